"""Table.prefetch: any interleaving of prefetches and reads returns exactly the file's rows (and gguf's
dequantization), every row is counted once by where it came from, a changed file is never served from a prefetch,
a failed prefetch only costs the read, and the switches (baselines, cache off, Config.prefetch=0) do nothing."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gds_gather as gg
from gds_gather import prefetch, rowcache

N_ROWS = 400
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def table(tmp_path_factory, ggufs):
    """(path, raw rows as the file holds them, gguf's dequantization of the table)."""
    return ggufs.table(tmp_path_factory.mktemp("pf") / "pf.gguf", N_ROWS, seed=5)


@pytest.fixture(autouse=True)
def fresh_caches():
    rowcache.drop_all()
    yield
    rowcache.drop_all()


def _sources(s: dict) -> int:
    """Rows read or served: a prefetched row counts where the prefetch read it (rows_prefetched is a part)."""
    return s["rows_from_cache"] + s["rows_from_page_cache"] + s["rows_from_device"]


steps = st.lists(st.tuples(st.sampled_from(["prefetch", "read", "gather", "unique"]),
                           st.lists(st.integers(0, N_ROWS - 1), max_size=120)), min_size=1, max_size=12)


@SETTINGS
@given(steps=steps, budget=st.sampled_from([0, 4_000, 40_000, 1 << 20]))
def test_any_prefetches_and_reads_return_the_files_rows(table, steps, budget):
    path, raw, ref = table
    rowcache.drop_all()
    asked = prefetched = 0      # unique rows the reads asked for; rows the prefetches started reading
    with gg.open_table(path, config=gg.Config(cache_bytes=budget, page_cache_reads=0, prefetch=1)) as t:
        for op, ids in steps:
            ids = np.array(ids, np.int64)
            if op == "prefetch":
                n = t.prefetch(ids, "direct")
                prefetched += n
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
        # each row a read asked for was taken from a prefetch or looked up in the cache (when there is one); the
        # sources exceed the asks by the rows prefetches read that no read took (yet)
        assert asked <= _sources(s) <= asked + prefetched
        has_cache = rowcache.capacity_for(budget, t.row_bytes) > 0
        assert s["cache_hits"] + s["cache_misses"] + s["rows_prefetched"] == (asked if has_cache else 0)


def test_prefetched_rows_are_taken_and_counted_once(table):
    path, raw, _ = table
    a, b = np.arange(0, 200, 2), np.arange(0, 400, 4)     # 50 rows in both
    with gg.open_table(path, config=gg.Config(cache_bytes=1 << 20, page_cache_reads=0, prefetch=1)) as t:
        assert t.prefetch(b, "direct") == b.size           # nothing cached yet: all of it
        assert t.prefetch(b, "direct") == 0                # already being read (or read): nothing new
        np.testing.assert_array_equal(t.read_rows(a, "direct"), raw[a])
        np.testing.assert_array_equal(t.read_rows(b, "direct"), raw[b])
        s = t.stats()
        shared = np.intersect1d(a, b).size
        assert shared == 50 and s["rows_prefetched"] == b.size    # a took its share of b from the prefetch
        assert s["rows_from_device"] == a.size - shared + b.size   # (the prefetch's reads are the device's)
        assert s["cache_hits"] == s["rows_from_cache"] == shared   # ... and b found that share in the cache
        assert _sources(s) == a.size + b.size
        np.testing.assert_array_equal(t.read_rows(b, "direct"), raw[b])   # again: now from the row cache
        assert t.stats()["rows_from_cache"] == shared + b.size and t.stats()["rows_prefetched"] == b.size


def test_a_read_covered_by_one_prefetch_takes_all_of_it(table):
    path, raw, _ = table
    b = np.array([390, 3, 77, 3, 150])
    with gg.open_table(path, config=gg.Config(cache_bytes=1 << 20, page_cache_reads=0, prefetch=1)) as t:
        assert t.prefetch(b, "direct") == 4
        np.testing.assert_array_equal(t.read_rows(b, "direct"), raw[b])
        s = t.stats()
        assert s["rows_prefetched"] == 4 and s["rows_from_device"] == 4 and _sources(s) == 4


def test_baselines_cache_off_and_the_switch_prefetch_nothing(table):
    path, raw, _ = table
    ids = np.arange(0, N_ROWS, 3)
    with gg.open_table(path, config=gg.Config(cache_bytes=1 << 20, prefetch=1)) as t:
        for b in ("pread", "mmap", "readahead", "resident"):
            assert t.prefetch(ids, b) == 0
    with gg.open_table(path, config=gg.Config(cache_bytes=0, prefetch=1)) as t:
        assert t.prefetch(ids, "direct") == 0
        np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
    with gg.open_table(path, config=gg.Config(cache_bytes=1 << 20)) as t:      # off by default
        assert gg.Config().prefetch == 0 and t.prefetch(ids, "direct") == 0
        assert t.stats()["rows_prefetched"] == 0
    assert gg.Config.from_env({"GDS_GATHER_PREFETCH": "1"}).prefetch == 1
    with pytest.raises(ValueError, match="GDS_GATHER_PREFETCH"):
        gg.Config(prefetch=2)


def test_bad_ids_and_a_closed_table_are_refused(table):
    path, _, _ = table
    t = gg.open_table(path, config=gg.Config(cache_bytes=1 << 20, prefetch=1))
    for bad in (np.array([0, N_ROWS]), np.array([-1, 3]), np.array([0.5, 1.0])):
        with pytest.raises(gg.BadIdsError):
            t.prefetch(bad, "direct")
    assert t.prefetch(np.zeros(0, np.int64), "direct") == 0      # opens the prefetch readers, reads nothing
    t.close()
    with pytest.raises(gg.TableClosedError):
        t.prefetch(np.arange(3), "direct")


def test_a_file_changed_after_a_prefetch_is_refused_not_served(tmp_path, ggufs):
    rows_a = ggufs.rows(Q.IQ4_NL, 50, 160, seed=1)
    path = ggufs.write(tmp_path / "c.gguf", rows_a, Q.IQ4_NL)
    ids = np.array([1, 2, 3])
    with gg.open_table(path, config=gg.Config(cache_bytes=1 << 20, page_cache_reads=0, prefetch=1)) as t:
        assert t.prefetch(ids, "direct") == 3
        t.stats()                                   # (collects the finished prefetch)
        st_ = os.stat(path)
        os.utime(path, ns=(st_.st_atime_ns, st_.st_mtime_ns + 10**9))
        with pytest.raises(gg.ReadError, match="modified"):
            t.read_rows(ids, "direct")              # every row is prefetched: refused all the same


def test_a_failed_prefetch_costs_only_the_read(table, monkeypatch, caplog):
    path, raw, _ = table
    ids = np.arange(10, 60)

    def broken(self, reader, rows):
        raise gg.ReadError("injected: I/O error")
    monkeypatch.setattr(prefetch.Prefetcher, "_read", broken)
    with gg.open_table(path, config=gg.Config(cache_bytes=1 << 20, page_cache_reads=0, prefetch=1)) as t:
        assert t.prefetch(ids, "direct") == ids.size
        np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
        s = t.stats()
        assert s["rows_prefetched"] == 0 and s["rows_from_device"] == ids.size
    assert "a prefetch failed" in caplog.text and "injected" in caplog.text


def test_close_waits_for_prefetches_in_flight(table):
    path, _, _ = table
    def threads():
        return [th for th in threading.enumerate() if th.name.startswith("gds-gather-prefetch")]
    before = len(threads())
    t = gg.open_table(path, config=gg.Config(cache_bytes=1 << 20, page_cache_reads=0, prefetch=1))
    t.prefetch(np.arange(0, N_ROWS, 2), "direct")
    assert len(threads()) == before + prefetch.DEPTH
    t.close()
    assert len(threads()) == before


def test_the_cpu_prefill_with_prefetch_gives_the_same_rows(tmp_path):
    """CpuPrefill hands each next ubatch to prefetch (Config.prefetch=1): the per-layer rows equal those of the
    prefill without it, and its reads are taken from the prefetches."""
    from gds_gather.model import write_model
    from gds_gather.pipeline import CpuPrefill
    from gds_gather.prefill import RowMapper
    path = write_model(tmp_path / "q.gguf", "qwen4exp", rows=20000, progress=False)
    tokens = np.random.default_rng(3).integers(0, 5000, 700)
    outs = {}
    for on in (0, 1):
        rowcache.drop_all()
        with gg.open_table(path, config=gg.Config(cache_bytes=1 << 22, page_cache_reads=0, prefetch=on)) as t:
            res = CpuPrefill(t, RowMapper(t), backend="direct", ubatch=128, trunk="none").run(tokens, collect=True)
            outs[on] = np.concatenate([o[0].numpy() for o in res["outputs"]])
            s = t.stats()
            assert (s["rows_prefetched"] > 0) == bool(on)
            assert res["bytes_read"] == s["bytes_requested"] > 0
    np.testing.assert_array_equal(outs[0], outs[1])
