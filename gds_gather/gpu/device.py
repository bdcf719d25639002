"""The CUDA-side pieces behind cuda.CudaAccel that are more than one call: page-locking (and GPU-mapping) a
reader's staging, a device view of mapped host memory, KvikIO's configuration, and the cuFile reader of the "gds"
destination (destinations.py), which reads windows straight into device memory (real GPU-direct where the driver
has it, KvikIO's compat path otherwise). Nothing here is imported on the CPU path.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np

from ..errors import BackendError, ReadError
from ..planner import ReadPlan
from ..io.readers import GDS_ALIGN, check_file, default_threads

log = logging.getLogger(__name__)

HOST_REGISTER_PORTABLE, HOST_REGISTER_MAPPED = 1, 2
_KVIKIO_LOCK = threading.Lock()
_KVIKIO_SET: list = []      # [(kvikio module, threads, answer)] of the last configuration (the module kept alive)


def _cp():
    import cupy
    return cupy


class DeviceBuffer:
    """A device byte buffer that grows by doubling (a cuFile reader's staging)."""

    def __init__(self, accel):
        self.accel, self.buf = accel, None

    def ensure(self, nbytes: int):
        if self.buf is None or self.buf.nbytes < nbytes:
            self.buf = self.accel.empty(max(1 << 20, 1 << (int(nbytes) - 1).bit_length()))
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


def configure_kvikio(threads: int, kvikio=None) -> tuple[bool, str]:
    """Set KvikIO's process-wide defaults for our reads and say how they run: (real GPU-direct storage, how).

    Threads and a GDS threshold of 0 (KvikIO's 1 thread and 16 KiB threshold would serialize and bypass GDS for
    small reads); without real GPU-direct storage also `auto_direct_io_read` (KvikIO >= 25.12), since KvikIO's
    compat-mode POSIX reads are buffered otherwise and repeated "cold" reads would measure the page cache.
    Once per process and thread count: setting the thread count rebuilds KvikIO's pool (it waits for the reads
    in flight), so a reader opened with the count already set leaves it alone. `kvikio`: the module (tests pass
    a stand-in)."""
    if kvikio is None:
        import kvikio
        import kvikio.cufile_driver
        import kvikio.defaults
    with _KVIKIO_LOCK:
        if _KVIKIO_SET and _KVIKIO_SET[0][0] is kvikio and _KVIKIO_SET[0][1] == threads:
            return _KVIKIO_SET[0][2]
        answer = _configure(threads, kvikio)
        _KVIKIO_SET[:] = [(kvikio, threads, answer)]
        return answer


def _configure(threads: int, kvikio) -> tuple[bool, str]:
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


def read_runs(plan: ReadPlan, file_size: int):
    """The plan's windows as the fewest reads: windows that follow each other both in the file and in the
    staging (the planner's window-size cuts, or windows that touch) are one read. (file offsets, staging offsets,
    bytes each read spans, bytes the file has of them), int64 arrays; vectorized."""
    off, ln, st = plan.win_offsets, plan.win_lengths, plan.win_staging
    w = off.shape[0]
    brk = np.ones(w, bool)
    np.not_equal(off[1:], off[:-1] + ln[:-1], out=brk[1:])
    brk[1:] |= st[1:] != st[:-1] + ln[:-1]
    heads = np.flatnonzero(brk)
    tails = np.append(heads[1:], w) - 1
    span = off[tails] + ln[tails] - off[heads]
    return off[heads], st[heads], span, np.clip(file_size - off[heads], 0, span)


class GdsReader:
    """KvikIO/cuFile (Accel.cufile): aligned windows read straight into device memory.

    KvikIO's Python API takes one call per read: a plan's runs of adjacent windows are one pread each
    (`read_runs`), every one submitted before any is waited for, each split across KvikIO's thread pool. Windows
    apart in the file stay apart (the planner bridges gaps: Config.max_gap), so small scattered rows still cost a
    call each: this suits large rows (Gemma's 7 KiB) far better than qwen4exp's 90-byte ones.
    """

    name = "gds"
    cache = None
    tells_source = True      # cuFile reads every row from the file (no page-cache copies)
    overlaps_io = False
    staging = None
    odirect = True
    rows_from_page_cache = 0
    last_from_page_cache = None
    admit_page_cache = False

    def __init__(self, path, data_offset, n_bytes, *, config, file_id, accel):
        self.accel = accel
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
        self.dev = DeviceBuffer(self.accel)     # where read_windows reads (a destination may place it)
        self.bytes_read = 0

    def check_file(self) -> None:
        """ReadError if the file changed since the table was opened (as the host readers' check_file)."""
        check_file(self.path, self.file_id)

    def read_windows(self, plan: ReadPlan):
        """The plan's windows into the device staging (`dev.buf`, which the caller may have placed), now; the
        caller guarantees nothing still reads that staging (a destination's slot is reused only after the stream
        that read it is done)."""
        self.check_file()
        if plan.align % GDS_ALIGN:     # (a destination keeps the plan's row_staging: no realigning here)
            raise BackendError(f"gds: plan at {plan.align}-byte alignment; plan at Table.gds_align ({GDS_ALIGN})")
        dev = self.dev.ensure(plan.window_bytes)
        futures = []
        for off, st, n, want in zip(*(a.tolist() for a in read_runs(plan, self.file_size))):
            futures.append((off, want, self.file.pread(dev[st:st + n], want, off)))
        for off, want, fu in futures:
            got = fu.get()
            if got != want:
                raise ReadError(f"{self.path}: cuFile read at offset {off} returned {got} of {want} bytes")
        self.bytes_read += plan.window_bytes
        return dev

    def close(self) -> None:
        """(The destination that reads this staging waited for its stream before closing its readers.)"""
        if getattr(self, "file", None) is not None:
            self.file.close()
            self.file = None
        self.dev.buf = None
