"""Reads of a coming batch's missing rows, in flight while the caller reads and uses the current one.

A caller that knows its next batch (a prefill's next ubatch, a benchmark's next gather) hands its ids to
`Table.prefetch(ids)` before it reads the current batch. At the start of that read (or, when the read has rows of
its own to fetch, as soon as those are queued, so the current batch does not wait behind the next one) the rows the
row cache lacks get slots reserved in it (pending: a miss for every reader, never read twice) and their O_DIRECT
windows are queued on a ring of the prefetch's own, with no thread. The next read collects them first, their bytes
into their slots, so it finds them as row-cache hits; meanwhile the device has read them while the current batch's
rows were copied out and the caller used them, as llama.cpp's readahead issues its hints from set_input. Only the
engine's O_DIRECT reader on io_uring prefetches, with a row cache (rowcache.CACHED_BACKENDS), and not while the
page cache serves the file; otherwise prefetch does nothing.

Narrow rows share 4 KiB windows: the next batch's misses that the last read's windows hold whole are taken from the
reader's staging into the row cache when noted (take_staged()), and ask no request of their own. A next batch wider
than MAX_WINDOWS keeps the device busy by itself: reading it ahead only reorders the device's work
(docs/decisions/prefetch-next-batch.md); its misses ride along the current read instead: those its windows hold are
taken the same way once it is done.
"""
from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass

import numpy as np

from ..io import forksafe
from ..io import native
from . import rowcache
from .store import Reservation, RowCache
from ..io.native import RowsAt
from ..io.uring_groups import GroupRing
from ..planner import ReadPlan, plan_unique
from ..io.readers import Staging

log = logging.getLogger(__name__)

DEPTH = 2               # jobs in flight at once: the one the next read collects and the one it starts
RING_DEPTH = 4096
MAX_WINDOWS = RING_DEPTH // DEPTH    # the most windows of one job; a wider next batch is not prefetched
_TAGS = itertools.count(1)


def member(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """bool [len(a)]: which of the sorted rows a are in the sorted rows b."""
    if not a.shape[0] or not b.shape[0]:
        return np.zeros(a.shape[0], bool)
    at = np.minimum(np.searchsorted(b, a), b.shape[0] - 1)
    return b[at] == a


@dataclass
class Job:
    tag: int
    plan: ReadPlan                  # the windows of the rows it reads, in staging
    cache: RowCache                 # the cache its slots are reserved in (a later cache_for may be another)
    reservation: Reservation
    pos: np.ndarray                 # which of the reservation's rows it reads (those given a slot), in plan order
    staging: Staging


class Prefetcher:
    """The prefetches of one Table and backend, read through `reader`'s file (the table's own O_DIRECT reader: its
    file check and its page-cache residency too) in windows planned as the table plans them."""

    def __init__(self, table, reader):
        self.table, self.reader = table, reader
        self.ring = None
        self.noted = np.empty(0, np.int64)      # rows handed over and not started yet
        self.riders = np.empty(0, np.int64)     # a wide next batch's misses: taken from the current read's windows
        self.jobs: list[Job] = []               # in flight, oldest first
        self.deferred = None                    # rows of the read under way: the noted start once its reads are queued
        self.free: list[Staging] = []
        self.io = {"rows_prefetched": 0, "bytes_requested": 0}
        self.lib = native.library(table.config)[0]
        self.lock = threading.RLock()
        forksafe.track(self, "lock")

    @property
    def usable(self) -> bool:
        """Only O_DIRECT windows read through io_uring can be left in flight without a thread."""
        return bool(self.reader.odirect and self.reader.ring is not None)

    def open(self) -> None:
        """The ring and the staging buffers, made now (before a caller's clock starts) rather than by the first
        prefetch."""
        with self.lock:
            self._after_fork()
            if self.ring is None:
                self.ring = GroupRing(RING_DEPTH)
                self.free = [Staging() for _ in range(DEPTH)]

    def note(self, ids: np.ndarray) -> int:
        """The next batch's row ids (int64, valid, in any order, repeats allowed); returns how many rows will be
        read ahead: those the row cache lacks now and the last read's windows did not hold (those are taken from
        them now, see take_staged()); none where they are more than MAX_WINDOWS (they ride along the current read), or
        while the page cache serves the file (the last read took most of its rows from it). Rows noted before and
        not started yet are started first. Only the misses are sorted (a batch the cache holds costs one
        look-up)."""
        cache = rowcache.cache_for(self.table)
        if cache is None or self.declines():
            return 0
        with cache.lock:
            missing = ids[cache.cached(ids) < 0]
        if missing.shape[0]:
            missing.sort()
            missing = missing[np.r_[True, missing[1:] != missing[:-1]]]
            missing = missing[~self.take_staged(missing, cache)]
        with self.lock:
            self.open()
            if self.noted.shape[0]:
                self._start(self.noted, np.empty(0, np.int64))
            if missing.shape[0] > MAX_WINDOWS:   # too wide to read ahead: its rows ride along
                self.noted, self.riders = np.empty(0, np.int64), missing
                return 0
            self.noted, self.riders = missing, np.empty(0, np.int64)
            return int(missing.shape[0])

    def take_staged(self, rows: np.ndarray, cache: RowCache) -> np.ndarray:
        """bool [len(rows)]: which of the sorted unique rows the reader's last read left whole in its staging
        (narrow rows share 4 KiB windows) and are now in the row cache, counted as prefetched: no request of their
        own. Called without self.lock (the reader's lock comes first: a read starts deferred prefetches under it)."""
        taken = np.zeros(rows.shape[0], bool)

        def take(pos: np.ndarray, at: RowsAt) -> None:
            with cache.lock:
                taken[pos[cache.admit(rows[pos], at) >= 0]] = True
        self.reader.rows_in_staging(rows, self.table.row_bytes, take)
        n = int(np.count_nonzero(taken))
        if n:
            with self.lock:
                self.io["rows_prefetched"] += n
        return taken

    def before(self, rows: np.ndarray) -> None:
        """Before the table's read of the sorted unique `rows` through the row cache: the noted rows (less `rows`)
        are started now where every one of `rows` is cached or being read, else deferred (start_deferred: once the
        read's own reads are queued, source.through, or after it); then the jobs holding any of `rows` are
        collected, so the read finds those rows in the cache."""
        with self.lock:
            self._after_fork()
            self.deferred = None
            cache = rowcache.cache_for(self.table)
            if self.noted.shape[0] and cache is not None:
                with cache.lock:
                    ready = bool((cache.cached(rows) >= 0).all())
                if ready:
                    self._start(self.noted, rows)
                else:
                    self.deferred = rows
            for job in [j for j in self.jobs if member(rows, j.plan.unique_rows).any()]:
                self._finish(job)

    def start_deferred(self) -> None:
        """Start the noted rows that before() deferred, once (the read's own reads are queued now)."""
        with self.lock:
            rows, self.deferred = self.deferred, None
            if rows is not None:
                self._start(self.noted, rows)

    def after(self, rows: np.ndarray) -> None:
        """After the table's read of `rows`: a start still deferred runs now; the riders its windows held are
        taken."""
        self.start_deferred()
        if self.riders.shape[0]:
            self._ride(rows)

    def _ride(self, rows: np.ndarray) -> None:
        """The riders (less `rows`, the read's own) that the read's windows held: into the row cache."""
        with self.lock:
            riders, self.riders = self.riders, np.empty(0, np.int64)
        cache = rowcache.cache_for(self.table)
        if cache is not None and not self.declines():
            self.take_staged(riders[~member(riders, rows)], cache)

    def declines(self) -> bool:
        """Whether to read nothing ahead now: the last read (of 16 rows or more: not a start-up's or a decode
        step's few) took most of its rows from the page cache: nothing to overlap, only look-ups to pay (a new
        process on a warm file asking about residency in its first batch). The read that starts a prefetch has set
        it already, so this asks nothing of the page cache."""
        pc = self.reader.last_from_page_cache
        return pc is not None and pc.shape[0] >= 16 and 2 * int(np.count_nonzero(pc)) >= pc.shape[0]

    def _after_fork(self) -> None:
        """In a forked child the ring and its reads are the parent's: forget them (their slots come back by
        themselves: rowcache's reclaim of reservations nobody holds)."""
        if self.ring is not None and self.ring.foreign:
            self.ring, self.jobs, self.free = None, [], []
            self.noted = self.riders = np.empty(0, np.int64)

    def _start(self, rows: np.ndarray, exclude: np.ndarray) -> None:
        """Reserve slots for those of `rows` that are neither in `exclude`, cached, being read nor in the page
        cache, and queue their windows (under self.lock); nothing while the page cache serves the file."""
        self.noted = np.empty(0, np.int64)
        cache = rowcache.cache_for(self.table)
        if cache is None or self.ring is None or self.declines():
            return
        rows = rows[~member(rows, exclude)]
        if not rows.shape[0]:
            return
        while len(self.jobs) >= DEPTH:
            self._finish(self.jobs[0])
        with cache.lock:
            rows = rows[cache.cached(rows) < 0]
        res = self.reader.resident(rows, self.table.row_bytes) if rows.shape[0] else None
        if res is not None:         # the page cache's rows: the read copies them (no I/O to overlap)
            rows = rows[~res]
        if not rows.shape[0]:
            return
        with cache.lock:
            r = cache.reserve(rows)
        pos = np.flatnonzero(r.slots >= 0)     # (all but where the cache is too small for them all)
        if not pos.shape[0]:
            return
        plan = self._plan(rows[pos])           # (at most MAX_WINDOWS rows: note() refuses more, and so windows)
        staging = self.free.pop()
        try:
            buf = staging.ensure(plan.window_bytes)
            expect = np.minimum(plan.win_offsets + plan.win_lengths, self.reader.file_size) - plan.win_offsets
            tag = next(_TAGS) % (1 << 31) or next(_TAGS)
            self.ring.start(tag, self.reader.fd, plan.win_offsets, plan.win_lengths,
                            np.uint64(buf.ctypes.data) + plan.win_staging.astype(np.uint64), expect)
        except BaseException as e:
            with cache.lock:
                cache.settle(r)
            self.free.append(staging)
            if not isinstance(e, Exception):
                raise
            log.warning("%s: a prefetch could not start (%s: %s); its rows are read when needed",
                        self.table.path.name, type(e).__name__, e)
            return
        self.io["bytes_requested"] += int(expect.sum())
        self.jobs.append(Job(tag, plan, cache, r, pos, staging))

    def _plan(self, rows: np.ndarray) -> ReadPlan:
        c, t = self.table.config, self.table
        return plan_unique(rows, row_bytes=t.row_bytes, data_offset=t.data_offset, align=t.align,
                           max_gap=c.max_gap, max_window=c.max_window, max_waste=c.max_waste)

    def _finish(self, job: Job) -> None:
        """Wait for a job's reads; its rows into their slots where every read was whole and the file is unchanged,
        else its slots back (its rows are read when needed; a changed file is the read's to report)."""
        self.jobs.remove(job)
        cache, got, ok, why = job.cache, 0, False, ""
        try:
            ok = self.ring.finish(job.tag)
            if ok:
                self.reader.check_file()
            else:
                why = "its reads came back short or failed"
        except Exception as e:
            ok, why = False, f"{type(e).__name__}: {e}"
        finally:
            with cache.lock:
                if ok:
                    plan = job.plan
                    got = int(np.count_nonzero(cache.fill(
                        job.reservation, job.pos,
                        RowsAt(job.staging.buf, plan.row_staging, plan.row_bytes, self.lib)) >= 0))
                cache.settle(job.reservation)
            self.free.append(job.staging)
        self.io["rows_prefetched"] += got       # (rows whose cache was emptied or closed meanwhile: not counted)
        if why:
            log.warning("%s: a prefetch failed (%s); its rows are read when needed", self.table.path.name, why)

    def counts(self) -> dict:
        """What the prefetches read: rows_prefetched (all of them rows_from_device) and bytes_requested."""
        with self.lock:
            return {**self.io, "rows_from_device": self.io["rows_prefetched"]}

    def close(self) -> None:
        with self.lock:
            jobs, self.jobs = self.jobs, []
            self.noted = self.riders = np.empty(0, np.int64)
            try:
                if self.ring is not None:
                    self.ring.close()           # reaps every read in flight: none lands in a staging after this
            finally:
                self.ring = None
                for job in jobs:
                    with job.cache.lock:
                        job.cache.settle(job.reservation)
                for s in self.free + [j.staging for j in jobs]:
                    s.close()
                self.free = []

