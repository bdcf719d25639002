"""Rows into GPU memory. Three destinations, chosen by platform (see backends.resolve_device):

- "copy": a host reader fills page-locked staging, then one H2D copy on the caller's stream (discrete GPU, ROCm);
- "zero-copy": a host reader fills staging mapped into the GPU's address space, which kernels read in place
  (GB10 and other unified-memory boxes; forced with platform=unified it runs on a discrete GPU too);
- "gds": KvikIO/cuFile reads the windows straight into device memory (real GPU-direct where the driver has it,
  KvikIO's compat path otherwise).

Nothing here is imported on the CPU path. fetch() returns (device staging, device offset of each unique row);
the staging stays valid until the next fetch on the same sink, which first waits for work queued on the stream,
or until close(), which first waits for the stream of the last fetch.
"""
from __future__ import annotations

import logging
import weakref
from pathlib import Path

import numpy as np

from . import devcache
from .errors import BackendError, ReadError
from .planner import ReadPlan, realign
from .readers import GDS_ALIGN, check_file

log = logging.getLogger(__name__)

HOST_REGISTER_PORTABLE, HOST_REGISTER_MAPPED = 1, 2


def _cp():
    import cupy
    return cupy


class _LastStream:
    """The stream of a sink's last fetch (and the caller's stream object, kept alive), to wait for before the
    staging it reads is unpinned, unmapped or freed."""

    def __init__(self, accel):
        self.accel, self.caller, self.stream = accel, None, None

    def used(self, caller, stream) -> None:
        self.caller, self.stream = caller, stream

    def wait(self) -> None:
        s, self.caller, self.stream = self.stream, None, None
        if s is not None:
            self.accel.synchronize(s)


class _DeviceBuffer:
    """A device byte buffer that grows by doubling."""

    def __init__(self, accel):
        self.accel, self.buf = accel, None

    def ensure(self, nbytes: int):
        if self.buf is None or self.buf.nbytes < nbytes:
            self.buf = self.accel.empty(max(1 << 20, 1 << (int(nbytes) - 1).bit_length()))
        return self.buf

    def int64(self, n: int):
        return self.ensure(8 * n).view(np.int64)[:n]


class _Pin:
    """hostRegister / hostUnregister hooks of one Staging that unregister only a range they registered (after a
    refused register, the staging's buffer is not page-locked and close must not unregister it)."""

    def __init__(self, flags: int):
        self.flags, self.addr = flags, None

    def pin(self, buf) -> None:
        _cp().cuda.runtime.hostRegister(buf.ctypes.data, buf.nbytes, self.flags)
        self.addr = buf.ctypes.data

    def unpin(self, buf) -> None:
        if self.addr is not None and self.addr == buf.ctypes.data:
            self.addr = None
            _cp().cuda.runtime.hostUnregister(buf.ctypes.data)


def pin_staging(staging, mapped: bool) -> None:
    """Page-lock a reader's Staging for the GPU, now and after every regrowth; `mapped` also maps it into the
    GPU's address space so kernels can read it in place (zero copy). The hooks are installed once the current
    buffer is registered."""
    p = _Pin(HOST_REGISTER_PORTABLE | (HOST_REGISTER_MAPPED if mapped else 0))
    if staging.buf.nbytes:
        p.pin(staging.buf)
    staging.pin, staging.unpin = p.pin, p.unpin


def device_view(host: np.ndarray):
    """A cupy array over GPU-mapped (pinned with mapped=True) host memory: no copy."""
    cp = _cp()
    attrs = cp.cuda.runtime.pointerGetAttributes(host.ctypes.data)
    mem = cp.cuda.UnownedMemory(attrs.devicePointer, host.nbytes, host, cp.cuda.Device().id)
    return cp.ndarray((host.nbytes,), cp.uint8, cp.cuda.MemoryPointer(mem, 0))


class DeviceSink:
    """Moves what a host reader reads to the device: one H2D copy ("copy") or none ("zero-copy"). With a device
    row cache (devcache.DeviceRowCache, copy mode) hits stay in device memory and only misses are copied up."""

    bytes_read = 0          # (its reader, one of the Table's, counts the bytes)

    def __init__(self, reader, mode: str, *, accel, table=None, cache=None):
        if mode not in ("copy", "zero-copy"):
            raise ValueError(mode)
        # (a proxy: the Table's finalizer holds its sinks, which must not keep the Table alive)
        self.reader, self.mode, self.accel = reader, mode, accel
        self.table = weakref.proxy(table) if table is not None else None
        self.dc = cache if mode == "copy" else None
        if cache is not None and self.dc is None:
            devcache.release(cache)
        self.dev = _DeviceBuffer(accel)
        self.offsets = _DeviceBuffer(accel)
        self.pairs = _DeviceBuffer(accel)
        self.fresh = None           # (host view, device pointer, owner) of pinned memory for the misses
        self.last = _LastStream(accel)
        self.pinned = reader.staging is not None
        if self.pinned:
            accel.pin(reader.staging, mapped=mode == "zero-copy")
        elif mode == "zero-copy":
            self.mode = "copy"      # mmap/readahead/resident return fresh arrays: copy them up
        self.how = f"{reader.how}; {'zero-copy GPU-mapped staging' if self.mode == 'zero-copy' else 'pinned staging + one H2D copy' if self.pinned else 'host rows + one H2D copy'}"
        if self.dc is not None:
            self.how += f"; device row cache of {self.dc.index.capacity:,} rows"

    @property
    def cache(self):
        """The device cache's index (rowcache.RowCache), or None."""
        return self.dc.index if self.dc is not None else None

    def fetch(self, plan: ReadPlan, stream=None, wait: bool = True):
        """wait=False: the caller has waited for the stream (Table's copy of the ids down on it)."""
        a = self.accel
        s = a.current(stream)
        if wait:
            a.synchronize(s)    # the previous batch's consumers on this stream are done with staging
        self.last.used(stream, s)
        if self.dc is not None:
            return self._fetch_cached(plan, s)
        if self.pinned:
            host, offs = self.reader.fetch(plan)
            nbytes = (int(offs.max()) + plan.row_bytes) if offs.shape[0] else 0
        else:
            host = np.ascontiguousarray(self.reader.read(plan)).reshape(-1)
            offs = np.arange(plan.n_unique, dtype=np.int64) * plan.row_bytes
            nbytes = host.nbytes
        with a.using(s):
            if self.mode == "zero-copy":
                dev = a.device_view(host[:max(nbytes, 1)])
            else:
                dev = self.dev.ensure(nbytes)
                if nbytes:
                    a.h2d(dev, host, nbytes, s)
                if not self.pinned:
                    a.synchronize(s)     # `host` is a temporary: finish the copy before it is freed
            d_offs = self.offsets.int64(offs.shape[0])
            a.upload(d_offs, np.ascontiguousarray(offs, np.int64), s)
        return dev[:nbytes], d_offs

    def _fetch_cached(self, plan: ReadPlan, s):
        """devcache.stage looks up, reads the misses into pinned memory and admits them; the misses are copied
        up behind the cache slots, then the admitted ones device-to-device into their slots."""
        a, dc, rb, U = self.accel, self.dc, plan.row_bytes, plan.n_unique
        need = -(-U * rb // 8) * 8
        if self.fresh is None or self.fresh[0].nbytes < need:
            self.fresh = a.mapped(max(1 << 20, 1 << (int(need) - 1).bit_length()))
        got = devcache.stage(dc, self.table, self.reader, plan, fresh=self.fresh[0])
        nbytes, k = 8 * got.fresh_words, got.adm_src.shape[0]
        try:
            with a.using(s):
                pool = dc.ensure(nbytes)
                if nbytes:
                    a.h2d(pool, self.fresh[0], nbytes, s, dst_offset=dc.fresh_base)
                if k:   # devcache's row copy: [src offsets | dst offsets | 0, k] in one upload, one launch
                    pairs = self.pairs.int64(2 * k + 2)
                    a.upload(pairs, np.concatenate([got.adm_src, got.adm_dst, [0, k]]).astype(np.int64), s)
                    p = a.ptr(pairs)
                    a.copy_rows(a.ptr(pool), p, p + 8 * k, p + 16 * k, rb, k, s, dc.device_id)
                d_offs = self.offsets.int64(U)
                a.upload(d_offs, got.offsets, s)
        except BaseException:
            dc.clear()       # the index holds rows the device never copied
            raise
        return pool[:dc.fresh_base + nbytes], d_offs

    def close(self) -> None:
        """Wait for the last fetch's stream (its kernels may still read the staging), then drop the buffers and
        give the device cache back; the reader, closed after the sinks (Table), then unpins and unmaps."""
        try:
            self.last.wait()
        finally:
            self.dev.buf = self.offsets.buf = self.pairs.buf = self.fresh = None
            devcache.release(self.dc)
            self.dc = None


def configure_kvikio(threads: int, kvikio=None) -> tuple[bool, str]:
    """Set KvikIO's process-wide defaults for our reads and say how they run: (real GPU-direct storage, how).

    Threads and a GDS threshold of 0 (KvikIO's 1 thread and 16 KiB threshold would serialize and bypass GDS for
    small reads); without real GPU-direct storage also `auto_direct_io_read` (KvikIO >= 25.12), since KvikIO's
    compat-mode POSIX reads are buffered otherwise and repeated "cold" reads would measure the page cache.
    `kvikio`: the module (tests pass a stand-in)."""
    if kvikio is None:
        import kvikio
        import kvikio.cufile_driver
        import kvikio.defaults
    d = kvikio.defaults
    try:
        d.set({"num_threads": threads, "gds_threshold": 0})
    except AttributeError:       # KvikIO < 25.02
        d.num_threads_reset(threads)
        d.gds_threshold_reset(0)
    try:
        real = bool(kvikio.cufile_driver.get("is_gds_available"))
    except Exception:            # no cuFile driver to ask: no GPU-direct DMA
        real = False
    if real and not d.is_compat_mode_preferred():
        return True, "real GPU-direct storage"
    try:
        d.set({"auto_direct_io_read": True})
        direct = bool(d.get("auto_direct_io_read"))
    except (AttributeError, KeyError, ValueError, TypeError):      # KvikIO < 25.12: no such setting
        direct = False
    return False, ("cuFile/KvikIO compat mode: POSIX O_DIRECT reads (auto_direct_io_read) through a bounce "
                   "buffer, no GPU-direct DMA" if direct else
                   "cuFile/KvikIO compat mode: BUFFERED POSIX reads through the page cache (this KvikIO has no "
                   "auto_direct_io_read; 25.12+ has), no GPU-direct DMA")


class GdsReader:
    """KvikIO/cuFile (accel.cufile): aligned windows read straight into device memory.

    KvikIO's Python API takes one call per read, so this submits one pread per window (each split by KvikIO's
    thread pool): it suits large rows (Gemma's 7 KiB) far better than qwen4exp's 90-byte ones.
    """

    name = "gds"
    cache = None
    tells_source = True      # cuFile reads every row from the file (no page-cache copies)
    overlaps_io = False
    staging = None
    odirect = True
    rows_from_page_cache = 0
    last_from_page_cache = None

    def __init__(self, path, data_offset, n_bytes, *, config, file_id, accel=None):
        from .accel import get
        from .readers import default_threads
        self.accel = accel or get("cuda")
        self.path, self.config, self.file_id = Path(path), config, file_id
        self.data_offset, self.n_bytes, self.file_size = int(data_offset), int(n_bytes), int(file_id[2])
        threads = default_threads(config)
        try:
            self.file, self.how, self.real_gds = self.accel.cufile(self.path, threads)
        except BackendError:
            raise
        except (OSError, RuntimeError) as e:
            raise BackendError(f"gds: KvikIO could not open {self.path}: {type(e).__name__}: {e}") from e
        if not self.real_gds:
            log.warning("%s: gds: %s", self.path.name, self.how)
        self.dev = _DeviceBuffer(self.accel)
        self.offsets = _DeviceBuffer(self.accel)
        self.last = _LastStream(self.accel)
        self.bytes_read = 0

    def check_file(self) -> None:
        """ReadError if the file changed since the table was opened (as the host readers' check_file)."""
        check_file(self.path, self.file_id)

    def read_windows(self, plan: ReadPlan):
        """The plan's windows into the device staging (`dev.buf`, which the caller may have placed), now; the
        caller guarantees nothing still reads that staging (the prefill's slots wait on their events)."""
        self.check_file()
        if plan.align % GDS_ALIGN:     # (the prefill keeps the plan's row_staging: no realigning)
            raise BackendError(f"gds: plan at {plan.align}-byte alignment; plan at Table.gds_align ({GDS_ALIGN})")
        dev = self.dev.ensure(plan.window_bytes)
        futures = []
        for off, n, st in zip(plan.win_offsets.tolist(), plan.win_lengths.tolist(), plan.win_staging.tolist()):
            want = min(n, self.file_size - off)
            futures.append((off, want, self.file.pread(dev[st:st + n], want, off)))
        for off, want, fu in futures:
            got = fu.get()
            if got != want:
                raise ReadError(f"{self.path}: cuFile read at offset {off} returned {got} of {want} bytes")
        self.bytes_read += plan.window_bytes
        return dev

    def fetch(self, plan: ReadPlan, stream=None, wait: bool = True):
        """(device staging, device offset of each unique row): the plan realigned to GDS_ALIGN and read, once the
        stream's queued work is done with the staging (cuFile is not stream-ordered; wait=False: the caller has
        waited)."""
        a = self.accel
        plan = realign(plan, GDS_ALIGN, self.config)     # windows KvikIO reads with GDS: 4 KiB-aligned
        s = a.current(stream)
        if wait:
            a.synchronize(s)
        self.last.used(stream, s)
        dev = self.read_windows(plan)
        d_offs = self.offsets.int64(plan.n_unique)
        a.upload(d_offs, plan.row_staging, s)
        return dev[:plan.window_bytes], d_offs

    def close(self) -> None:
        try:
            self.last.wait()        # kernels queued after the last fetch may still read the device staging
        finally:
            if getattr(self, "file", None) is not None:
                self.file.close()
                self.file = None
            self.dev.buf = self.offsets.buf = None
