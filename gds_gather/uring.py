"""A minimal io_uring driven from numpy: raw syscalls through ctypes, submission entries written in batches.

One thread submits many reads with one `io_uring_enter`; numpy fills the mmapped submission ring and reads the
completion ring a batch at a time, so no Python runs per read. Short reads are resubmitted for the remainder,
-EINTR/-EAGAIN are retried, and any other error or an unexpected end of file raises ReadError naming the file
and offset.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import threading
import time

import numpy as np

from .errors import ReadError

SYS_SETUP, SYS_ENTER, SYS_REGISTER = 425, 426, 427        # the same numbers on x86-64 and arm64
OFF_SQ_RING, OFF_CQ_RING, OFF_SQES = 0, 0x8000000, 0x10000000
OP_READ_FIXED, OP_READ = 4, 22
FEAT_SINGLE_MMAP = 1
ENTER_GETEVENTS = 1
REGISTER_BUFFERS, REGISTER_FILES = 0, 2
SQE_FIXED_FILE = 1

SQE = np.dtype({"names": ["opcode", "flags", "ioprio", "fd", "off", "addr", "len", "rw_flags", "user_data",
                          "buf_index"],
                "formats": [np.uint8, np.uint8, np.uint16, np.int32, np.uint64, np.uint64, np.uint32, np.uint32,
                            np.uint64, np.uint16],
                "offsets": [0, 1, 2, 4, 8, 16, 24, 28, 32, 40], "itemsize": 64})
CQE = np.dtype({"names": ["user_data", "res", "flags"], "formats": [np.uint64, np.int32, np.uint32],
                "offsets": [0, 8, 12], "itemsize": 16})


class _Params(ctypes.Structure):
    _fields_ = [("sq_entries", ctypes.c_uint32), ("cq_entries", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("sq_thread_cpu", ctypes.c_uint32), ("sq_thread_idle", ctypes.c_uint32),
                ("features", ctypes.c_uint32), ("wq_fd", ctypes.c_uint32), ("resv", ctypes.c_uint32 * 3),
                ("sq_off", ctypes.c_uint32 * 10), ("cq_off", ctypes.c_uint32 * 10)]


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


@functools.cache
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


_BARRIER_MUTEX = ctypes.create_string_buffer(64)


def full_barrier() -> None:
    """A full memory barrier callable from Python (lock + unlock of a private pthread mutex): needed on
    weakly ordered CPUs (arm64: GB10, Grace) between reading a ring tail and its entries, or between filling
    a buffer and publishing a flag."""
    libc = _libc()
    libc.pthread_mutex_lock(_BARRIER_MUTEX)
    libc.pthread_mutex_unlock(_BARRIER_MUTEX)


def _sys(nr: int, *args) -> int:
    while True:
        r = _libc().syscall(ctypes.c_long(nr), *args)
        if r >= 0:
            return r
        e = ctypes.get_errno()
        if e != errno.EINTR:
            raise OSError(e, os.strerror(e))


@functools.cache
def probe() -> tuple[bool, str]:
    """(usable, why): whether this kernel and sandbox allow io_uring with the opcodes we use."""
    try:
        r = Ring(8)
    except OSError as e:
        return False, f"io_uring_setup failed: {e.strerror or e} (kernel < 5.6, io_uring_disabled, or seccomp)"
    r.close()
    return True, "io_uring available"


class Ring:
    """One io_uring instance of `depth` entries. Not thread-safe: a second concurrent user raises clearly."""

    def __init__(self, depth: int = 128):
        p = _Params()
        self.fd = _sys(SYS_SETUP, ctypes.c_uint32(depth), ctypes.byref(p))
        self._maps = []
        try:
            sq, cq = list(p.sq_off), list(p.cq_off)
            sq_size = sq[6] + p.sq_entries * 4
            cq_size = cq[5] + p.cq_entries * CQE.itemsize
            prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            if p.features & FEAT_SINGLE_MMAP:
                sq_size = cq_size = max(sq_size, cq_size)
            sq_map = mmap.mmap(self.fd, sq_size, flags, prot, offset=OFF_SQ_RING)
            cq_map = sq_map if p.features & FEAT_SINGLE_MMAP else mmap.mmap(self.fd, cq_size, flags, prot,
                                                                              offset=OFF_CQ_RING)
            sqe_map = mmap.mmap(self.fd, p.sq_entries * SQE.itemsize, flags, prot, offset=OFF_SQES)
            self._maps = [m for m in {id(x): x for x in (sq_map, cq_map, sqe_map)}.values()]
            u32 = lambda m, off, n=1: np.frombuffer(m, np.uint32, n, off)   # noqa: E731
            self._sq_head, self._sq_tail, self._sq_mask = u32(sq_map, sq[0]), u32(sq_map, sq[1]), int(u32(sq_map, sq[2])[0])
            self.sq_entries = p.sq_entries
            u32(sq_map, sq[6], p.sq_entries)[:] = np.arange(p.sq_entries, dtype=np.uint32)  # identity SQ array
            self._cq_head, self._cq_tail, self._cq_mask = u32(cq_map, cq[0]), u32(cq_map, cq[1]), int(u32(cq_map, cq[2])[0])
            self._cq_overflow = u32(cq_map, cq[4])
            self.cq_entries = p.cq_entries
            self._cqes = np.frombuffer(cq_map, CQE, p.cq_entries, cq[5])
            self._sqes = np.frombuffer(sqe_map, SQE, p.sq_entries, 0)
            self._ramp = np.arange(max(p.sq_entries, p.cq_entries), dtype=np.int64)
        except BaseException:
            self.close()
            raise
        self._lock = threading.Lock()
        self.buffer_registered = False
        self.files_registered = False
        self.inject = None     # tests: callable(res int32[k], user_data[k]) -> res, applied to completions
        self.enters = 0

    # -- registration --------------------------------------------------------------------------------------
    def register_buffer(self, buf: np.ndarray) -> bool:
        """Register one fixed buffer (pins it once); False (and plain reads) if the kernel refuses (memlock)."""
        iov = _Iovec(buf.ctypes.data, buf.nbytes)
        try:
            if self.buffer_registered:
                _sys(SYS_REGISTER, ctypes.c_int(self.fd), ctypes.c_uint(1), None, ctypes.c_uint(0))
                self.buffer_registered = False
            _sys(SYS_REGISTER, ctypes.c_int(self.fd), ctypes.c_uint(REGISTER_BUFFERS), ctypes.byref(iov),
                 ctypes.c_uint(1))
        except OSError:
            return False
        self.buffer_registered = True
        return True

    def register_file(self, fd: int) -> bool:
        arr = (ctypes.c_int * 1)(fd)
        try:
            if self.files_registered:
                _sys(SYS_REGISTER, ctypes.c_int(self.fd), ctypes.c_uint(3), None, ctypes.c_uint(0))
                self.files_registered = False
            _sys(SYS_REGISTER, ctypes.c_int(self.fd), ctypes.c_uint(REGISTER_FILES), arr, ctypes.c_uint(1))
        except OSError:
            return False
        self.files_registered = True
        return True

    # -- the batched read loop -----------------------------------------------------------------------------
    def read(self, fd: int, offsets: np.ndarray, lengths: np.ndarray, addrs: np.ndarray, *, expect=None,
             align: int = 1, path="?", queue_depth: int | None = None, lat_ns: np.ndarray | None = None) -> None:
        """Read lengths[i] bytes at file offset offsets[i] into memory address addrs[i], for every i.

        Keeps up to `queue_depth` reads in flight. expect[i] (default lengths[i]) is how many bytes the file
        holds there (less than an O_DIRECT window that runs past the end of the file): a read returning 0
        bytes before that is an unexpected end of file. A short read resumes at the last `align`ed byte.
        lat_ns (optional, int64 [n]): filled with each extent's latency in ns as this thread sees it, from just
        before the io_uring_enter that first submits it to the return of the one that reaps its last completion
        (benchmarks; stamped per batch with numpy, nothing is done when it is None).
        """
        if not self._lock.acquire(blocking=False):
            raise ReadError(f"{path}: this reader is already reading in another thread; "
                            "use one reader (one Table) per thread")
        try:
            lengths = np.asarray(lengths, np.int64)
            self._read(fd, np.asarray(offsets, np.int64), lengths, np.asarray(addrs, np.uint64),
                       lengths if expect is None else np.asarray(expect, np.int64), int(align), path,
                       min(queue_depth or self.sq_entries, self.sq_entries), lat_ns)
        finally:
            self._lock.release()

    def _read(self, fd, offsets, lengths, addrs, expect, align, path, qd, lat=None) -> None:
        n = offsets.shape[0]
        if lat is not None:
            if lat.shape != (n,) or lat.dtype != np.int64:
                raise ValueError(f"lat_ns must be int64 of shape ({n},), got {lat.dtype} {lat.shape}")
            first = np.zeros(n, np.int64)      # time of each extent's first submission
        got = np.zeros(n, np.int64)
        todo = np.arange(n, dtype=np.int64)
        pos = 0
        retry: list[np.ndarray] = []
        inflight = unsubmitted = 0     # in the ring or in flight; placed in the ring but not yet taken
        sq, cq = self._sqes, self._cqes
        # fields that are the same for every read of this call, written once
        sq["opcode"] = OP_READ_FIXED if self.buffer_registered else OP_READ
        sq["flags"] = SQE_FIXED_FILE if self.files_registered else 0
        sq["fd"] = 0 if self.files_registered else fd
        sq["ioprio"] = sq["rw_flags"] = sq["buf_index"] = 0
        f_off, f_addr, f_len, f_ud = sq["off"], sq["addr"], sq["len"], sq["user_data"]
        c_ud, c_res = cq["user_data"], cq["res"]
        mask, cmask, ramp = self._sq_mask, self._cq_mask, self._ramp
        while True:
            if pos >= todo.shape[0] and retry:
                todo, pos, retry = np.concatenate(retry), 0, []
            k = min(qd - inflight, todo.shape[0] - pos)
            if k > 0:
                idx = todo[pos:pos + k]
                pos += k
                tail = int(self._sq_tail[0])
                s0 = tail & mask
                sl = slice(s0, s0 + k) if s0 + k <= mask + 1 else (tail + ramp[:k]) & mask
                g = got[idx]
                f_off[sl] = offsets[idx] + g
                f_addr[sl] = addrs[idx] + g.view(np.uint64)
                f_len[sl] = lengths[idx] - g
                f_ud[sl] = idx
                self._sq_tail[0] = (tail + k) & 0xFFFFFFFF   # the enter syscall below orders this store
                inflight += k
            if inflight == 0:
                break
            # wait for a quarter of the queue once it is full (or nothing is left to submit), else just submit
            wait = min(inflight, max(1, qd // 4)) if inflight >= qd or pos >= todo.shape[0] else 0
            to_submit = unsubmitted + max(k, 0)
            if lat is not None and k > 0:
                f = first[idx]
                first[idx] = np.where(f == 0, time.perf_counter_ns(), f)
            unsubmitted = to_submit - _sys(SYS_ENTER, ctypes.c_int(self.fd), ctypes.c_uint(to_submit),
                                           ctypes.c_uint(wait), ctypes.c_uint(ENTER_GETEVENTS), None,
                                           ctypes.c_size_t(0))
            self.enters += 1
            if lat is not None:
                reaped = time.perf_counter_ns()
            head, tail = int(self._cq_head[0]), int(self._cq_tail[0])
            m = (tail - head) & 0xFFFFFFFF
            if m == 0:
                continue
            full_barrier()      # acquire: the entries up to `tail` are visible (arm64)
            h0 = head & cmask
            sl = slice(h0, h0 + m) if h0 + m <= cmask + 1 else (head + ramp[:m]) & cmask
            idx = c_ud[sl].astype(np.int64)
            res = c_res[sl].astype(np.int64)
            self._cq_head[0] = tail
            inflight -= m
            if lat is not None:
                lat[idx] = reaped - first[idx]     # a retried extent is stamped again when it completes
            if self.inject is not None:
                res = np.asarray(self.inject(res.copy(), idx), np.int64)
            if (res <= 0).any() or (res < lengths[idx] - got[idx]).any():
                self._slow_path(idx, res, got, offsets, lengths, expect, align, path, retry)
            else:
                got[idx] += res            # one read per extent in flight: indices are unique
            if int(self._cq_overflow[0]):
                raise ReadError(f"{path}: io_uring completion queue overflowed")

    @staticmethod
    def _slow_path(idx, res, got, offsets, lengths, expect, align, path, retry) -> None:
        """Completions with errors, retries, short reads or end of file."""
        again = (res == -errno.EINTR) | (res == -errno.EAGAIN)
        bad = (res < 0) & ~again
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            e = -int(res[i])
            raise ReadError(e, f"{path}: read of {int(lengths[idx[i]] - got[idx[i]])} bytes at offset "
                               f"{int(offsets[idx[i]] + got[idx[i]])} failed: {os.strerror(e)}")
        ok = ~again
        got[idx[ok]] += res[ok]
        eof = ok & (res == 0) & (got[idx] < expect[idx])
        if eof.any():
            i = int(idx[np.flatnonzero(eof)[0]])
            raise ReadError(f"{path}: unexpected end of file at offset {int(offsets[i] + got[i])} "
                            f"({int(expect[i] - got[i])} bytes missing): was the file truncated?")
        short = idx[got[idx] < expect[idx]]
        if short.size:
            got[short] -= got[short] % align      # O_DIRECT offsets must stay aligned
            retry.append(short)

    def close(self) -> None:
        # drop every numpy view of the rings first, so the mappings can be unmapped now
        self._sq_head = self._sq_tail = self._cq_head = self._cq_tail = self._cq_overflow = None
        self._cqes = self._sqes = None
        for m in getattr(self, "_maps", []):
            try:
                m.close()
            except BufferError:
                pass
        self._maps = []
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
