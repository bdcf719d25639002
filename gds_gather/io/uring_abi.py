"""The kernel's io_uring interface as uring.py uses it: syscall numbers, named opcodes and flags, the layouts of
the submission and completion entries (numpy dtypes) and of the setup/wait structures (ctypes), the raw syscall,
and the memory barrier a weakly ordered CPU needs between a ring's index and its entries. Facts of the ABI only:
no state, no policy."""
from __future__ import annotations

import ctypes
import enum
import errno
import os
import platform

import numpy as np

from .libc import libc

SYS_SETUP, SYS_ENTER, SYS_REGISTER = 425, 426, 427        # the same numbers on x86-64 and arm64
OFF_SQ_RING, OFF_CQ_RING, OFF_SQES = 0, 0x8000000, 0x10000000
FEAT_SINGLE_MMAP, FEAT_EXT_ARG = 1, 1 << 8
ENTER_GETEVENTS, ENTER_EXT_ARG = 1, 8
SQE_FIXED_FILE = 1
SQE_ASYNC = 1 << 4
MAX_CHUNK = 0x7FFFF000      # the most one read returns on Linux (MAX_RW_COUNT), well inside the 32-bit SQE length
U32 = 0xFFFFFFFF


class Op(enum.IntEnum):
    """Submission opcodes (enum io_uring_op)."""
    READ_FIXED = 4          # into a registered buffer
    READ = 22               # into any memory


class Register(enum.IntEnum):
    """io_uring_register opcodes."""
    BUFFERS = 0
    UNREGISTER_BUFFERS = 1
    FILES = 2
    UNREGISTER_FILES = 3


SQE = np.dtype({"names": ["opcode", "flags", "ioprio", "fd", "off", "addr", "len", "rw_flags", "user_data",
                          "buf_index"],
                "formats": [np.uint8, np.uint8, np.uint16, np.int32, np.uint64, np.uint64, np.uint32, np.uint32,
                            np.uint64, np.uint16],
                "offsets": [0, 1, 2, 4, 8, 16, 24, 28, 32, 40], "itemsize": 64})
CQE = np.dtype({"names": ["user_data", "res", "flags"], "formats": [np.uint64, np.int32, np.uint32],
                "offsets": [0, 8, 12], "itemsize": 16})


class Params(ctypes.Structure):             # struct io_uring_params
    _fields_ = [("sq_entries", ctypes.c_uint32), ("cq_entries", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("sq_thread_cpu", ctypes.c_uint32), ("sq_thread_idle", ctypes.c_uint32),
                ("features", ctypes.c_uint32), ("wq_fd", ctypes.c_uint32), ("resv", ctypes.c_uint32 * 3),
                ("sq_off", ctypes.c_uint32 * 10), ("cq_off", ctypes.c_uint32 * 10)]


class Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_int64), ("tv_nsec", ctypes.c_long)]


class GeteventsArg(ctypes.Structure):       # struct io_uring_getevents_arg
    _fields_ = [("sigmask", ctypes.c_uint64), ("sigmask_sz", ctypes.c_uint32), ("pad", ctypes.c_uint32),
                ("ts", ctypes.c_uint64)]


class Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def syscall(nr: int, *args) -> int:
    """syscall(nr, *args), retried on EINTR; OSError on any other failure."""
    while True:
        r = libc().syscall(ctypes.c_long(nr), *args)
        if r >= 0:
            return r
        e = ctypes.get_errno()
        if e != errno.EINTR:
            raise OSError(e, os.strerror(e))


def enter(ring_fd: int, to_submit: int, wait: int, flags: int = ENTER_GETEVENTS, arg=None, arg_size: int = 0) -> int:
    """io_uring_enter: submit `to_submit` entries and wait for `wait` completions; returns the entries taken."""
    return syscall(SYS_ENTER, ctypes.c_int(ring_fd), ctypes.c_uint(to_submit), ctypes.c_uint(wait),
                   ctypes.c_uint(flags), arg, ctypes.c_size_t(arg_size))


def full_barrier() -> None:
    """A full memory barrier callable from Python (lock + unlock of a private pthread mutex): needed on
    weakly ordered CPUs (arm64: GB10, Grace) between reading a ring tail and its entries, or between filling
    a buffer and publishing a flag. A fresh mutex each time: a signal handler that raises between the two calls
    (Python runs handlers between bytecodes) abandons that one mutex instead of deadlocking the next barrier."""
    lib = libc()
    m = ctypes.create_string_buffer(64)      # all zeros: PTHREAD_MUTEX_INITIALIZER
    lib.pthread_mutex_lock(m)
    lib.pthread_mutex_unlock(m)


def _no_barrier() -> None:
    pass


# Reading a completion ring's tail, then its entries: an acquire. x86-64 never reorders a load with an earlier
# load (TSO), so there it takes nothing (liburing's io_uring_smp_load_acquire is a plain load there).
acquire = _no_barrier if platform.machine() in ("x86_64", "AMD64", "i686", "i386") else full_barrier
