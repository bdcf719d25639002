"""The I/O engine after faults, at any size, and when Tables are dropped unclosed.

Every read is checked byte for byte against the file itself (np.fromfile), never against the engine's own output.
- faults mid-read (an I/O error, a short read, an early end of file, an exception raised from a completion, a real
  SIGALRM whose handler raises, KeyboardInterrupt): the ring is drained (nothing left in flight) and the next
  reads on the same Table are exact; a ring that cannot be drained refuses every later use clearly;
- extents longer than the ring's chunk limit are split (a tiny limit injected; one real > 4 GiB read, `slow`);
- Tables dropped without close() give back their fds, io_uring rings, mappings and pinned pages.
"""
from __future__ import annotations

import errno
import gc
import mmap
import os
import signal
import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import gds_gather as gg
from gds_gather.io import native
from gds_gather.io import uring
from gds_gather.planner import split_extents

needs_uring = pytest.mark.skipif(not uring.probe()[0], reason="io_uring unavailable here")
needs_native = pytest.mark.skipif(native.library()[0] is None, reason="no C compiler for the native pool")
ENGINES = [pytest.param("uring", marks=needs_uring), pytest.param("threads", marks=needs_native)]


def _cfg(**kw) -> gg.Config:
    """The engine alone: no row cache, no copies out of the page cache (where this version has them); 512-B
    windows (the smallest O_DIRECT allows here) so that random ids make many reads, far more than the QD."""
    fields = gg.Config.__dataclass_fields__
    off = {k: 0 for k in ("cache_bytes", "page_cache_reads") if k in fields and k not in kw}
    return gg.Config(**off, **{"align": 512, **kw})


class Timeout(Exception):
    """What a timeout helper raises from its SIGALRM handler."""


def _write(path, ggufs, n_rows, row_bytes=90, qtype=Q.IQ4_NL, seed=0):
    rows = np.random.default_rng(seed).integers(0, 256, (n_rows, row_bytes), dtype=np.uint8)
    ggufs.write(path, rows, qtype)
    return path


def _oracle(path) -> np.ndarray:
    with gg.open_table(path) as t:
        return np.fromfile(path, np.uint8, t.n_bytes, offset=t.data_offset).reshape(t.n_rows, t.row_bytes)


@pytest.fixture(scope="module")
def big(tmp_path_factory, ggufs):
    """200,000 rows of 90 B (18 MB): 20,000 random ids make ~20,000 O_DIRECT windows, far more than the QD."""
    p = _write(tmp_path_factory.mktemp("faults") / "big.gguf", ggufs, 200_000)
    return p, _oracle(p)


def _check_next_reads(t, rows, backend="direct", n=4, seed=7):
    rng = np.random.default_rng(seed)
    for k in range(n):
        ids = rng.integers(0, t.n_rows, int(rng.integers(1, 5000)))
        np.testing.assert_array_equal(t.read_rows(ids, backend), rows[ids], err_msg=f"read {k} after the fault")
    ids = np.arange(t.n_rows - 3000, t.n_rows)            # contiguous, up to the last row
    np.testing.assert_array_equal(t.read_rows(ids, backend), rows[ids])


def _reader(t, backend="direct"):
    t.read_rows([0], backend)
    return t._readers[backend]


# -- io_uring: every fault class, then exact reads ----------------------------------------------------------

def _nth_batch(n, make, ring=None):
    """An inject hook that applies `make(res, idx)` once, to the n-th batch of completions (counting from 1) or,
    given the ring, to the first batch from the n-th on that leaves reads in flight (the fault then has reads to
    leave behind)."""
    seen = {"batches": 0, "done": False}

    def inject(res, idx):
        seen["batches"] += 1
        if seen["done"] or seen["batches"] < n or (ring is not None and not ring.outstanding()[1]):
            return res
        seen["done"] = True
        return make(res, idx)
    return inject


def _raise(exc):
    def make(res, idx):
        raise exc
    return make


FAULTS = {
    "eio": (lambda res, idx: np.where(idx == idx.min(), -errno.EIO, res), gg.ReadError, "Input/output error"),
    "eof": (lambda res, idx: np.where(idx == idx.min(), 0, res), gg.ReadError, "unexpected end of file"),
    "short-then-eio": (lambda res, idx: np.where(idx == idx.min(), -errno.ENOSPC,
                                                 np.where(res > 512, res // 2 // 512 * 512, res)),
                       gg.ReadError, "No space left"),
    "keyboard-interrupt": (_raise(KeyboardInterrupt()), KeyboardInterrupt, None),
    "timeout-helper": (_raise(Timeout("deadline")), Timeout, "deadline"),
}


@needs_uring
@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("batch", [1, 3])
def test_uring_fault_drains_then_reads_exact(big, fault, batch):
    path, rows = big
    make, exc, msg = FAULTS[fault]
    with gg.open_table(path, config=_cfg(engine="uring")) as t:
        r = _reader(t)
        ring = r.ring
        r.inject = _nth_batch(batch, make, ring)
        ids = np.random.default_rng(1).integers(0, t.n_rows, 20_000)
        with pytest.raises(exc, match=msg):
            t.read_rows(ids, "direct")
        assert ring.outstanding() == (0, 0) and not ring.broken
        assert ring.drained > 0, "the fault should have left reads in flight"
        r.inject = None
        _check_next_reads(t, rows)
        assert ring.outstanding() == (0, 0) and r.ring is ring


@needs_uring
def test_uring_real_signal_raising_while_waiting(big):
    """SIGALRM at varied moments while read_rows waits in io_uring_enter; its handler raises (a timeout helper,
    then KeyboardInterrupt). Each time the ring is drained and the next read is exact."""
    path, rows = big
    interrupted = 0
    with gg.open_table(path, config=_cfg(engine="uring", queue_depth=32)) as t:
        ring = _reader(t).ring
        ids = np.random.default_rng(3).integers(0, t.n_rows, 20_000)
        rng = np.random.default_rng(4)
        for k, exc in enumerate([Timeout, KeyboardInterrupt] * 6):
            def handler(signum, frame, exc=exc):
                raise exc()
            old = signal.signal(signal.SIGALRM, handler)
            try:
                signal.setitimer(signal.ITIMER_REAL, float(rng.uniform(0.001, 0.03)))
                try:
                    t.read_rows(ids, "direct")
                    signal.setitimer(signal.ITIMER_REAL, 0)
                except exc:
                    interrupted += 1
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, old)
            assert ring.outstanding() == (0, 0) and not ring.broken
            sub = ids[rng.integers(0, ids.size, 3000)]
            np.testing.assert_array_equal(t.read_rows(sub, "direct"), rows[sub], err_msg=f"after signal {k}")
        assert interrupted >= 3 and ring.drained > 0, (interrupted, ring.drained)
        _check_next_reads(t, rows)


@needs_uring
def test_undrainable_ring_refuses_clearly(big, monkeypatch):
    path, rows = big
    with gg.open_table(path, config=_cfg(engine="uring")) as t:
        r = _reader(t)
        r.inject = _nth_batch(1, _raise(KeyboardInterrupt()), r.ring)

        def dead(n):
            raise OSError(errno.EBADF, "Bad file descriptor")
        monkeypatch.setattr(r.ring, "wait", dead)
        with pytest.raises(KeyboardInterrupt):
            t.read_rows(np.arange(0, t.n_rows, 37), "direct")
        assert r.ring.broken
        monkeypatch.undo()
        r.inject = None
        for _ in range(2):
            with pytest.raises(gg.ReadError, match="unusable after an earlier fault.*reopen the table"):
                t.read_rows([1, 2], "direct")
        from gds_gather.io import readers
        readers.release_staging_pool()
        st = r.staging
    assert not readers._POOL and st._map is None    # reads may still land in an undrained ring's staging: not reused
    with gg.open_table(path, config=_cfg(engine="uring")) as t:     # reopened: fine
        _check_next_reads(t, rows, n=1)


@needs_uring
def test_exception_between_drain_steps_is_healed_on_next_read(big):
    """Reads left in flight by an exception that escaped every handler: the next read drains first."""
    path, rows = big
    with gg.open_table(path, config=_cfg(engine="uring")) as t:
        r = _reader(t)
        ring = r.ring
        r.inject = _nth_batch(1, _raise(KeyboardInterrupt()), ring)
        real = ring.drain
        ring.drain = lambda path, timeout_s=60.0: None         # as if the drain itself had been skipped
        with pytest.raises(KeyboardInterrupt):
            t.read_rows(np.arange(0, t.n_rows, 11), "direct")
        assert ring.outstanding() != (0, 0)
        ring.drain = real
        r.inject = None
        _check_next_reads(t, rows, n=2)
        assert ring.outstanding() == (0, 0)


# -- the native thread pool (GDS_GATHER_ENGINE=threads) and pread -----------------------------------------------

@needs_native
@pytest.mark.parametrize("backend", ["direct", "pread"])
def test_thread_pool_faults_then_reads_exact(big, backend):
    path, rows = big
    with gg.open_table(path, config=_cfg(engine="threads")) as t:
        r = _reader(t, backend)
        ids = np.random.default_rng(5).integers(0, t.n_rows, 5000)
        for inj, exc in (((3, errno.EIO), "Input/output error"), ((0, -2), None), ((7, errno.EINTR), None)):
            r.inject = inj
            if exc:
                with pytest.raises(gg.ReadError, match=exc):
                    t.read_rows(ids, backend)
            else:
                np.testing.assert_array_equal(t.read_rows(ids, backend), rows[ids])
            r.inject = None
            _check_next_reads(t, rows, backend, n=2)


@pytest.mark.parametrize("engine", ENGINES)
def test_signal_raising_during_any_engine(big, engine):
    """The native pool finishes its reads inside C; the handler raises after: the next reads are exact."""
    path, rows = big
    with gg.open_table(path, config=_cfg(engine=engine)) as t:
        _reader(t)
        ids = np.random.default_rng(6).integers(0, t.n_rows, 20_000)

        def handler(signum, frame):
            raise Timeout()
        old = signal.signal(signal.SIGALRM, handler)
        try:
            for delay in (0.002, 0.01):
                signal.setitimer(signal.ITIMER_REAL, delay)
                try:
                    t.read_rows(ids, "direct")
                    time.sleep(0.05)          # the alarm lands here if the read was faster
                except Timeout:
                    pass
                signal.setitimer(signal.ITIMER_REAL, 0)
                _check_next_reads(t, rows, n=1)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


# -- windows of any size --------------------------------------------------------------------------------------

def test_split_extents_matches_plain_python():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(0, 20))
        off = rng.integers(0, 10**9, n) // 512 * 512
        ln = rng.integers(0, 50_000, n)
        ex = np.minimum(ln, rng.integers(0, 60_000, n))
        dst = rng.integers(0, 10**9, n)
        chunk = int(rng.choice([512, 4096, 8192, 30_000 // 512 * 512]))
        got = split_extents(off, ln, ex, dst, chunk)
        want = [[], [], [], [], []]
        for i in range(n):
            for s in range(0, max(int(ln[i]), 1), chunk):
                piece = min(chunk, int(ln[i]) - s)
                for lst, v in zip(want, (off[i] + s, piece, min(max(int(ex[i]) - s, 0), piece), dst[i] + s, i)):
                    lst.append(int(v))
        assert [a.tolist() for a in got] == want


@pytest.mark.parametrize("engine", ENGINES)
def test_windows_longer_than_the_chunk_limit_are_split(tmp_path, ggufs, engine, monkeypatch):
    """Long windows (contiguous ids, no window cap; 20,000-byte rows) through a ring whose chunk limit is tiny."""
    monkeypatch.setattr(uring.Ring, "max_chunk", 8192 + 512)       # not a multiple of 4096: rounded down to align
    for rb, n in ((90, 60_000), (20_000, 300)):
        path = _write(tmp_path / f"t{rb}.gguf", ggufs, n, row_bytes=rb, qtype=Q.F16 if rb == 20_000 else Q.IQ4_NL)
        rows = _oracle(path)
        with gg.open_table(path, config=_cfg(engine=engine, max_window=0)) as t:
            for ids in (np.arange(n), np.arange(n)[::-1][: n // 2], np.random.default_rng(1).integers(0, n, 900)):
                np.testing.assert_array_equal(t.read_rows(ids, "direct"), rows[ids])
            r = t._readers["direct"]
            if r.odirect:
                assert t.plan(np.arange(n)).win_lengths.max() > 10 * uring.Ring.max_chunk
            if engine == "uring":
                assert r.ring.enters > 0 and r.ring.outstanding() == (0, 0)


@needs_uring
def test_ring_read_splits_with_latencies(tmp_path):
    """Ring.read directly: 3 extents of 100 KiB through a 16 KiB chunk limit, O_DIRECT, with lat_ns per extent."""
    path = tmp_path / "raw.bin"
    data = np.random.default_rng(2).integers(0, 256, 1 << 20, dtype=np.uint8)
    data.tofile(path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    buf = mmap.mmap(-1, 1 << 20)
    dst = np.frombuffer(buf, np.uint8)
    try:
        with uring.Ring(16) as ring:
            ring.max_chunk = 16384
            offs = np.array([0, 4096 * 40, 4096 * 100], np.int64)
            lens = np.full(3, 100 * 1024, np.int64)
            addrs = np.uint64(dst.ctypes.data) + np.array([0, 300_000 // 4096 * 4096, 700_000 // 4096 * 4096],
                                                          np.uint64)
            lat = np.zeros(3, np.int64)
            ring.read(fd, offs, lens, addrs, align=4096, lat_ns=lat, queue_depth=4)
            for o, a in zip(offs.tolist(), (addrs - np.uint64(dst.ctypes.data)).tolist()):
                np.testing.assert_array_equal(dst[a:a + 100 * 1024], data[o:o + 100 * 1024])
            assert (lat > 0).all() and ring.outstanding() == (0, 0)
    finally:
        os.close(fd)
        del dst
        buf.close()


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable"))
    except (OSError, StopIteration):
        return 0


@pytest.mark.slow
@needs_uring
@pytest.mark.skipif(_mem_available() < 12 << 30, reason="needs ~4.6 GiB of free memory for one real > 4 GiB read")
def test_one_real_read_over_4_gib(tmp_path):
    """One O_DIRECT extent of 4.5 GiB through io_uring (it wrapped the 32-bit SQE length before): a sparse file
    with known bytes near both ends and around 4 GiB, read into a MAP_NORESERVE buffer."""
    size = (9 << 29) + 8192                  # 4.5 GiB + 8 KiB
    path = tmp_path / "sparse.bin"
    marks = {0: b"HEAD", 4095: b"x", (1 << 32) - 3: b"wrap", (1 << 32) + 4096: b"past", size - 8192 - 4: b"TAIL"}
    with open(path, "wb") as f:
        f.truncate(size)
        for at, b in marks.items():
            f.seek(at)
            f.write(b)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        pytest.skip("O_DIRECT refused here")
    length = size - 8192
    buf = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0))
    dst = np.frombuffer(buf, np.uint8)
    try:
        with uring.Ring(8) as ring:
            ring.read(fd, np.array([0]), np.array([length]), np.array([dst.ctypes.data], np.uint64), align=4096)
            assert ring.outstanding() == (0, 0)
        for at, b in marks.items():
            assert bytes(dst[at:at + len(b)]) == b, at
        assert not dst[(1 << 32) + 8192:(1 << 32) + 16384].any()
    finally:
        os.close(fd)
        del dst
        buf.close()


# -- unclosed Tables -----------------------------------------------------------------------------------------

def _resources():
    with open("/proc/self/maps") as f:
        maps = sum(1 for _ in f)
    with open("/proc/self/status") as f:
        pin = next((int(line.split()[1]) for line in f if line.startswith("VmPin")), 0)
    return len(os.listdir("/proc/self/fd")), maps, pin


def _settled(before, timeout=10.0):
    """The resources once the kernel's asynchronous io_uring teardown has unpinned the registered buffers."""
    end = time.monotonic() + timeout
    while True:
        now = _resources()
        if (now[0] <= before[0] and now[1] <= before[1] + 2 and now[2] <= before[2]) or time.monotonic() > end:
            return now
        time.sleep(0.05)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
@pytest.mark.parametrize("collector", ["refcount", "gc"])
def test_hundreds_of_unclosed_tables_release_everything(big, collector):
    path, rows = big
    cfgs = [_cfg(engine="uring"), _cfg(engine="threads")] \
        if uring.probe()[0] else [_cfg(engine="threads")]
    for cfg in cfgs:                                  # warm up lazy imports, the native library, caches
        t = gg.open_table(path, config=cfg)
        for b in ("direct", "pread", "mmap"):
            t.read_rows([0, 1], b)
        t.close()
    gc.collect()
    before = _resources()
    if collector == "refcount":
        gc.disable()           # no reference cycles: dropping the last reference must be enough
    try:
        rng = np.random.default_rng(0)
        peak = None
        for k in range(240):
            cfg = cfgs[k % len(cfgs)]
            t = gg.open_table(path, config=cfg)
            ids = rng.integers(0, t.n_rows, 300)
            for b in ("direct", "pread", "mmap") if k % 3 == 0 else ("direct",):
                np.testing.assert_array_equal(t.read_rows(ids, b), rows[ids])
            if k == 100:
                keep = [gg.open_table(path, config=cfg) for _ in range(20)]     # many alive at once
                for x in keep:
                    x.read_rows(ids, "direct")
                peak = _resources()
                del keep, x
            del t
        if collector == "gc":
            gc.collect()
    finally:
        gc.enable()
    assert peak[0] >= before[0] + 20                  # the live ones did hold fds
    after = _settled(before)
    assert after[0] == before[0], (before, after)
    assert after[1] <= before[1] + 2, (before, after)
    assert after[2] <= before[2], ("pinned pages not released", before, after)
