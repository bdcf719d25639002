"""Table.prefetch: any interleaving of prefetches and reads returns exactly the file's rows (and gguf's
dequantization); every row a read asks for is counted once by where the read found it, and every row a prefetch
read ahead once more (rows_prefetched, a part of rows_from_device); a prefetch reads none of the rows the read after
it asks for itself (that read is not queued behind it), collects its rows into the row cache for the read after that,
never serves a changed file, costs only the read when it fails, leaves no read in flight and no slot pending when
the table closes; the switches (baselines, cache off, Config.prefetch=0) do nothing."""
from __future__ import annotations

import logging

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gds_gather as gg
from gds_gather.cache import prefetch
from gds_gather.cache import rowcache
from gds_gather.io import uring, uring_groups

N_ROWS = 400
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
pytestmark = [pytest.mark.skipif(not uring.probe()[0], reason="io_uring unavailable here: prefetch does nothing"),
              pytest.mark.usefixtures("fresh_row_caches")]


@pytest.fixture(scope="module")
def table(tmp_path_factory, ggufs):
    """(path, raw rows as the file holds them, gguf's dequantization of the table)."""
    return ggufs.table(tmp_path_factory.mktemp("pf") / "pf.gguf", N_ROWS, seed=5)


def _cfg(budget=1 << 20, **kw):
    return gg.Config(cache_bytes=budget, page_cache_reads=0, hot_rows=0, **kw)


def _sources(s: dict) -> int:
    return s["rows_from_cache"] + s["rows_from_page_cache"] + s["rows_from_device"]


def _pending(path) -> int:
    return sum(c.pending for c in rowcache._CACHES.values())      # noqa: SLF001 (the test looks inside)


steps = st.lists(st.tuples(st.sampled_from(["prefetch", "read", "gather", "unique"]),
                           st.lists(st.integers(0, N_ROWS - 1), max_size=120)), min_size=1, max_size=12)


@SETTINGS
@given(steps=steps, budget=st.sampled_from([0, 4_000, 40_000, 1 << 20]))
def test_any_prefetches_and_reads_return_the_files_rows(table, steps, budget):
    path, raw, ref = table
    rowcache.drop_all()
    asked = 0               # unique rows the reads asked for
    with gg.open_table(path, config=_cfg(budget)) as t:
        for op, ids in steps:
            ids = np.array(ids, np.int64)
            if op == "prefetch":
                n = t.prefetch(ids, "direct")
                assert 0 <= n <= np.unique(ids).size
                assert n == 0 or budget > 0
            elif op == "read":
                np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
                asked += np.unique(ids).size
            elif op == "gather":
                np.testing.assert_array_equal(t.gather(ids, "direct"), ref[ids])
                asked += np.unique(ids).size
            else:
                u = np.unique(ids)
                np.testing.assert_array_equal(t.read_unique(u, "direct"), raw[u])
                asked += u.size
        s = t.stats()
        assert _sources(s) == asked + s["rows_prefetched"]
        has_cache = rowcache.capacity_for(budget, t.row_bytes) > 0
        assert s["cache_hits"] + s["cache_misses"] == (asked if has_cache else 0)
        assert s["rows_prefetched"] == 0 or has_cache
    assert _pending(path) == 0


def test_the_next_batch_is_read_ahead_and_found_in_the_cache(table):
    path, raw, _ = table
    a, b = np.arange(0, 200, 2), np.arange(0, 400, 4)     # 50 rows in both
    with gg.open_table(path, config=_cfg()) as t:
        assert t.prefetch(b, "direct") == b.size           # nothing cached yet: all of it, once the next read starts
        np.testing.assert_array_equal(t.read_rows(a, "direct"), raw[a])   # reads a; b less a is read meanwhile
        s = t.stats()
        assert s["rows_prefetched"] == 0 and s["rows_from_device"] == a.size    # (counted once collected)
        assert s["cache_misses"] == a.size
        assert t.prefetch(b, "direct") == 0                # all of it cached or being read now
        np.testing.assert_array_equal(t.read_rows(b, "direct"), raw[b])
        s = t.stats()
        shared = np.intersect1d(a, b).size
        assert shared == 50 and s["rows_prefetched"] == b.size - shared    # a's own rows were a's to read
        assert s["cache_hits"] == s["rows_from_cache"] == b.size          # every row of b: a hit
        assert s["rows_from_device"] == a.size + b.size - shared          # ... and none read twice
        assert _sources(s) == a.size + b.size + s["rows_prefetched"]


def test_a_prefetch_of_the_rows_read_next_reads_nothing_ahead(table):
    path, raw, _ = table
    b = np.array([390, 3, 77, 3, 150])
    with gg.open_table(path, config=_cfg()) as t:
        assert t.prefetch(b, "direct") == 4
        np.testing.assert_array_equal(t.read_rows(b, "direct"), raw[b])   # the read reads them itself
        s = t.stats()
        assert s["rows_prefetched"] == 0 and s["rows_from_device"] == 4 and _sources(s) == 4


def test_a_second_prefetch_starts_the_first(table):
    path, raw, _ = table
    b, c = np.arange(100, 140), np.arange(300, 310)
    with gg.open_table(path, config=_cfg()) as t:
        assert t.prefetch(b, "direct") == b.size
        assert t.prefetch(c, "direct") == c.size       # b starts now (no read came); c is noted
        np.testing.assert_array_equal(t.read_rows(b, "direct"), raw[b])
        s = t.stats()
        assert s["rows_prefetched"] == b.size and s["cache_hits"] == b.size and s["rows_from_device"] == b.size


def test_a_batch_too_wide_is_not_prefetched(table, monkeypatch):
    path, raw, _ = table
    monkeypatch.setattr(prefetch, "MAX_WINDOWS", 8)
    with gg.open_table(path, config=_cfg()) as t:
        assert t.prefetch(np.arange(9) * 10, "direct") == 0
        assert t.prefetch(np.arange(8) * 10, "direct") == 8
        np.testing.assert_array_equal(t.read_rows([399], "direct"), raw[[399]])
        np.testing.assert_array_equal(t.read_rows(np.arange(8) * 10, "direct"), raw[np.arange(8) * 10])
        s = t.stats()
        assert s["rows_prefetched"] == 8 and s["cache_hits"] == 8


def test_nothing_is_prefetched_while_the_page_cache_serves_the_file(table):
    path, raw, _ = table
    with gg.open_table(path, config=gg.Config(cache_bytes=1 << 20, hot_rows=0)) as t:   # page-cache reads on
        t.open_reader("direct").resident(np.arange(N_ROWS), t.row_bytes)               # (residency known)
        np.testing.assert_array_equal(t.read_rows(np.arange(5, 25), "direct"), raw[5:25])
        assert t.stats()["rows_from_page_cache"] == 20                  # (the file was just written: warm)
        assert t.prefetch(np.arange(100, 150), "direct") == 0


@pytest.mark.parametrize("read, from_page_cache, started",
                         [(20, 0, True), (20, 1, True), (20, 9, True), (20, 10, False), (20, 20, False),
                          (1, 1, True), (15, 15, True), (16, 8, False)])
def test_prefetching_stops_while_most_rows_come_from_the_page_cache(table, read, from_page_cache, started):
    """A few rows of a cold file still in the page cache (a live mapping's pages after an eviction) do not stop
    prefetching, nor does a start-up's or a decode step's read of a few rows; a read of 16 rows or more that took
    most of them from the page cache does (reader.last_from_page_cache)."""
    path, raw, _ = table
    with gg.open_table(path, config=_cfg()) as t:
        np.testing.assert_array_equal(t.read_rows(np.arange(read), "direct"), raw[:read])
        t.open_reader("direct").last_from_page_cache = np.arange(read) < from_page_cache
        assert (t.prefetch(np.arange(100, 120), "direct") == 20) == started


def test_baselines_cache_off_and_the_switch_prefetch_nothing(table):
    path, raw, _ = table
    ids = np.arange(0, N_ROWS, 3)
    with gg.open_table(path, config=_cfg()) as t:
        for b in ("pread", "mmap", "readahead", "resident"):
            assert t.prefetch(ids, b) == 0
    with gg.open_table(path, config=_cfg(0)) as t:
        assert t.prefetch(ids, "direct") == 0
        np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
    with gg.open_table(path, config=_cfg(prefetch=0)) as t:
        assert t.prefetch(ids, "direct") == 0
        t.read_rows([1], "direct")
        assert t.stats()["rows_prefetched"] == 0
    assert gg.Config().prefetch == 1
    assert gg.Config.from_env({"GDS_GATHER_PREFETCH": "0"}).prefetch == 0
    with pytest.raises(ValueError, match="GDS_GATHER_PREFETCH"):
        gg.Config(prefetch=2)


def test_bad_ids_and_a_closed_table_are_refused(table):
    path, _, _ = table
    t = gg.open_table(path, config=_cfg())
    for bad in (np.array([0, N_ROWS]), np.array([-1, 3]), np.array([0.5, 1.0])):
        with pytest.raises(gg.BadIdsError):
            t.prefetch(bad, "direct")
    assert t.prefetch(np.zeros(0, np.int64), "direct") == 0      # makes the ring, reads nothing
    t.close()
    with pytest.raises(gg.TableClosedError):
        t.prefetch(np.arange(3), "direct")


def test_a_file_changed_after_a_prefetch_is_refused_not_served(tmp_path, ggufs, caplog):
    import os
    rows_a = ggufs.rows(Q.IQ4_NL, 50, 160, seed=1)
    path = ggufs.write(tmp_path / "c.gguf", rows_a, Q.IQ4_NL)
    ids = np.array([1, 2, 3])
    with gg.open_table(path, config=_cfg()) as t:
        assert t.prefetch(ids, "direct") == 3
        t.read_rows([40], "direct")                 # starts the prefetch of ids
        st_ = os.stat(path)
        os.utime(path, ns=(st_.st_atime_ns, st_.st_mtime_ns + 10**9))
        with pytest.raises(gg.ReadError, match="modified"):
            t.read_rows(ids, "direct")              # the prefetch's rows are not filled in: refused all the same
        assert t.stats()["rows_prefetched"] == 0
    assert _pending(path) == 0


def test_a_prefetch_whose_reads_fail_costs_only_the_read(table, monkeypatch, caplog):
    path, raw, _ = table
    ids = np.arange(10, 60)
    real = uring_groups.GroupRing.finish
    monkeypatch.setattr(uring_groups.GroupRing, "finish", lambda self, tag, timeout_s=60.0: real(self, tag) and False)
    with caplog.at_level(logging.WARNING), gg.open_table(path, config=_cfg()) as t:
        assert t.prefetch(ids, "direct") == ids.size
        t.read_rows([300], "direct")
        np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
        s = t.stats()
        assert s["rows_prefetched"] == 0 and s["rows_from_device"] == ids.size + 1
    assert "a prefetch failed (its reads came back short or failed)" in caplog.text
    assert _pending(path) == 0


def test_a_prefetch_that_cannot_start_costs_only_the_read(table, monkeypatch, caplog):
    path, raw, _ = table
    ids = np.arange(10, 60)

    def refuse(*a, **k):
        raise gg.ReadError("injected: no ring")
    monkeypatch.setattr(uring_groups.GroupRing, "start", refuse)
    with caplog.at_level(logging.WARNING), gg.open_table(path, config=_cfg()) as t:
        assert t.prefetch(ids, "direct") == ids.size
        t.read_rows([300], "direct")
        np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
        assert t.stats()["rows_prefetched"] == 0
    assert "could not start" in caplog.text and "injected" in caplog.text
    assert _pending(path) == 0


def test_close_leaves_no_read_in_flight_and_no_slot_pending(table):
    path, _, _ = table
    t = gg.open_table(path, config=_cfg())
    t.prefetch(np.arange(0, N_ROWS, 2), "direct")
    t.read_rows([1], "direct")                      # the prefetch is in flight now
    ahead = t._ahead["direct"]                      # noqa: SLF001 (the test looks inside)
    ring = ahead.ring
    assert ahead.jobs and _pending(path) > 0
    t.close()
    assert ring.fd < 0 and ahead.ring is None and not ahead.jobs
    assert _pending(path) == 0


def test_caches_emptied_or_dropped_under_a_prefetch_in_flight(table):
    path, raw, _ = table
    for forget in (rowcache.empty_all, rowcache.drop_all):
        with gg.open_table(path, config=_cfg()) as t:
            t.prefetch(np.arange(100, 200), "direct")
            t.read_rows([1], "direct")                  # the prefetch is in flight
            forget()
            np.testing.assert_array_equal(t.read_rows(np.arange(100, 200), "direct"), raw[100:200])
            assert t.stats()["rows_prefetched"] == 0    # its slots were voided with the cache
        assert _pending(path) == 0


def test_a_forked_child_forgets_the_parents_prefetch(table):
    import os
    path, raw, _ = table
    with gg.open_table(path, config=_cfg()) as t:
        t.prefetch(np.arange(100, 200), "direct")
        t.read_rows([1], "direct")                      # in flight in the parent
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:                                    # the child: its own reads, the parent's ring untouched
            ok = 0
            try:
                ok = int(np.array_equal(t.read_rows(np.arange(100, 200), "direct"), raw[100:200])
                         and t.prefetch(np.arange(300, 310), "direct") == 10
                         and np.array_equal(t.read_rows([2], "direct"), raw[[2]])
                         and np.array_equal(t.read_rows(np.arange(300, 310), "direct"), raw[300:310]))
            finally:
                os.write(w, bytes([ok]))
                os._exit(0)
        os.close(w)
        assert os.read(r, 1) == b"\x01"
        os.waitpid(pid, 0)
        np.testing.assert_array_equal(t.read_rows(np.arange(100, 200), "direct"), raw[100:200])
        assert t.stats()["rows_prefetched"] == 100      # the parent's prefetch, collected by the parent


def test_the_cpu_prefill_with_prefetch_gives_the_same_rows(tmp_path):
    """CpuPrefill hands each next ubatch to prefetch: the per-layer rows equal those of the prefill without it,
    and rows were read ahead."""
    from gds_gather.model.synth import write_model
    from gds_gather.prefill.pipeline import CpuPrefill
    from gds_gather.prefill.run import RowMapper
    path = write_model(tmp_path / "q.gguf", "qwen4exp", rows=20000, progress=False)
    tokens = np.random.default_rng(3).integers(0, 5000, 700)
    outs = {}
    for on in (0, 1):
        rowcache.drop_all()
        with gg.open_table(path, config=_cfg(1 << 22, prefetch=on)) as t:
            res = CpuPrefill(t, RowMapper(t), backend="direct", ubatch=64, trunk="none").run(tokens, collect=True)
            outs[on] = np.concatenate([o[0].numpy() for o in res["outputs"]])
            s = t.stats()
            assert (s["rows_prefetched"] > 0) == bool(on)
            assert res["bytes_read"] == s["bytes_requested"] > 0
    np.testing.assert_array_equal(outs[0], outs[1])
