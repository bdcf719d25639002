"""The cold direct path: wide rows windowed at the device's logical block, the row cache's hits copied while the
misses' reads are in flight, and hits evicted by another Table between the lookup and that copy read again."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gds_gather as gg
from gds_gather import readers, rowcache, storage, uring
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


@pytest.fixture(autouse=True)
def fresh_caches():
    rowcache.drop_all()
    yield
    rowcache.drop_all()


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
    real_copy = rowcache._copy_hits
    in_read = _flag_ring_reads(monkeypatch)

    def copy_hits(*a):
        seen.append(in_read[0])
        return real_copy(*a)
    monkeypatch.setattr(rowcache, "_copy_hits", copy_hits)
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
    """[bool]: True while an io_uring read of this process is in flight (Ring.read wrapped)."""
    in_read, real_read = [False], uring.Ring.read

    def ring_read(self, *a, **kw):
        in_read[0] = True
        try:
            return real_read(self, *a, **kw)
        finally:
            in_read[0] = False
    monkeypatch.setattr(uring.Ring, "read", ring_read)
    return in_read


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
    real_copy = rowcache._copy_hits

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
        monkeypatch.setattr(rowcache, "_copy_hits", copy_hits)
        monkeypatch.setattr(readers, "SPLIT_MIN", split_min)
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
    """read(on_rows=...) of at least SPLIT_MIN windows: two submissions; the first part's rows come while the second
    part is in flight, every row once and right; through the row cache, the result and the cache hold the file's
    rows whatever the caller does to the arrays it got."""
    path, raw = wide
    if not uring.probe()[0]:
        pytest.skip("io_uring not usable here")
    parts = []
    in_read = _flag_ring_reads(monkeypatch)
    monkeypatch.setattr(readers, "SPLIT_MIN", 8)
    ids = np.arange(0, N_ROWS, 2)                     # 60 rows, none adjacent: 60 windows
    with gg.open_table(path, config=Config(cache_bytes=1 << 20, page_cache_reads=0)) as t:
        r = t._reader("direct")
        if r.ring is None or not r.odirect:
            pytest.skip(f"direct runs without io_uring or O_DIRECT here ({r.how})")
        p = t.plan(ids)
        assert p.n_windows == 60
        assert r.read(p, on_rows=lambda lo, hi, rows: parts.append((lo, hi, rows.copy(), in_read[0]))) is None
        assert [(lo, hi, during) for lo, hi, _, during in parts] == [(0, 45, True), (45, 60, False)]
        np.testing.assert_array_equal(np.concatenate([x for _, _, x, _ in parts]), raw[ids])
        np.testing.assert_array_equal(r.read(p), raw[ids])        # without on_rows: one read, the rows returned
        first = t.read_plan(t.plan(np.arange(0, 20)), "direct")  # 20 misses, one part: admitted
        first[:] = 3
        got = t.read_plan(p, "direct")                   # 10 hits, 50 misses read in two parts
        np.testing.assert_array_equal(got, raw[ids])
        c = rowcache._existing(t)
        assert c.n_used == 70 and t.stats()["rows_from_cache"] == 10
        got[:] = 1
        np.testing.assert_array_equal(c.data[:c.n_used], raw[c.slot_row[:c.n_used]])
        np.testing.assert_array_equal(t.read_plan(t.plan(np.arange(N_ROWS)), "direct"), raw)
