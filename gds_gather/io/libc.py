"""The C library through ctypes, loaded once for the whole package (io_uring syscalls and barriers, mincore,
cachestat): one handle, errno kept for ctypes.get_errno(), the functions callers share typed here once."""
from __future__ import annotations

import ctypes
import functools


@functools.cache
def libc() -> ctypes.CDLL:
    """The process's C library (the symbols already loaded; libc.so.6 where those lack syscall), with `use_errno`.
    Typed: syscall returns a long (-1 and errno on failure); mincore(addr, length, vec) takes three pointers/sizes.
    Other functions (pthread_mutex_lock/unlock) keep ctypes' defaults."""
    lib = ctypes.CDLL(None, use_errno=True)
    if not hasattr(lib, "syscall"):     # pragma: no cover - a statically linked interpreter
        lib = ctypes.CDLL("libc.so.6", use_errno=True)
    lib.syscall.restype = ctypes.c_long
    lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    lib.mincore.restype = ctypes.c_int
    return lib
