"""The cold direct path: wide rows windowed at the device's logical block, the row cache's hits copied while the
misses' reads are in flight, and hits evicted by another Table between the lookup and that copy read again."""
from __future__ import annotations

from contextlib import closing

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gds_gather as gg
from gds_gather.io import direct, readers
from gds_gather.cache import index, rowcache
from gds_gather.io import storage
from gds_gather.io import uring
from gds_gather.config import Config

N_ROWS = 120
WIDTH = 4096            # Q8_0: 4,352 B rows, wider than a 4 KiB block
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def wide(tmp_path_factory, ggufs):
    """(path, the file's raw rows) of a table of 4,352 B rows."""
    path = ggufs.write(tmp_path_factory.mktemp("cold") / "wide.gguf", ggufs.rows(Q.Q8_0, N_ROWS, WIDTH, seed=5),
                       Q.Q8_0)
    with gg.open_table(path) as t:
        raw = np.fromfile(path, np.uint8, t.n_bytes, offset=t.data_offset).reshape(N_ROWS, t.row_bytes)
    return path, raw


pytestmark = pytest.mark.usefixtures("fresh_row_caches")


def test_wide_rows_are_windowed_at_the_logical_block(monkeypatch, wide):
    monkeypatch.setattr(storage, "logical_block_size", lambda path: 512)
    assert readers.default_align(Config(), "x", 7392) == 512         # gemma4-e4b rows
    assert readers.default_align(Config(), "x", 4096) == 512
    assert readers.default_align(Config(), "x", 4095) == 4096        # narrow rows: neighbours share 4 KiB blocks
    assert readers.default_align(Config(), "x", 90) == 4096
    assert readers.default_align(Config(align=1024), "x", 7392) == 1024   # GDS_GATHER_ALIGN wins
    monkeypatch.setattr(storage, "logical_block_size", lambda path: 8192)
    assert readers.default_align(Config(), "x", 7392) == 8192 == readers.default_align(Config(), "x", 90)
    monkeypatch.undo()
    path, raw = wide
    lbs = storage.logical_block_size(path)
    with gg.open_table(path, config=Config(cache_bytes=0, page_cache_reads=0)) as t:
        assert t.row_bytes == 4352 and t.align == lbs
        ids = np.array([3, 4, 90, 17, 3, N_ROWS - 1, 0])
        p = t.plan(ids)
        assert (p.win_offsets % lbs == 0).all() and (p.win_lengths % lbs == 0).all()
        np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])


def test_hits_are_copied_while_the_misses_are_read(monkeypatch, wide):
    path, raw = wide
    if not uring.probe()[0]:
        pytest.skip("io_uring not usable here: no reads in flight to overlap")
    seen = []
    real_copy = rowcache.RowCache.copy_hits
    in_read = _flag_ring_reads(monkeypatch)

    def copy_hits(*a):
        seen.append(in_read[0])
        return real_copy(*a)
    monkeypatch.setattr(rowcache.RowCache, "copy_hits", copy_hits)
    with gg.open_table(path, config=Config(cache_bytes=1 << 20, page_cache_reads=0)) as t:
        r = t._reader("direct")
        if r.ring is None:
            pytest.skip(f"direct runs without io_uring here ({r.how})")
        np.testing.assert_array_equal(t.read_rows(np.arange(0, 40), "direct"), raw[:40])
        assert seen == []                               # no hits: nothing to copy
        ids = np.arange(20, 60)
        np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
        assert seen == [True]                           # the 20 hits, inside the misses' read
        assert t.stats()["rows_from_cache"] == 20


def _flag_ring_reads(monkeypatch) -> list:
    """[bool]: True while an io_uring read of this process is in flight (Ring.reads wrapped)."""
    in_read, real_reads = [False], uring.Ring.reads

    def ring_reads(self, *a, **kw):
        in_read[0] = True
        try:
            yield from real_reads(self, *a, **kw)
        finally:
            in_read[0] = False
    monkeypatch.setattr(uring.Ring, "reads", ring_reads)
    return in_read


def _parts(reader, plan, on_part) -> None:
    """on_part(positions, rows) for each Part of reader.parts(plan), as the row cache's loop takes them."""
    with closing(reader.parts(plan)) as steps:
        for step in steps:
            if step is not readers.IN_FLIGHT:
                on_part(step.positions, step.rows)


def _evict(cache, victims: np.ndarray, rows: np.ndarray, raw: np.ndarray) -> None:
    """What another Table's admission does to the slots it evicts: new rows, their bytes, the index moved, and
    cache.gen advanced (an admission since a lookup)."""
    with cache.lock:
        cache.gen += 1
        cache.index.delete(cache.slot_row[victims])
        cache.slot_row[victims] = rows
        cache.data[victims] = raw[rows]
        cache.index.insert(rows, victims)


@SETTINGS
@given(batches=st.lists(st.lists(st.integers(0, N_ROWS - 1), min_size=1, max_size=60), min_size=1, max_size=8),
       data=st.data())
def test_hits_evicted_before_their_copy_are_read_again(monkeypatch, wide, batches, data):
    """Between a batch's lookup and the copy of its hits, another Table's admission replaces some hits' rows,
    clears the cache or drops it: every batch still returns exactly the file's rows, and the cache stays true."""
    path, raw = wide
    rowcache.drop_all()
    split_min = data.draw(st.sampled_from([2, 5, 10 ** 9]))      # reads in two parts, or in one
    real_copy = rowcache.RowCache.copy_hits

    def copy_hits(cache, slots, unique_rows, out):
        what = data.draw(st.sampled_from(["none", "evict", "clear", "drop"]))
        hs = slots[slots >= 0]
        if what == "evict" and hs.size:
            victims = np.unique(data.draw(st.lists(st.sampled_from(hs.tolist()), min_size=1, max_size=hs.size)))
            free = np.setdiff1d(np.arange(N_ROWS), cache.slot_row[:cache.n_used])
            if free.size >= victims.size:       # rows no slot holds, admitted in the victims' place
                _evict(cache, victims, free[:victims.size], raw)
        elif what == "clear":
            cache.clear()
        elif what == "drop":
            rowcache.drop_all()
        return real_copy(cache, slots, unique_rows, out)
    try:
        monkeypatch.setattr(rowcache.RowCache, "copy_hits", copy_hits)
        monkeypatch.setattr(direct, "SPLIT_MIN", split_min)
        seen = 0
        with gg.open_table(path, config=Config(cache_bytes=1 << 20, page_cache_reads=0)) as t:
            for b in batches:
                ids = np.array(b, np.int64)
                np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
                seen += np.unique(ids).size
                c = rowcache._existing(t)
                if c is not None and c.n_used:
                    used = c.slot_row[:c.n_used]
                    np.testing.assert_array_equal(c.index.get(used), np.arange(c.n_used))
                    np.testing.assert_array_equal(c.data[:c.n_used], raw[used])   # every slot holds its row
            s = t.stats()
            assert s["rows_from_cache"] + s["rows_from_page_cache"] + s["rows_from_device"] == seen
    finally:
        monkeypatch.undo()


def test_a_large_read_hands_its_first_rows_over_while_the_rest_is_read(monkeypatch, wide):
    """parts(plan) of at least SPLIT_MIN windows: one submission; the rows of the windows complete at each
    fraction in HANDOVER come while the read is in flight, the rest after, every row once and right; through the row
    cache, the result and the cache hold the file's rows whatever the caller does to the arrays it got."""
    path, raw = wide
    if not uring.probe()[0]:
        pytest.skip("io_uring not usable here")
    parts = []
    in_read = _flag_ring_reads(monkeypatch)
    monkeypatch.setattr(direct, "SPLIT_MIN", 8)
    submits = []
    real_submit = direct._Engines._submit

    def submit(self, offsets, *a, **kw):
        submits.append(offsets.shape[0])
        return real_submit(self, offsets, *a, **kw)
    monkeypatch.setattr(direct._Engines, "_submit", submit)
    ids = np.arange(0, N_ROWS, 3)       # 40 rows two rows apart: 40 windows at 512 or 4096 alignment
    with gg.open_table(path, config=Config(cache_bytes=1 << 20, page_cache_reads=0)) as t:
        r = t._reader("direct")
        if r.ring is None or not r.odirect:
            pytest.skip(f"direct runs without io_uring or O_DIRECT here ({r.how})")
        p = t.plan(ids)
        assert p.n_windows == 40
        submits.clear()
        _parts(r, p, lambda pos, rows: parts.append((pos, rows.array(), in_read[0])))
        assert submits == [40]                                  # one submission
        assert parts[0][2] and parts[0][0].shape[0] >= 20       # half the windows, handed over in flight
        during = [d for _, _, d in parts]
        assert during[:sum(during)] == [True] * sum(during) and 1 <= sum(during) <= 2 and len(parts) - sum(during) <= 1
        pos = np.concatenate([x for x, _, _ in parts])
        np.testing.assert_array_equal(np.sort(pos), np.arange(40))      # every row exactly once
        for x, rows, _ in parts:
            np.testing.assert_array_equal(rows, raw[ids[x]])
        np.testing.assert_array_equal(r.read(p), raw[ids])        # read(): one read, the rows returned
        first = t.read_plan(t.plan(np.arange(0, 20)), "direct")  # 20 misses, one part: admitted
        first[:] = 3
        got = t.read_plan(p, "direct")                   # 7 hits, 33 misses handed over in up to two parts
        np.testing.assert_array_equal(got, raw[ids])
        c = rowcache._existing(t)
        assert c.n_used == 53 and t.stats()["rows_from_cache"] == 7
        got[:] = 1
        np.testing.assert_array_equal(c.data[:c.n_used], raw[c.slot_row[:c.n_used]])
        np.testing.assert_array_equal(t.read_plan(t.plan(np.arange(N_ROWS)), "direct"), raw)


def test_misses_all_from_the_page_cache_in_a_mostly_hit_batch(wide):
    """No read is made (every miss is copied from the page cache), so the hits are copied after the reader
    returns: they must not overwrite the misses (the all-rows take of a mostly-hit batch writes every row)."""
    import os
    import time
    path, raw = wide
    with gg.open_table(path, config=Config(cache_bytes=1 << 20)) as t:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            np.testing.assert_array_equal(t.read_rows(np.arange(40), "direct"), raw[:40])     # cold: admitted
            assert t.stats()["rows_from_device"] == 40
            os.pread(fd, 12 * t.row_bytes + 8192, t.data_offset + 40 * t.row_bytes - 4096)   # rows 40..51 cached
        finally:
            os.close(fd)
        time.sleep(0.3)                                     # the residency map's refresh interval
        ids = np.arange(50)
        s0 = t.stats()
        np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
        s1 = t.stats()
        if s1["rows_from_page_cache"] - s0["rows_from_page_cache"] != 10:
            pytest.skip("the page cache did not keep rows 40..49 (memory pressure?)")
        assert s1["rows_from_cache"] - s0["rows_from_cache"] == 40


def test_tables_of_one_file_in_threads_with_clears_return_the_files_rows(monkeypatch, wide):
    """Three Tables of one file (one shared cache, each its own reader lock) in real threads, a tiny budget that
    keeps evicting, two-part reads, and a thread clearing and dropping the cache: every row right, and hits
    evicted between lookup and copy did happen (and were read again)."""
    import threading
    import time
    path, raw = wide
    monkeypatch.setattr(direct, "SPLIT_MIN", 4)
    stale = [0]
    real_copy = rowcache.RowCache.copy_hits

    def copy_hits(*a):
        r = real_copy(*a)
        stale[0] += int(r.sum())
        return r
    monkeypatch.setattr(rowcache.RowCache, "copy_hits", copy_hits)
    cfg = Config(cache_bytes=120_000, page_cache_reads=0)
    stop, errs, batches = time.monotonic() + 4.0, [], [0]

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            with gg.open_table(path, config=cfg) as t:
                while time.monotonic() < stop and not errs:
                    n = int(rng.integers(1, 60))
                    ids = np.where(rng.random(n) < 0.6, rng.integers(0, 20, n), rng.integers(0, N_ROWS, n))
                    got = t.read_rows(ids, "direct")
                    if not np.array_equal(got, raw[ids]):
                        errs.append(f"{int((got != raw[ids]).any(1).sum())} wrong rows")
                    batches[0] += 1
        except BaseException as e:          # noqa: BLE001 (reported below)
            errs.append(repr(e))

    def clearer():
        rng = np.random.default_rng(9)
        while time.monotonic() < stop and not errs:
            time.sleep(rng.random() * 0.005)
            c = next(iter(list(rowcache._CACHES.values())), None)
            if c is not None:
                c.clear() if rng.random() < 0.8 else rowcache.drop_all()
    threads = [threading.Thread(target=worker, args=(s,)) for s in range(3)] + [threading.Thread(target=clearer)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errs, errs[:3]
    assert batches[0] > 100 and stale[0] > 0, (batches, stale)
    for c in rowcache._CACHES.values():            # the index: one entry a row, each at the slot holding that row
        keys = c.index.keys[c.index.keys >= 0]
        assert np.unique(keys).size == keys.size and c.pending == 0
        np.testing.assert_array_equal(c.slot_row[c.index.get(keys)], keys)


def test_an_interrupted_admission_leaves_no_wrong_hit(wide):
    """A KeyboardInterrupt (a signal handler) between publishing slots and writing their bytes: the cache is
    emptied, the next reads are the file's rows."""
    path, raw = wide
    with gg.open_table(path, config=Config(cache_bytes=1 << 20, page_cache_reads=0)) as t:
        t.read_rows(np.arange(10), "direct")
        c = rowcache._existing(t)
        real_insert = c.index.insert

        def insert(*a):
            real_insert(*a)
            raise KeyboardInterrupt
        c.index.insert = insert
        with pytest.raises(KeyboardInterrupt):
            t.read_rows(np.arange(10, 30), "direct")
        del c.index.insert                  # (the emptied cache keeps its index object: the handler is gone)
        assert c.n_used == 0
        np.testing.assert_array_equal(t.read_rows(np.arange(30), "direct"), raw[:30])
        np.testing.assert_array_equal(t.read_rows(np.arange(30), "direct"), raw[:30])
        assert t.stats()["rows_from_cache"] >= 30


def test_an_interrupted_emptying_leaves_no_wrong_hit(wide, monkeypatch):
    """A second interrupt, inside the emptying itself (clearing the index): the cache stays dirty and is emptied
    before its next use, so old index entries never point at rows admitted afterwards."""
    path, raw = wide
    with gg.open_table(path, config=Config(cache_bytes=1 << 20, page_cache_reads=0)) as t:
        t.read_rows(np.arange(10), "direct")
        c = rowcache._existing(t)
        real_clear = index.HashIndex.clear
        calls = [0]

        def clear_once(self):
            calls[0] += 1
            if calls[0] == 1:
                raise KeyboardInterrupt
            return real_clear(self)
        monkeypatch.setattr(index.HashIndex, "clear", clear_once)
        with pytest.raises(KeyboardInterrupt):
            c.clear()
        assert c._dirty and (c.index.get(np.arange(10)) >= 0).all()     # the old entries are still there...
        monkeypatch.setattr(index.HashIndex, "clear", real_clear)
        np.testing.assert_array_equal(t.read_rows(np.arange(100, 110), "direct"), raw[100:110])
        np.testing.assert_array_equal(t.read_rows(np.arange(10), "direct"), raw[:10])
        np.testing.assert_array_equal(t.read_rows(np.arange(100, 110), "direct"), raw[100:110])


def test_a_file_changed_before_a_hand_over_read_is_refused_before_any_row(monkeypatch, wide):
    """The hand-over read checks the file while its reads are in flight: a changed file raises before any row is
    handed over, and the ring is left clean (no read in flight)."""
    import os
    path, raw = wide
    if not uring.probe()[0]:
        pytest.skip("io_uring not usable here")
    monkeypatch.setattr(direct, "SPLIT_MIN", 8)
    with gg.open_table(path, config=Config(cache_bytes=1 << 20, page_cache_reads=0)) as t:
        r = t._reader("direct")
        if r.ring is None or not r.odirect:
            pytest.skip(f"direct runs without io_uring or O_DIRECT here ({r.how})")
        p = t.plan(np.arange(0, N_ROWS, 3))
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        parts = []
        with pytest.raises(gg.ReadError, match="modified"):
            _parts(r, p, lambda pos, rows: parts.append(pos))
        assert parts == [] and r.ring.outstanding() == (0, 0) and not r.ring.broken
        with pytest.raises(gg.ReadError, match="modified"):
            t.read_rows(np.arange(0, N_ROWS, 3), "direct")
