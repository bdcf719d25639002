"""Rows taken from an O_DIRECT read's windows (readers.rows_in_staging, prefetch.py's staged rows and riders): a
narrow row that shares a 4 KiB window with the rows a read asked for costs the next batch no request. Exactly the
rows whose every byte the last read's O_DIRECT windows delivered are offered, with the file's bytes; nothing after a
failed read, a read served by the page cache, or a close; the next batch's reads return the file's rows."""
from __future__ import annotations

import errno

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gds_gather as gg
from gds_gather.io import measure
from gds_gather.io import native
from gds_gather.cache import prefetch
from gds_gather.io import uring

N_ROWS = 2000            # IQ4_NL width 160: 90 B rows, ~45 to a 4 KiB page, some straddling two


@pytest.fixture(scope="module")
def table(tmp_path_factory, ggufs):
    """(path, the file's raw rows as gguf's reader sees them)."""
    path, raw, _ = ggufs.table(tmp_path_factory.mktemp("staged") / "s.gguf", N_ROWS, seed=9)
    return path, raw


pytestmark = pytest.mark.usefixtures("fresh_row_caches")


def _cfg(**kw):
    return gg.Config(page_cache_reads=0, hot_rows=0, **{"cache_bytes": 1 << 20, **kw})


def _delivered(t, plan) -> np.ndarray:
    """bool [n_rows]: rows every byte of which lies in the plan's windows (a byte map of the file: independent of
    how the reader looks rows up)."""
    have = np.zeros(t.data_offset + t.n_bytes + 8192, bool)
    for o, n in zip(plan.win_offsets.tolist(), plan.win_lengths.tolist()):
        have[o:o + n] = True
    starts = t.data_offset + np.arange(t.n_rows) * t.row_bytes
    return np.array([have[s:s + t.row_bytes].all() for s in starts.tolist()])


def _taken(reader, rows, row_bytes):
    got = {}

    def take(pos, at):
        assert not got, "one call"
        got["pos"], got["rows"] = pos.copy(), at.array().copy()
    n = reader.rows_in_staging(np.asarray(rows, np.int64), row_bytes, take)
    pos = got.get("pos", np.zeros(0, np.int64))
    assert n == pos.shape[0]
    return pos, got.get("rows", np.zeros((0, row_bytes), np.uint8))


row_sets = st.lists(st.integers(0, N_ROWS - 1), min_size=1, max_size=150).map(lambda x: np.unique(x))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(read=row_sets, ask=row_sets, max_gap=st.sampled_from([0, 4096, 20000]),
       engine=st.sampled_from(["uring", "threads"]))
def test_exactly_the_rows_the_windows_hold_are_offered_with_the_files_bytes(table, read, ask, max_gap, engine):
    path, raw = table
    if (engine == "uring" and not uring.probe()[0]) or (engine == "threads" and native.library()[0] is None):
        return
    with gg.open_table(path, config=_cfg(max_gap=max_gap, max_waste=1e9, cache_bytes=0, engine=engine)) as t:
        r = t.open_reader("direct")
        if not r.odirect:
            pytest.skip("O_DIRECT refused here")
        plan = t.plan(read)
        np.testing.assert_array_equal(r.read(plan), raw[read])
        pos, rows = _taken(r, ask, t.row_bytes)
        np.testing.assert_array_equal(ask[pos], ask[_delivered(t, plan)[ask]])
        np.testing.assert_array_equal(rows, raw[ask[pos]])
        assert np.isin(read, ask[pos]).sum() == np.isin(read, ask).sum()     # the read's own rows among them


def test_rows_straddling_a_windows_edge_are_not_offered(table):
    """One row in every other 4 KiB page read: every window edge has a row across it (90 B rows), offered by none."""
    path, raw = table
    with gg.open_table(path, config=_cfg(cache_bytes=0)) as t:
        r = t.open_reader("direct")
        if not r.odirect:
            pytest.skip("O_DIRECT refused here")
        start = t.data_offset + np.arange(t.n_rows) * t.row_bytes
        page = start // 4096
        whole = page == (start + t.row_bytes - 1) // 4096
        read = np.flatnonzero(whole & (page % 2 == 0) & np.r_[True, page[1:] != page[:-1]])
        plan = t.plan(read)
        r.read(plan)
        ask = np.arange(t.n_rows)
        pos, rows = _taken(r, ask, t.row_bytes)
        straddling = ~whole & (page % 2 == 0)
        assert straddling.sum() > 5 and not np.isin(ask[straddling], ask[pos]).any()
        np.testing.assert_array_equal(pos, np.flatnonzero(_delivered(t, plan)))
        np.testing.assert_array_equal(rows, raw[pos])


@pytest.mark.skipif(not uring.probe()[0], reason="io_uring unavailable here")
def test_nothing_is_offered_after_a_failed_read_a_page_cache_read_or_a_close(table):
    path, raw = table
    near = np.arange(0, 40)
    with gg.open_table(path, config=_cfg(cache_bytes=0, engine="uring")) as t:
        r = t.open_reader("direct")
        r.read(t.plan([5]))
        assert _taken(r, near, t.row_bytes)[0].shape[0] > 10
        r.inject = lambda res, idx: np.where(idx == idx.max(), -errno.EIO, res)
        with pytest.raises(gg.ReadError):
            r.read(t.plan([5, 1500]))          # the window of row 5 came in, another failed: offer nothing
        r.inject = None
        assert _taken(r, near, t.row_bytes)[0].shape[0] == 0
        r.read(t.plan([5]))
        r.close()
        assert _taken(r, near, t.row_bytes)[0].shape[0] == 0
    measure.evict_file(path)
    with gg.open_table(path, config=gg.Config(cache_bytes=0, hot_rows=0, engine="uring")) as t:
        r = t.open_reader("direct")
        r.read(t.plan([5]))
        assert _taken(r, near, t.row_bytes)[0].shape[0] > 10
        r.resident = lambda rows, rb: np.ones(rows.shape[0], bool)     # as if the page cache held every row
        np.testing.assert_array_equal(r.read(t.plan([6])), raw[[6]])
        assert r.last_from_page_cache.all()
        assert _taken(r, near, t.row_bytes)[0].shape[0] == 0


pf = pytest.mark.skipif(not uring.probe()[0], reason="io_uring unavailable here: prefetch does nothing")


@pf
def test_a_noted_batch_takes_the_rows_the_last_reads_windows_hold(table):
    path, raw = table
    a, far = np.array([0, 100]), np.array([1500, 1900])
    b = np.concatenate([np.arange(1, 30), np.arange(90, 110), far])
    with gg.open_table(path, config=_cfg()) as t:
        np.testing.assert_array_equal(t.read_rows(a, "direct"), raw[a])
        held = _delivered(t, t.plan(a))
        inside = np.setdiff1d(b[held[b]], a)
        assert inside.shape[0] > 30
        assert t.prefetch(b, "direct") == b.shape[0] - inside.shape[0] - np.isin(b, a).sum()
        assert t.stats()["rows_prefetched"] == inside.shape[0]
        device = t.stats()["rows_from_device"]
        np.testing.assert_array_equal(t.read_rows(b, "direct"), raw[b])
        s = t.stats()
        assert s["rows_from_device"] == device + far.shape[0]       # only the far rows came from the device
        assert s["cache_hits"] == inside.shape[0] + np.isin(b, a).sum()


@pf
def test_a_batch_too_wide_to_read_ahead_rides_along_the_current_read(table, monkeypatch):
    path, raw = table
    monkeypatch.setattr(prefetch, "MAX_WINDOWS", 4)
    a = np.array([300, 1000])
    c = np.concatenate([np.arange(290, 320), np.arange(1000, 1010), [1700, 1800, 1990]])
    with gg.open_table(path, config=_cfg()) as t:
        held = _delivered(t, t.plan(a))
        riders = np.setdiff1d(c[held[c]], a)
        assert t.prefetch(c, "direct") == 0             # too wide: nothing is read ahead
        np.testing.assert_array_equal(t.read_rows(a, "direct"), raw[a])
        s = t.stats()
        assert s["rows_prefetched"] == riders.shape[0] > 20
        np.testing.assert_array_equal(t.read_rows(c, "direct"), raw[c])
        s2 = t.stats()
        assert s2["rows_from_device"] - s["rows_from_device"] == c.shape[0] - riders.shape[0] - np.isin(c, a).sum()


@pf
def test_staged_rows_respect_the_budget_and_stay_exact_when_the_cache_is_full(table):
    path, raw = table
    budget = 40 * 90 + 4096                             # a few dozen rows (the index takes its share)
    with gg.open_table(path, config=_cfg(cache_bytes=budget)) as t:
        rng = np.random.default_rng(3)
        batches = [np.unique(rng.integers(0, N_ROWS, 300)) for _ in range(6)]
        for i, ids in enumerate(batches):
            if i + 1 < len(batches):
                t.prefetch(batches[i + 1], "direct")
            np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
        assert t.stats()["cache_bytes"] <= budget
