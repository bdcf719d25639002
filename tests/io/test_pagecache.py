"""Page-cache-aware direct reads: rows whose pages are resident come from the page cache, the rest O_DIRECT; the
rows are exact either way and O_DIRECT still adds nothing to the page cache."""
from __future__ import annotations

import errno
import gc
import mmap
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import gds_gather as gg
from gds_gather.io import measure
from gds_gather.cache import rowcache
from gds_gather.io import uring
from gds_gather.io.pagecache import PAGE, Residency

NO_CACHE = gg.Config(cache_bytes=0)          # the row cache off: every row goes to the reader


@pytest.fixture
def wide(tmp_path, ggufs):
    """A Q8_0 table of 1,088-byte rows (width 1024; several straddle pages), with the file's raw rows."""
    path = ggufs.write(tmp_path / "w.gguf", ggufs.rows(Q.Q8_0, 3000, 1024, seed=4), Q.Q8_0)
    with gg.open_table(path) as t:
        raw = np.fromfile(path, np.uint8, t.n_bytes, offset=t.data_offset).reshape(t.n_rows, t.row_bytes)
    return path, raw


@pytest.fixture(autouse=True)
def map_path(monkeypatch):
    """These tests check the whole-span map (its refreshes, its planted state): keep every batch on it. The
    per-row path has its own tests below (exact_path)."""
    monkeypatch.setattr(Residency, "EXACT_DIV", 1 << 40)


@pytest.fixture
def exact_path(monkeypatch):
    monkeypatch.setattr(Residency, "EXACT_DIV", 1)
    from gds_gather.io import native
    if native.library()[0] is None:
        pytest.skip("no native helpers (C compiler): the per-row path is not used")


def _odirect(t) -> bool:
    t.read_rows([0], "direct")
    return t._readers["direct"].odirect


def _warm(path, start: int, n: int) -> None:
    """Bring exactly [start, start + n) into the page cache (FADV_RANDOM: no readahead past it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for o in range(start, start + n, 1 << 16):
            os.pread(fd, min(1 << 16, start + n - o), o)
    finally:
        os.close(fd)


def _plant(path, warm_bytes: int) -> None:
    """A planted page state: the file evicted, [0, warm_bytes) brought in, then every 7th page of it dropped."""
    gc.collect()
    measure.evict_file(path)
    _warm(path, 0, warm_bytes)
    fd = os.open(path, os.O_RDONLY)
    try:
        for o in range(0, os.path.getsize(path), 7 * PAGE):
            os.posix_fadvise(fd, o, PAGE, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _truth(res, path, rows, row_bytes, data_offset):
    """Whether every page of each row is resident, from one mincore of the whole file (the oracle)."""
    import ctypes
    from gds_gather.io.libc import libc as _libc
    vec = np.zeros(-(-os.path.getsize(path) // PAGE), np.uint8)
    _libc().mincore(ctypes.c_void_p(res._base.ctypes.data), ctypes.c_size_t(vec.size * PAGE),
                    vec.ctypes.data_as(ctypes.c_void_p))
    start = data_offset + rows * row_bytes
    return np.array([all(vec[p] & 1 for p in range(s // PAGE, (s + row_bytes - 1) // PAGE + 1))
                     for s in start.tolist()])


def test_warm_rows_come_from_the_page_cache_cold_ones_odirect(wide):
    path, raw = wide
    gc.collect()                  # no mapping of the file left (a live mapping makes preads read ahead)
    measure.evict_file(path)
    _warm(path, 0, os.path.getsize(path) // 2)
    with gg.open_table(path, config=NO_CACHE) as t:
        if not _odirect(t):
            pytest.skip("no O_DIRECT on this filesystem")
        ids = np.random.default_rng(0).integers(0, t.n_rows, 800)
        before = measure.resident_bytes(path)
        np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
        s = t.stats()
        assert s["rows_from_page_cache"] > 0 and s["rows_from_device"] > 0
        assert s["rows_from_page_cache"] + s["rows_from_device"] == np.unique(ids).size + 1
        assert measure.resident_bytes(path) == before        # O_DIRECT added nothing to the page cache
        np.testing.assert_array_equal(t.gather(ids, "direct"), t.gather(ids, "pread"))


def test_a_large_batch_of_narrow_rows_is_copied_by_several_threads(tmp_path, ggufs, monkeypatch):
    """Narrow page-cache rows (34 B, Q8_0 of 32) of a batch of at least COPY_PER_THREAD rows a thread are copied out
    of the mapping by native threads: the rows equal the file's, and every one came from the page cache."""
    from gds_gather.io import native
    from gds_gather.io import pagecache
    if native.library()[0] is None:
        pytest.skip("no native helpers (C compiler)")
    path = ggufs.write(tmp_path / "n.gguf", ggufs.rows(Q.Q8_0, 20000, 32, seed=5), Q.Q8_0)
    with gg.open_table(path) as t:
        raw = np.fromfile(path, np.uint8, t.n_bytes, offset=t.data_offset).reshape(t.n_rows, t.row_bytes)
    monkeypatch.setattr(pagecache, "COPY_PER_THREAD", 64)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    calls, real = [], native.copy_rows

    def spy(lib, src, offs, dst, dst_rows=None, threads=1):
        calls.append(threads)
        return real(lib, src, offs, dst, dst_rows, threads)
    monkeypatch.setattr(native, "copy_rows", spy)
    gc.collect()
    measure.evict_file(path)
    _warm(path, 0, os.path.getsize(path))
    with gg.open_table(path, config=NO_CACHE) as t:
        if not _odirect(t) or not t._readers["direct"]._pc.trusted:
            pytest.skip("no O_DIRECT or no trusted mincore here")
        ids = np.random.default_rng(1).integers(0, t.n_rows, 3000)
        np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
        s = t.stats()
        assert s["rows_from_page_cache"] == np.unique(ids).size + 1 and s["rows_from_device"] == 0
    assert calls and max(calls) == 4       # ~2,600 unique rows, 64 a thread, at most PREAD_THREADS


def test_cold_file_reads_everything_odirect(wide):
    path, raw = wide
    measure.evict_file(path)
    with gg.open_table(path, config=NO_CACHE) as t:
        if not _odirect(t):
            pytest.skip("no O_DIRECT on this filesystem")
        measure.evict_file(path)
        t._readers["direct"]._pc.refresh()
        ids = np.arange(100, t.n_rows, 7)          # clear of the header pages the metadata reader maps
        np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
        s = t.stats()
        assert s["rows_from_page_cache"] <= 1 and s["rows_from_device"] >= ids.size


def test_eviction_since_the_last_refresh_is_noticed(wide):
    """The map says resident, then the file is evicted (a benchmark going cold): no fault per row, nothing added
    to the page cache, every row O_DIRECT."""
    path, raw = wide
    _warm(path, 0, os.path.getsize(path))
    with gg.open_table(path, config=NO_CACHE) as t:
        if not _odirect(t):
            pytest.skip("no O_DIRECT on this filesystem")
        assert t._readers["direct"]._pc.any
        measure.evict_file(path)
        before, flt = measure.resident_bytes(path), measure.major_faults()
        ids = np.arange(100, t.n_rows, 4)
        np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
        assert t.stats()["rows_from_page_cache"] <= 1 and measure.major_faults() - flt <= 2
        assert measure.resident_bytes(path) <= before + 2 * PAGE


def test_page_cache_reads_can_be_turned_off(wide):
    path, raw = wide
    _warm(path, 0, os.path.getsize(path))
    with gg.open_table(path, config=gg.Config(cache_bytes=0, page_cache_reads=0)) as t:
        ids = np.arange(0, t.n_rows, 5)
        np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
        assert t.stats()["rows_from_page_cache"] == 0
        assert t._readers["direct"]._pc is None


def test_page_cache_rows_are_not_admitted_to_the_row_cache(wide):
    """The page cache already holds them: the row cache keeps what the device delivered."""
    path, raw = wide
    rowcache.drop_all()
    _warm(path, 0, os.path.getsize(path))
    with gg.open_table(path, config=gg.Config(cache_bytes=1 << 20)) as t:
        if not _odirect(t):
            pytest.skip("no O_DIRECT on this filesystem")
        t._readers["direct"]._pc.refresh()
        ids = np.array([[1, 2999, 1], [1500, 2, 3]])
        for _ in range(2):
            np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
        s = t.stats()
        assert s["rows_from_page_cache"] == 11 and s["rows_from_cache"] == 0 and s["rows_from_device"] == 0
    rowcache.drop_all()


def test_residency_mask_matches_every_page_of_each_row(wide):
    path, _ = wide
    with gg.open_table(path) as t:
        res = Residency(path, t.data_offset, t.n_bytes)
        try:
            res.refresh()
            rng = np.random.default_rng(1)
            res.vec[:] = rng.integers(0, 2, res.vec.shape[0]) | (rng.random(res.vec.shape[0]) < 0.7)
            res.any = True
            res._last = float("inf")               # keep the planted map
            res._still_resident = lambda pages: True
            rows = np.arange(t.n_rows)
            got = res.rows_resident(rows, t.row_bytes)
            start = t.data_offset + rows * t.row_bytes
            want = [all(res.vec[p - res.page0] for p in range(s // PAGE, (s + t.row_bytes - 1) // PAGE + 1))
                    for s in start.tolist()]
            np.testing.assert_array_equal(got, np.array(want))
        finally:
            res.close()


@pytest.mark.skipif(not uring.probe()[0], reason="io_uring unavailable here")
def test_mixed_read_errors_still_raise(wide):
    path, _ = wide
    gc.collect()
    measure.evict_file(path)
    _warm(path, 0, os.path.getsize(path) // 2)
    with gg.open_table(path, config=gg.Config(cache_bytes=0, engine="uring")) as t:
        if not _odirect(t):
            pytest.skip("no O_DIRECT on this filesystem")
        assert t._readers["direct"]._pc.any
        t._readers["direct"].inject = lambda res, idx: np.where(idx == idx.min(), -errno.EIO, res)
        with pytest.raises(gg.ReadError, match="Input/output error"):
            t.read_rows(np.arange(0, t.n_rows, 3), "direct")


def test_pagecache_is_page_sized():
    assert PAGE == mmap.PAGESIZE


def test_cachestat_spares_the_mincore_of_a_cold_file(wide):
    """A due refresh of a file with nothing cached costs one cachestat, no mincore; once pages are cached the next
    due refresh runs mincore and sees them; an unchanged count keeps the map."""
    path, raw = wide
    gc.collect()
    with gg.open_table(path) as t:
        measure.evict_file(path)            # (a warm file would be learned in the background at once)
        res = Residency(path, t.data_offset, t.n_bytes)
        try:
            if res.cached() is None:
                pytest.skip("no cachestat on this kernel")
            measure.evict_file(path)
            res._last = -float("inf")
            assert res.rows_resident(np.arange(100, 200), t.row_bytes) is None
            assert res.refreshes == 0 and res.skipped == 1 and not res.any
            _warm(path, 0, os.path.getsize(path))
            res._last = -float("inf")
            got = res.rows_resident(np.arange(100, 200), t.row_bytes)
            assert res.refreshes == 1 and got is not None and got.all()
            res._last = -float("inf")
            assert res.rows_resident(np.arange(100, 200), t.row_bytes).all()
            assert res.refreshes == 1 and res.skipped == 2          # nothing changed: the map kept
        finally:
            res.close()


def test_a_new_reader_learns_a_warm_files_residency_in_the_background(wide):
    """On a file whose pages are cached, a new Residency builds its map at once in the background: the first batch
    finds it made (no refresh of its own) and its mask is the truth; on a cold file it starts nothing."""
    path, raw = wide
    gc.collect()
    _warm(path, 0, os.path.getsize(path))
    with gg.open_table(path) as t:
        res = Residency(path, t.data_offset, t.n_bytes)
        try:
            rows = np.arange(0, t.n_rows, 3)
            got = res.rows_resident(rows, t.row_bytes)
            assert res.refreshes == 1 and got is not None and got.all()     # the background refresh, not a second
        finally:
            res.close()
        measure.evict_file(path)
        res = Residency(path, t.data_offset, t.n_bytes)
        try:
            if res.cached() is not None:
                assert res.refreshes == 0 and res.rows_resident(rows, t.row_bytes) is None
        finally:
            res.close()


def test_few_rows_ask_mincore_about_their_own_pages(wide, exact_path):
    """The per-row path (no map): the mask is every page of each row resident, against a planted page state
    (half the file warm, then pages dropped here and there), and reads through it are exact."""
    path, raw = wide
    _plant(path, os.path.getsize(path))
    with gg.open_table(path, config=NO_CACHE) as t:
        res = Residency(path, t.data_offset, t.n_bytes)
        try:
            rows = np.arange(100, 400)              # 300 rows x 2 pages <= the span's pages: per-row
            res._learned()
            learned = res.refreshes                 # the background map of a warm file (1), made stale here:
            res._last = -float("inf")               # the per-row path then runs until it has cost one refresh
            want = _truth(res, path, rows, t.row_bytes, t.data_offset)
            assert want.any() and not want.all()
            np.testing.assert_array_equal(res.rows_resident(rows, t.row_bytes), want)
            assert res.exact == 1 and res.refreshes == learned
        finally:
            res.close()
        if not _odirect(t):
            pytest.skip("no O_DIRECT on this filesystem")
        ids = np.random.default_rng(2).integers(100, t.n_rows, 300)
        np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
        s = t.stats()
        assert s["rows_from_page_cache"] > 0 and s["rows_from_device"] > 0


def test_few_rows_on_a_cold_file_skip_mincore(wide, exact_path):
    path, raw = wide
    gc.collect()
    measure.evict_file(path)
    with gg.open_table(path, config=NO_CACHE) as t:
        if not _odirect(t):
            pytest.skip("no O_DIRECT on this filesystem")
        pc = t._readers["direct"]._pc
        if pc is None or pc.cached() is None:
            pytest.skip("no cachestat here: the per-row mincore runs every batch")
        ids = np.arange(100, t.n_rows, 9)
        np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
        assert pc.exact == 0 and t.stats()["rows_from_page_cache"] == 0


def test_mincore_is_not_trusted_for_files_it_would_lie_about(wide, monkeypatch):
    """Linux >= 5.0 reports every page resident where the process neither owns nor may write the file: such a
    file gets no page-cache reads (all O_DIRECT), rows still exact."""
    from gds_gather.io import pagecache
    path, raw = wide
    assert pagecache._mincore_trusted(path)
    monkeypatch.setattr(pagecache.os, "geteuid", lambda: 12345)          # another user, no write access
    monkeypatch.setattr(pagecache.os, "access", lambda *a, **k: False)
    assert not pagecache._mincore_trusted(path)
    _warm(path, 0, os.path.getsize(path))
    with gg.open_table(path, config=NO_CACHE) as t:
        if not _odirect(t):
            pytest.skip("no O_DIRECT on this filesystem")
        ids = np.arange(100, 400)
        np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
        assert t.stats()["rows_from_page_cache"] == 0 and not t._readers["direct"]._pc.trusted


@pytest.mark.parametrize("native_lib", [True, False])
def test_the_sample_before_a_copy_sees_evicted_pages(wide, native_lib):
    """_still_resident (the 8 pages sampled before copying rows the map calls resident), native and by ctypes:
    True over resident pages, False as soon as a sampled page left the page cache."""
    path, _ = wide
    measure.evict_file(path)
    half = os.path.getsize(path) // 2 // PAGE * PAGE
    _warm(path, 0, half)
    off = 3 * PAGE + 100                     # pages are counted from the span's first (page0 = 3)
    res = Residency(path, off, os.path.getsize(path) - off)
    try:
        if native_lib and res._lib is None:
            pytest.skip("no native helpers (C compiler)")
        if not native_lib:
            res._lib = None
        if not res.trusted or measure.resident_bytes(path) < half:
            pytest.skip("mincore cannot be trusted here")
        cold = half // PAGE - 3                  # the span's first page not warmed
        warm_pages = np.arange(cold, dtype=np.int64)
        assert res._still_resident(warm_pages)
        assert not res._still_resident(np.r_[warm_pages[:7], cold + 2])      # the last sample is cold
        assert not res._still_resident(np.arange(cold, cold + 8, dtype=np.int64))
    finally:
        res.close()


@pytest.fixture
def sampled(monkeypatch):
    """Every span counts as wider than a whole-span map may cover (MAP_MAX_PAGES): the sampled path."""
    monkeypatch.setattr(Residency, "MAP_MAX_PAGES", 0)
    from gds_gather.io import native
    if native.library()[0] is None:
        pytest.skip("no native helpers (C compiler): every span gets the map")


def test_a_sampled_span_costs_nothing_that_grows_with_it(wide, sampled, monkeypatch):
    """A span wider than MAP_MAX_PAGES: no background map, no cachestat, no refresh, no map array, whatever the
    page cache holds; a warm batch (its sample all resident) is read from the page cache by pread (narrow rows
    too), exact."""
    from gds_gather.io import native
    path, raw = wide
    gc.collect()
    _warm(path, 0, os.path.getsize(path))
    asked = []
    monkeypatch.setattr(Residency, "cached", lambda self: asked.append(1))
    monkeypatch.setattr(Residency, "refresh", lambda self: asked.append(2))
    preads, real = [], native.pread_pool
    monkeypatch.setattr(native, "pread_pool", lambda *a, **k: preads.append(1) or real(*a, **k))
    with gg.open_table(path, config=NO_CACHE) as t:
        if not _odirect(t) or not t._readers["direct"]._pc.trusted:
            pytest.skip("no O_DIRECT or no trusted mincore here")
        pc = t._readers["direct"]._pc
        assert pc.sampled and pc._learning is None and pc.vec.size == 0
        ids = np.random.default_rng(3).integers(0, t.n_rows, 2000)
        np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
        s = t.stats()
        assert s["rows_from_page_cache"] == np.unique(ids).size + 1 and s["rows_from_device"] == 0
        assert pc.exact == 0 and preads and not asked


def test_a_mixed_sample_asks_about_every_row(wide, sampled):
    """Half the file warm, every 7th page of it dropped: a batch whose sample is mixed gets the exact mask (the
    oracle: one mincore of the whole file), and reads through it are exact, from both sources."""
    path, raw = wide
    _plant(path, os.path.getsize(path) // 2)
    with gg.open_table(path, config=NO_CACHE) as t:
        res = Residency(path, t.data_offset, t.n_bytes)
        try:
            if not res.trusted:
                pytest.skip("mincore cannot be trusted here")
            rows = np.arange(100, t.n_rows, 2)
            want = _truth(res, path, rows, t.row_bytes, t.data_offset)
            assert want.any() and not want.all()
            np.testing.assert_array_equal(res.rows_resident(rows, t.row_bytes), want)
            assert res.exact == 1
            few = rows[:Residency.SAMPLE]               # a batch no larger than the sample: the sample is the answer
            np.testing.assert_array_equal(res.rows_resident(few, t.row_bytes), want[:few.size])
            assert res.exact == 1
        finally:
            res.close()
        if not _odirect(t):
            pytest.skip("no O_DIRECT on this filesystem")
        ids = np.random.default_rng(4).integers(100, t.n_rows, 600)
        np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
        s = t.stats()
        assert s["rows_from_page_cache"] > 0 and s["rows_from_device"] > 0


def test_a_cold_sampled_span_reads_odirect_and_adds_nothing(wide, sampled):
    path, raw = wide
    gc.collect()
    measure.evict_file(path)
    with gg.open_table(path, config=NO_CACHE) as t:
        if not _odirect(t):
            pytest.skip("no O_DIRECT on this filesystem")
        measure.evict_file(path)
        before = measure.resident_bytes(path)
        ids = np.arange(100, t.n_rows, 3)
        np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
        s = t.stats()
        assert s["rows_from_page_cache"] <= 1 and s["rows_from_device"] >= ids.size     # (row 0: _odirect's)
        assert t._readers["direct"]._pc.exact == 0
        assert measure.resident_bytes(path) <= before + 2 * PAGE


def test_a_sampled_spans_page_cache_rows_are_admitted_to_the_row_cache(wide, sampled):
    """Each of its page-cache rows cost a pread: the row cache keeps them, so the same rows again are hits (the
    whole-span map's copies are not admitted: test_page_cache_rows_are_not_admitted_to_the_row_cache)."""
    path, raw = wide
    rowcache.drop_all()
    _warm(path, 0, os.path.getsize(path))
    with gg.open_table(path, config=gg.Config(cache_bytes=1 << 20, hot_rows=0)) as t:
        if not _odirect(t) or not t._readers["direct"]._pc.trusted:
            pytest.skip("no O_DIRECT or no trusted mincore here")
        ids = np.array([[1, 2999, 1], [1500, 2, 3]])
        for _ in range(2):
            np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
        s = t.stats()
        assert s["rows_from_page_cache"] == 6 and s["rows_from_cache"] == 5 and s["rows_from_device"] == 0
    rowcache.drop_all()


def test_batches_the_page_cache_serves_plan_no_windows(wide, sampled, monkeypatch):
    """A batch read from the page cache, or from it and the row cache, never makes O_DIRECT windows (planner: made
    on first use), and its rows are exact; a cold batch makes them."""
    from gds_gather import planner
    path, raw = wide
    rowcache.drop_all()
    _warm(path, 0, os.path.getsize(path))
    made, real = [], planner.windows
    monkeypatch.setattr(planner, "windows", lambda *a, **k: made.append(1) or real(*a, **k))
    with gg.open_table(path, config=gg.Config(cache_bytes=1 << 20, hot_rows=0)) as t:
        if not _odirect(t) or not t._readers["direct"]._pc.trusted:
            pytest.skip("no O_DIRECT or no trusted mincore here")
        made.clear()
        rng = np.random.default_rng(5)
        first = rng.integers(0, t.n_rows, 400)
        again = np.concatenate([first[:100], rng.integers(0, t.n_rows, 300)])     # a quarter of it hits
        for ids in (first, again):
            np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
        s = t.stats()
        assert s["rows_from_cache"] > 0 and s["rows_from_device"] == 0 and not made
        measure.evict_file(path)
        cold = rng.integers(0, t.n_rows, 300)
        np.testing.assert_array_equal(t.read_rows(cold, "direct"), raw[cold])
        assert t.stats()["rows_from_device"] > 0 and made
    rowcache.drop_all()
