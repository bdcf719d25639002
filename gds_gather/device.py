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

import numpy as np

from . import arrays
from .errors import BackendError, ReadError
from .planner import ReadPlan, realign
from .readers import GDS_ALIGN

log = logging.getLogger(__name__)

HOST_REGISTER_PORTABLE, HOST_REGISTER_MAPPED = 1, 2


def _cp():
    import cupy
    return cupy


class _LastStream:
    """The stream of a sink's last fetch (and the caller's stream object, kept alive), to wait for before the
    staging it reads is unpinned, unmapped or freed."""

    def __init__(self):
        self.caller = self.stream = None

    def used(self, caller, stream) -> None:
        self.caller, self.stream = caller, stream

    def wait(self) -> None:
        s, self.caller, self.stream = self.stream, None, None
        if s is not None:
            s.synchronize()


class _DeviceBuffer:
    """A device byte buffer that grows by doubling (cupy allocation)."""

    def __init__(self):
        self.buf = None

    def ensure(self, nbytes: int):
        cp = _cp()
        if self.buf is None or self.buf.nbytes < nbytes:
            self.buf = cp.empty(max(1 << 20, 1 << (int(nbytes) - 1).bit_length()), cp.uint8)
        return self.buf


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
    """Moves what a host reader reads to the GPU: one H2D copy ("copy") or none ("zero-copy")."""

    def __init__(self, reader, mode: str, *, cache=None, replan=None, io=None):
        if mode not in ("copy", "zero-copy"):
            raise ValueError(mode)
        self.reader, self.mode = reader, mode
        # device-resident row cache (copy mode): rowcache.RowCache(store=False) keeps the index and policy, the
        # rows live in GPU memory in front of the staging, in one buffer, so one offsets array serves both
        self.cache = cache if mode == "copy" else None
        self.replan, self.io = replan, io
        self._cache_dev = None
        self.dev = _DeviceBuffer()
        self.offsets = _DeviceBuffer()
        self.last = _LastStream()
        staging = getattr(reader, "staging", None)
        self.pinned = staging is not None
        if staging is not None:
            pin_staging(staging, mapped=mode == "zero-copy")
        elif mode == "zero-copy":
            self.mode = "copy"      # mmap/readahead/resident return fresh arrays: copy them up
        self.how = f"{reader.how}; {'zero-copy GPU-mapped staging' if self.mode == 'zero-copy' else 'pinned staging + one H2D copy' if self.pinned else 'host rows + one H2D copy'}"

    def fetch(self, plan: ReadPlan, stream=None):
        cp = _cp()
        s = arrays.cupy_stream(stream)
        s.synchronize()      # the previous batch's consumers on this stream are done with staging
        self.last.used(stream, s)
        if self.cache is not None and self.cache.capacity and hasattr(self.reader, "fetch"):
            return self._fetch_cached(plan, s)
        if hasattr(self.reader, "fetch"):
            host, offs = self.reader.fetch(plan)
            nbytes = (int(offs.max()) + plan.row_bytes) if offs.shape[0] else 0
        else:
            host = np.ascontiguousarray(self.reader.read(plan)).reshape(-1)
            offs = np.arange(plan.n_unique, dtype=np.int64) * plan.row_bytes
            nbytes = host.nbytes
        with s:
            if self.mode == "zero-copy":
                dev = device_view(host[:max(nbytes, 1)])
            else:
                dev = self.dev.ensure(nbytes)
                if nbytes:
                    cp.cuda.runtime.memcpyAsync(dev.data.ptr, host.ctypes.data, nbytes,
                                                cp.cuda.runtime.memcpyHostToDevice, s.ptr)
                if not self.pinned:
                    s.synchronize()     # `host` is a temporary: finish the copy before it is freed
            d_offs = self.offsets.ensure(offs.nbytes).view(cp.int64)[:offs.shape[0]]
            d_offs.set(np.ascontiguousarray(offs, np.int64), stream=s)
        return dev[:nbytes], d_offs

    def _fetch_cached(self, plan: ReadPlan, s):
        """Hits stay in the device cache (no PCIe); misses are read and copied up behind the cache slots, then
        the admitted ones are copied device-to-device into their slots. Offsets: slot * row_bytes for hits,
        cache bytes + staging offset for fresh rows, into one device buffer."""
        cp = _cp()
        c, rb, U = self.cache, plan.row_bytes, plan.n_unique
        cb = c.capacity * rb
        self.reader.check_file()                 # hits must not outlive a changed file
        slots, g = c.lookup_gen(plan.unique_rows)
        hit = slots >= 0
        nh = int(hit.sum())
        offs_all = np.empty(U, np.int64)
        offs_all[hit] = slots[hit] * rb
        nbytes = 0
        if nh < U:
            miss = ~hit
            rows = plan.unique_rows[miss]
            pc0 = getattr(self.reader, "rows_from_page_cache", 0)
            host, offs = self.reader.fetch(self.replan(rows) if nh else plan)
            nbytes = int(offs.max()) + rb
            offs_all[miss] = cb + offs
            if self.io is not None:
                from .rowcache import _count_reader
                _count_reader(self.io, self.reader, pc0, U - nh)
        if self.io is not None:
            self.io["cache_hits"] += nh
            self.io["rows_from_cache"] += nh
            self.io["cache_misses"] += U - nh
        with s:
            need = cb + nbytes
            if self._cache_dev is None or self._cache_dev.nbytes < need:
                new = cp.empty(max(1 << 20, 1 << (int(need) - 1).bit_length()), cp.uint8)
                if self._cache_dev is not None and cb:
                    new[:cb] = self._cache_dev[:cb]
                self._cache_dev = new
            dev = self._cache_dev
            if nbytes:
                cp.cuda.runtime.memcpyAsync(dev.data.ptr + cb, host.ctypes.data, nbytes,
                                            cp.cuda.runtime.memcpyHostToDevice, s.ptr)
                with c.lock:
                    new_slots = c.admit(rows, None, protect=slots[hit], gen=g)
                a = new_slots >= 0
                k = int(a.sum())
                try:
                    if k:   # devcache's row copy: [src offsets | dst offsets | 0, k] in one upload, one launch
                        from . import devcache
                        pairs = cp.asarray(np.concatenate([cb + offs[a], new_slots[a] * rb, [0, k]]).astype(np.int64))
                        p = pairs.data.ptr
                        devcache.copy_rows(dev.data.ptr, p, p + 8 * k, p + 16 * k, rb, k, s.ptr, dev.device.id)
                except BaseException:
                    c.clear()       # the index holds rows the device never copied
                    raise
            d_offs = self.offsets.ensure(U * 8).view(cp.int64)[:U]
            d_offs.set(offs_all, stream=s)
        return dev[:need], d_offs

    def close(self) -> None:
        """Wait for the last fetch's stream (its kernels may still read the staging), then drop the buffers; the
        reader, closed after the sinks (Table), then unpins and unmaps the staging."""
        try:
            self.last.wait()
        finally:
            self.dev.buf = self.offsets.buf = None
            self._cache_dev = None


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
    """KvikIO/cuFile: aligned windows read straight into device memory.

    KvikIO's Python API takes one call per read, so this submits one pread per window (each split by KvikIO's
    thread pool): it suits large rows (Gemma's 7 KiB) far better than qwen4exp's 90-byte ones.
    """

    name = "gds"
    tells_source = True      # cuFile reads every row from the file (no page-cache copies)

    def __init__(self, path, data_offset, n_bytes, *, config, file_id):
        try:
            import kvikio
            import kvikio.defaults
        except Exception as e:   # ImportError, or OSError/RuntimeError from loading libkvikio / libcufile / libcuda
            raise BackendError(f"gds needs a loadable kvikio (pip install 'gds-gather[cuda13]'): "
                               f"{type(e).__name__}: {e}") from e
        from .readers import Reader, default_threads
        self._base = Reader(path, data_offset, n_bytes, config=config, file_id=file_id)
        self.path, self.config = self._base.path, config
        threads = default_threads(config)
        try:
            self.real_gds, reads = configure_kvikio(threads)
            self.file = kvikio.CuFile(str(self.path), "r")
        except (OSError, RuntimeError) as e:
            self._base.close()
            raise BackendError(f"gds: KvikIO could not open {self.path}: {type(e).__name__}: {e}") from e
        self.how = f"KvikIO CuFile, {threads} threads, {reads}"
        if not self.real_gds:
            log.warning("%s: gds: %s", self.path.name, self.how)
        self.dev = _DeviceBuffer()
        self.offsets = _DeviceBuffer()
        self.last = _LastStream()
        self.odirect = True
        self.bytes_read = 0

    def check_file(self) -> None:
        """ReadError if the file changed since the table was opened (as the host readers' check_file)."""
        self._base.check_file()

    def fetch(self, plan: ReadPlan, stream=None, wait: bool = True):
        """wait=False: the caller guarantees nothing still reads the device staging (the prefill's double
        buffering waits on its own event per slot)."""
        cp = _cp()
        self._base.check_file()
        if not wait and plan.align % GDS_ALIGN:     # (the prefill keeps the plan's row_staging: no realigning)
            raise BackendError(f"gds: plan at {plan.align}-byte alignment; plan at Table.gds_align ({GDS_ALIGN})")
        plan = realign(plan, GDS_ALIGN, self.config)     # windows KvikIO reads with GDS: 4 KiB-aligned
        s = arrays.cupy_stream(stream)
        if wait:
            s.synchronize()  # cuFile is not stream-ordered: queued work must be done before we overwrite
            self.last.used(stream, s)   # (wait=False: the prefill orders and drains its slots itself)
        dev = self.dev.ensure(plan.window_bytes)
        size = self._base.file_size
        futures = []
        for off, n, st in zip(plan.win_offsets.tolist(), plan.win_lengths.tolist(), plan.win_staging.tolist()):
            want = min(n, size - off)
            futures.append((off, want, self.file.pread(dev[st:st + n], want, off)))
        for off, want, fu in futures:
            got = fu.get()
            if got != want:
                raise ReadError(f"{self.path}: cuFile read at offset {off} returned {got} of {want} bytes")
        self.bytes_read += plan.window_bytes
        d_offs = self.offsets.ensure(plan.row_staging.nbytes).view(cp.int64)[:plan.n_unique]
        d_offs.set(plan.row_staging, stream=s)
        return dev[:plan.window_bytes], d_offs

    def close(self) -> None:
        try:
            self.last.wait()        # kernels queued after the last fetch may still read the device staging
        finally:
            if getattr(self, "file", None) is not None:
                self.file.close()
                self.file = None
            self.dev.buf = self.offsets.buf = None
