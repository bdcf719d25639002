"""Admission in steps (RowCache.reserve / fill / settle), the native row copies, and plans of a batch's misses made
from its own windows (planner.subplan): checked against numpy, replan and the file's rows."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gds_gather as gg
from gds_gather.io import native
from gds_gather.cache import rowcache, store
from gds_gather.config import Config
from gds_gather import planner
from gds_gather.errors import ReadError
from gds_gather.planner import plan_rows, replan, subplan
from gds_gather.cache.store import PENDING, RowCache


def _lib():
    lib = native.library()[0]
    if lib is None:
        pytest.skip("no C compiler for the native helpers")
    return lib


def _bytes(rows, rb=16):
    return ((np.asarray(rows, np.int64)[:, None] * 31 + np.arange(rb)) % 251).astype(np.uint8)


@pytest.mark.parametrize("use_lib", [False, True], ids=["numpy", "native"])
def test_reserved_rows_are_misses_until_filled_then_hits_with_their_bytes(use_lib):
    c = RowCache(row_bytes=16, budget=store._footprint(8, 16), lib=_lib() if use_lib else None)
    rows = np.array([3, 9, 40], np.int64)
    with c.lock:
        r = c.reserve(rows)
        assert (r.slots >= 0).all() and (c.slot_row[r.slots] == PENDING - rows).all() and c.pending == 3
        assert (c.find(rows) == -1).all()                  # being read: no hit (no bytes yet)
        assert (c.cached(rows) >= 0).all()                 # ...but a prefetch need not read it again
        assert (c.reserve(rows).slots == -1).all()         # nor does a second reader admit it twice
        g = c.gen
        got = c.fill(r, np.array([0, 2]), native.RowsAt.of(_bytes(rows[[0, 2]])))
        assert (got >= 0).all() and c.pending == 1
        assert c.gen > g                                   # rows became live: the hot-row file is out of date
        s = c.find(rows)
        assert s[0] >= 0 and s[1] == -1 and s[2] >= 0
        np.testing.assert_array_equal(c.data[s[[0, 2]]], _bytes(rows[[0, 2]]))
        c.settle(r)                                        # row 9 never arrived: given back
        assert c.pending == 0 and (c.index.get(rows[1:2]) == -1).all()
        assert c.slot_row[got].tolist() == [3, 40]
    ids, freq, data = c.snapshot()                         # the hot-row file never gets a slot without a row
    assert sorted(ids.tolist()) == [3, 40]
    np.testing.assert_array_equal(data, _bytes(ids))


def test_a_row_another_reader_reserved_or_filled_since_a_find_is_never_admitted_twice():
    """find calls a row being read a miss; the reader that missed it must not give it a second slot, whether the
    other reader is still reading it or filled it meanwhile."""
    c = RowCache(row_bytes=8, budget=store._footprint(8, 8))
    with c.lock:                                # as source.through: find, since(), later reserve(gen=)
        other = c.reserve(np.array([5, 6], np.int64))
        assert (c.find(np.array([5, 6], np.int64)) == -1).all()       # this reader misses them
        g = c.since()
        assert g is None                                               # a slot reserved: no shortcut
        mine = c.reserve(np.array([5], np.int64), gen=g)               # still being read: no second slot
        assert (mine.slots == -1).all()
        c.fill(other, np.array([0, 1]), np.full((2, 8), 3, np.uint8))  # ...or filled since this reader's find
        mine = c.reserve(np.array([5, 6, 7], np.int64), gen=g)
        assert mine.slots.tolist()[:2] == [-1, -1] and mine.slots[2] >= 0
        c.fill(mine, np.array([2]), np.full((1, 8), 7, np.uint8))
        assert (c.find(np.array([8], np.int64)) == -1).all()           # nothing pending: find's misses are absent
        g = c.since()
        assert g == c.gen
        late = c.reserve(np.array([8], np.int64))                      # another reader reserves 8 meanwhile
        mine = c.reserve(np.array([8], np.int64), gen=g)               # the generation moved: asked again
        assert (mine.slots == -1).all() and (late.slots >= 0).all()
        for row in (5, 6, 7, 8):
            assert int((c.index.keys == row).sum()) == 1                # one entry a row


def test_a_reserved_slot_is_never_a_victim_and_a_given_back_one_is_reused():
    c = RowCache(row_bytes=8, budget=store._footprint(4, 8))
    assert c.capacity == 4
    with c.lock:
        first = np.arange(4, dtype=np.int64)
        c.lookup(first)                                    # counted, as every batch's look-up is
        a = c.reserve(first)                               # the cache is full of rows being read
        for _ in range(3):
            c.lookup(np.array([100], np.int64))
        b = c.reserve(np.array([100], np.int64))
        assert (b.slots == -1).all()                       # no victim among pending slots
        c.fill(a, np.array([0, 1, 2]), np.ones((3, 8), np.uint8))
        c.settle(a)                                        # slot of row 3 given back: a hole
        b = c.reserve(np.array([100], np.int64))
        assert (b.slots >= 0).all() and c.evicted == 0     # the hole is taken first; no row evicted for it
        c.fill(b, np.array([0]), np.full((1, 8), 7, np.uint8))
        s = c.find(np.array([0, 1, 2, 100], np.int64))
        assert (s >= 0).all() and (c.data[s[3]] == 7).all()


def test_a_reservation_lost_unsettled_is_given_back_at_the_next_one():
    """A batch interrupted between its reservation and its settle (KeyboardInterrupt waiting for the lock) leaves
    pending slots no one owns: the next reservation takes them back, and the row can be cached again."""
    import gc
    c = RowCache(row_bytes=8, budget=store._footprint(8, 8))
    with c.lock:
        c.reserve(np.array([1, 2], np.int64))      # the Reservation is dropped unsettled
        gc.collect()
        keep = c.reserve(np.array([3], np.int64))  # takes back the slots of 1 and 2
        assert c.pending == 1 and (c.index.get(np.array([1, 2], np.int64)) == -1).all()
        again = c.reserve(np.array([1, 9], np.int64))      # keep is alive: its slot stays reserved
        assert (again.slots >= 0).all() and c.pending == 3 and keep.slots[0] not in again.slots
        c.fill(again, np.arange(2), np.full((2, 8), 4, np.uint8))
        c.fill(keep, np.arange(1), np.full((1, 8), 6, np.uint8))
        s = c.find(np.array([1, 3, 9], np.int64))
        assert (s >= 0).all() and c.pending == 0
        assert (c.data[s] == np.array([[4], [6], [4]], np.uint8)).all()


def test_a_lost_reservation_is_given_back_beside_one_held_across_calls():
    """A prefetch holds its reservation between calls: the next reservation does not scan the slots while every
    pending one has its owner, and still takes back those of a reservation lost meanwhile."""
    import gc
    c = RowCache(row_bytes=8, budget=store._footprint(8, 8))
    with c.lock:
        held = c.reserve(np.array([5], np.int64))
        c.reserve(np.array([1, 2], np.int64))      # lost
        gc.collect()
        c.reserve(np.array([3], np.int64))
        assert c.pending == 2 and (c.index.get(np.array([1, 2], np.int64)) == -1).all()
        assert held.slots[0] >= 0 and c.index.get(np.array([5], np.int64))[0] == held.slots[0]


def test_a_cache_emptied_between_reserve_and_fill_takes_no_bytes():
    c = RowCache(row_bytes=8, budget=store._footprint(4, 8))
    with c.lock:
        r = c.reserve(np.array([1, 2], np.int64))
    c.clear()
    with c.lock:
        other = c.admit(np.array([5, 6], np.int64), np.full((2, 8), 5, np.uint8))
        assert (np.sort(other) == np.sort(r.slots)).all()      # the same slots, now another row's
        assert (c.fill(r, np.arange(2), np.full((2, 8), 9, np.uint8)) == -1).all()
        c.settle(r)
        s = c.find(np.array([5, 6, 1, 2], np.int64))
        assert (s[:2] >= 0).all() and (s[2:] == -1).all() and (c.data[s[:2]] == 5).all()


def test_an_interrupted_fill_empties_the_cache():
    c = RowCache(row_bytes=8, budget=store._footprint(4, 8))

    class Boom(native.RowsAt):
        def take(self, idx):
            raise KeyboardInterrupt
    with c.lock:
        r = c.reserve(np.array([1, 2], np.int64))
        with pytest.raises(KeyboardInterrupt):
            c.fill(r, np.arange(2), Boom(np.zeros(16, np.uint8), np.array([0, 8]), 8))
        assert c.n_used == 0 and c.pending == 0 and (c.find(np.array([1, 2], np.int64)) == -1).all()


def test_a_failed_read_leaves_no_slot_pending(tmp_path, ggufs):
    path, raw, _ = ggufs.table(tmp_path / "t.gguf", 300, seed=5)
    rowcache.drop_all()
    with gg.open_table(path, config=Config(page_cache_reads=0, cache_bytes=1 << 20)) as t:
        t.read_rows(np.arange(0, 100, 3), "direct")
        rd = t.open_reader("direct")
        rd.inject = lambda res, idx: np.where(idx == idx[0], -5, res)     # EIO on the first completion
        with pytest.raises(ReadError):
            t.read_rows(np.arange(0, 300, 2), "direct")
        rd.inject = None
        c = rowcache._existing(t)
        assert c.pending == 0 and (c.slot_row[:c.n_used] > PENDING).all()
        ids = np.arange(0, 300, 2)
        np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
    rowcache.drop_all()


@settings(max_examples=50, deadline=None)
@given(n=st.integers(0, 700), rb=st.sampled_from([1, 7, 90, 4096]), seed=st.integers(0, 2**31), dst_rows=st.booleans(),
       threads=st.sampled_from([1, 2, 3, 17]))
def test_copy_rows_native_equals_numpy(n, rb, seed, dst_rows, threads):
    """The native copy, by one thread or several (taking chunks of 256 rows; 17: more than its cap of 16, at times more
    than the rows), equals numpy's and a copy written here row by row."""
    lib = _lib()
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, 64 * 4096 + 8, dtype=np.uint8)
    offs = rng.integers(0, src.size - rb + 1, n)
    rows = rng.permutation(max(n, 1) * 2)[:n] if dst_rows else None
    a = np.zeros((2 * max(n, 1), rb), np.uint8)
    b = a.copy()
    native.copy_rows(lib, src, offs, a, rows, threads=threads)
    native.copy_rows(None, src, offs, b, rows)
    np.testing.assert_array_equal(a, b)
    want = np.zeros_like(a)
    for i, o in enumerate(offs.tolist()):
        want[i if rows is None else rows[i]] = src[o:o + rb]
    np.testing.assert_array_equal(a, want)


def test_copy_rows_refuses_rows_outside_their_buffers():
    src, dst = np.zeros(100, np.uint8), np.zeros((4, 10), np.uint8)
    for lib in (None, native.library()[0]):
        with pytest.raises(IndexError):
            native.copy_rows(lib, src, np.array([91]), dst)
        with pytest.raises(IndexError):
            native.copy_rows(lib, src, np.array([0]), dst, np.array([4]))
        with pytest.raises(IndexError):
            native.copy_rows(lib, src, np.array([-1]), dst)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31), rb=st.sampled_from([90, 512, 3000, 4096, 7392]),
       align=st.sampled_from([512, 4096]), frac=st.floats(0, 1))
def test_subplan_is_replan_where_it_applies(seed, rb, align, frac):
    rng = np.random.default_rng(seed)
    cfg = Config()
    n = int(rng.integers(1, 20000))
    p = plan_rows(rng.integers(0, n, int(rng.integers(1, 300))), n_rows=n, row_bytes=rb,
                  data_offset=int(rng.integers(0, 5000)), align=align, max_gap=cfg.max_gap,
                  max_window=cfg.max_window, max_waste=cfg.max_waste)
    keep = rng.random(p.n_unique) < frac
    sp, rp = subplan(p, keep), replan(p, cfg, p.unique_rows[keep])
    heads = np.flatnonzero(np.r_[True, p.row_window[1:] != p.row_window[:-1]])
    mixed = np.logical_or.reduceat(keep, heads) != np.logical_and.reduceat(keep, heads)
    assert (sp is None) == bool(mixed.any())
    if sp is None:
        return
    for f in ("unique_rows", "inverse", "win_offsets", "win_lengths", "win_staging", "row_window", "row_staging"):
        np.testing.assert_array_equal(getattr(sp, f), getattr(rp, f), err_msg=f)
    assert sp.shape == rp.shape


def test_a_partly_cached_batch_reads_its_misses_by_subplan(tmp_path, ggufs, monkeypatch):
    path, raw, _ = ggufs.table(tmp_path / "w.gguf", 600, seed=7, width=8192)    # IQ4_NL rows of 4,608 B
    rowcache.drop_all()
    made = []
    real = planner.subplan
    monkeypatch.setattr(planner, "subplan", lambda p, k: made.append(real(p, k)) or made[-1])
    with gg.open_table(path, config=Config(page_cache_reads=0, cache_bytes=1 << 22)) as t:
        t.read_rows(np.arange(0, 600, 7), "direct")
        ids = np.arange(0, 600, 3)
        np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
    assert made and made[-1] is not None and made[-1].n_unique == 171   # 200 rows, 29 of them hits
    rowcache.drop_all()
