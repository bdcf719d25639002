"""io_uring's RWF_NOWAIT mode (`Ring.read(..., nowait=True)`): buffered reads the page cache serves whole, the
rest reported as misses, never retried; a row it reports as read holds exactly the file's bytes, and normal reads
keep their retry semantics (-EAGAIN/-EINTR retried, short reads resumed)."""
from __future__ import annotations

import errno
import gc
import os

import numpy as np
import pytest

from gds_gather import measure, uring
from gds_gather.errors import ReadError

PAGE = 4096
SIZE = 64 * PAGE
SENTINEL = 0xA5


@pytest.fixture
def ring():
    ok, why = uring.probe()
    if not ok:
        pytest.skip(f"io_uring unavailable here: {why}")
    with uring.Ring(64) as r:
        yield r


@pytest.fixture
def data_file(tmp_path):
    """(path, bytes, buffered fd) of a 256 KiB file of random bytes, written and fsync'ed."""
    data = np.random.default_rng(7).integers(0, 256, SIZE, dtype=np.uint8)
    path = tmp_path / "f.bin"
    with open(path, "wb") as f:
        f.write(data.tobytes())
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    yield path, data, fd
    os.close(fd)


def _evict(path, fd) -> None:
    os.fsync(fd)                                    # dirty pages are not dropped
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    if measure.resident_bytes(path):
        pytest.skip("posix_fadvise(DONTNEED) cannot evict this file here (a memory filesystem?)")


def _extents(n, length, seed=0):
    """n extents of `length` bytes at random offsets (each may straddle pages), one per slot of the destination."""
    offs = np.random.default_rng(seed).integers(0, SIZE - length, n).astype(np.int64)
    return offs, np.full(n, length, np.int64)


def _read(ring, fd, offs, lens, **kw):
    dst = np.full((offs.shape[0], int(lens.max())), SENTINEL, np.uint8)
    addrs = np.uint64(dst.ctypes.data) + (np.arange(offs.shape[0]) * dst.shape[1]).astype(np.uint64)
    return ring.read(fd, offs, lens, addrs, **kw), dst


def _exact(dst, data, offs, lens, rows):
    for i in np.flatnonzero(rows):
        o, n = int(offs[i]), int(lens[i])
        np.testing.assert_array_equal(dst[i, :n], data[o:o + n], err_msg=f"extent {i} at {o}")


def test_warm_file_reads_exact_bytes_and_misses_nothing(ring, data_file):
    path, data, fd = data_file
    os.pread(fd, SIZE, 0)                               # every page cached
    offs, lens = _extents(200, 1088)
    missed, dst = _read(ring, fd, offs, lens, nowait=True)
    assert missed.dtype == bool and missed.shape == (200,)
    assert not missed.any()
    _exact(dst, data, offs, lens, np.ones(200, bool))
    assert (ring._sqes["rw_flags"][:64] == uring.RWF_NOWAIT).any()     # it was submitted with RWF_NOWAIT


def test_cold_file_reports_misses_and_claims_only_rows_it_read(ring, data_file):
    path, data, fd = data_file
    _evict(path, fd)
    os.pread(fd, 4 * PAGE, 8 * PAGE)                    # pages 8..11 cached, everything else cold
    offs, lens = _extents(64, 1088, seed=1)
    inside = (offs >= 8 * PAGE) & (offs + lens <= 12 * PAGE)
    missed, dst = _read(ring, fd, offs, lens, nowait=True)
    assert missed[~inside].sum() >= 1                   # cold extents come back -EAGAIN
    assert not missed[inside].any()                     # cached ones are served
    _exact(dst, data, offs, lens, ~missed)              # whatever it claims is the file's bytes


def test_real_short_read_over_a_cold_page_is_a_miss(ring, data_file):
    """An extent whose first page is cached and whose second is not comes back short: a miss of the whole
    extent, though its destination holds a correct prefix."""
    path, data, fd = data_file
    _evict(path, fd)
    cached = np.arange(0, 64, 8)                        # pages 0, 8, ..., 56 cached; the ones after them cold
    for p in cached:
        os.pread(fd, PAGE, int(p) * PAGE)
    offs = (cached * PAGE + PAGE - 100).astype(np.int64)
    lens = np.full(offs.shape[0], 300, np.int64)
    missed, dst = _read(ring, fd, offs, lens, nowait=True)
    assert missed.sum() >= 1
    _exact(dst, data, offs, lens, ~missed)
    # they were real short reads: the cached page's 100 bytes arrived, the rest did not, and still a miss
    short = [i for i in np.flatnonzero(missed)
             if np.array_equal(dst[i, :100], data[offs[i]:offs[i] + 100]) and (dst[i, 100:] == SENTINEL).all()]
    assert short


@pytest.mark.parametrize("fault", ["short", "eagain", "eintr", "zero"])
def test_injected_nowait_faults_are_misses_never_retried(ring, data_file, fault):
    path, data, fd = data_file
    os.pread(fd, SIZE, 0)
    offs, lens = _extents(40, 700, seed=2)
    hit = np.array([3, 17, 39])

    def inject(res, idx):
        sel = np.isin(idx, hit)
        res[sel] = {"short": res[sel] - 1, "eagain": -errno.EAGAIN, "eintr": -errno.EINTR, "zero": 0}[fault]
        return res
    ring.inject = inject
    enters = ring.enters
    missed, dst = _read(ring, fd, offs, lens, nowait=True)
    assert np.array_equal(np.flatnonzero(missed), hit)
    _exact(dst, data, offs, lens, ~missed)
    assert ring.enters - enters <= 2                   # one submission of 40 (+ one wait): nothing resubmitted


def test_nowait_other_errors_still_raise(ring, data_file):
    path, data, fd = data_file
    offs, lens = _extents(10, 500, seed=3)
    ring.inject = lambda res, idx: np.where(idx == 4, -errno.EIO, res)
    with pytest.raises(ReadError, match="RWF_NOWAIT read of 500 bytes .* failed") as e:
        _read(ring, fd, offs, lens, nowait=True)
    assert e.value.errno == errno.EIO
    ring.inject = None
    assert ring.outstanding() == (0, 0)
    missed, dst = _read(ring, fd, offs, lens, nowait=True)          # the ring is still usable
    _exact(dst, data, offs, lens, ~missed)


def test_a_missed_piece_misses_its_whole_extent(ring, data_file):
    """Extents split at max_chunk: one piece short or -EAGAIN makes the whole extent a miss."""
    path, data, fd = data_file
    os.pread(fd, SIZE, 0)
    ring.max_chunk = PAGE
    offs = np.array([0, 4 * PAGE, 10 * PAGE], np.int64)
    lens = np.array([3 * PAGE, 3 * PAGE, PAGE], np.int64)
    missed, dst = _read(ring, fd, offs, lens, nowait=True)
    assert not missed.any()
    _exact(dst, data, offs, lens, np.ones(3, bool))
    ring.inject = lambda res, idx: np.where(idx == 4, -errno.EAGAIN, res)   # piece 4: the 2nd of extent 1
    missed, dst = _read(ring, fd, offs, lens, nowait=True)
    assert missed.tolist() == [False, True, False]
    _exact(dst, data, offs, lens, ~missed)


@pytest.mark.parametrize("fault", ["short", "eagain", "eintr"])
def test_normal_reads_still_retry_and_return_exact_bytes(ring, data_file, fault):
    path, data, fd = data_file
    offs, lens = _extents(40, 700, seed=4)
    _read(ring, fd, offs, lens, nowait=True)            # a nowait read first: its flags must not leak
    seen = {"n": 0}

    def inject(res, idx):
        seen["n"] += 1
        if seen["n"] == 1:
            sel = idx % 5 == 0
            res[sel] = {"short": res[sel] // 2, "eagain": -errno.EAGAIN, "eintr": -errno.EINTR}[fault]
        return res
    ring.inject = inject
    out, dst = _read(ring, fd, offs, lens)
    assert out is None
    assert seen["n"] >= 2                               # the faulted reads were resubmitted
    _exact(dst, data, offs, lens, np.ones(40, bool))
    assert (ring._sqes["rw_flags"] == 0).all()          # normal reads carry no RWF_NOWAIT


def test_normal_reads_of_a_cold_file_are_exact(ring, data_file):
    path, data, fd = data_file
    _evict(path, fd)
    offs, lens = _extents(50, 1500, seed=5)
    out, dst = _read(ring, fd, offs, lens)
    assert out is None
    _exact(dst, data, offs, lens, np.ones(50, bool))


@pytest.mark.parametrize("warm", ["cold", "half", "warm"])
def test_bench_nowait_way_serves_the_files_rows(ring, tmp_path, ggufs, warm):
    """bench/bench_pagecache.py's way (b) (RWF_NOWAIT rows, O_DIRECT windows for the misses) returns exactly the
    file's rows whatever the page cache holds, and counts every row once."""
    import importlib.util
    from pathlib import Path
    from types import SimpleNamespace

    import gds_gather as gg
    from gguf import GGMLQuantizationType as Q
    spec = importlib.util.spec_from_file_location(
        "bench_pagecache", Path(__file__).resolve().parents[1] / "bench" / "bench_pagecache.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    path = ggufs.write(tmp_path / "w.gguf", ggufs.rows(Q.Q8_0, 3000, 1024, seed=4), Q.Q8_0)
    cfg = gg.Config(cache_bytes=0)
    with gg.open_table(path, config=cfg) as t:      # closed before the eviction: its mapping keeps the file's head
        plans = [t.plan(np.random.default_rng(seed).integers(0, t.n_rows, 700)) for seed in range(3)]
        geo = SimpleNamespace(data_offset=t.data_offset, n_bytes=t.n_bytes, n_rows=t.n_rows, row_bytes=t.row_bytes)
    raw = np.fromfile(path, np.uint8, geo.n_bytes, offset=geo.data_offset).reshape(geo.n_rows, geo.row_bytes)
    gc.collect()                                    # the header parser's mapping goes with its last view
    fd = os.open(path, os.O_RDONLY)
    try:
        _evict(path, fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)       # no readahead past what is read
        if warm != "cold":
            step = 2 if warm == "half" else 1
            for r in range(0, geo.n_rows, step * 50):     # every other run of 50 rows, or all of them
                os.pread(fd, 50 * geo.row_bytes, geo.data_offset + r * geo.row_bytes)
    finally:
        os.close(fd)
    way = bench.Nowait(path, geo, cfg)
    try:
        for plan in plans:
            np.testing.assert_array_equal(way.read(plan), raw[plan.unique_rows])
        assert way.hits + way.misses == sum(p.n_unique for p in plans)
        if warm == "warm":
            assert way.misses == 0
        elif warm == "cold":
            assert way.misses > 0
        else:
            assert way.misses > 0 and way.hits > 0
    finally:
        way.close()
