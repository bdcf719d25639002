"""RowCache: one file's quantized rows by row id within a byte budget (the row bytes, the index, the sketch and the
slot table), and its policy.

Policy: TinyLFU-style (it kept more of the default text's per-batch rows than CLOCK and S3-FIFO at every budget
tried: docs/decisions/row-cache-policy.md). Every lookup counts the batch's unique rows in a 4-row count-min sketch
(uint8, halved every 10 x capacity counts); misses fill free slots first; once full, a miss is admitted only where
its estimated frequency beats that of a victim drawn from a sweeping sample of slots (sampled LFU), never a slot the
current batch hit.

Admission comes in steps (reserve, fill, settle): the bookkeeping once per batch while its reads are in flight,
then each part's bytes into slots reserved for them (PENDING until then: no hit, no victim).

Everything is per batch and numpy (the index: index.py; the sketch: sketch.py). Row bytes live in one page-aligned
anonymous mapping (pinnable for the GPU). The whole footprint (rows, index, sketch, slot table) stays within the
budget. The process-wide caches, one per file identity, are rowcache.py's.
"""
from __future__ import annotations

import mmap
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from ..io import forksafe
from ..io.native import RowsAt, copy_rows
from ..io.storage import close_mapping
from .index import SCALAR_MAX, HashIndex
from .sketch import FreqSketch

PENDING = -3            # slot_row <= PENDING: reserved for row PENDING - slot_row, its bytes being read (reserve)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_POPULATE_OK = [True]


def _footprint(slots: int, row_bytes: int) -> int:
    # rows, slot_row (8), slot_freq and _mark (1 each), the index, the sketch
    return slots * (row_bytes + 10) + HashIndex.nbytes_for(slots) + FreqSketch.nbytes_for(slots)


def capacity_for(budget: int, row_bytes: int) -> int:
    """The most slots whose whole footprint (rows + index + sketch + slot table) fits the budget."""
    lo, hi = 0, max(0, budget // row_bytes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _footprint(mid, row_bytes) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(eq=False)       # (identity: the cache keeps the live ones in a WeakSet)
class Reservation:
    """RowCache.reserve's answer: rows and, for each, the slot reserved for it until filled or settled (-1: none,
    or done); epoch: the cache's at the reservation."""
    rows: np.ndarray
    slots: np.ndarray
    epoch: int


class RowCache:
    """Rows of one table file by row id, within `budget` bytes in all. Thread-safe (one lock per cache).

    store=False keeps the index and policy only (the device cache keeps the bytes in GPU memory).
    """

    def __init__(self, *, row_bytes: int, budget: int, file_id=None, store: bool = True, max_rows: int | None = None,
                 lib=None):
        self.row_bytes = int(row_bytes)
        self.lib = lib                  # native.library()'s: copies with no temporary, the index in C (None: numpy)
        self.budget = int(budget)
        self.file_id = file_id
        self.capacity = capacity_for(self.budget, self.row_bytes)
        if max_rows is not None:            # never more slots than the table has rows (a budget above its size)
            self.capacity = min(self.capacity, int(max_rows))
        C = self.capacity
        self.index = HashIndex(C, lib)
        self.sketch = FreqSketch(C, period=10 * max(C, 1), lib=lib)
        self.slot_row = np.full(C, -1, np.int64)
        self.n_used = 0
        self._map = None
        self.data = np.zeros((0, self.row_bytes), np.uint8)
        if store and C:
            # page-aligned (pinnable: device.pin_staging) and private: a fork()ed child must not write the parent's rows
            self._map = mmap.mmap(-1, C * self.row_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.data = np.frombuffer(self._map, np.uint8).reshape(C, self.row_bytes)
        self.lock = threading.Lock()
        self._dirty = False     # an admission or an emptying was interrupted: empty before the next use
        forksafe.track(self, "lock")
        self.slot_freq = np.zeros(C, np.uint8)        # access counts of cached rows (aged with the sketch)
        self._age = 0
        self.gen = 0                                    # changes that may add rows (hot-row file: save_hot)
        self.epoch = 0                                  # emptyings so far (a reservation is void after one)
        self.pending = 0                                # slots reserved and not filled yet
        self._live = weakref.WeakSet()                  # reservations not settled yet (see _reclaim)
        self._hand = 0
        self._mark = np.zeros(C, np.uint8)
        self._faulted = 0                               # bytes of the row mapping prefault() populated
        self.hits = self.misses = self.admitted = self.evicted = 0
        self.hot, self.hot_loaded, self.hot_saved = None, 0, 0      # hot-row file (cache_for sets them)

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds now: rows in use plus the index, sketch and slot table (never above budget)."""
        return _footprint(self.capacity, self.row_bytes) - (self.capacity - self.n_used) * self.row_bytes

    def find(self, rows: np.ndarray) -> np.ndarray:
        """Slot of each (unique) row, -1 for a miss (a row whose bytes are still being read is a miss), without
        counting the access (count does). Call under self.lock."""
        if self._dirty:
            self._empty()
        rows = np.asarray(rows, np.int64)
        if not self.n_used:
            return np.full(rows.shape[0], -1, np.int64)
        slots = self.index.get(rows)
        if self.pending:            # a slot reserved for its row holds no bytes yet: a miss (slot_row <= PENDING)
            slots[self.slot_row[np.maximum(slots, 0)] != rows] = -1
        return slots

    def since(self) -> int | None:
        """What reserve(gen=) may be given after a find (call under the same lock hold): the generation, where
        find's misses are then surely absent from the index (no slot reserved at the time), else None."""
        return None if self.pending else self.gen

    def count(self, rows: np.ndarray, slots: np.ndarray) -> None:
        """Count one access of each row found at slots (find's answer): hits in their slot's counter, misses in
        the sketch. Call under self.lock."""
        rows = np.asarray(rows, np.int64)
        if rows.shape[0] <= SCALAR_MAX:       # a decode step: the same counting without numpy calls (_get_few)
            sf, missed = self.slot_freq, []
            for r, sl in zip(rows.tolist(), slots.tolist()):
                if sl < 0:
                    missed.append(r)
                elif sf[sl] < 255:
                    sf[sl] += 1
            if missed:
                self.sketch.add(np.array(missed, np.int64))
            h = rows.shape[0] - len(missed)
        else:
            hit = slots >= 0
            hs = slots[hit]
            f = self.slot_freq[hs]
            self.slot_freq[hs] = f + (f < 255)
            self.sketch.add(rows[~hit])
            h = hs.shape[0]
        self._age += rows.shape[0]
        if self._age >= self.sketch.period:           # aging: halve every counter
            self.sketch.table >>= 1
            self.slot_freq >>= 1
            self._age //= 2
        self.hits += h
        self.misses += rows.shape[0] - h

    def take_all(self, rows: np.ndarray) -> np.ndarray | None:
        """The bytes of the (unique) rows, uint8 [k, row_bytes], counted as hits, where every one is cached; None
        (nothing counted) otherwise. Call under self.lock."""
        slots = self.find(rows)
        if (slots < 0).any():
            return None
        self.count(rows, slots)
        return self.data.take(slots, axis=0)

    def lookup(self, rows: np.ndarray) -> np.ndarray:
        """find and count. Call under self.lock."""
        slots = self.find(rows)
        self.count(rows, slots)
        return slots

    def cached(self, rows: np.ndarray) -> np.ndarray:
        """Slot of each row, -1 where not cached, without counting an access (a prefetch's question: the read
        that follows counts it; a row being read counts as cached). Call under self.lock."""
        rows = np.asarray(rows, np.int64)
        if self._dirty or not self.n_used:
            return np.full(rows.shape[0], -1, np.int64)
        return self.index.get(rows)

    # -- admission: reserve slots for rows being read, fill them as their bytes arrive, settle the rest ------------
    # Between reserve and fill a slot is PENDING: in the index (no second reader admits the row) but no hit (find,
    # copy_hits and victim sampling pass it by). The bookkeeping runs once per batch while its reads are in flight;
    # a part that arrives costs a copy. settle gives back what was never filled (a failed read, page-cache rows).

    def reserve(self, rows: np.ndarray, protect: np.ndarray | None = None, gen: int | None = None,
                skip: np.ndarray | None = None) -> "Reservation":
        """Slots for fresh (unique) rows about to be read: -1 where not admitted (among them rows the index holds
        already: reserved or filled by another reader since this one's find, or being read, which find calls a
        miss). protect: slots that must not be evicted now (the current batch's hits). gen: since() at the find
        that missed these rows; while the generation has not moved (every insertion and fill moves it) the index
        need not be asked again (docs/decisions/row-cache-policy.md). skip:
        bool mask of rows not to admit. Call under self.lock.

        Anything raised inside empties the cache before it propagates (as in every step that changes it)."""
        return self._guarded(self._reserve, rows, protect, gen, skip)

    def fill(self, r: "Reservation", idx: np.ndarray, data) -> np.ndarray:
        """The bytes of rows r.rows[idx] arrived (data: uint8 [k, row_bytes] or a native.RowsAt, ignored with
        store=False): copied into their reserved slots, which become hits; returns the slot of each, -1 where
        none was reserved (or the cache was emptied since). Call under self.lock."""
        return self._guarded(self._fill, r, np.asarray(idx, np.int64), data)

    def settle(self, r: "Reservation") -> None:
        """Give back the slots of r never filled (their rows leave the index). Call under self.lock."""
        self._guarded(self._settle, r)

    def admit(self, rows: np.ndarray, data=None, protect: np.ndarray | None = None):
        """Offer freshly read (unique) rows whose bytes are all here: reserve, fill and settle in one step; returns
        the slot each was stored in, -1 where not admitted. Call under self.lock."""
        r = self.reserve(rows, protect)
        out = self.fill(r, np.arange(r.rows.shape[0]), data)
        self.settle(r)
        return out

    def _guarded(self, step, *args):
        """step(*args) with the cache dirty until it returns: anything raised inside (a KeyboardInterrupt from a
        signal handler between publishing a slot and writing its bytes) empties the cache before it propagates,
        so a half-made change is never a hit."""
        if self._dirty:
            self._empty()
        self._dirty = True          # (a second interrupt may hit the handler below)
        try:
            out = step(*args)
        except BaseException:
            self._empty()
            raise
        self._dirty = False
        return out

    def _reserve(self, rows, protect, gen, skip) -> "Reservation":
        rows = np.asarray(rows, np.int64)
        out = np.full(rows.shape[0], -1, np.int64)
        r = Reservation(rows, out, self.epoch)
        C = self.capacity
        if not rows.size or not C:
            return r
        if self.pending:
            self._reclaim()
        fresh = not self.n_used or (gen is not None and gen == self.gen)
        todo = np.arange(rows.shape[0]) if fresh else np.flatnonzero(self.index.get(rows) < 0)
        if skip is not None:
            todo = todo[~skip[todo]]
        if not todo.size:
            return r
        self.gen += 1               # (only where rows may enter: an unchanged cache needs no hot-row write)
        free = C - self.n_used
        freq = None
        if free < todo.shape[0]:                       # not all fit: the most frequent first
            freq = self.sketch.estimate(rows[todo]).astype(np.int64)
            o = np.argsort(-freq, kind="stable")
            todo, freq = todo[o], freq[o]
        free = min(free, todo.shape[0])
        pick, slots = todo[:free], np.arange(self.n_used, self.n_used + free)
        self.n_used += free
        rest = todo[free:] if not free else todo[:0]    # (slots filled just now are no victims)
        if rest.size:       # full: sampled-LFU victims, admitted where the newcomer is more frequent
            m = min(C, max(64, 4 * rest.shape[0]))      # a sweeping run of slots: distinct, in random order
            sample = (self._hand + np.arange(m)) % C     # of rows (slots fill as misses arrive)
            self._hand = (self._hand + m) % C
            if protect is not None and protect.size:
                self._mark[protect] = 1
                sample = sample[self._mark[sample] == 0]
                self._mark[protect] = 0
            if self.pending:
                sample = sample[self.slot_row[sample] > PENDING]      # another batch's rows are landing there
            vf = self.slot_freq[sample]
            o = np.argsort(vf, kind="stable")
            k = min(rest.shape[0], sample.shape[0])
            victims = sample[o[:k]]
            ok = freq[free:free + k] > vf[o[:k]]
            victims, newcomers = victims[ok], rest[:k][ok]
            if victims.size:
                old = self.slot_row[victims]
                self.index.delete(old[old >= 0])        # (a slot given back by settle holds no row)
                self.evicted += int(np.count_nonzero(old >= 0))
                pick = np.concatenate([pick, newcomers])
                slots = np.concatenate([slots, victims])
        if pick.size:
            self.slot_row[slots] = PENDING - rows[pick]
            self.slot_freq[slots] = np.minimum(self.sketch.estimate(rows[pick]), 255)   # its history so far
            self.index.insert(rows[pick], slots)
            self.pending += pick.shape[0]
            out[pick] = slots
            self._live.add(r)
        return r

    def _reclaim(self) -> None:
        """Give back the slots of reservations that died unsettled (an exception between a reservation and its
        settle, e.g. KeyboardInterrupt while waiting for the lock): pending slots no live reservation owns."""
        owned = [x.slots[x.slots >= 0] for x in list(self._live) if x.epoch == self.epoch]
        if sum(o.shape[0] for o in owned) == self.pending:     # all owned (a prefetch holds some between calls)
            return
        pend = np.flatnonzero(self.slot_row[:self.n_used] <= PENDING)
        lost = np.setdiff1d(pend, np.concatenate(owned)) if owned else pend
        if lost.size:
            self.index.delete(PENDING - self.slot_row[lost])
            self.slot_row[lost] = -1
            self.slot_freq[lost] = 0
            self.pending -= lost.shape[0]

    def _fill(self, r, idx, data) -> np.ndarray:
        if r.epoch != self.epoch:           # emptied or closed since: those slots may be another row's now
            return np.full(idx.shape[0], -1, np.int64)
        sl = r.slots[idx]
        ok = np.flatnonzero(sl >= 0)
        if ok.size:
            got = sl[ok]
            if self.data.shape[0] and data is not None:
                if not isinstance(data, RowsAt):
                    data = RowsAt.of(data)
                data.take(ok).copy_to(self.data, got)
            self.slot_row[got] = r.rows[idx[ok]]     # now a hit
            r.slots[idx[ok]] = -1                   # (filled: settle leaves it)
            self.pending -= ok.shape[0]
            self.admitted += ok.shape[0]
            self.gen += 1                           # (rows became live: a hot-row snapshot taken since lacks them)
        return sl

    def _settle(self, r) -> None:
        if r.epoch != self.epoch:
            return
        left = np.flatnonzero(r.slots >= 0)
        if left.size:
            sl = r.slots[left]
            self.index.delete(r.rows[left])
            self.slot_row[sl] = -1
            self.slot_freq[sl] = 0                  # the first victims a later admission takes
            self.pending -= left.shape[0]
            r.slots[left] = -1

    def copy_hits(self, slots: np.ndarray, unique_rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Copy the hits' rows (slots >= 0) into out; returns the hits whose slot no longer holds their row
        (evicted, the cache cleared or closed since the look-up), which out does not have right."""
        hit = slots >= 0
        with self.lock:
            if not self.data.shape[0] or self._dirty:     # closed, or an interrupted admission/emptying
                if self._dirty:
                    self._empty()
                return hit
            pos = np.flatnonzero(hit)
            copy_rows(self.lib, self.data.reshape(-1), slots[pos] * self.row_bytes, out, pos)
            return hit & (self.slot_row[np.maximum(slots, 0)] != unique_rows)

    def prefault(self, k: int) -> None:
        """Fault in the pages of the next k free slots (where the next admissions land) without changing their
        bytes (MADV_POPULATE_WRITE, Linux 5.14+; nothing where the kernel lacks it). Called while a read is in
        flight: the first touch of fresh anonymous memory (about half of an admission's cost;
        docs/decisions/staging-memory.md) then overlaps the device."""
        with self.lock:                     # (close() unmaps under it)
            if self._map is None or not _POPULATE_OK[0]:
                return
            lo = max(self.n_used * self.row_bytes, self._faulted)
            lo -= lo % mmap.PAGESIZE
            hi = min(self.n_used + int(k), self.capacity) * self.row_bytes
            if hi <= lo:
                return
            try:
                self._map.madvise(MADV_POPULATE_WRITE, lo, hi - lo)
            except OSError:                 # EINVAL: a kernel before 5.14
                _POPULATE_OK[0] = False
                return
            self._faulted = max(self._faulted, hi)

    def snapshot(self):
        """(row ids, access counts, row bytes) of every cached row, copies; None for an index-only cache."""
        with self.lock:
            if self._dirty or not self.data.shape[0]:
                return None
            live = np.flatnonzero(self.slot_row[:self.n_used] >= 0)    # (not slots reserved or given back)
            return self.slot_row[live], self.slot_freq[live], self.data[live]

    def restore(self, ids: np.ndarray, freq: np.ndarray, rows: np.ndarray) -> int:
        """Fill an empty cache with saved rows (distinct ids, checked by hotrows.load) in slots 0..n-1, their
        access counts kept; returns how many it took (none when the cache already holds rows)."""
        with self.lock:
            if self._dirty:
                self._empty()
            if self.n_used or not self.data.shape[0]:
                return 0
            n = min(int(ids.shape[0]), self.capacity)
            self._dirty = True                  # interrupted half way: emptied before the next use
            self.data[:n] = rows[:n]
            self.slot_row[:n] = ids[:n]
            self.slot_freq[:n] = freq[:n]
            self.index.insert(np.ascontiguousarray(ids[:n], np.int64), np.arange(n, dtype=np.int64))
            self.n_used = n
            self.gen += 1
            self._dirty = False
            return n

    def clear(self) -> None:
        with self.lock:
            self._empty()

    def _empty(self) -> None:
        """Forget every row (under self.lock). Interrupted, it leaves the cache dirty: the next lookup, admission
        or hit copy empties it again before anything else."""
        self._dirty = True
        self.n_used = 0
        self.index.clear()
        self.sketch.table.fill(0)
        self.slot_row.fill(-1)
        self.slot_freq.fill(0)
        self._age = 0
        self.gen += 1
        self.epoch += 1
        self.pending = 0
        self._live = weakref.WeakSet()
        self._dirty = False

    def close(self) -> None:
        # under the lock, and empty first: a thread that still holds this cache then only misses (admit returns)
        with self.lock:
            self.capacity = self.n_used = self.pending = 0
            self.epoch += 1
            self.index = HashIndex(0)
            self.slot_row = self.slot_row[:0]
            self.data = np.zeros((0, self.row_bytes), np.uint8)
            close_mapping(self._map)
            self._map = None


