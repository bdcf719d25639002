"""The cached source (gds_gather/cache/source.py): one look-up / read / admit / count for host and device storage.

Host storage returns the batch's rows; device storage returns pool offsets, fresh rows and admissions, which
tests/gpu/test_devcache.emulate plays as the device would. Both are checked against the file's bytes, and against each
other: with page-cache reads off, the same batches make the same hits, misses and admissions in either storage.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gds_gather as gg
from gds_gather.gpu import devcache
from gds_gather.gpu.cuda import CudaAccel
from gds_gather.io import direct, readers
from gds_gather.cache import source
from gds_gather.cache.store import RowCache

from ..gpu.test_devcache import emulate

N_ROWS = 400
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
CFG = gg.Config(page_cache_reads=0, cache_bytes=0)      # (the tests' own caches, not the process-wide one)


@pytest.fixture(scope="module")
def table(tmp_path_factory, ggufs):
    path = ggufs.write(tmp_path_factory.mktemp("src") / "src.gguf", ggufs.rows(Q.Q5_K, N_ROWS, 512, seed=9), Q.Q5_K)
    with gg.open_table(path) as t:
        raw = np.fromfile(path, np.uint8, t.n_bytes, offset=t.data_offset).reshape(N_ROWS, t.row_bytes)
    return path, raw


class PlainReader:
    """A RowReader that declares no overlap (read returns every row at once): exact rows by pread, each counted as
    from the device."""
    name = "plain"
    how = "pread per row (test)"
    tells_source = True
    overlaps_io = False
    staging = None
    odirect = False
    last_from_page_cache = None
    admit_page_cache = False
    rows_from_page_cache = 0

    def __init__(self, t):
        self.t, self.bytes_read, self.calls = t, 0, 0

    def check_file(self):
        readers.check_file(self.t.path, self.t.file_id)

    def read(self, plan):
        self.calls += 1
        with open(self.t.path, "rb") as f:
            out = np.empty((plan.n_unique, plan.row_bytes), np.uint8)
            for i, off in enumerate(plan.row_offsets.tolist()):
                f.seek(off)
                out[i] = np.frombuffer(f.read(plan.row_bytes), np.uint8)
        self.bytes_read += out.nbytes
        return out

    def close(self):
        pass


def _io():
    return {k: 0 for k in ("rows_from_cache", "rows_from_page_cache", "rows_from_device", "rows_buffered",
                           "cache_hits", "cache_misses", "rows_prefetched")}


@SETTINGS
@given(batches=st.lists(st.lists(st.integers(0, N_ROWS - 1), min_size=1, max_size=120), min_size=1, max_size=10),
       budget=st.sampled_from([20_000, 60_000, 1 << 20]), engine=st.sampled_from(["direct", "plain"]))
def test_host_and_device_storage_make_the_same_decisions(table, batches, budget, engine):
    path, raw = table
    with gg.open_table(path, config=CFG) as t:
        rb = t.row_bytes
        host = RowCache(row_bytes=rb, budget=budget, max_rows=N_ROWS)
        dc = devcache.DeviceRowCache(RowCache(row_bytes=rb, budget=budget, store=False, max_rows=N_ROWS), 0,
                                     CudaAccel())
        assert host.capacity == dc.index.capacity
        n_max = max(len(b) for b in batches)
        fresh = np.zeros(-(-n_max * rb // 8) * 8, np.uint8)
        pool = np.zeros(dc.fresh_base + fresh.size, np.uint8)
        rh = (t.region.open(direct.DirectReader, t.config) if engine == "direct" else PlainReader(t))
        rd = (t.region.open(direct.DirectReader, t.config) if engine == "direct" else PlainReader(t))
        io_h, io_d = _io(), _io()
        try:
            for b in batches:
                plan = t.plan(np.array(b))
                rows = source.through(t, rh, plan, source.HostRows(host), io=io_h)
                np.testing.assert_array_equal(rows, raw[plan.unique_rows])
                got = source.through(t, rd, plan, source.DeviceRows(dc, fresh=fresh), io=io_d)
                np.testing.assert_array_equal(emulate(pool, got, fresh, dc.fresh_base, rb), raw[plan.unique_rows])
                assert io_h == io_d                                 # same hits, misses and sources, batch by batch
                np.testing.assert_array_equal(host.slot_row, dc.index.slot_row)    # same admissions and evictions
                used = host.slot_row[:host.n_used]
                np.testing.assert_array_equal(host.data[:host.n_used], raw[used])  # host bytes are the rows'
        finally:
            rh.close()
            rd.close()
        assert io_h["cache_hits"] + io_h["cache_misses"] == sum(len(set(b)) for b in batches)


def test_a_reader_without_overlap_gets_the_hits_copied_after_its_read(table):
    """PlainReader declares overlaps_io=False: the misses are read in one call and placed beside the hits, which
    are copied from the cache (no second read of a hit)."""
    path, raw = table
    with gg.open_table(path, config=CFG) as t:
        cache = RowCache(row_bytes=t.row_bytes, budget=1 << 20, max_rows=N_ROWS)
        r = PlainReader(t)
        io = _io()
        first = t.plan(np.array([5, 9, 300]))
        np.testing.assert_array_equal(source.through(t, r, first, source.HostRows(cache), io=io), raw[[5, 9, 300]])
        mixed = t.plan(np.array([300, 1, 9, 399, 5]))
        calls, nbytes = r.calls, r.bytes_read
        got = source.through(t, r, mixed, source.HostRows(cache), io=io)
        np.testing.assert_array_equal(got, raw[mixed.unique_rows])
        assert r.calls == calls + 1 and r.bytes_read - nbytes == 2 * t.row_bytes   # only rows 1 and 399 read
        assert io["cache_hits"] == 3 and io["rows_from_cache"] == 3 and io["rows_from_device"] == 5
        rows = np.array([1, 5, 399])
        np.testing.assert_array_equal(source.through(t, r, None, source.HostRows(cache), rows=rows, io=io),
                                      raw[rows])        # unplanned rows: all hits, no plan made, no read
        assert r.calls == calls + 1 and io["cache_hits"] == 6
