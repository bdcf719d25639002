"""A PLE table in a GGUF file: geometry from the metadata, planned reads, exact gathers."""
from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from pathlib import Path

import numpy as np

from .gpu import arrays
from .gpu.device_path import DevicePath
from .io import forksafe
from .formats import quants
from .cache import rowcache
from .backends import resolve
from .config import Config
from .errors import (BackendError, BadIdsError, GatherError, HeaderError, ModelNotFoundError, TableClosedError,
                     TruncatedFileError, UnsupportedTypeError)
from .formats.gguf_file import TensorInfo, field_value, find_tensor
from .formats.scales import find_scales
from .planner import ReadPlan, plan_rows
from .cache.prefetch import Prefetcher
from .io.direct import HOST_READERS
from .io.readers import GDS_ALIGN, Reader, Region, default_align
from .io.storage import filesystem

log = logging.getLogger(__name__)

DEFAULT_TENSOR = "per_layer_token_embd.weight"


def _cast_numpy(f32: np.ndarray, name: str) -> np.ndarray:
    if name == "float32":
        return f32
    if name == "float16":
        with np.errstate(over="ignore"):   # beyond the f16 range is inf, as in ggml's f16 get_rows
            return f32.astype(np.float16)
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError("bfloat16 output of numpy arrays needs the ml_dtypes package "
                        "(or pass torch ids: torch has bfloat16)") from None
    return f32.astype(ml_dtypes.bfloat16)


def _locate(path, tensor: str):
    """(tensor info, header, metadata): a GGUF file (any shard), or a Hugging Face safetensors checkpoint (a model
    directory, model.safetensors.index.json or one .safetensors file; see safetensors_file.py)."""
    from .formats.safetensors_file import find_table_tensor, is_safetensors_source
    try:
        if is_safetensors_source(path):
            return find_table_tensor(path, tensor)
        return find_tensor(path, tensor)
    except FileNotFoundError as e:      # a missing path or shard: a GatherError, still a FileNotFoundError
        if isinstance(e, GatherError):
            raise
        text = f"{e.filename}: {e.strerror}" if e.filename is not None and e.strerror else str(e)
        raise ModelNotFoundError(text if str(Path(path)) in text else f"{path}: {text}") from None


def _locked(method):
    """Run a Table method under the table's lock: one read at a time per Table, from planning to the rows copied
    out of the shared staging (a second thread waits, it is not refused)."""
    @functools.wraps(method)
    def locked(self, *a, **kw):
        with self._lock:
            return method(self, *a, **kw)
    return locked


def _release(readers: dict, device: DevicePath, ahead: dict) -> None:
    """Close what a Table opened (Table.close, or the finalizer of a Table that was never closed): the prefetches
    (each waits for its reads), the device destinations (once the stream of the last device fetch is done with
    their staging: DevicePath.closes), then the readers (unpin, unmap); every close is tried, then the first error
    is raised."""
    first = None
    closes = [r.close for r in ahead.values()] + device.closes() + [r.close for r in readers.values()]
    for close in closes:
        try:
            close()
        except BaseException as e:      # noqa: B036 (a KeyboardInterrupt too: the other closes still run)
            first = first or e
    ahead.clear()
    device.dests.clear()
    readers.clear()
    if first is not None:
        raise first


class Table:
    """One row-gather table (default: the per-layer token embedding) of a GGUF model.

    Opening reads metadata only. Attributes: n_rows, row_elems, qtype, row_bytes, data_offset (absolute, in
    `path`), path (the shard holding the table), name, arch, n_bytes.
    """

    def __init__(self, path, tensor: str = DEFAULT_TENSOR, config: Config | None = None, *, scales=None,
                 scale_block=None, info=None):
        self.config = config or Config.from_env()
        if info is None:
            info, reader, meta_reader = _locate(path, tensor)
        else:                   # a tensor already found (a float8 table's scale rows): no metadata of its own
            meta_reader = None
        self.model_path = Path(path)
        self.path = info.path
        self.name = info.name
        self._meta = meta_reader
        self.arch = field_value(meta_reader, "general.architecture", "") if meta_reader is not None else ""
        if len(info.shape) != 2:
            raise HeaderError(f"{info.path}: tensor {tensor!r} has shape {list(info.shape)}; a row table is 2-D")
        self.row_elems, self.n_rows = info.shape
        try:
            self.qtype = quants.check_supported(info.type_id)
            if info.container == "gguf" and self.qtype not in quants.supported_types():
                raise UnsupportedTypeError(f"type id {int(self.qtype)} is not a GGML type")
        except UnsupportedTypeError as e:
            raise UnsupportedTypeError(f"{info.path}: tensor {tensor!r}: {e}") from None
        self.row_bytes = quants.row_bytes(self.qtype, self.row_elems, what=f"{info.path}: {tensor!r} row")
        self.data_offset = info.data_offset
        self.n_bytes = self.n_rows * self.row_bytes
        st = os.stat(self.path)
        if self.data_offset + self.n_bytes > st.st_size:
            raise TruncatedFileError(
                f"{self.path}: tensor {tensor!r} data [{self.data_offset}, {self.data_offset + self.n_bytes}) runs "
                f"past the end of the file ({st.st_size} bytes)")
        self.file_id = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        self.region = Region(self.path, self.data_offset, self.n_bytes, self.file_id)   # what every reader reads
        self.align = default_align(self.config, self.path, self.row_bytes)   # O_DIRECT windows (readers.MIN_ALIGN)
        self.gds_align = max(GDS_ALIGN, self.align)     # windows of plans read by KvikIO/cuFile (device.GdsReader)
        self._readers: dict[str, Reader] = {}
        self._ahead: dict[str, Prefetcher] = {}     # backend -> its prefetches (prefetch())
        self._hit_path: dict[str, tuple] = {}       # backend -> (rowcache.generation(), reader, row cache): _read_hits
        self.closed = False
        self._lock = threading.RLock()      # safe to share between threads (see _locked)
        forksafe.track(self, "_lock")       # ... and to use in a forked child
        self.io = dict.fromkeys(rowcache.IO_COUNTERS, 0)   # where rows came from (counters; see stats())
        # the GPU path (destinations, their streams, the gds choice), holding a proxy: the finalizer holds it
        self.device_path = DevicePath(weakref.proxy(self))
        self._fin = weakref.finalize(self, _release, self._readers, self.device_path, self._ahead)
        # a float8 table's scales (formats/scales.py): per tensor a number, else a row table of their own
        self.scales = (find_scales(self.model_path, self.name, self.qtype, self.n_rows, self.row_elems, scales,
                                   scale_block) if info.container == "safetensors" else None)
        self.scale_table = None
        if self.scales is not None and self.scales.value is None:
            sp = self.scales
            self.scale_table = Table(sp.path, sp.name, self.config, info=TensorInfo(
                sp.path, sp.name, int(sp.stype), (sp.per_row, sp.n_rows), sp.data_offset,
                sp.n_rows * sp.per_row * quants.block_geometry(sp.stype)[1], "safetensors"))

    # -- metadata ------------------------------------------------------------------------------------------
    @property
    def reader(self):
        """The metadata reader of the model's first shard (gguf_parse's bounded parser for GGUF: get_field(key)
        like gguf.GGUFReader's; the safetensors header for a checkpoint)."""
        return self._meta

    def field(self, key: str, default=None):
        """A metadata value of the model (first shard), e.g. t.field('gemma4.block_count')."""
        return field_value(self._meta, key, default)

    def describe(self) -> dict:
        return {
            "path": str(self.path), "tensor": self.name, "arch": self.arch, "qtype": self.qtype.name,
            "n_rows": self.n_rows, "row_elems": self.row_elems, "row_bytes": self.row_bytes,
            "data_offset": self.data_offset, "table_bytes": self.n_bytes,
            "f32_bytes": self.n_rows * self.row_elems * 4, "align": self.align,
            "filesystem": filesystem(self.path),
            "scales": self.scales.describe() if self.scales is not None else None,
        }

    # -- planning and reading --------------------------------------------------------------------------------
    def plan(self, ids, align: int | None = None, max_gap: int | None = None) -> ReadPlan:
        return plan_rows(ids, n_rows=self.n_rows, row_bytes=self.row_bytes, data_offset=self.data_offset,
                         align=align or self.align,
                         max_gap=self.config.max_gap if max_gap is None else max_gap,
                         max_window=self.config.max_window, max_waste=self.config.max_waste)

    @_locked
    def open_reader(self, backend: str = "auto") -> Reader:
        """The host reader of `backend`, opened now (file, io_uring, page-cache residency learned in the background)
        rather than by the first read: an engine's start-up, before a caller's clock starts."""
        return self._reader(backend)

    @_locked
    def prefetch(self, ids, backend: str = "auto") -> int:
        """Hand over the next batch's ids before reading the current one, and return at once: the rows the row
        cache lacks are read while this table reads the current batch and the caller uses it, and the next read
        finds them cached (prefetch.py). Returns how many rows that is now: 0 for backends without a row cache
        (the baselines), when the cache or Config.prefetch is off, or where the reader is not O_DIRECT on
        io_uring."""
        name, _ = resolve(backend, self.config)
        if self.closed:
            raise TableClosedError(f"table {self.path} is closed")
        if name not in rowcache.CACHED_BACKENDS or name not in HOST_READERS or not self.config.prefetch \
                or rowcache.cache_for(self) is None:
            return 0
        ahead = self._ahead.get(name)
        if ahead is None:
            ahead = self._ahead[name] = Prefetcher(self, self._reader(name))
        if not ahead.usable:
            return 0
        ids = np.asarray(ids)
        if ids.size == 0:
            ahead.open()                # (an empty prefetch makes its ring: start-up before a caller's clock)
            return 0
        if not np.issubdtype(ids.dtype, np.integer) or int(ids.min()) < 0 or int(ids.max()) >= self.n_rows:
            raise BadIdsError(f"{self.path}: prefetch takes integer row ids in [0, {self.n_rows})")
        if ahead.declines():
            return 0
        return ahead.note(np.ascontiguousarray(ids.ravel(), np.int64))

    def _reader(self, backend: str) -> Reader:
        if self.closed:
            raise TableClosedError(f"table {self.path} is closed")
        name, why = resolve(backend, self.config)
        r = self._readers.get(name)
        if r is None:
            if name not in HOST_READERS:
                raise BackendError(f"backend {name!r} has no host reader in this version")
            log.info("%s: backend %s (%s)", self.path.name, name, why)
            r = self._readers[name] = self.region.open(HOST_READERS[name], self.config)
            log.info("%s: %s runs as: %s", self.path.name, name, r.how)
        return r

    # -- the device path (gpu/device_path.py) ---------------------------------------------------------------
    @property
    def accel(self):
        """The device of this table's GPU path (accel.get(config.accel)), made on first use."""
        return self.device_path.accel

    @_locked
    def fetch_device(self, plan: ReadPlan, backend: str = "auto", stream=None):
        """Read the plan's rows into GPU memory: (device staging uint8, device byte offset of each unique row).

        The rows stay where the destination put them (compact, inside O_DIRECT windows, or in the device row
        cache) for a kernel to read in place; they are valid until the next fetch on this table, which first
        waits for `stream`.
        """
        return self.device_path.fetch(plan, backend, stream)

    def device_choice(self, backend: str = "auto") -> tuple[str, str, str]:
        """(backend, destination mode, why) of rows that must end in GPU memory, asked once per backend (the one
        gds-or-direct decision, backends.choose_device)."""
        return self.device_path.device_choice(backend)

    def gds_faster(self) -> tuple[bool, str]:
        """(gds faster than direct + pinned copy?, detail), timed once on 512 random rows (real GDS only)."""
        return self.device_path.gds_faster()

    @property
    def typical_window(self) -> int:
        """Bytes of one row's window at the gds alignment (the gds-or-direct window check)."""
        return -(-self.row_bytes // self.gds_align) * self.gds_align

    def readers(self) -> tuple[list, list]:
        """(host readers, device destinations) this table has opened so far, in the order opened; each has .how
        and .bytes_read."""
        return list(self._readers.values()), self.device_path.destinations()

    def stats(self) -> dict:
        """Where this table's rows came from so far: rows_from_cache, rows_from_page_cache, rows_from_device,
        rows_buffered (a buffered reader's: page cache or device, it cannot tell), rows_prefetched (read ahead by
        prefetch() into the row cache, a part of rows_from_device; the read that wants them finds them there as
        cache hits: the sources add up to the rows read plus these), cache_hits,
        cache_misses, cache_hit_rate (unique rows per batch), cache_bytes (what the file's row cache and the device
        caches hold now), cache_budget_bytes and cache_budget_reason (why that size), bytes_requested (bytes asked of
        the file by every reader, a scaled float8 table's scale reads included), and for such a table `scales`: the
        scale table's own stats."""
        st = rowcache.stats(self, self.device_path.caches(),
                            sum(r.bytes_read for r in self._readers.values()) + self.device_path.bytes_read)
        for ahead in self._ahead.values():
            for k, v in ahead.counts().items():
                st[k] += v
        if self.scale_table is not None:        # the scale rows' reads: their own counters, their bytes counted here
            st["scales"] = self.scale_table.stats()
            st["bytes_requested"] += st["scales"]["bytes_requested"]
        return st

    @_locked
    def read_plan(self, plan: ReadPlan, backend: str = "auto") -> np.ndarray:
        """Raw bytes of the plan's unique rows, uint8 [plan.n_unique, row_bytes], in plan order."""
        if plan.n_unique == 0:
            return np.empty((0, self.row_bytes), np.uint8)
        if plan.row_bytes != self.row_bytes or plan.data_offset != self.data_offset \
                or int(plan.unique_rows[-1]) >= self.n_rows or int(plan.unique_rows[0]) < 0:
            raise BadIdsError(f"{self.path}: this plan was made for another table (rows of {plan.row_bytes} B at "
                              f"offset {plan.data_offset}, up to row {int(plan.unique_rows[-1])}); this table has "
                              f"{self.n_rows} rows of {self.row_bytes} B at offset {self.data_offset}: use t.plan(ids)")
        reader = self._reader(backend)
        ahead = self._ahead.get(reader.name)        # this backend's prefetches (prefetch.py), if any
        if ahead is not None:
            ahead.before(plan.unique_rows)
        out = rowcache.read_through(self, reader, plan, ahead=ahead)
        if ahead is not None:
            ahead.after(plan.unique_rows)
        return out

    def read_unique(self, rows: np.ndarray, backend: str = "auto") -> np.ndarray:
        """Raw bytes of sorted unique row ids, uint8 [len(rows), row_bytes]: read_plan(plan(rows)), without the plan
        where the row cache holds every row, and then without the table's lock too (a decode step's few tokens: one
        look-up and one copy)."""
        rows = self._unique_ids(rows)
        hit = self._read_hits(rows, backend) if rows.shape[0] else None
        return hit if hit is not None else self._read_unique_locked(rows, backend)

    def _read_hits(self, rows: np.ndarray, backend: str) -> np.ndarray | None:
        """The rows from this file's row cache where it holds every one, else None (nothing read or counted). The
        (reader, cache) of a backend are kept until the caches are dropped (rowcache.generation) or a look-up
        misses. Always None while prefetches run (prefetch()): they see every read."""
        path = self._hit_path.get(backend)
        if path is None or path[0] != rowcache.generation():
            path = self._open_hit_path(backend)
        cache = path[2]
        if cache is None or self.closed or self._ahead:
            return None
        out = rowcache.read_hits(cache, path[1], rows, self.io)
        if out is None:             # looked up again next time: the file's cache may have been replaced meanwhile
            self._hit_path.pop(backend, None)
        return out

    @_locked
    def _open_hit_path(self, backend: str) -> tuple:
        gen, reader = rowcache.generation(), self._reader(backend)
        cache = rowcache.cache_for(self) if reader.name in rowcache.CACHED_BACKENDS else None
        path = self._hit_path[backend] = (gen, reader, cache)
        return path

    def _unique_ids(self, rows) -> np.ndarray:
        rows = np.asarray(rows, np.int64)
        if rows.shape[0] and (int(rows[0]) < 0 or int(rows[-1]) >= self.n_rows
                              or (rows.shape[0] > 1 and not (np.diff(rows) > 0).all())):
            raise BadIdsError(f"{self.path}: read_unique takes sorted unique row ids in [0, {self.n_rows})")
        return rows

    @_locked
    def _read_unique_locked(self, rows: np.ndarray, backend: str) -> np.ndarray:
        reader = self._reader(backend)
        ahead = self._ahead.get(reader.name)
        if ahead is not None:
            ahead.before(rows)
        out = rowcache.read_unique(self, reader, rows, ahead=ahead)
        if ahead is not None:
            ahead.after(rows)
        return out

    @_locked
    def read_rows(self, ids, backend: str = "auto", *, stream=None):
        """The raw quantized rows behind `ids`: uint8 of shape ids.shape + (row_bytes,).

        numpy (or torch CPU) ids give host rows; cupy or torch CUDA ids give device rows of the same kind.
        """
        if arrays.is_device(ids):
            return self.device_path.read_rows(ids, backend, stream)
        if arrays.kind(ids) == "torch":
            import torch
            return torch.from_numpy(self.read_rows(ids.numpy(), backend))
        plan = self.plan(ids)
        return self.read_plan(plan, backend)[plan.inverse].reshape(plan.shape + (self.row_bytes,))

    def gather(self, ids, backend: str = "auto", dtype=np.float32, *, stream=None, host_ids=None):
        """Dequantized rows: shape ids.shape + (row_elems,), exactly gguf.quants.dequantize(table)[ids].

        ids: integer numpy array (or torch CPU tensor) of any shape; the result is of the same kind.
        GPU flavour: cupy or torch CUDA ids give a result of the same kind on the same device, dequantized by the
        CUDA kernel launched on `stream` (bfloat16 comes back as uint16 bits for cupy, which has no bfloat16).
        host_ids (GPU flavour): the ids' values already copied to the host on `stream` (the plan is made from
        them, without a second copy down and its synchronization).
        """
        kind = arrays.kind(ids)
        name = arrays.dtype_name(dtype)
        if arrays.is_device(ids):
            with self._lock:        # the kernel is queued before another thread's fetch can overwrite the staging
                return self.device_path.gather(ids, backend, name, stream, host_ids)
        if kind == "torch":
            out = self._gather_host(ids.numpy(), backend)
            import torch
            t = torch.from_numpy(out)
            return t if name == "float32" else t.to(getattr(torch, name))
        return _cast_numpy(self._gather_host(ids, backend), name)

    def _gather_host(self, ids, backend: str) -> np.ndarray:
        return self.gather_plan(self.plan(ids), backend)

    def gather_plan(self, plan: ReadPlan, backend: str = "auto") -> np.ndarray:
        """Float32 rows for an existing plan: shape plan.shape + (row_elems,)."""
        rows = self.dequantize(self.read_plan(plan, backend), plan.unique_rows, backend)
        return rows[plan.inverse].reshape(plan.shape + (self.row_elems,))

    def dequantize(self, raw: np.ndarray, rows: np.ndarray, backend: str = "auto") -> np.ndarray:
        """float32 [n, row_elems] of raw rows uint8 [n, row_bytes] whose row ids are `rows`: the type's values
        (quants.dequantize_rows), times their scales for a scaled float8 table (one float32 multiply each; the
        scales from scale_rows, decoded as the kernels decode them)."""
        out = quants.dequantize_rows(raw, self.qtype, self.row_elems)
        scales = self.scale_rows(rows, backend) if out.shape[0] else None
        if scales is None:
            return out
        sp = self.scales
        s = quants.dequantize_rows(scales, sp.kernel_type, sp.kernel_width)
        if sp.global_scale is not None:
            s = s * np.float32(sp.global_scale)
        return out * sp.expand(s, self.row_elems)

    def scale_rows(self, rows: np.ndarray, backend: str = "auto") -> np.ndarray | None:
        """The raw scales of each of `rows` (table row ids, each once): uint8 [len(rows), scale row bytes], what
        the kernels read beside the rows (gpu.dequant's block_scales: type scales.kernel_type, one per
        scales.block elements); None for an unscaled table. Per-row and per-block scales are read through the
        scale table's own reads (its row cache too); a per-tensor scale is its float32 bytes on every row."""
        sp = self.scales
        if sp is None:
            return None
        rows = np.asarray(rows, np.int64)
        if sp.value is not None:
            return np.broadcast_to(np.float32(sp.value).reshape(1).view(np.uint8), (rows.shape[0], 4))
        srows, where = np.unique(sp.rows_of(rows), return_inverse=True)
        return self.scale_table.read_unique(srows, backend if backend in HOST_READERS else "auto")[where]

    # -- lifetime --------------------------------------------------------------------------------------------
    @_locked
    def close(self) -> None:
        try:
            if not self.closed:
                rowcache.save_hot(self)     # the next process starts with this one's hot rows (hotrows.py)
            if self.scale_table is not None:
                self.scale_table.close()
            self._fin()
        finally:
            self._meta = None
            self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return (f"Table({str(self.path)!r}, {self.name!r}, {self.qtype.name}, rows={self.n_rows}, "
                f"row_elems={self.row_elems}, row_bytes={self.row_bytes})")


def open_table(path, tensor: str = DEFAULT_TENSOR, config: Config | None = None, *, scales=None,
               scale_block=None) -> Table:
    """Open the row table `tensor` of a GGUF model (any shard of a split model) or a safetensors checkpoint,
    reading metadata only. A missing path or shard raises ModelNotFoundError (a GatherError and a
    FileNotFoundError) naming it. A float8 table's scales are found beside it by their published names
    (formats/scales.py); scales=NAME names the scale tensor, scales=False reads the values unscaled; scale_block:
    elements per scale along a row, or (rows, elements), where the scale's shape leaves it open."""
    return Table(path, tensor, config, scales=scales, scale_block=scale_block)

