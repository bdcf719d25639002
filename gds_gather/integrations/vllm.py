"""vLLM plugin: Gemma 4 and Gemma 3n served by vLLM with the per-layer embedding (PLE) table on disk.

Switched on by ``GDS_GATHER_VLLM=1`` in the environment of ``vllm serve`` / ``LLM(...)`` (the package registers
``register`` under vLLM's ``vllm.general_plugins`` entry point; without the variable it does nothing):

    GDS_GATHER_VLLM=1 vllm serve google/gemma-4-E2B-it          # or a local directory; GDS_GATHER_VLLM_TABLE=x.gguf

It overrides vLLM's Gemma4ForCausalLM and Gemma3nForCausalLM (the multimodal Gemma4/Gemma3nForConditionalGeneration
build their language model through the registry, so they get the override too). While the model is constructed,
the ``VocabParallelEmbedding`` that would hold ``embed_tokens_per_layer`` is replaced by ``PerLayerEmbedding``: no
weight is allocated, the checkpoint's tensor is skipped in ``load_weights`` (safe_open hands it over mmap-backed:
it is never read), and forward(ids) returns the table's rows in the weight dtype, read with gds_gather (host path
for CPU ids, the GPU path for CUDA ids: ``DiskEmbedding.rows`` of the transformers integration). vLLM's own code
still masks ids beyond the PLE vocab and multiplies by ``embed_scale_per_layer``, so the values are the resident
module's exactly when the table holds the model's rows exactly (the checkpoint, or an unquantized
``gds-gather convert`` GGUF).

Where the lookup runs (vLLM 0.32):
- Gemma4/Gemma3nForConditionalGeneration: in ``embed_input_ids``, eagerly, before the compiled/graph-captured
  forward, which reads a persistent buffer: safe with any compilation and CUDA graph mode.
- Gemma4ForCausalLM (text only): inside the compiled ``Gemma4Model`` forward. There the lookup is the opaque custom
  op ``gds_gather::ple_rows`` (it plans reads on the host; eager, the module calls its rows directly), which the
  plugin appends to ``compilation_config.splitting_ops`` so vLLM runs it eagerly between the compiled pieces; full
  CUDA graphs would capture it, so they are refused with the fix in the message (``cudagraph_mode="PIECEWISE"``).
- Gemma3nForCausalLM (text only): vLLM 0.32 never calls the table there (its per-layer inputs are the projection
  alone); the weight is still not allocated.

Tensor parallelism: vLLM shards the replaced module by vocabulary and all-reduces its output; here every rank reads
whole rows for all its ids from its own table file (its own storage), which is the all-reduced result, with no
collective. Pipeline parallelism: only the first stage computes per-layer inputs (vLLM passes them on as
``per_layer_inputs``); later stages open the table (metadata only) and never read it.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import weakref
from pathlib import Path

import torch

from ..backends import resolve
from ..cache import hotrows
from ..config import Config
from ..errors import ModelMismatchError
from .transformers import EXACT_TYPES, DiskEmbedding
from ..table import open_table

# vLLM's handler prints the "vllm" logger tree
log = logging.getLogger("vllm.gds_gather")

# the text classes the plugin overrides -> their vLLM module
ARCHS = {"Gemma4ForCausalLM": "gemma4", "Gemma3nForCausalLM": "gemma3n"}
# the last component of the PLE module's prefix in those modules (gemma3n names it per_layer_embed_tokens)
PLE_PREFIXES = ("embed_tokens_per_layer", "per_layer_embed_tokens")
OP = "gds_gather::ple_rows"

_LIVE: "weakref.WeakValueDictionary[str, PerLayerEmbedding]" = weakref.WeakValueDictionary()   # by module prefix


def register() -> None:
    """vLLM's general-plugin hook (every vLLM process calls it): override the Gemma text classes when
    GDS_GATHER_VLLM=1. Lazy "module:class" names: nothing of vLLM's model code is imported here."""
    cfg = Config.from_env()
    if not cfg.vllm:
        return
    from vllm import ModelRegistry
    for arch in ARCHS:
        ModelRegistry.register_model(arch, f"{__name__}:{arch}")
    log.info("gds_gather: per-layer embeddings of %s served from disk (GDS_GATHER_VLLM=1)", ", ".join(ARCHS))


def __getattr__(name):
    if name in ARCHS:
        cls = globals()[name] = _disk_class(name)
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _disk_class(arch: str):
    """vLLM's `arch` with its per-layer embedding built as a PerLayerEmbedding."""
    module = importlib.import_module(f"vllm.model_executor.models.{ARCHS[arch]}")
    base = getattr(module, arch)

    def __init__(self, *, vllm_config, prefix: str = ""):
        with _ple_on_disk(module, vllm_config, top_level=not prefix):
            base.__init__(self, vllm_config=vllm_config, prefix=prefix)

    return type(arch, (base,), {"__init__": __init__, "__module__": __name__, "__qualname__": arch,
                                "__doc__": f"vLLM's {arch} with the per-layer embedding table on disk."})


@contextlib.contextmanager
def _ple_on_disk(module, vllm_config, top_level: bool):
    """While the model is built, the module's VocabParallelEmbedding makes a PerLayerEmbedding for the PLE."""
    real = module.VocabParallelEmbedding

    def build(num_embeddings, embedding_dim, *args, prefix: str = "", **kw):
        if prefix.rsplit(".", 1)[-1] not in PLE_PREFIXES:
            return real(num_embeddings, embedding_dim, *args, prefix=prefix, **kw)
        if top_level:
            _split_at_lookup(vllm_config)
        if isinstance(vllm_config.additional_config, dict):
            # a factor of vLLM's compile-cache key: graphs traced with the op are not loaded without it, or back
            vllm_config.additional_config["gds_gather_ple"] = "disk"
        return PerLayerEmbedding.open(vllm_config, num_embeddings, embedding_dim, prefix)

    module.VocabParallelEmbedding = build
    try:
        yield
    finally:
        module.VocabParallelEmbedding = real


def _split_at_lookup(vllm_config) -> None:
    """The text-only class looks rows up inside its compiled forward: run the op between compiled pieces, and
    refuse full CUDA graphs (they would capture a lookup that plans on the host)."""
    from vllm.config import CompilationMode
    cc = vllm_config.compilation_config
    if cc.mode == CompilationMode.VLLM_COMPILE and cc.splitting_ops is not None and OP not in cc.splitting_ops:
        cc.splitting_ops.append(OP)
        log.info("gds_gather: %s added to compilation_config.splitting_ops", OP)
    if cc.cudagraph_mode is not None and cc.cudagraph_mode.has_full_cudagraphs():
        raise ModelMismatchError(
            f"the per-layer embedding on disk cannot run inside a full CUDA graph (cudagraph_mode="
            f"{cc.cudagraph_mode.name}) of the text-only class: pass compilation_config={{'cudagraph_mode': "
            f"'PIECEWISE'}} (or enforce_eager=True), or serve the multimodal checkpoint class, which looks rows up "
            f"outside the graph")


def table_source(vllm_config, cfg: Config):
    """GDS_GATHER_VLLM_TABLE, else the model directory, else the Hub snapshot vLLM loads (its safetensors)."""
    if cfg.vllm_table is not None:
        return cfg.vllm_table
    mc = vllm_config.model_config
    if Path(mc.model).is_dir():
        return Path(mc.model)
    from huggingface_hub import snapshot_download
    return Path(snapshot_download(mc.model, revision=mc.revision, cache_dir=vllm_config.load_config.download_dir,
                                 allow_patterns=["*.safetensors", "*.safetensors.index.json"]))


@torch.library.custom_op(OP, mutates_args=())
def ple_rows(ids: torch.Tensor, prefix: str) -> torch.Tensor:
    """The rows of the PerLayerEmbedding registered under `prefix`, opaque to torch.compile (keyed by a string,
    not a handle: vLLM caches compiled graphs across processes)."""
    return _LIVE[prefix].rows(ids)


@ple_rows.register_fake
def _(ids, prefix):
    m = _LIVE[prefix]
    return ids.new_empty((*ids.shape, m.embedding_dim), dtype=m.weight_dtype)


class PerLayerEmbedding(DiskEmbedding):
    """vLLM's embed_tokens_per_layer from a table file: forward(ids) = the unscaled rows in the weight dtype
    (vLLM multiplies by embed_scale_per_layer), through the opaque op gds_gather::ple_rows."""

    @classmethod
    def open(cls, vllm_config, num_embeddings: int, embedding_dim: int, prefix: str) -> "PerLayerEmbedding":
        cfg = Config.from_env()
        dtype = torch.get_default_dtype()        # vLLM builds the model under its dtype
        table = open_table(table_source(vllm_config, cfg), config=cfg)
        try:
            try:
                if table.row_elems != embedding_dim or table.n_rows < num_embeddings:
                    raise ModelMismatchError(f"{table.path}: a table of {table.n_rows:,} rows x {table.row_elems} "
                                             f"elements, but the model's per-layer embedding is [{num_embeddings:,}, "
                                             f"{embedding_dim}]")
                if table.qtype not in EXACT_TYPES.get(dtype, ()):
                    raise ModelMismatchError(f"{table.path}: a {table.qtype.name} table cannot give the model's "
                                             f"{dtype} rows exactly (convert the checkpoint without --qtype)")
            except ModelMismatchError as e:
                # the one line to read among the tracebacks vLLM prints for a worker that fails to start
                log.error("gds_gather: %s; the server does not start", e)
                raise
            m = cls(table, num_embeddings, embedding_dim, dtype, torch.ones(()), None, cfg.backend)
        except BaseException:
            table.close()
            raise
        pc = vllm_config.parallel_config
        m.prefix = prefix
        # what the replaced module would hold on this rank: its vocabulary shard
        m.bytes_not_allocated = -(-num_embeddings // pc.tensor_parallel_size) * embedding_dim * dtype.itemsize
        _LIVE[prefix] = m
        backend, why = resolve(cfg.backend, cfg)
        st = table.stats()
        hot = hotrows.path_for(table) if cfg.hot_rows else "off (GDS_GATHER_HOT_ROWS=0)"
        log.info("gds_gather: %s from %s (%s, %s): %d bytes not allocated on this rank (tp=%d, pp=%d); host "
                 "backend %s (%s); row cache budget %d bytes in this process (%s); hot rows %s", prefix, table.path,
                 table.name, table.qtype.name, m.bytes_not_allocated, pc.tensor_parallel_size,
                 pc.pipeline_parallel_size, backend, why, st["cache_budget_bytes"], st["cache_budget_reason"], hot)
        return m

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # the op only where torch.compile traces the forward (it must stay opaque there); eager, its dispatch
        # would cost more than a decode step's look-up itself
        if torch.compiler.is_compiling():
            return ple_rows(input_ids, self.prefix)
        return self.rows(input_ids)

    def load_weights(self, weights) -> set:
        for _ in weights:           # the checkpoint's table: skipped (an mmap-backed tensor, never read)
            pass
        return set()
