"""The device-resident row cache of the GPU prefill (gds_gather/gpu/devcache.py), on the CPU.

The host half (`source.through` with `source.DeviceRows`: lookup, reads of the misses, admissions) is the code the GPU
prefill runs; the device half is played by `emulate` (below) on a numpy pool, in stream order and one ubatch behind
the host as the double-buffered prefill runs it. Every ubatch's rows must be the file's bytes, for any batches,
budgets and both destinations (copy: misses packed in a host buffer; gds: misses' windows read into the slot's
region). The copy kernels' source is built and run as host C++ and compiled for sm_90 and two AMD targets.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import gds_gather as gg
from gds_gather.gpu import devcache
from gds_gather.gpu.cuda import CudaAccel
from gds_gather.cache import rowcache
from gds_gather.cache import source
from gds_gather.gpu.kernel_sources import write_sources
from gds_gather.io.direct import DirectReader
from gds_gather.cache.store import RowCache

N_ROWS = 300
CUDA = CudaAccel()      # the device caches made here never allocate a pool: the CUDA accel is never called
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
CFG = gg.Config(page_cache_reads=0)


def stage(dc, table, reader, plan, *, fresh=None, region=None) -> source.Staged:
    """One batch through the device-storage cached source (what a cached destination's stage runs)."""
    return source.through(table, reader, plan, source.DeviceRows(dc, fresh=fresh, region=region))


def emulate(pool: np.ndarray, st: source.Staged, fresh: np.ndarray | None, fresh_base: int,
            row_bytes: int) -> np.ndarray:
    """What the device step does with `st`, in numpy (tests): copy the fresh words up, gather every unique row
    through the offsets, then copy the admitted rows into their slots. Returns uint8 [U, row_bytes]."""
    if st.fresh_words:
        nb = 8 * st.fresh_words
        pool[fresh_base:fresh_base + nb] = fresh[:nb]
    rows = pool[st.offsets[:, None] + np.arange(row_bytes)]
    if st.adm_src.shape[0]:
        pool[st.adm_dst[:, None] + np.arange(row_bytes)] = pool[st.adm_src[:, None] + np.arange(row_bytes)]
    return rows



@pytest.fixture(scope="module", params=[(Q.IQ4_NL, 160), (Q.Q5_K, 512)], ids=["iq4nl-90B", "q5k-352B"])
def table(tmp_path_factory, ggufs, request):
    qt, width = request.param
    path = ggufs.write(tmp_path_factory.mktemp("dc") / "dc.gguf", ggufs.rows(qt, N_ROWS, width, seed=5), qt)
    with gg.open_table(path) as t:
        raw = np.fromfile(path, np.uint8, t.n_bytes, offset=t.data_offset).reshape(N_ROWS, t.row_bytes)
    return path, raw


class FakeGds:
    """cuFile's stand-in: reads a plan's O_DIRECT windows into the slot's region of the (numpy) pool."""

    tells_source = True      # as GdsReader: every row it delivers came from the file
    rows_from_page_cache = 0

    def __init__(self, direct: DirectReader, pool: np.ndarray, region: int):
        self.direct, self.pool, self.region = direct, pool, region

    def check_file(self):
        self.direct.check_file()

    def read_windows(self, plan):
        staging, offs = self.direct.fetch(plan)
        np.testing.assert_array_equal(offs, plan.row_staging)
        self.pool[self.region:self.region + plan.window_bytes] = staging[:plan.window_bytes]


def test_the_gds_stand_in_has_only_what_gdsreader_has():
    from gds_gather.gpu.device import GdsReader
    mine = {n for n in vars(FakeGds) if not n.startswith("_")}
    assert mine <= set(dir(GdsReader)), mine - set(dir(GdsReader))


def run_batches(path, raw, batches, budget, mode, lag=1, fail_at=None):
    """Stage every batch on the host and play the device `lag` ubatches behind; returns the table's stats."""
    with gg.open_table(path, config=CFG.with_(cache_bytes=budget)) as t:
        index = RowCache(row_bytes=t.row_bytes, budget=budget, store=False, max_rows=N_ROWS)
        dc = devcache.DeviceRowCache(index, 0, CUDA)
        rb = t.row_bytes
        N = max([len(b) for b in batches] + [1])
        step = -(-(N + 2) * 2 * 4096 // 4096) * 4096           # a gds slot region (windows of up to N rows)
        fresh_n = -(-N * rb // 8) * 8
        pool = np.zeros(dc.fresh_base + max(2 * step, fresh_n), np.uint8)
        readers = [DirectReader(t.path, t.data_offset, t.n_bytes, config=t.config, file_id=t.file_id)
                   for _ in range(2)]
        fresh = [np.zeros(fresh_n, np.uint8) for _ in range(2)]
        if mode == "gds":
            readers = [FakeGds(r, pool, dc.fresh_base + s * step) for s, r in enumerate(readers)]
        queue = []
        try:
            for k, b in enumerate(batches):
                s = k % 2
                plan = t.plan(np.array(b, np.int64))
                got = stage(dc, t, readers[s], plan, fresh=fresh[s] if mode == "copy" else None,
                                     region=readers[s].region if mode == "gds" else None)
                assert got.offsets.shape[0] == plan.n_unique and got.hits + got.from_device == plan.n_unique
                assert ((got.adm_dst >= 0) & (got.adm_dst + rb <= dc.cache_bytes)).all()
                assert (got.adm_src >= dc.fresh_base).all()
                queue.append((plan, got, s))
                while len(queue) > lag:
                    _device(queue.pop(0), pool, fresh, dc, raw, rb)
                if fail_at is not None and k == fail_at:
                    raise RuntimeError("injected")
                assert dc.index.nbytes <= budget
            while queue:
                _device(queue.pop(0), pool, fresh, dc, raw, rb)
        except RuntimeError:
            dc.clear()                      # what GpuPrefill.run does on any error: the queue is never played
            queue.clear()
            for k, b in enumerate(batches):      # the cache still serves exact rows afterwards
                plan = t.plan(np.array(b, np.int64))
                got = stage(dc, t, readers[k % 2], plan, fresh=fresh[k % 2] if mode == "copy" else None,
                                     region=readers[k % 2].region if mode == "gds" else None)
                _device((plan, got, k % 2), pool, fresh, dc, raw, rb)
        finally:
            for r in readers:
                (r.direct if mode == "gds" else r).close()
        return t.stats(), dc


def _device(item, pool, fresh, dc, raw, rb):
    plan, got, s = item
    rows = emulate(pool, got, fresh[s], dc.fresh_base, rb)
    np.testing.assert_array_equal(rows, raw[plan.unique_rows])
    used = dc.index.slot_row[:dc.index.n_used]
    assert np.unique(used).size == used.size


batches = st.lists(st.lists(st.integers(0, N_ROWS - 1), max_size=120), min_size=1, max_size=12)


@settings(SETTINGS, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much])
@given(batches=batches, budget=st.integers(0, 60_000), mode=st.sampled_from(["copy", "gds"]),
       lag=st.integers(0, 1))
def test_any_batches_give_the_files_rows_within_budget(table, batches, budget, mode, lag):
    path, raw = table
    assume(rowcache.capacity_for(budget, raw.shape[1]) > 0)      # else acquire() gives no cache at all
    stats, dc = run_batches(path, raw, batches, budget, mode, lag)
    seen = sum(np.unique(np.array(b, np.int64)).size for b in batches)
    assert stats["cache_hits"] + stats["cache_misses"] == seen
    assert stats["rows_from_cache"] + stats["rows_from_device"] + stats["rows_from_page_cache"] == seen
    assert dc.index.nbytes <= budget


def test_repeats_are_hits_and_an_error_clears_the_index(table):
    path, raw = table
    rng = np.random.default_rng(1)
    zipf = [np.minimum(rng.zipf(1.3, 100) - 1, N_ROWS - 1) for _ in range(8)]
    for mode in ("copy", "gds"):
        stats, dc = run_batches(path, raw, zipf, 1 << 20, mode)
        assert stats["cache_hits"] > 0.5 * stats["cache_misses"] > 0
        stats, dc = run_batches(path, raw, zipf, 1 << 20, mode, fail_at=4)
        assert dc.index.n_used > 0


def test_the_emulated_device_catches_a_missed_admission(table):
    """The oracle can fail: a step whose admissions the device skips leaves slots the index trusts unwritten."""
    path, raw = table
    ids = np.arange(40)
    with gg.open_table(path, config=CFG.with_(cache_bytes=1 << 20)) as t, \
            DirectReader(t.path, t.data_offset, t.n_bytes, config=t.config, file_id=t.file_id) as r:
        dc = devcache.DeviceRowCache(RowCache(row_bytes=t.row_bytes, budget=1 << 20, store=False), 0, CUDA)
        pool = np.zeros(dc.fresh_base + 64 * t.row_bytes, np.uint8)
        fresh = np.zeros(64 * t.row_bytes, np.uint8)
        first = stage(dc, t, r, t.plan(ids), fresh=fresh)
        assert first.adm_src.shape[0] == 40 and first.fresh_words == -(-40 * t.row_bytes // 8)
        first.adm_src = first.adm_src[:0]               # the device "forgets" the admissions
        first.adm_dst = first.adm_dst[:0]
        emulate(pool, first, fresh, dc.fresh_base, t.row_bytes)
        again = stage(dc, t, r, t.plan(ids), fresh=fresh)
        assert again.hits == 40 and again.fresh_words == 0
        rows = emulate(pool, again, fresh, dc.fresh_base, t.row_bytes)
        assert not np.array_equal(rows, raw[ids])


def test_all_hits_still_refuse_a_changed_file(tmp_path, ggufs):
    path = ggufs.write(tmp_path / "c.gguf", ggufs.rows(Q.IQ4_NL, 50, 160, seed=1), Q.IQ4_NL)
    with gg.open_table(path, config=CFG.with_(cache_bytes=1 << 20)) as t, \
            DirectReader(t.path, t.data_offset, t.n_bytes, config=t.config, file_id=t.file_id) as r:
        dc = devcache.DeviceRowCache(RowCache(row_bytes=t.row_bytes, budget=1 << 20, store=False), 0, CUDA)
        fresh = np.zeros(50 * t.row_bytes + 8, np.uint8)
        stage(dc, t, r, t.plan(np.arange(5)), fresh=fresh)
        st_ = os.stat(path)
        os.utime(path, ns=(st_.st_atime_ns, st_.st_mtime_ns + 10**9))
        with pytest.raises(gg.ReadError, match="modified"):
            stage(dc, t, r, t.plan(np.arange(5)), fresh=fresh)     # every row a hit: refused anyway


def test_acquire_lends_one_cache_per_file_and_device(table):
    path, _ = table
    devcache.drop_all()
    with gg.open_table(path, config=gg.Config(cache_bytes=1 << 20)) as t:
        a = devcache.acquire(t, 0, CUDA)
        b = devcache.acquire(t, 0, CUDA)           # while `a` is lent: a private cache
        assert a is not b and a.in_use and b.in_use and b.key is None
        devcache.release(a)
        devcache.release(b)
        assert devcache.acquire(t, 0, CUDA) is a   # the next prefill finds a's rows
        c = devcache.acquire(t, 1, CUDA)
        assert c is not a                          # another device: its own
        devcache.release(a)
        devcache.release(c)
        devcache.discard(a)                        # left queued work: never lent again
        assert devcache.acquire(t, 0, CUDA) is not a
        assert a.index.budget == 1 << 20 and a.cache_bytes == a.index.capacity * t.row_bytes
    with gg.open_table(path, config=gg.Config(cache_bytes=0)) as t:
        assert devcache.acquire(t, 0, CUDA) is None
    devcache.drop_all()


def test_acquire_drops_stale_and_least_recently_used_caches(table):
    """A cache of the same path under an older file identity is dropped when the new identity's is made; beyond
    MAX_POOLS idle caches the least recently used goes: asked again, each is a new, empty one."""
    path, _ = table
    devcache.drop_all()
    with gg.open_table(path, config=gg.Config(cache_bytes=1 << 20)) as old:
        a = devcache.acquire(old, 0, CUDA)
        devcache.release(a)
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        with gg.open_table(path, config=gg.Config(cache_bytes=1 << 20)) as t:
            b = devcache.acquire(t, 0, CUDA)
            devcache.release(b)
            assert devcache.acquire(old, 0, CUDA) is not a  # a's pool was dropped as stale
            devcache.drop_all()
            first = devcache.acquire(t, 0, CUDA)
            devcache.release(first)
            later = []
            for dev in range(1, devcache.MAX_POOLS + 1):
                later.append(devcache.acquire(t, dev, CUDA))
                devcache.release(later[-1])
            assert devcache.acquire(t, devcache.MAX_POOLS, CUDA) is later[-1]    # kept
            devcache.release(later[-1])
            assert devcache.acquire(t, 0, CUDA) is not first               # the oldest idle one went
    devcache.drop_all()


# -- kernels/copy.cu ------------------------------------------------------------------------------------------

HOST_SHIM = """
struct GGDim { unsigned x, y, z; };
static GGDim blockIdx, threadIdx, blockDim, gridDim;
#define __global__
#include "copy.cu"
extern "C" void run_words(const unsigned long long* s, unsigned long long* d, const long long* c, unsigned g,
                          unsigned b) {
    gridDim = {g, 1, 1}; blockDim = {b, 1, 1};
    for (unsigned i = 0; i < g; ++i) for (unsigned j = 0; j < b; ++j) {
        blockIdx = {i, 0, 0}; threadIdx = {j, 0, 0}; gg_copy_words(s, d, c); }
}
extern "C" void run_rows(unsigned char* p, const long long* s, const long long* d, const long long* c, long long rb,
                         unsigned g, unsigned b) {
    gridDim = {g, 1, 1}; blockDim = {b, 1, 1};
    for (unsigned i = 0; i < g; ++i) for (unsigned j = 0; j < b; ++j) {
        blockIdx = {i, 0, 0}; threadIdx = {j, 0, 0}; gg_copy_rows(p, s, d, c, rb); }
}
"""


def test_copy_kernels_as_host_code(tmp_path):
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler: the host build of kernels/copy.cu cannot be checked")
    write_sources(tmp_path, ("copy.cu",))
    (tmp_path / "shim.cpp").write_text(HOST_SHIM, encoding="utf-8")
    lib = tmp_path / "libcopy.so"
    subprocess.run([cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "shim.cpp")],
                   check=True, cwd=tmp_path)
    so = ctypes.CDLL(str(lib))
    P = ctypes.c_void_p
    rng = np.random.default_rng(0)
    src = rng.integers(0, 2**63, 1000, dtype=np.uint64)
    for n, grid, block in ((0, 3, 32), (1, 1, 1), (999, 2, 64), (1000, 7, 32)):
        dst = np.zeros(1000, np.uint64)
        ctl = np.array([n, 0], np.int64)
        so.run_words(P(src.ctypes.data), P(dst.ctypes.data), P(ctl.ctypes.data), grid, block)
        np.testing.assert_array_equal(dst[:n], src[:n])
        assert not dst[n:].any()
    for rb in (90, 96, 7392):
        pool = rng.integers(0, 256, 40 * rb + 16 * rb, dtype=np.uint8)
        want = pool.copy()
        srcs = (40 * rb + np.arange(16) * rb).astype(np.int64)
        dsts = (rng.permutation(40)[:16] * rb).astype(np.int64)
        for n in (0, 5, 16):
            ctl = np.array([0, n], np.int64)
            so.run_rows(P(pool.ctypes.data), P(srcs.ctypes.data), P(dsts.ctypes.data), P(ctl.ctypes.data),
                        ctypes.c_longlong(rb), 3, 64)
            for i in range(n):
                want[dsts[i]:dsts[i] + rb] = want[srcs[i]:srcs[i] + rb]
            np.testing.assert_array_equal(pool, want)


def test_copy_kernels_compile_for_sm90_and_amd(tmp_path):
    nvcc, hipcc = shutil.which("nvcc"), shutil.which("hipcc")
    if nvcc is None and hipcc is None:
        pytest.skip("neither nvcc nor hipcc: the device builds of kernels/copy.cu cannot be checked")
    write_sources(tmp_path, ("copy.cu",))
    if nvcc:
        r = subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-o", str(tmp_path / "c.cubin"), str(tmp_path / "copy.cu")],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        blob = (tmp_path / "c.cubin").read_bytes()
        assert b"gg_copy_words" in blob and b"gg_copy_rows" in blob
    if hipcc:
        r = subprocess.run([hipcc, "--offload-arch=gfx90a", "--offload-arch=gfx1030", "-x", "hip", "-c",
                            str(tmp_path / "copy.cu"), "-o", str(tmp_path / "c.o")],
                           capture_output=True, text=True, env={**os.environ, "HIP_PLATFORM": "amd"})
        assert r.returncode == 0, r.stderr[-2000:]
        assert b"gg_copy_rows" in (tmp_path / "c.o").read_bytes()


def test_budget_is_the_host_caches(table):
    path, _ = table
    with gg.open_table(path, config=gg.Config(cache_bytes=50_000)) as t:
        dc = devcache.acquire(t, 7, CUDA)
        try:
            assert dc.index.capacity == min(rowcache.capacity_for(50_000, t.row_bytes), N_ROWS)
            assert dc.fresh_base % devcache.FRESH_ALIGN == 0 and dc.fresh_base >= dc.cache_bytes
        finally:
            devcache.release(dc)
            devcache.drop_all()
