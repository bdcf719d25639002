"""The disk-backed per-layer embedding: DiskEmbedding (transformers' scaled embedding's forward, rows gathered
from a gds_gather Table), OffloadHandle (what an offload did, and the A/B swap), and finding a model's per-layer
embedding module. Imports torch and the layers below integrations; gds_gather.integrations.transformers builds these
from a model."""
from __future__ import annotations

import logging

import numpy as np
import torch

from ..backends import resolve
from ..errors import BadIdsError, ModelMismatchError, TableClosedError
from ..formats.quants import Q
from ..table import Table
from .recent_rows import BUDGET as RECENT_BUDGET, RecentRows

log = logging.getLogger(__name__)

SMALL_BATCH = 64       # ids per call read by Table.read_unique (no plan on row-cache hits)
FLOAT_TORCH = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def per_layer_embedding(model, stand_in=None):
    """(the per-layer embedding module, text config) of a transformers model; ModelMismatchError without one (or,
    with stand_in, when the module is not of that type)."""
    get = getattr(model, "get_per_layer_input_embeddings", None)
    module = None
    if callable(get):
        try:
            module = get()
        except (AttributeError, NotImplementedError):
            module = None
    name = type(model).__name__
    if module is None:
        raise ModelMismatchError(f"{name} has no per-layer embeddings (embed_tokens_per_layer): only Gemma 4 "
                                 f"E2B/E4B and Gemma 3n models carry a PLE table")
    if stand_in is not None and not isinstance(module, stand_in):
        raise ModelMismatchError(f"{name}'s per-layer embedding is a {type(module).__name__}, not {stand_in.__name__}")
    if isinstance(module, DiskEmbedding):
        raise ModelMismatchError(f"{name}'s per-layer embeddings are already on disk ({module.table.path})")
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return module, cfg


class DiskEmbedding(torch.nn.Module):
    """A drop-in for transformers' scaled per-layer embedding: rows from a gds_gather Table, same forward.

    forward(ids) = rows(ids) in the weight dtype * embed_scale.to(weight dtype), on the ids' device.
    """

    def __init__(self, table: Table, num_embeddings: int, embedding_dim: int, weight_dtype: torch.dtype,
                 embed_scale: torch.Tensor, padding_idx=None, backend: str = "auto"):
        super().__init__()
        self.table = table
        self.num_embeddings = int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        self.weight_dtype = weight_dtype
        self.padding_idx = padding_idx
        self.backend = backend
        self.register_buffer("embed_scale", embed_scale.detach().clone(), persistent=False)
        self._counts = [0, 0]     # row_ids, rows_read: a list, so a step's counting skips nn.Module.__setattr__
        self._scale = (None, None)    # (embed_scale buffer, it in the weight dtype): converted once per buffer
        self._as_dtype = FLOAT_TORCH.get(table.qtype)    # a float table's rows are viewed as this dtype
        self.device_backend = None    # (backend, mode, why) after the first CUDA call
        # rows read lately (a decode step's hits): at most 1/8 of the table's rows in the weight dtype, so that a
        # small table's offload still saves most of what it frees
        full = self.num_embeddings * self.embedding_dim * weight_dtype.itemsize
        self.recent = RecentRows(self.embedding_dim, weight_dtype, budget=min(RECENT_BUDGET, full // 8))

    @property
    def row_ids(self) -> int:
        """Ids looked up (cumulative)."""
        return self._counts[0]

    @property
    def rows_read(self) -> int:
        """Unique rows after per-call deduplication (cumulative), wherever they came from: the file, the page cache,
        the row cache or the rows read lately (RecentRows)."""
        return self._counts[1]

    def extra_repr(self) -> str:
        t = self.table
        return (f"{self.num_embeddings}, {self.embedding_dim}, table={str(t.path)!r} ({t.qtype.name}), "
                f"dtype={self.weight_dtype}, backend={self.backend}")

    def _check(self, ids_np: np.ndarray) -> None:
        if ids_np.size and self.table.n_rows != self.num_embeddings:   # a padded table: refuse ids past the vocab
            lo, hi = int(ids_np.min()), int(ids_np.max())
            if lo < 0 or hi >= self.num_embeddings:
                bad = lo if lo < 0 else hi
                raise BadIdsError(f"token id {bad} out of range [0, {self.num_embeddings})")

    def rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The unscaled rows in the weight dtype, shape ids.shape + (embedding_dim,), on the ids' device."""
        return self._lookup(input_ids, None)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._lookup(input_ids, self.scale())

    def _lookup(self, input_ids: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """rows(ids), times scale where given: from the rows read lately (a prompt's, earlier steps') where they hold
        every id (a decode step: no read, plan, lock or conversion), else read from the table."""
        if self.table.closed:
            raise TableClosedError(f"the per-layer embedding table {self.table.path} was closed (handle.close(), or "
                                   f"the end of a `with` block): this model cannot compute its per-layer inputs any "
                                   f"more; load it again (gds_gather.integrations.transformers.from_pretrained) "
                                   f"or keep the handle open")
        hit = self.recent.get(input_ids, scale)
        if hit is not None:
            counts = self._counts
            counts[0] += input_ids.numel()
            counts[1] += hit[1]
            return hit[0]
        ids_np = input_ids.detach().cpu().numpy()       # CUDA ids: one small copy down (the plan is made on the host)
        if input_ids.is_cuda:
            self._check(ids_np)
            rows = self._rows_cuda(input_ids, ids_np)
            return rows if scale is None else rows * scale
        flat = ids_np.reshape(-1)
        if flat.shape[0] <= SMALL_BATCH:        # a decode step: cached rows are one look-up, without plan or lock
            unique, inverse = (flat, None) if flat.shape[0] == 1 else np.unique(flat, return_inverse=True)
            if unique.shape[0] and not 0 <= int(unique[0]) <= int(unique[-1]) < self.num_embeddings:
                bad = int(unique[0]) if unique[0] < 0 else int(unique[-1])
                raise BadIdsError(f"token id {bad} out of range [0, {self.num_embeddings})")
            rows = self._as_torch(self.table.read_unique(unique, self.backend), unique)
            rows = rows if scale is None else rows * scale
            self.recent.put(unique, rows, scale)
        else:
            self._check(ids_np)
            plan = self.table.plan(ids_np)
            unique, inverse = plan.unique_rows, plan.inverse
            rows = self._as_torch(self.table.read_plan(plan, self.backend), unique)
            rows = rows if scale is None else rows * scale      # (the unique rows: the same values, fewer products)
            self.recent.put(unique, rows, scale)                # a prompt's rows: the decode steps after it hit them
        counts = self._counts
        counts[0] += flat.shape[0]
        counts[1] += unique.shape[0]
        if inverse is not None:
            rows = rows.index_select(0, torch.from_numpy(inverse.reshape(-1)))
        return rows.reshape(tuple(input_ids.shape) + (self.embedding_dim,))

    def _as_torch(self, raw: np.ndarray, unique: np.ndarray) -> torch.Tensor:
        """Raw rows of the ids `unique` -> torch rows in the weight dtype: a float table's bytes are viewed as its
        torch dtype and cast (exactly gguf's dequantization, without its per-call overhead); a quantized or float8
        one is dequantized by its Table (scales applied)."""
        t = self.table
        if self._as_dtype is not None:
            rows = torch.from_numpy(np.ascontiguousarray(raw)).view(self._as_dtype).reshape(raw.shape[0], -1)
        else:
            rows = torch.from_numpy(t.dequantize(raw, unique, self.backend))
        return rows if rows.dtype == self.weight_dtype else rows.to(self.weight_dtype)

    def _rows_cuda(self, input_ids: torch.Tensor, ids_np: np.ndarray) -> torch.Tensor:
        """Table.gather's GPU flavour: rows read into GPU memory, dequantized by the CUDA kernel on the current
        stream straight into the weight dtype."""
        t = self.table
        if self.device_backend is None:
            self.device_backend = t.device_choice(self.backend)   # what Table.fetch_device will use
        self._counts[0] += ids_np.size
        self._counts[1] += np.unique(ids_np).size
        with torch.cuda.device(input_ids.device):
            return t.gather(input_ids, self.backend, dtype=self.weight_dtype,
                            stream=torch.cuda.current_stream(input_ids.device), host_ids=ids_np)

    def scale(self) -> torch.Tensor:
        """embed_scale in the weight dtype, converted once per buffer (a move to another device replaces it)."""
        buf = self._buffers["embed_scale"]
        src, scale = self._scale
        if src is not buf:
            scale = buf.to(self.weight_dtype)
            self._scale = (buf, scale)
        return scale


class OffloadHandle:
    """What offload_per_layer_embeddings did: bytes_freed, rows_read, row_ids, backend, why, the table.

    close() closes the table (the model can no longer compute its per-layer inputs). With keep_original=True the
    original module is kept: use("resident" | "offloaded") swaps between the two (for A/B timing) and release()
    frees it.
    """

    def __init__(self, model, module: DiskEmbedding, original, setter, weight_bytes: int, verified: int,
                 max_abs_error: float, rms_error: float):
        self.model = model
        self.module = module
        self.table = module.table
        self._setter = setter
        self._original = original
        self.weight_bytes = weight_bytes
        self.bytes_freed = 0
        self.verified_rows = verified
        self.max_abs_error = max_abs_error
        self.rms_error = rms_error
        self.backend, self.why = resolve(module.backend, self.table.config)

    @property
    def rows_read(self) -> int:
        return self.module.rows_read

    @property
    def row_ids(self) -> int:
        return self.module.row_ids

    @property
    def bytes_read(self) -> int:
        return self.module.rows_read * self.table.row_bytes

    @property
    def exact(self) -> bool:
        return self.max_abs_error == 0.0

    def use(self, which: str) -> None:
        if which not in ("resident", "offloaded"):
            raise ValueError(f"use('resident') or use('offloaded'), got {which!r}")
        if which == "resident" and self._original is None:
            raise ValueError("the original per-layer embedding was released")
        self._setter(self._original if which == "resident" else self.module)

    def release(self) -> int:
        """Put the disk-backed module in place and free the original weight; returns the bytes freed."""
        self._setter(self.module)
        if self._original is not None:
            self.bytes_freed = _free_weight(self.model, self._original)
            self._original = None
        return self.bytes_freed

    def stats(self) -> dict:
        d = self.device_backend
        return {"table": str(self.table.path), "tensor": self.table.name, "qtype": self.table.qtype.name,
                "row_bytes": self.table.row_bytes, "bytes_freed": self.bytes_freed, "row_ids": self.row_ids,
                "rows_read": self.rows_read, "bytes_read": self.bytes_read, "backend": self.backend, "why": self.why,
                "device_backend": None if d is None else f"{d[0]}@{d[1]}", "device_why": None if d is None else d[2],
                "verified_rows": self.verified_rows, "max_abs_error": self.max_abs_error, "rms_error": self.rms_error}

    @property
    def device_backend(self):
        return self.module.device_backend

    def close(self) -> None:
        self.table.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return (f"OffloadHandle({str(self.table.path)!r}, {self.table.qtype.name}, freed={self.bytes_freed}, "
                f"rows_read={self.rows_read}, backend={self.backend})")


def _free_weight(model, module) -> int:
    """Drop the module's weight storage unless another parameter of the model shares it; returns bytes freed."""
    w = module.weight
    if w.device.type == "meta":
        return 0
    n = w.numel() * w.element_size()
    ptr = w.untyped_storage().data_ptr()
    if any(p.device == w.device and p.untyped_storage().data_ptr() == ptr for p in model.parameters()):
        log.warning("per-layer embedding weight is shared with another parameter: not freed")
        return 0
    w.data = torch.empty(0, dtype=w.dtype, device=w.device)
    return n
