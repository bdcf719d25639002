"""What lets the fetch-dequant step live inside a CUDA graph: a host flag the graph waits on.

The host reads a ubatch's rows into pinned staging while the GPU computes the previous ubatch; the captured
graph starts with a stream wait-value node on a pinned int32 flag (cuStreamWaitValue32), so each replay blocks
on the GPU until the host writes 1, then copies, dequantizes and computes, and re-arms the flag to 0 with a
write-value node. No host callback and no cuFile call is inside the graph (NVIDIA's GDS release notes: cuFile's
stream APIs are not supported in CUDA graphs); the wait and write nodes capture through the versioned `_v2` driver
symbols. CUDA only: on ROCm the prefill runs eagerly and never builds HostFlags (see pipeline.GpuPrefill). The order
of host writes, replays and the release on errors is gds_gather.gpu.schedule's.
"""
from __future__ import annotations

import ctypes
import functools
import platform

import numpy as np

from ..io import native
from ..errors import BackendError, WaitValueRefused

CU_STREAM_WAIT_VALUE_EQ = 0x1
CU_STREAM_WRITE_VALUE_DEFAULT = 0x0


@functools.cache
def _libcuda():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise BackendError(f"libcuda.so.1 is not loadable: {e}") from None
    for name in ("cuStreamWaitValue32_v2", "cuStreamWriteValue32_v2"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise WaitValueRefused(f"{what} failed with CUresult {rc}")


def refused_in(exc: BaseException | None) -> WaitValueRefused | None:
    """The WaitValueRefused behind `exc` (itself, or its cause/context: torch's capture_end raises its own error
    over it), or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, WaitValueRefused):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def publisher():
    """A function (flags, i, value) that publishes a host flag after the staging writes: the native helpers'
    fenced release store; plain numpy stores only on x86-64, whose stores are never reordered with older ones.
    BackendError elsewhere without the native helpers (then the prefill runs eagerly)."""
    lib, why = native.library()
    if lib is not None:
        return functools.partial(native.publish_i32, lib)
    if platform.machine().lower() in ("x86_64", "amd64"):
        def store(flags, i, value):
            flags[i] = value
        return store
    raise BackendError(f"publishing a host flag on {platform.machine()} needs a store-store barrier from the "
                       f"native helpers: {why}")


class HostFlags:
    """`n` int32 flags in page-locked, GPU-mapped host memory: the host sets them, captured nodes wait on them."""

    def __init__(self, n: int = 2):
        import cupy as cp
        self._publish = publisher()
        self._mem = cp.cuda.alloc_pinned_memory(4 * n)        # cudaHostAlloc: portable, mapped (UVA)
        self.host = np.frombuffer(self._mem, np.int32, n)
        self.host[:] = 0
        attrs = cp.cuda.runtime.pointerGetAttributes(self._mem.ptr)
        self.dev_ptr = int(attrs.devicePointer)

    def wait(self, stream_handle: int, i: int, value: int = 1) -> None:
        """Enqueue (or capture) a wait until flag i == value."""
        _check(_libcuda().cuStreamWaitValue32_v2(ctypes.c_void_p(stream_handle), self.dev_ptr + 4 * i, value,
                                                 CU_STREAM_WAIT_VALUE_EQ), "cuStreamWaitValue32")

    def write(self, stream_handle: int, i: int, value: int) -> None:
        """Enqueue (or capture) a GPU write of `value` into flag i."""
        _check(_libcuda().cuStreamWriteValue32_v2(ctypes.c_void_p(stream_handle), self.dev_ptr + 4 * i, value,
                                                  CU_STREAM_WRITE_VALUE_DEFAULT), "cuStreamWriteValue32")

    def set(self, i: int, value: int = 1) -> None:
        """Host side: release the GPU; every staging write is visible before the flag (see publisher)."""
        self._publish(self.host, i, value)

    def probe(self, stream_handle: int) -> None:
        """Queue a (satisfied) wait and a write on flag 0 eagerly and wait for them, before any capture:
        WaitValueRefused where the driver refuses stream memory operations."""
        from .arrays import cupy_stream
        self.set(0, 1)
        try:
            self.wait(stream_handle, 0, 1)
            self.write(stream_handle, 0, 0)
            cupy_stream(stream_handle).synchronize()
            if self.host[0] != 0:
                raise WaitValueRefused("cuStreamWriteValue32 ran but its write did not reach the host flag")
        finally:
            self.host[:] = 0
