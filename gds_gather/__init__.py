"""gds-gather: gather the rows of a per-layer embedding table from NVMe into (GPU) memory.

    import gds_gather as gg
    with gg.open_table("model.gguf") as t:
        x = t.gather(ids)          # ids.shape + (t.row_elems,), exactly gguf's dequantization

Importing this package never touches the GPU, cupy or kvikio.
"""
from .backends import Backend, backends
from .config import Config
from .errors import (BackendError, BadDtypeError, BadIdsError, GatherError, HeaderError, ModelMismatchError,
                     ModelNotFoundError, NotGGUFError, NotSafetensorsError, ReadError, RowWidthError, TableClosedError,
                     TableLayoutError, TableNotFoundError, TruncatedFileError, UnsupportedTypeError)
from .planner import ReadPlan, plan_rows
from .table import DEFAULT_TENSOR, Table, open_table

__version__ = "0.1.0"

__all__ = [
    "open_table", "Table", "backends", "Backend", "Config", "plan_rows", "ReadPlan", "DEFAULT_TENSOR",
    "GatherError", "NotGGUFError", "HeaderError", "TruncatedFileError", "TableNotFoundError",
    "ModelNotFoundError", "UnsupportedTypeError", "RowWidthError", "BadIdsError", "BackendError", "ReadError",
    "BadDtypeError",
    "ModelMismatchError", "NotSafetensorsError", "TableClosedError", "TableLayoutError",
    "offload_per_layer_embeddings",
]


def __getattr__(name):
    # the transformers integration imports torch: load it on first use only (`import gds_gather` stays light)
    if name == "offload_per_layer_embeddings":
        from .integrations.transformers import offload_per_layer_embeddings
        return offload_per_layer_embeddings
    raise AttributeError(f"module 'gds_gather' has no attribute {name!r}")
