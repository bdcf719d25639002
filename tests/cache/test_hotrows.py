"""Hot rows across processes (hotrows.py): a new process starts with the rows the last one cached, never a stale or
corrupt one. The oracle is gguf's dequantization of the table file as it is now."""
from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gds_gather as gg
from gds_gather.cache import hotrows
from gds_gather.io import measure
from gds_gather.cache import rowcache
from gds_gather.config import Config
from gds_gather.formats.quants import GGMLQuantizationType as Q

pytestmark = pytest.mark.hot_rows
N_ROWS, WIDTH = 4000, 64
G = {}      # the conftest helpers (ggufs fixture), for the module-level functions below


@pytest.fixture
def table(tmp_path, ggufs):
    G.update(write=ggufs.write, rows=ggufs.rows, reference=ggufs.reference)
    path = ggufs.write(tmp_path / "t.gguf", ggufs.rows(Q.Q8_0, N_ROWS, WIDTH), Q.Q8_0)
    return path, Config.from_env(hot_rows=1, cache_dir=tmp_path / "cache", cache_bytes=64 << 10)


def reference(path):
    return G["reference"](path)


def _run(path, cfg, ids):
    """gather in a fresh row-cache state of this process, as a new process would start, the file evicted (rows
    the page cache held are not admitted to the row cache): (rows, hot rows loaded)."""
    rowcache.drop_all()
    measure.evict_file(path)
    with gg.open_table(path, config=cfg) as t:
        x = t.gather(ids, backend="direct")
        loaded = t.stats()["hot_rows_loaded"]
    return x, loaded


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=st.lists(st.integers(0, N_ROWS - 1), min_size=1, max_size=600),
       second=st.lists(st.integers(0, N_ROWS - 1), min_size=1, max_size=600))
def test_saved_rows_serve_a_new_start_exactly(table, first, second):
    path, cfg = table
    ref = reference(path)
    x, _ = _run(path, cfg, np.array(first))
    assert np.array_equal(x, ref[first])
    x, loaded = _run(path, cfg, np.array(second))          # the first run's rows come back from the hot file
    assert loaded > 0 and np.array_equal(x, ref[second])
    hotrows.path_for(hotrows.Target.of(gg.open_table(path, config=cfg))).unlink()


def test_a_new_process_finds_the_last_runs_rows(table):
    path, cfg = table
    code = ("import sys, numpy as np, gds_gather as gg; from gds_gather.io import measure; "
            "from gds_gather.config import Config; "
            f"cfg = Config.from_env(hot_rows=1, cache_dir={str(cfg.cache_dir)!r}, cache_bytes={cfg.cache_bytes}); "
            f"measure.evict_file({str(path)!r}); t = gg.open_table({str(path)!r}, config=cfg); "
            "x = t.gather(np.arange(0, 4000, 7), backend='direct'); "
            "s = t.stats(); print(s['hot_rows_loaded'], s['rows_from_cache']); np.save(sys.argv[1], x); t.close()")
    env = {**os.environ, "GDS_GATHER_HOT_ROWS": "1"}
    outs = []
    for k in range(2):
        r = subprocess.run([sys.executable, "-P", "-c", code, str(path.parent / f"x{k}.npy")], capture_output=True,
                           text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        outs.append([int(v) for v in r.stdout.split()])
    assert outs[0] == [0, 0] and outs[1][0] > 0 and outs[1][1] > 0          # the restart hit saved rows
    ref = reference(path)[np.arange(0, 4000, 7)]
    for k in range(2):
        assert np.array_equal(np.load(path.parent / f"x{k}.npy"), ref)


def _rewrite(path, seed, keep_mtime):
    st0 = os.stat(path)
    G["write"](path, G["rows"](Q.Q8_0, N_ROWS, WIDTH, seed=seed), Q.Q8_0)
    if keep_mtime:                  # same size and mtime: only the sampled rows can tell
        os.utime(path, ns=(st0.st_atime_ns, st0.st_mtime_ns))


@pytest.mark.parametrize("keep_mtime", [False, True])
def test_a_changed_table_is_never_served_stale(table, caplog, keep_mtime):
    path, cfg = table
    ids = np.arange(0, N_ROWS, 3)
    _run(path, cfg, ids)
    _rewrite(path, seed=5, keep_mtime=keep_mtime)
    with caplog.at_level(logging.WARNING, "gds_gather.cache.hotrows"):
        x, loaded = _run(path, cfg, ids)
    assert loaded == 0 and np.array_equal(x, reference(path)[ids])
    assert "ignored" in caplog.text


@pytest.mark.parametrize("damage", ["truncate", "flip", "header", "empty"])
def test_a_corrupt_hot_file_is_ignored_with_a_warning(table, caplog, damage):
    path, cfg = table
    ids = np.arange(0, N_ROWS, 5)
    _run(path, cfg, ids)
    with gg.open_table(path, config=cfg) as t:
        hot = hotrows.path_for(hotrows.Target.of(t))
    data = bytearray(hot.read_bytes())
    if damage == "truncate":
        data = data[:len(data) - 100]
    elif damage == "flip":
        data[-7] ^= 0x40
    elif damage == "header":
        data[:8] = b"NOTAHOTF"
    else:
        data = b""
    hot.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, "gds_gather.cache.hotrows"):
        x, loaded = _run(path, cfg, ids)
    assert loaded == 0 and np.array_equal(x, reference(path)[ids]) and "ignored" in caplog.text


def test_two_writers_at_once_leave_a_valid_file(table):
    path, cfg = table
    code = ("import numpy as np, gds_gather as gg; from gds_gather.io import measure; "
            "from gds_gather.cache import rowcache; "
            "from gds_gather.config import Config; "
            f"cfg = Config.from_env(hot_rows=1, cache_dir={str(cfg.cache_dir)!r}, cache_bytes=65536)\n"
            "for k in range(20):\n"
            "    rowcache.drop_all(); measure.evict_file(%r)\n" % str(path) +
            f"    t = gg.open_table({str(path)!r}, config=cfg)\n"
            "    t.gather(np.random.default_rng(k).integers(0, 4000, 300), backend='direct'); t.close()\n")
    procs = [subprocess.Popen([sys.executable, "-P", "-c", code]) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    with gg.open_table(path, config=cfg) as t:
        got = hotrows.load(hotrows.Target.of(t), 10 ** 6)
    assert got is not None
    ids, _, rows = got
    raw = np.fromfile(path, np.uint8)
    with gg.open_table(path, config=cfg) as t:
        want = raw[t.data_offset:t.data_offset + t.n_bytes].reshape(t.n_rows, t.row_bytes)[ids]
    assert np.array_equal(rows, want)


def test_no_page_cache_leaves_the_hot_file_out_of_the_page_cache(table):
    path, cfg = table
    cfg = cfg.with_(page_cache_reads=0)
    _run(path, cfg, np.arange(0, N_ROWS, 2))
    with gg.open_table(path, config=cfg) as t:
        hot = hotrows.path_for(hotrows.Target.of(t))
    assert hot.stat().st_size > 0 and measure.resident_bytes(hot) == 0
    _, loaded = _run(path, cfg, np.arange(10))
    assert loaded > 0 and measure.resident_bytes(hot) == 0


def test_off_writes_nothing(table):
    path, cfg = table
    _run(path, cfg.with_(hot_rows=0), np.arange(100))
    assert not (cfg.cache_dir / "hot").exists()


def test_the_hot_file_is_written_only_when_the_cache_changed(table):
    """Table.stats()'s hot_rows_changed (what `prefill` prints): a run whose rows all come from the hot file has
    nothing to write back; one that admits rows does."""
    path, cfg = table
    cfg = dataclasses.replace(cfg, page_cache_reads=0)     # (this small file's head stays cached: its metadata map)
    ids = np.arange(0, 400, 3)
    x, _ = _run(path, cfg, ids)
    rowcache.drop_all()                                       # written at the cache's end (as at exit)
    target = hotrows.path_for(hotrows.Target.of(gg.open_table(path, config=cfg)))
    rowcache.save_hot()
    for again, changed in ((ids, False), (np.arange(1, 400, 3), True)):
        rowcache.drop_all()
        measure.evict_file(path)
        mtime = target.stat().st_mtime_ns
        with gg.open_table(path, config=cfg) as t:
            got = t.gather(again, backend="direct")
            s = t.stats()
        assert s["hot_rows_loaded"] > 0 and s["hot_rows_changed"] is changed
        assert np.array_equal(got, reference(path)[again])
        rowcache.save_hot()
        assert (target.stat().st_mtime_ns != mtime) is changed
    target.unlink()
