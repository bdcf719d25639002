"""The cached source: a batch's look-up, the read of its misses, their admission and the counting, written once
for every destination.

The row cache's policy and index (rowcache.RowCache) are the same everywhere; a storage says where the cached
bytes live and where a batch's rows go:

- `HostRows`: the bytes in the cache's own host mapping (pinnable); a batch comes back as one host array
  [U, row_bytes] (host gathers, the copy and zero-copy destinations, prefetches, the transformers module).
- `DeviceRows`: the bytes in a device pool (devcache.DeviceRowCache); the rows stay where they are: hits are pool
  offsets, misses are read into the slot's pinned buffer (copy: the device copies them behind the slots) or into
  the slot's pool region (gds: cuFile), and admissions become device row copies. The result is a `Staged`.

Host hits are copied while the misses' reads are in flight (reader.overlaps_io: during_io), and so is the cache's
bookkeeping for the misses (reserve); a large read hands its first rows over while the rest is read (on_rows,
readers.SPLIT_MIN), copied from the reader's staging straight to the result and to their reserved slots (fill).
The host cache is shared by every Table of a file and its lock is not held while the hits are copied: a hit
evicted meanwhile is read again (the copy checks each slot still holds its row). A device pool is lent to one
holder at a time (devcache.acquire).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..io.native import RowsAt
from ..planner import ReadPlan, replan, subplan


def through(table, reader, plan: ReadPlan | None, store, *, rows: np.ndarray | None = None,
            io: dict | None = None, also=None):
    """The unique rows of `plan` (or sorted unique `rows`, planned only if some miss: a decode step's all-hit
    look-up costs less than planning one row) through the cache of `store`: hits from it, misses read by `reader`
    and offered to it, counted into `io` (default table.io; see Table.stats). also(): called once, when this
    batch's reads are queued (with the cache's bookkeeping for them), or after the look-up when it reads nothing
    (prefetch.py)."""
    io = table.io if io is None else io
    index = store.index
    unique = plan.unique_rows if plan is not None else np.asarray(rows, np.int64)
    U = unique.shape[0]
    early = None
    with index.lock:
        slots, g = index.find(unique), index.since()
        hit = slots >= 0
        nh = int(np.count_nonzero(hit))
        if nh == U:
            index.count(unique, slots)
            early = store.all_hits(slots)       # under the look-up's lock: no slot changes in between
    io["cache_hits"] += nh
    io["cache_misses"] += U - nh
    if nh == U:                 # no read follows (a read checks the file): hits must not outlive a change
        reader.check_file()
        io["rows_from_cache"] += nh
        if also is not None:
            also()
        return early
    missed = unique[~hit]
    protect = slots[hit]
    if plan is None:            # (the rows are sorted and unique: each plan is of the rows as given)
        plan_rows = table.plan
        mplan = table.plan(missed)
    else:
        def plan_rows(r):
            return replan(plan, table.config, r)
        mplan = (subplan(plan, ~hit) or plan_rows(missed)) if nh else plan
    held = []                   # the batch's reservation, once made

    def reserve():
        """Count the look-up and reserve slots for the misses the storage admits (not the rows this read copies
        from the page cache unless store.admit_page_cache: reader.last_from_page_cache, known before the reads
        are in flight): the cache's bookkeeping, done once while the reads are in flight where the reader allows;
        then also()."""
        if not held:
            pc = None if store.admit_page_cache else reader.last_from_page_cache
            with index.lock:
                index.count(unique, slots)
                held.append(index.reserve(missed, protect=protect, gen=g,
                                          skip=pc if pc is not None and pc.shape[0] == missed.shape[0] else None))
            if also is not None:
                also()
        return held[0]

    def admit(pos: np.ndarray, fresh) -> np.ndarray:
        """The misses at positions pos arrived (fresh: their bytes, a native.RowsAt, or None for an index-only
        cache): into their reserved slots; returns the slot of each, -1 where not admitted."""
        r = reserve()
        with index.lock:
            return index.fill(r, pos, fresh)
    pc0 = reader.rows_from_page_cache
    batch = store.batch(unique, slots, missed)
    try:
        n_stale = batch.read(reader, mplan, admit, plan_rows, reserve)
    finally:
        if held:
            with index.lock:
                index.settle(held[0])
    io["rows_from_cache"] += nh - n_stale
    pc = count_reader(io, reader, pc0, U - nh + n_stale)
    return batch.result(nh, pc)


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

    def read(self, reader, mplan: ReadPlan, admit, plan_rows, reserve) -> int:
        """Read the misses (mplan) into the result, copy the hits beside them, reserve (cache bookkeeping) while
        the reads are in flight; returns the hits read again (stale), planned by plan_rows(rows)."""
        cache, unique, slots, rows = self.cache, self.unique, self.slots, self.rows
        U, k = unique.shape[0], rows.shape[0]
        if k == U:                   # every row missed: no hits to copy
            def all_rows(pos, fresh):
                if pos.shape[0] == U:            # one part: the reader's rows are the result
                    self.out = fresh.array()
                else:
                    if self.out is None:
                        self.out = np.empty((U, mplan.row_bytes), np.uint8)
                    fresh.copy_to(self.out, pos)
                admit(pos, fresh)

            def during_all():
                cache.prefault(U)
                reserve()
            if reader.overlaps_io:
                reader.read(mplan, during_io=during_all, on_rows=all_rows)
            else:
                all_rows(np.arange(k), RowsAt.of(reader.read(mplan)))
            return 0
        out = self.out = np.empty((U, mplan.row_bytes), np.uint8)
        miss_pos = np.flatnonzero(slots < 0)
        stale = []                   # [bool [U]: hits evicted before they were copied], once the hits are copied

        def copy_hits():             # once, while the reads are in flight where the reader allows
            if not stale:
                stale.append(cache.copy_hits(slots, unique, out))

        def during_io():
            copy_hits()
            cache.prefault(k)
            reserve()

        def on_rows(pos, fresh):     # the misses at pos (native.RowsAt); a first part comes while the rest is read
            copy_hits()
            fresh.copy_to(out, miss_pos[pos])
            admit(pos, fresh)
        if reader.overlaps_io:
            reader.read(mplan, during_io=during_io, on_rows=on_rows)
        else:
            on_rows(np.arange(k), RowsAt.of(reader.read(mplan)))
        copy_hits()                  # (no read was made: all from the page cache)
        if not stale[0].any():
            return 0
        out[stale[0]] = reader.read(plan_rows(unique[stale[0]]))
        return int(stale[0].sum())

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

    def read(self, reader, mplan: ReadPlan, admit, plan_rows, reserve) -> int:
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
        new = admit(np.arange(k), None)
        ok = new >= 0
        self.src, self.dst = fo[ok], new[ok] * rb
        return 0

    def result(self, hits: int, from_page_cache: int) -> Staged:
        U = self.slots.shape[0]
        return Staged(self.offsets, self.words, self.src, self.dst, hits, from_page_cache,
                      U - hits - from_page_cache)
