"""Reads of a coming batch's missing rows, in flight while the caller reads and uses the current one.

A caller that knows its next batch (a prefill's next ubatch, a benchmark's next gather) calls
`Table.prefetch(ids)` before it reads the current batch. The rows of `ids` that the row cache lacks (and that no
earlier prefetch is reading) are read on a thread by a reader of their own (its own io_uring and staging), through
the row cache (read_through: counted, and offered to the cache), and kept until a read asks for them; a read that
needs them waits for that prefetch and takes them from it. So the device works on the next batch while the
current one's rows are copied out and admitted, and two batches' reads overlap where one alone leaves the device
idle (its last requests). llama.cpp's readahead issues its hints from set_input the same way. Only backends with a
row cache prefetch (rowcache.CACHED_BACKENDS); for the others prefetch does nothing.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from . import forksafe, rowcache

log = logging.getLogger(__name__)

DEPTH = 2       # prefetches in flight at once, each on its own reader
KEEP = 4        # finished prefetches kept for reads to take their rows (older ones are dropped)
COUNTED = ("rows_from_device", "rows_from_page_cache", "rows_buffered")


class Prefetcher:
    """The prefetches of one Table and backend: up to DEPTH in flight, then up to KEEP finished ones."""

    def __init__(self, table, new_reader):
        self.table = table
        self._new_reader = new_reader
        self.readers: list = []
        self.jobs: list[tuple[np.ndarray, Future]] = []     # (sorted rows being read, its future), oldest first
        self.done: list = []     # (sorted rows, their bytes, bool: not taken yet) of finished ones, oldest first
        self.io = dict.fromkeys(COUNTED, 0)                   # what finished prefetches read (Table.stats adds it)
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(DEPTH, thread_name_prefix="gds-gather-prefetch")
        self.turn = 0
        forksafe.track(self, "lock")

    def open(self) -> None:
        """The readers and threads, made now (before a caller's clock starts) rather than by the first prefetch."""
        if len(self.readers) == DEPTH:
            return
        while len(self.readers) < DEPTH:
            self.readers.append(self._new_reader())
        ready = threading.Barrier(DEPTH + 1)     # the pool's threads start now, not with the first prefetches
        for _ in range(DEPTH):
            self.pool.submit(ready.wait, 10)
        ready.wait(10)

    def start(self, rows: np.ndarray) -> int:
        """Start reading those of `rows` (sorted, unique) that are neither cached, being read nor kept; returns how
        many. Never waits for I/O: with DEPTH prefetches in flight it starts nothing (the read reads them)."""
        cache = rowcache.cache_for(self.table)
        if cache is None or not rows.shape[0]:
            return 0
        with cache.lock:
            missing = rows[cache.cached(rows) < 0]
        self.open()
        res = self.readers[0].resident(missing, self.table.row_bytes) if missing.shape[0] else None
        if res is not None:         # the page cache's rows: the read copies them (no I/O to overlap)
            missing = missing[~res]
        with self.lock:
            for r in [r for r, _ in self.jobs] + [r[left] for r, _, left in self.done]:
                if missing.shape[0] and r.shape[0]:
                    missing = missing[~np.isin(missing, r, assume_unique=True)]
            if not missing.shape[0] or sum(not f.done() for _, f in self.jobs) >= DEPTH:
                return 0
            reader = self.readers[self.turn % DEPTH]
            self.turn += 1
            self.jobs.append((missing, self.pool.submit(self._read, reader, missing)))
        return int(missing.shape[0])

    def _read(self, reader, rows: np.ndarray):
        io = dict.fromkeys(rowcache.IO_COUNTERS, 0)
        data = rowcache.read_through(self.table, reader, self.table.plan(rows), io=io)
        return data, io

    def take(self, rows: np.ndarray):
        """The prefetched bytes of any of `rows` (sorted, unique), waiting for the prefetches reading them:
        (bool [len(rows)]: rows prefetched, uint8 [k, row_bytes]: their bytes in order), or None. A row is taken
        once. A prefetch that failed is logged and forgotten: the read that needs its rows reads them itself (and
        meets the error itself if it persists)."""
        with self.lock:
            self._collect(rows)
            if not self.done or not rows.shape[0]:
                return None
            have = np.zeros(rows.shape[0], bool)
            parts = []                               # (positions in rows, that entry's bytes at them)
            for r, data, left in self.done:
                pos = np.searchsorted(r, rows)
                pos_c = np.minimum(pos, r.shape[0] - 1)
                hit = (pos < r.shape[0]) & (r[pos_c] == rows) & left[pos_c] & ~have
                if hit.any():
                    have |= hit
                    at = pos[hit]
                    left[at] = False
                    parts.append((hit, data, at))
            self.done = [d for d in self.done if d[2].any()][-KEEP:]
        if not parts:
            return None
        if len(parts) == 1 and parts[0][2].shape[0] == parts[0][1].shape[0]:
            return have, parts[0][1]                 # one whole prefetch, in order: its bytes as they are
        out = np.empty((int(have.sum()), self.table.row_bytes), np.uint8)
        rank = np.cumsum(have) - 1
        for hit, data, at in parts:
            out[rank[hit]] = data[at]
        return have, out

    def _collect(self, rows: np.ndarray) -> None:
        """Wait for the in-flight prefetches of any of `rows`; move every finished one to self.done (under lock)."""
        keep = []
        for r, f in self.jobs:
            need = (r.shape[0] and rows.shape[0] and r[0] <= rows[-1] and rows[0] <= r[-1]
                    and np.isin(rows, r, assume_unique=True).any())
            if not (need or f.done()):
                keep.append((r, f))
                continue
            try:
                data, io = f.result()
            except Exception as e:
                log.warning("%s: a prefetch failed (%s: %s); its rows are read when needed",
                            self.table.path.name, type(e).__name__, e)
                continue
            for k in COUNTED:
                self.io[k] += io[k]
            self.done.append((r, data, np.ones(r.shape[0], bool)))
        self.jobs = keep

    def counts(self) -> dict:
        """What the finished prefetches read: rows_from_device, rows_from_page_cache, rows_buffered and
        bytes_requested (their readers')."""
        with self.lock:
            self._collect(np.empty(0, np.int64))
            out = dict(self.io)
            out["bytes_requested"] = sum(r.bytes_read for r in self.readers)
        return out

    def close(self) -> None:
        try:
            with self.lock:
                jobs, self.jobs, self.done = self.jobs, [], []
            for _, f in jobs:
                f.exception()           # waits for the read; its outcome no longer matters
        finally:
            self.pool.shutdown(wait=True)
            for r in self.readers:
                r.close()
            self.readers = []
