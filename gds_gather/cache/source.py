"""The cached source: a batch's look-up, the read of its misses, their admission and the counting, written once
for every destination.

The row cache's policy and index (rowcache.RowCache) are the same everywhere; a storage says where the cached
bytes live and where a batch's rows go:

- `HostRows`: the bytes in the cache's own host mapping (pinnable); a batch comes back as one host array
  [U, row_bytes] (host gathers, the copy and zero-copy destinations, prefetches, the transformers module).
- `DeviceRows`: the bytes in a device pool (devcache.DeviceRowCache); the rows stay where they are: hits are pool
  offsets, misses are read into the slot's pinned buffer (copy: the device copies them behind the slots) or into
  the slot's pool region (gds: cuFile), and admissions become device row copies. The result is a `Staged`.

The steps of one batch (`through`): look the rows up; read the misses (readers.parts_of), and at the step where
the reads are in flight (IN_FLIGHT) copy the host hits and do the cache's bookkeeping for the misses
(Admission.reserve, then the next batch's prefetch is started); each Part of the misses then goes to the result and
into its reserved slot (Admission.fill); at the end the slots not filled go back (Admission.settle). A large read
hands its first rows over while the rest is read (direct.SPLIT_MIN). The host cache is shared by every Table of a
file and its lock is not held while the hits are copied: a hit evicted meanwhile is read again (the copy checks
each slot still holds its row). A device pool is lent to one holder at a time (devcache.acquire).
"""
from __future__ import annotations

from contextlib import closing
from dataclasses import dataclass

import numpy as np

from ..io.readers import IN_FLIGHT, parts_of
from ..planner import ReadPlan, misses, replan


def through(table, reader, plan: ReadPlan | None, store, *, rows: np.ndarray | None = None,
            io: dict | None = None, ahead=None):
    """The unique rows of `plan` (or sorted unique `rows`, planned only if some miss: a decode step's all-hit
    look-up costs less than planning one row) through the cache of `store`: hits from it, misses read by `reader`
    and offered to it, counted into `io` (default table.io; see Table.stats). ahead: the table's prefetches
    (prefetch.Prefetcher) or None; its deferred start runs once this batch's reads are queued."""
    io = table.io if io is None else io
    index = store.index
    unique = plan.unique_rows if plan is not None else np.asarray(rows, np.int64)
    U = unique.shape[0]
    with index.lock:                            # 1. look up
        slots, gen = index.find(unique), index.since()
        hit = slots >= 0
        nh = int(np.count_nonzero(hit))
        if nh == U:
            index.count(unique, slots)
            all_hits = store.all_hits(slots)    # under the look-up's lock: no slot changes in between
    io["cache_hits"] += nh
    io["cache_misses"] += U - nh
    if nh == U:                 # no read follows (a read checks the file): hits must not outlive a change
        reader.check_file()
        io["rows_from_cache"] += nh
        return all_hits
    missed = unique[~hit]       # 2. read the misses, 3. admit them
    if plan is None:            # (the rows are sorted and unique: each plan is of the rows as given)
        plan_rows = table.plan
        mplan = table.plan(missed)
    else:
        def plan_rows(r):
            return replan(plan, table.config, r)
        mplan = misses(plan, ~hit, table.config) if nh else plan
    admission = Admission(index, unique, slots, missed, gen, store.admit_page_cache, ahead)
    pc0 = reader.rows_from_page_cache
    batch = store.batch(unique, slots, missed)
    try:
        n_stale = batch.read(reader, mplan, admission, plan_rows)
    finally:
        admission.settle()
    io["rows_from_cache"] += nh - n_stale       # 4. count
    pc = count_reader(io, reader, pc0, U - nh + n_stale)
    return batch.result(nh, pc)


class Admission:
    """A batch's misses into the cache, in steps: reserve (slots for the misses, once, while the reads are in
    flight where the reader allows: the look-up counted, the rows the reader copies from the page cache left out
    unless the store or the reader admits them: reader.last_from_page_cache, known before the reads are in
    flight; then the next batch's prefetch started), fill (each part's bytes into its slots) and settle (the slots not filled go back)."""

    def __init__(self, index, unique, slots, missed, gen, admit_page_cache: bool, ahead):
        self.index, self.unique, self.slots, self.missed, self.gen = index, unique, slots, missed, gen
        self.admit_page_cache, self.ahead = admit_page_cache, ahead
        self.reservation = None

    def reserve(self, reader) -> None:
        if self.reservation is not None:
            return
        pc = None if self.admit_page_cache or reader.admit_page_cache else reader.last_from_page_cache
        skip = pc if pc is not None and pc.shape[0] == self.missed.shape[0] else None
        with self.index.lock:
            self.index.count(self.unique, self.slots)
            self.reservation = self.index.reserve(self.missed, protect=self.slots[self.slots >= 0], gen=self.gen,
                                                  skip=skip)
        if self.ahead is not None:
            self.ahead.start_deferred()

    def fill(self, reader, pos: np.ndarray, fresh) -> np.ndarray:
        """The misses at positions pos arrived (fresh: their bytes, a native.RowsAt, or None for an index-only
        cache): into their reserved slots; returns the slot of each, -1 where not admitted."""
        self.reserve(reader)
        with self.index.lock:
            return self.index.fill(self.reservation, pos, fresh)

    def settle(self) -> None:
        if self.reservation is not None:
            with self.index.lock:
                self.index.settle(self.reservation)


def count_reader(io: dict, reader, pc0: int, n: int) -> int:
    """Count n rows a reader delivered into io: those it copied from the page cache (its rows_from_page_cache
    counter, pc0 before the read) and the rest from the device; returns the former. A buffered reader cannot
    tell the two apart: its rows count as rows_buffered."""
    if not reader.tells_source:
        io["rows_buffered"] += n
        return 0
    pc = reader.rows_from_page_cache - pc0
    io["rows_from_page_cache"] += pc
    io["rows_from_device"] += n - pc
    return pc


# -- host memory ---------------------------------------------------------------------------------------------------

class HostRows:
    """The cache's bytes in host memory; a batch's rows come back as one host array. admit_page_cache: offer rows
    the reader copied from the page cache too (a decode step's few rows: there the per-call cost of the page-cache
    path, not the I/O, is what a hit saves)."""

    def __init__(self, cache, admit_page_cache: bool = False):
        self.index, self.admit_page_cache = cache, admit_page_cache

    def all_hits(self, slots: np.ndarray) -> np.ndarray:
        return self.index.data.take(slots, axis=0)

    def batch(self, unique: np.ndarray, slots: np.ndarray, rows: np.ndarray) -> "_HostBatch":
        return _HostBatch(self.index, unique, slots, rows)


class _HostBatch:
    def __init__(self, cache, unique, slots, rows):
        self.cache, self.unique, self.slots, self.rows = cache, unique, slots, rows
        self.out = None

    def read(self, reader, mplan: ReadPlan, admission: Admission, plan_rows) -> int:
        """Read the misses (mplan) into the result, copy the hits beside them and make the cache's bookkeeping
        while the reads are in flight; returns the hits read again (stale), planned by plan_rows(rows)."""
        cache, unique, slots = self.cache, self.unique, self.slots
        U, k = unique.shape[0], self.rows.shape[0]
        every_row_missed = k == U               # no hits to copy: the reader's rows may be the result
        if not every_row_missed:
            self.out = np.empty((U, mplan.row_bytes), np.uint8)
        miss_pos = np.flatnonzero(slots < 0)
        stale = None                            # bool [U]: hits evicted before they were copied
        with closing(parts_of(reader, mplan)) as steps:
            for step in steps:
                if step is IN_FLIGHT:           # the device reads: the CPU's share of the batch now
                    if not every_row_missed:
                        stale = cache.copy_hits(slots, unique, self.out)
                    cache.prefault(k)
                    admission.reserve(reader)
                    continue
                if stale is None and not every_row_missed:
                    stale = cache.copy_hits(slots, unique, self.out)
                if every_row_missed and step.positions.shape[0] == U:   # one part: the reader's rows
                    self.out = step.rows.array()
                else:
                    if self.out is None:
                        self.out = np.empty((U, mplan.row_bytes), np.uint8)
                    step.rows.copy_to(self.out, step.positions if every_row_missed else miss_pos[step.positions])
                admission.fill(reader, step.positions, step.rows)
        if every_row_missed:
            return 0
        if stale is None:                       # (no part came: nothing to read)
            stale = cache.copy_hits(slots, unique, self.out)
        if not stale.any():
            return 0
        self.out[stale] = reader.read(plan_rows(unique[stale]))
        return int(stale.sum())

    def result(self, hits: int, from_page_cache: int) -> np.ndarray:
        return self.out


# -- device memory -------------------------------------------------------------------------------------------------

@dataclass
class Staged:
    """What one batch asks of the device (devcache.py): the rows' pool offsets, the fresh rows to copy behind the
    slots, the admissions."""
    offsets: np.ndarray      # int64 [U]: byte offset of each unique row in the pool
    fresh_words: int         # 8-byte words of fresh rows to copy into the fresh area (copy mode; 0 for gds)
    adm_src: np.ndarray      # int64 [A]: pool offsets of admitted fresh rows
    adm_dst: np.ndarray      # int64 [A]: pool offsets of their slots
    hits: int
    from_page_cache: int
    from_device: int


class DeviceRows:
    """The cache's bytes in a device pool (dc: devcache.DeviceRowCache). copy: `fresh` is the slot's host buffer,
    the misses are packed there to land at dc.fresh_base; gds: `region` is the pool offset of the slot's region,
    the reader (cuFile) reads the misses' windows there. Page-cache rows are admitted too: they would cross PCIe
    again."""

    admit_page_cache = True

    def __init__(self, dc, *, fresh: np.ndarray | None = None, region: int | None = None):
        self.dc, self.index, self.fresh, self.region = dc, dc.index, fresh, region

    def all_hits(self, slots: np.ndarray) -> Staged:
        none = np.zeros(0, np.int64)
        return Staged(slots * self.index.row_bytes, 0, none, none, slots.shape[0], 0, 0)

    def batch(self, unique: np.ndarray, slots: np.ndarray, rows: np.ndarray) -> "_DeviceBatch":
        return _DeviceBatch(self, slots, rows)


class _DeviceBatch:
    def __init__(self, store, slots, rows):
        self.store, self.slots, self.rows = store, slots, rows
        self.offsets = np.where(slots >= 0, slots * store.index.row_bytes, 0)
        self.words, self.src, self.dst = 0, np.zeros(0, np.int64), np.zeros(0, np.int64)

    def read(self, reader, mplan: ReadPlan, admission: Admission, plan_rows) -> int:
        """Read the misses (mplan) into the slot's fresh buffer or pool region (a device pool is lent to one
        holder: no hit goes stale, plan_rows is not needed; the reservation is made at admission)."""
        st, rb, k = self.store, mplan.row_bytes, self.rows.shape[0]
        if st.region is None:
            got = reader.read(mplan)
            st.fresh[:got.size] = got.reshape(-1)
            fo = st.dc.fresh_base + np.arange(k, dtype=np.int64) * rb
            self.words = -(-got.size // 8)
        else:
            reader.read_windows(mplan)
            fo = int(st.region) + mplan.row_staging
        self.offsets[self.slots < 0] = fo
        new = admission.fill(reader, np.arange(k), None)
        ok = new >= 0
        self.src, self.dst = fo[ok], new[ok] * rb
        return 0

    def result(self, hits: int, from_page_cache: int) -> Staged:
        U = self.slots.shape[0]
        return Staged(self.offsets, self.words, self.src, self.dst, hits, from_page_cache,
                      U - hits - from_page_cache)
