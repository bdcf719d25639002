"""Reads left in flight on an io_uring: queued now as a group, collected later by its tag (prefetch.py).

A GroupRing is a uring.Ring whose reads are started (start) and finished (finish) in groups instead of read to
the end by one call; every entry is marked IOSQE_ASYNC: the kernel's workers issue the reads, so start does not
wait for the disk's queue (docs/decisions/queue-depth.md). Not to be mixed with Ring.read on the same ring.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .uring import Ring
from .uring_abi import U32
from ..errors import ReadError


@dataclass
class Group:
    """One started group of reads."""
    reads: int
    completed: int
    whole: bool             # every completion so far returned the bytes expected of it
    expect: np.ndarray      # int64 [reads]: bytes expected of each


class GroupRing(Ring):
    """A Ring for groups of reads left in flight; see the module docstring."""

    def __init__(self, depth: int = 128):
        super().__init__(depth)
        self.groups: dict[int, Group] = {}

    def start(self, tag: int, fd: int, offsets: np.ndarray, lengths: np.ndarray, addrs: np.ndarray,
              expect: np.ndarray) -> None:
        """Queue the reads of group `tag` (1 <= tag < 2**31) and return without waiting for any of them; finish(tag)
        collects them. No extent may exceed max_chunk, and at most `room()` reads may be queued."""
        n = int(offsets.shape[0])
        if not self.lock.acquire(blocking=False):
            raise ReadError("this io_uring ring is in use by another thread")
        try:
            if self.closed or self.foreign or self.broken:
                raise ReadError("this io_uring ring is closed, inherited through fork() or broken")
            if not 1 <= tag < 1 << 31 or tag in self.groups or n > self.room():
                raise ValueError(f"ring group {tag}: bad tag, already queued, or {n} reads > room {self.room()}")
            if n and int(lengths.max()) > self.max_chunk:
                raise ValueError("extents longer than max_chunk: split them first")
            self.groups[tag] = Group(n, 0, True, np.asarray(expect, np.int64))
            try:
                self.queue(fd, offsets, lengths, addrs,
                           (np.uint64(tag) << np.uint64(32)) | np.arange(n, dtype=np.uint64))
            except BaseException:
                self.drain("?")    # whatever was queued is reaped: every group's finish then says False
                self.groups.clear()
                raise
        finally:
            self.lock.release()

    def room(self) -> int:
        """Reads start() may still queue: every queued read's completion must fit the completion ring."""
        return min(self.sq_entries, self.cq_entries - sum(g.reads - g.completed for g in self.groups.values()))

    def finish(self, tag: int, timeout_s: float = 60.0) -> bool:
        """Wait for the reads of group `tag` (reaping the other groups' completions on the way); True when every
        one returned the bytes expected of it, False when any failed or came back short (the group's bytes are
        then not to be used; nothing is retried). A group that is not queued: False."""
        if not self.lock.acquire(blocking=False):
            raise ReadError("this io_uring ring is in use by another thread")
        try:
            g = self.groups.get(tag)
            if g is None or self.closed or self.foreign:   # (a child: the parent's ring)
                return False
            deadline = time.monotonic() + timeout_s
            while g.completed < g.reads:
                ud, res = self.completions()
                if ud.shape[0] == 0:
                    if time.monotonic() > deadline:
                        raise ReadError(f"reads still in flight {timeout_s:.0f} s after they were queued")
                    self.wait(1)
                    continue
                tags, idx = ud >> 32, ud & U32
                if self.inject is not None:
                    res = np.asarray(self.inject(res.copy(), idx), np.int64)
                for t in np.unique(tags).tolist():
                    mine = tags == t
                    h = self.groups.get(t)
                    if h is None:
                        continue
                    h.completed += int(mine.sum())
                    h.whole = h.whole and bool((res[mine] == h.expect[idx[mine]]).all())
            return g.whole
        except BaseException:
            self.drain("?")    # no read of any group is left in flight (their finish then says False)
            self.groups.clear()
            raise
        finally:
            self.groups.pop(tag, None)
            self.lock.release()
