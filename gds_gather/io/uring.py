"""A minimal io_uring driven from numpy: raw syscalls through ctypes, submission entries written in batches.

One thread submits many reads with one `io_uring_enter`; numpy fills the mmapped submission ring and reads the
completion ring a batch at a time, so no Python runs per read. Short reads are resubmitted for the remainder,
-EINTR/-EAGAIN are retried, and any other error or an unexpected end of file raises ReadError naming the file
and offset.

Faults never leave reads behind: whatever leaves `read` early (a ReadError on a bad completion, a signal handler
raising KeyboardInterrupt or a timeout while it waits in io_uring_enter) first drains the ring, that is takes
back the entries not yet submitted and reaps every completion of the reads in flight (their count is read from
the ring indices themselves, so it is right whatever line the exception interrupted). A ring that cannot be
drained is marked broken and every later use raises ReadError. Extents of any size are split at submission into
aligned pieces of at most MAX_CHUNK bytes (the 32-bit SQE length; Linux caps one read at 0x7ffff000 bytes).
"""
from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np

from . import forksafe
from .storage import close_mapping
from .uring_abi import (CQE, ENTER_EXT_ARG, ENTER_GETEVENTS, FEAT_EXT_ARG, FEAT_SINGLE_MMAP, MAX_CHUNK, OFF_CQ_RING,
                        OFF_SQ_RING, OFF_SQES, SQE, SQE_ASYNC, SQE_FIXED_FILE, SYS_REGISTER, SYS_SETUP, U32,
                        GeteventsArg, Iovec, Op, Params, Register, Timespec, acquire, enter, syscall)
from ..errors import ReadError
from ..planner import split_extents

DRAIN_TRIES = 64            # exceptions tolerated while draining (signals arriving again) before giving up


class Submitted:
    """What Ring.reads(pause=True) yields once, right after its first submission: the reads are in flight, the
    caller's CPU work now overlaps the device's."""

    def __repr__(self) -> str:
        return "SUBMITTED"


SUBMITTED = Submitted()


@dataclass(frozen=True)
class Complete:
    """What Ring.reads(marks=...) yields at each mark: extents[i] is True where extent i is complete (its bytes in
    place) while the others are still read."""
    extents: np.ndarray


@dataclass
class _Marks:
    """Ring.reads' hand-over state: the completion counts still to report, and how pieces map to extents."""
    left: list              # ascending counts of complete extents still to report
    src: np.ndarray | None  # the extent of each piece where extents were split at max_chunk, else None
    n_extents: int


@functools.cache
def probe() -> tuple[bool, str]:
    """(usable, why): whether this kernel and sandbox allow io_uring with the opcodes we use."""
    try:
        r = Ring(8)
    except OSError as e:
        return False, f"io_uring_setup failed: {e.strerror or e} (kernel < 5.6, io_uring_disabled, or seccomp)"
    r.close()
    return True, "io_uring available"


def _release(fd: int, maps: list) -> None:
    """Close a ring's mappings and fd (Ring.close, or the finalizer of a Ring that was never closed)."""
    for m in maps:
        close_mapping(m)      # numpy views may still exist (the finalizer runs before they die): refcounting unmaps
    maps.clear()
    try:
        os.close(fd)
    except OSError:
        pass


class Ring:
    """One io_uring instance of `depth` entries. Not thread-safe: a second concurrent user raises clearly.

    Released when closed or when collected (weakref.finalize); a ring inherited through fork() is refused in the
    child (its mappings are shared with the parent), see `foreign`.
    """

    max_chunk = MAX_CHUNK      # tests lower it to exercise the splitting of large extents

    def __init__(self, depth: int = 128):
        p = Params()
        self.fd = syscall(SYS_SETUP, ctypes.c_uint32(depth), ctypes.byref(p))
        self._maps = []
        self._fin = weakref.finalize(self, _release, self.fd, self._maps)
        self.pid = os.getpid()
        self.features = p.features
        self._sq_tail = None
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
            self._maps.extend({id(x): x for x in (sq_map, cq_map, sqe_map)}.values())
            u32 = lambda m, off, n=1: np.frombuffer(m, np.uint32, n, off)   # noqa: E731
            self._sq_head, self._sq_tail = u32(sq_map, sq[0]), u32(sq_map, sq[1])
            self._sq_mask = int(u32(sq_map, sq[2])[0])
            self.sq_entries = p.sq_entries
            u32(sq_map, sq[6], p.sq_entries)[:] = np.arange(p.sq_entries, dtype=np.uint32)  # identity SQ array
            self._cq_head, self._cq_tail = u32(cq_map, cq[0]), u32(cq_map, cq[1])
            self._cq_mask = int(u32(cq_map, cq[2])[0])
            self._cq_overflow = u32(cq_map, cq[4])
            self.cq_entries = p.cq_entries
            self._cqes = np.frombuffer(cq_map, CQE, p.cq_entries, cq[5])
            self._sqes = np.frombuffer(sqe_map, SQE, p.sq_entries, 0)
            self._ramp = np.arange(max(p.sq_entries, p.cq_entries), dtype=np.int64)
        except BaseException:
            self.close()
            raise
        self.lock = threading.Lock()
        forksafe.track(self, "lock")
        self.buffer_registered = False
        self.files_registered = False
        self.inject = None     # tests: callable(res int32[k], user_data[k]) -> res, applied to completions
        self.enters = 0
        self.broken = ""       # why this ring refuses further use ("" while it is usable)
        self.drains = 0        # faults after which the ring was drained
        self.drained = 0       # entries taken back or completions reaped by those drains (reads a fault left behind)

    # -- state read from the ring itself ---------------------------------------------------------------------
    @property
    def foreign(self) -> bool:
        """True in a child process that inherited this ring through fork(): its rings are the parent's."""
        return self.pid != os.getpid()

    def outstanding(self) -> tuple[int, int]:
        """(entries placed in the submission ring but not yet taken by the kernel, reads taken whose completion
        has not been reaped). Every read posts exactly one completion, so both come from the ring indices."""
        tail, head, chead = int(self._sq_tail[0]), int(self._sq_head[0]), int(self._cq_head[0])
        return (tail - head) & U32, (head - chead) & U32

    # -- registration --------------------------------------------------------------------------------------
    def register_buffer(self, buf: np.ndarray) -> bool:
        """Register one fixed buffer (pins it once); False (and plain reads) if the kernel refuses (memlock)."""
        iov = Iovec(buf.ctypes.data, buf.nbytes)
        try:
            if self.buffer_registered:
                syscall(SYS_REGISTER, ctypes.c_int(self.fd), ctypes.c_uint(Register.UNREGISTER_BUFFERS), None,
                        ctypes.c_uint(0))
                self.buffer_registered = False
            syscall(SYS_REGISTER, ctypes.c_int(self.fd), ctypes.c_uint(Register.BUFFERS), ctypes.byref(iov),
                 ctypes.c_uint(1))
        except OSError:
            return False
        self.buffer_registered = True
        return True

    def register_file(self, fd: int) -> bool:
        arr = (ctypes.c_int * 1)(fd)
        try:
            if self.files_registered:
                syscall(SYS_REGISTER, ctypes.c_int(self.fd), ctypes.c_uint(Register.UNREGISTER_FILES), None,
                        ctypes.c_uint(0))
                self.files_registered = False
            syscall(SYS_REGISTER, ctypes.c_int(self.fd), ctypes.c_uint(Register.FILES), arr, ctypes.c_uint(1))
        except OSError:
            return False
        self.files_registered = True
        return True

    # -- the batched read loop -----------------------------------------------------------------------------
    def read(self, fd: int, offsets: np.ndarray, lengths: np.ndarray, addrs: np.ndarray, *, expect=None,
             align: int = 1, path="?", queue_depth: int | None = None, lat_ns: np.ndarray | None = None) -> None:
        """Read lengths[i] bytes at file offset offsets[i] into memory address addrs[i], for every i: reads()
        with nothing handed back on the way."""
        for _ in self.reads(fd, offsets, lengths, addrs, expect=expect, align=align, path=path,
                            queue_depth=queue_depth, lat_ns=lat_ns):
            pass

    def reads(self, fd: int, offsets: np.ndarray, lengths: np.ndarray, addrs: np.ndarray, *, expect=None,
              align: int = 1, path="?", queue_depth: int | None = None, lat_ns: np.ndarray | None = None,
              pause: bool = False, marks=()):
        """Read lengths[i] bytes at file offset offsets[i] into memory address addrs[i], for every i, as a
        generator of what the caller may act on while the reads go on.

        Keeps up to `queue_depth` reads in flight. expect[i] (default lengths[i]) is how many bytes the file
        holds there (less than an O_DIRECT window that runs past the end of the file): a read returning 0
        bytes before that is an unexpected end of file. A short read resumes at the last `align`ed byte.
        Extents longer than `max_chunk` are read as aligned pieces of at most that size.
        lat_ns (optional, int64 [n]): filled with each extent's latency in ns as this thread sees it, from just
        before the io_uring_enter that first submits it to the return of the one that reaps its last completion
        (benchmarks; stamped per batch with numpy, nothing is done when it is None).
        Yields: SUBMITTED once, right after the first submission (pause=True), while those reads are in flight;
        Complete(extents) as soon as at least marks[0] extents are complete, again at marks[1], and so on
        (thresholds passed together give one), while the others are still read. The generator ends when every
        read is in. Whatever leaves it early (a ReadError, an exception the caller raises while it holds a step
        and closes the generator: use contextlib.closing), no read of it is still in flight (see the module's
        docstring).
        """
        if not self.lock.acquire(blocking=False):
            raise ReadError(f"{path}: this reader is already reading in another thread; "
                            "use one reader (one Table) per thread")
        try:
            self._check_usable(path)
            offsets = np.asarray(offsets, np.int64)
            lengths = np.asarray(lengths, np.int64)
            addrs = np.asarray(addrs, np.uint64)
            expect = lengths if expect is None else np.asarray(expect, np.int64)
            n = offsets.shape[0]
            if lat_ns is not None and (lat_ns.shape != (n,) or lat_ns.dtype != np.int64):
                raise ValueError(f"lat_ns must be int64 of shape ({n},), got {lat_ns.dtype} {lat_ns.shape}")
            lat, src = lat_ns, None
            if n and int(lengths.max()) > self.max_chunk:
                chunk = max(int(align), self.max_chunk // int(align) * int(align))
                offsets, lengths, expect, dst, src = split_extents(offsets, lengths, expect,
                                                                   addrs.view(np.int64), chunk)
                addrs = dst.view(np.uint64)
                lat = None if lat_ns is None else np.zeros(offsets.shape[0], np.int64)
            left = _Marks(sorted(marks), src, n) if len(marks) else None
            try:
                yield from self._read(fd, offsets, lengths, addrs, expect, int(align), path,
                                      min(queue_depth or self.sq_entries, self.sq_entries), lat, pause, left)
            except BaseException:
                self.drain(path)      # the original exception goes on; a second one met while draining is dropped
                raise
            if src is not None and lat_ns is not None:
                lat_ns[:] = 0
                np.maximum.at(lat_ns, src, lat)
        finally:
            self.lock.release()

    def _check_usable(self, path) -> None:
        if self.fd < 0 or self._sq_tail is None:
            raise ReadError(f"{path}: the io_uring ring is closed")
        if self.foreign:
            raise ReadError(f"{path}: this io_uring ring was created in process {self.pid} and inherited through "
                            "fork(); reopen the table in this process")
        if self.broken:
            raise ReadError(f"{path}: the reader is unusable after an earlier fault ({self.broken}); "
                            "reopen the table")
        if any(self.outstanding()):     # an exception escaped between two steps of an earlier drain
            late = self.drain(path)
            if self.broken:
                raise ReadError(f"{path}: the reader is unusable after an earlier fault ({self.broken}); "
                                "reopen the table")
            if late is not None:
                raise late

    def drain(self, path, timeout_s: float = 60.0):
        """Back to a clean ring after a fault: take back the entries the kernel has not taken, then reap the
        completion of every read in flight. Returns an exception that arrived meanwhile (a signal handler raising
        again), or None; marks the ring broken if it cannot be drained."""
        if self.foreign or self.fd < 0 or self._sq_tail is None:
            return None
        late = None
        deadline = time.monotonic() + timeout_s
        for _ in range(DRAIN_TRIES):
            try:
                self._drain_once(deadline)
                self.drains += 1
                return late
            except TimeoutError:            # before OSError: TimeoutError is one of its subclasses
                self.broken = f"reads still in flight {timeout_s:.0f} s after a fault"
                return late
            except OSError as e:
                self.broken = f"io_uring_enter failed while reaping the reads in flight: {e}"
                return late
            except BaseException as e:      # KeyboardInterrupt or another handler's exception: keep draining
                late = late or e
        self.broken = "interrupted too often while reaping the reads in flight"
        return late

    def _drain_once(self, deadline: float) -> None:
        unsubmitted, _ = self.outstanding()
        if unsubmitted:        # no SQPOLL: the kernel reads the submission ring only inside io_uring_enter
            self._sq_tail[0] = self._sq_head[0]
            self.drained += unsubmitted
        while True:
            _, inflight = self.outstanding()
            if inflight == 0:
                return
            ready = (int(self._cq_tail[0]) - int(self._cq_head[0])) & U32
            if ready < inflight:
                if time.monotonic() > deadline:
                    raise TimeoutError
                self.wait(inflight - ready)
            acquire()
            tail = int(self._cq_tail[0])
            self.drained += (tail - int(self._cq_head[0])) & U32
            self._cq_head[0] = tail

    def wait(self, n: int) -> None:
        """io_uring_enter waiting for n completions, for at most about a second where the kernel allows a timeout."""
        if self.features & FEAT_EXT_ARG:
            ts = Timespec(1, 0)
            arg = GeteventsArg(0, 0, 0, ctypes.addressof(ts))
            try:
                enter(self.fd, 0, n, ENTER_GETEVENTS | ENTER_EXT_ARG, ctypes.byref(arg), 24)
            except OSError as e:
                if e.errno not in (errno.ETIME, errno.EAGAIN):
                    raise
            return
        enter(self.fd, 0, n)

    def _read(self, fd, offsets, lengths, addrs, expect, align, path, qd, lat, pause: bool, marks: _Marks | None):
        n = offsets.shape[0]
        done = 0                       # extents complete (handover)
        if lat is not None:
            first = np.zeros(n, np.int64)      # time of each extent's first submission
        got = np.zeros(n, np.int64)
        todo = np.arange(n, dtype=np.int64)
        pos = 0
        retry: list[np.ndarray] = []
        inflight = unsubmitted = 0     # in the ring or in flight; placed in the ring but not yet taken
        sq = self._sqes
        # fields that are the same for every read of this call, written once
        sq["opcode"] = Op.READ_FIXED if self.buffer_registered else Op.READ
        sq["flags"] = SQE_FIXED_FILE if self.files_registered else 0
        sq["fd"] = 0 if self.files_registered else fd
        sq["ioprio"] = sq["buf_index"] = 0
        sq["rw_flags"] = 0
        f_off, f_addr, f_len, f_ud = sq["off"], sq["addr"], sq["len"], sq["user_data"]
        mask, ramp = self._sq_mask, self._ramp
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
            # wait for a quarter of the queue once it is full (or nothing is left to submit), else just submit;
            # a pending mark wakes up when its extents are in
            wait = min(inflight, max(1, qd // 4)) if inflight >= qd or pos >= todo.shape[0] else 0
            if marks is not None and wait:
                wait = max(1, min(wait, marks.left[0] - done))
            if pause:                   # submit only: the caller's work runs while these reads are in flight
                wait = 0
            to_submit = unsubmitted + max(k, 0)
            if lat is not None and k > 0:
                f = first[idx]
                first[idx] = np.where(f == 0, time.perf_counter_ns(), f)
            unsubmitted = to_submit - enter(self.fd, to_submit, wait)
            self.enters += 1
            if pause:
                pause = False
                yield SUBMITTED
            if lat is not None:
                reaped = time.perf_counter_ns()
            idx, res = self.completions()
            m = idx.shape[0]
            if m == 0:
                continue
            inflight -= m
            if lat is not None:
                lat[idx] = reaped - first[idx]     # a retried extent is stamped again when it completes
            if self.inject is not None:
                res = np.asarray(self.inject(res.copy(), idx), np.int64)
            if (res <= 0).any() or (res < lengths[idx] - got[idx]).any():
                self._slow_path(idx, res, got, offsets, lengths, expect, align, path, retry)
                done += int(np.count_nonzero(got[idx] >= expect[idx]))
            else:
                got[idx] += res            # one read per extent in flight: indices are unique
                done += m
            if int(self._cq_overflow[0]):
                raise ReadError(f"{path}: io_uring completion queue overflowed")
            if marks is not None and done >= marks.left[0]:
                ok = got >= expect
                if marks.src is not None:       # an extent cut into pieces is complete when all its pieces are
                    ok = np.bincount(marks.src, ~ok, minlength=marks.n_extents) == 0
                k = np.count_nonzero(ok)
                if k >= marks.left[0]:
                    while marks.left and marks.left[0] <= k:
                        marks.left.pop(0)
                    if not marks.left:
                        marks = None
                    yield Complete(ok)

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
        m = got[idx] < expect[idx]
        short = idx[m]
        if short.size:
            aligned = got[short] - got[short] % align      # O_DIRECT offsets must stay aligned
            stall = ok[m] & (aligned <= got[short] - res[m])  # the file ends inside this block: it would loop
            if stall.any():
                i = int(short[np.flatnonzero(stall)[0]])
                raise ReadError(f"{path}: unexpected end of file at offset {int(offsets[i] + got[i])} "
                                f"({int(expect[i] - got[i])} bytes missing): was the file truncated?")
            got[short] = aligned
            retry.append(short)

    def completions(self) -> tuple[np.ndarray, np.ndarray]:
        """The completions posted since the last call, taken off the ring: (user_data, res), both int64 copies
        (empty when none)."""
        head, tail = int(self._cq_head[0]), int(self._cq_tail[0])
        m = (tail - head) & U32
        if m == 0:
            return self._ramp[:0], self._ramp[:0]
        acquire()           # the entries up to `tail` are visible (arm64)
        h0 = head & self._cq_mask
        sl = slice(h0, h0 + m) if h0 + m <= self._cq_mask + 1 else (head + self._ramp[:m]) & self._cq_mask
        ud, res = self._cqes["user_data"][sl].astype(np.int64), self._cqes["res"][sl].astype(np.int64)
        self._cq_head[0] = tail
        return ud, res

    # -- entries queued without waiting (uring_groups.py) -----------------------------------------------------
    @property
    def closed(self) -> bool:
        return self.fd < 0 or self._sq_tail is None

    def queue(self, fd: int, offsets, lengths, addrs, user_data, flags: int = SQE_ASYNC) -> None:
        """Place one plain read per extent (at most the free submission entries) and submit them all, waiting for
        none; call under self.lock. user_data: uint64 [n], what each completion carries back."""
        n = int(offsets.shape[0])
        sq = self._sqes
        tail = int(self._sq_tail[0])
        s0 = tail & self._sq_mask
        at = slice(s0, s0 + n) if s0 + n <= self.sq_entries else (tail + self._ramp[:n]) & self._sq_mask
        sq["opcode"][at] = Op.READ
        sq["flags"][at] = flags
        sq["ioprio"][at] = 0
        sq["fd"][at] = fd
        sq["buf_index"][at] = 0
        sq["rw_flags"][at] = 0
        sq["off"][at] = offsets
        sq["addr"][at] = addrs
        sq["len"][at] = lengths
        sq["user_data"][at] = user_data
        self._sq_tail[0] = (tail + n) & U32
        left = n
        while left:         # the kernel takes them all at once unless a signal interrupts the call
            left -= enter(self.fd, left, 0, 0)
            self.enters += 1

    def close(self) -> None:
        if getattr(self, "_cqes", None) is not None and not self.foreign and self.fd >= 0:
            self.drain("?")
        # drop every numpy view of the rings first, so the mappings can be unmapped now
        self._sq_head = self._sq_tail = self._cq_head = self._cq_tail = self._cq_overflow = None
        self._cqes = self._sqes = None
        self._fin()
        self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
