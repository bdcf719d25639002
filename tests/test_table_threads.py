"""One Table shared by threads, and one file (and one inherited Table) used by forked processes: every returned
byte is checked against the file itself (np.fromfile), for every host backend and both direct engines."""
from __future__ import annotations

import multiprocessing
import os
import threading

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import gds_gather as gg
from gds_gather.io import native
from gds_gather.io import uring

THREADS, BATCHES = 4, 250


def _cfg(**kw) -> gg.Config:
    """The engine alone: no row cache and no copies out of the page cache (where this version has them)."""
    fields = gg.Config.__dataclass_fields__
    return gg.Config(**{k: 0 for k in ("cache_bytes", "page_cache_reads") if k in fields and k not in kw}, **kw)


SETTINGS = [
    pytest.param("direct", dict(engine="uring"), True, id="direct-uring",
                 marks=pytest.mark.skipif(not uring.probe()[0], reason="io_uring unavailable")),
    pytest.param("direct", dict(engine="threads"), True, id="direct-threads",
                 marks=pytest.mark.skipif(native.library()[0] is None, reason="no C compiler")),
    pytest.param("direct", {}, False, id="direct-default"),          # with every cache this version has
    pytest.param("pread", {}, True, id="pread"),
    pytest.param("mmap", {}, True, id="mmap"),
    pytest.param("readahead", {}, True, id="readahead"),
]


@pytest.fixture(scope="module")
def table_file(tmp_path_factory, ggufs):
    """60,000 rows of 170 B (Q8_0 x 160, 10 MB): many rows straddle 512 B and 4 KiB blocks."""
    rows = np.random.default_rng(21).integers(0, 256, (60_000, 170), dtype=np.uint8)
    p = ggufs.write(tmp_path_factory.mktemp("threads") / "shared.gguf", rows, Q.Q8_0)
    with gg.open_table(p) as t:
        oracle = np.fromfile(p, np.uint8, t.n_bytes, offset=t.data_offset).reshape(t.n_rows, t.row_bytes)
    return p, oracle


def _batches(n_rows: int, seed: int, n: int):
    """Random batches: uniform, clustered (merged windows), contiguous runs, 2-D, repeated ids, single ids."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        kind = int(rng.integers(0, 5))
        size = int(rng.integers(1, 600))
        if kind == 0:
            ids = rng.integers(0, n_rows, size)
        elif kind == 1:
            lo = int(rng.integers(0, n_rows))
            ids = np.minimum(lo + rng.integers(0, 2000, size), n_rows - 1)
        elif kind == 2:
            lo = int(rng.integers(0, n_rows - size))
            ids = np.arange(lo, lo + size)
        elif kind == 3:
            ids = rng.integers(0, n_rows, (size // 2 + 1, 2))
        else:
            ids = rng.integers(0, n_rows, 1)
        yield ids


def _hammer(t, backend, rows, seed, n, bad: list) -> None:
    for k, ids in enumerate(_batches(rows.shape[0], seed, n)):
        got = t.read_rows(ids, backend)
        if got.shape != ids.shape + (rows.shape[1],) or not np.array_equal(got, rows[ids]):
            bad.append((seed, k, ids.shape))


@pytest.mark.slow
@pytest.mark.parametrize("backend,kw,engine_only", SETTINGS)
def test_threads_sharing_one_table_get_exactly_their_rows(table_file, backend, kw, engine_only):
    path, rows = table_file
    bad, errors = [], []
    with gg.open_table(path, config=_cfg(**kw) if engine_only else gg.Config(**kw)) as t:
        def work(seed):
            try:
                _hammer(t, backend, rows, seed, BATCHES, bad)
            except Exception as e:     # reported below
                errors.append(repr(e))
        ths = [threading.Thread(target=work, args=(s,)) for s in range(THREADS)]
        [th.start() for th in ths]
        [th.join() for th in ths]
    assert not errors, errors[:3]
    assert not bad, f"{len(bad)} of {THREADS * BATCHES} batches had wrong rows, e.g. {bad[:3]}"


def _child(path, backend, kw, engine_only, shared, seed) -> None:
    """In a forked child: the inherited Table (the parent's ring and staging must not be touched) and one of its
    own, each checked against the file read independently in the child."""
    cfg = _cfg(**kw) if engine_only else gg.Config(**kw)
    with gg.open_table(path) as t0:
        rows = np.fromfile(path, np.uint8, t0.n_bytes, offset=t0.data_offset).reshape(t0.n_rows, t0.row_bytes)
    bad: list = []
    _hammer(shared, backend, rows, seed, 150, bad)
    with gg.open_table(path, config=cfg) as t:
        _hammer(t, backend, rows, seed + 1000, 150, bad)
    if bad:
        raise SystemExit(f"{len(bad)} wrong batches, e.g. {bad[:2]}")


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("backend,kw,engine_only", SETTINGS)
def test_forked_processes_and_the_parent_read_exactly(table_file, backend, kw, engine_only):
    path, rows = table_file
    ctx = multiprocessing.get_context("fork")
    with gg.open_table(path, config=_cfg(**kw) if engine_only else gg.Config(**kw)) as t:
        t.read_rows([0, 1, 59_999], backend)        # the reader (ring, staging) exists before the fork
        procs = [ctx.Process(target=_child, args=(path, backend, kw, engine_only, t, 100 + i)) for i in range(3)]
        [p.start() for p in procs]
        bad: list = []
        _hammer(t, backend, rows, 7, 200, bad)      # the parent keeps reading meanwhile
        [p.join(120) for p in procs]
        assert not bad, bad[:3]
        assert [p.exitcode for p in procs] == [0, 0, 0]
        _hammer(t, backend, rows, 8, 20, bad)       # and its ring still works afterwards
        assert not bad


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_child_forked_while_another_thread_reads_does_not_hang(table_file):
    """fork() while a parent thread holds the Table's, the reader's, the ring's or the row cache's lock: the child
    gets fresh locks (gds_gather.io.forksafe) and reads exactly, instead of waiting forever for a thread it lacks."""
    import signal
    import time
    path, oracle = table_file
    t = gg.open_table(path, config=gg.Config(cache_bytes=1 << 20))
    t.read_rows(np.arange(10), "direct")
    stop = threading.Event()

    def loop():
        rng = np.random.default_rng(0)
        while not stop.is_set():
            t.read_rows(rng.integers(0, oracle.shape[0], 4096), "direct")
    th = threading.Thread(target=loop)
    th.start()
    hung = wrong = 0
    try:
        for i in range(8):
            time.sleep(0.03)
            pid = os.fork()
            if pid == 0:                                        # the child: exit 0 only with exact rows
                ids = np.arange(i, 5000, 7)
                os._exit(0 if np.array_equal(t.read_rows(ids, "direct"), oracle[ids]) else 3)
            deadline = time.monotonic() + 10
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    wrong += os.waitstatus_to_exitcode(status) != 0
                    break
                if time.monotonic() > deadline:
                    hung += 1
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.02)
    finally:
        stop.set()
        th.join()
        t.close()
    assert (hung, wrong) == (0, 0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_child_forked_while_the_staging_pool_is_locked_opens_readers(table_file):
    from gds_gather.io import readers
    path, oracle = table_file
    held, go = threading.Event(), threading.Event()

    def holder():
        with readers._POOL_LOCK:            # e.g. release_staging_pool() unmapping a large buffer
            held.set()
            go.wait()
    th = threading.Thread(target=holder)
    th.start()
    held.wait()
    try:
        pid = os.fork()
        if pid == 0:
            with gg.open_table(path, config=gg.Config(cache_bytes=0)) as t:
                ok = np.array_equal(t.read_rows([3, 1, 4], "direct"), oracle[[3, 1, 4]])
            os._exit(0 if ok else 3)
        import time
        deadline = time.monotonic() + 10
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("the child hung on the staging pool's lock")
            time.sleep(0.02)
    finally:
        go.set()
        th.join()
