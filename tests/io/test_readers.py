"""Every host reader is bit-exact over odd geometries; faults raise errors naming file and offset; no leaks."""
from __future__ import annotations

import errno
import os
import shutil
import threading

from contextlib import closing

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gds_gather as gg
from gds_gather.io import native
from gds_gather.io import direct, readers
from gds_gather.io import uring
from gds_gather.io.storage import filesystem

HOST = ["direct", "pread", "mmap", "readahead", "resident"]
# (type, width): row bytes 2, 90, 170, 4080, 4096, 4097, 20000
GEOMETRIES = [(Q.F16, 1), (Q.IQ4_NL, 160), (Q.Q8_0, 160), (Q.MXFP4, 7680), (Q.F32, 1024), (Q.MXFP4, 7712),
              (Q.F16, 10000)]

def _read_marks(ring, *a, marks, hand, **kw):
    """Ring.reads(marks=...) with hand(extents) called at each Complete step; an exception from it closes the
    generator (the ring drains)."""
    with closing(ring.reads(*a, marks=marks, **kw)) as steps:
        for step in steps:
            if isinstance(step, uring.Complete):
                hand(step.extents)


def _read_between(ring, *a, between, **kw):
    """Ring.reads(pause=True) with `between` run at its SUBMITTED step: a caller's work while the reads are in
    flight; an exception from it closes the generator (the ring drains)."""
    with closing(ring.reads(*a, pause=True, **kw)) as steps:
        for step in steps:
            if step is uring.SUBMITTED:
                between()



def table_file(tmp_path, ggufs, qtype, width, n_rows, seed=0, at_eof=True):
    """A GGUF whose table is the last tensor; with at_eof the file ends exactly at the table's last byte."""
    rng = np.random.default_rng(seed)
    from gds_gather.formats.quants import row_bytes
    rows = rng.integers(0, 256, (n_rows, row_bytes(qtype, width)), dtype=np.uint8)
    p = ggufs.write(tmp_path / f"t-{qtype.name}-{width}.gguf", rows, qtype)
    if at_eof:
        with gg.open_table(p) as t:
            end = t.data_offset + t.n_bytes
        os.truncate(p, end)
    return p, rows


def engine_only(**kw) -> gg.Config:
    """The engine alone: no row cache and no copies out of the page cache (where this version has them), so that
    injected faults meet real reads."""
    fields = gg.Config.__dataclass_fields__
    return gg.Config(**{k: 0 for k in ("cache_bytes", "page_cache_reads") if k in fields and k not in kw}, **kw)


def engine_configs():
    return {"uring": gg.Config(engine="uring"), "threads": gg.Config(engine="threads")}


@pytest.mark.parametrize("qtype,width", GEOMETRIES, ids=lambda x: getattr(x, "name", str(x)))
def test_every_reader_exact_odd_geometries(tmp_path, ggufs, qtype, width):
    from gds_gather.formats.quants import row_bytes
    rb = row_bytes(qtype, width)
    n_rows = max(40, 300_000 // rb)
    path, rows = table_file(tmp_path, ggufs, qtype, width, n_rows)
    with gg.open_table(path) as t:
        assert t.data_offset + t.n_bytes == os.path.getsize(path)      # the last row ends at EOF
        off = t.data_offset + np.arange(n_rows) * rb
        straddle = np.flatnonzero(off // 4096 != (off + rb - 1) // 4096)
        rng = np.random.default_rng(1)
        ids = np.concatenate([rng.integers(0, n_rows, 500), [n_rows - 1, 0, n_rows - 1], straddle[:50]])
        rng.shuffle(ids)
        ids = ids.reshape(-1, 1) if ids.size % 2 else ids.reshape(-1, 2)
    for name, cfg in [("default", gg.Config())] + list(engine_configs().items()):
        with gg.open_table(path, config=cfg) as t:
            for backend in HOST:
                got = t.read_rows(ids, backend)
                assert got.shape == ids.shape + (rb,)
                np.testing.assert_array_equal(got, rows[ids], err_msg=f"{backend} via {name}")


def test_direct_uses_odirect_windows_and_io_uring(small_table):
    ok, why = uring.probe()
    with gg.open_table(small_table) as t:
        t.read_rows([1, 2], "direct")
        r = t._readers["direct"]
        if filesystem(small_table) in direct.MEMORY_FILESYSTEMS:
            assert not r.odirect
        else:
            assert r.odirect and r.align == t.align and "O_DIRECT" in r.how
        assert ("io_uring" in r.how) == ok, (r.how, why)


def test_python_pool_fallback_without_compiler(small_table, ggufs, monkeypatch):
    """No native helpers: direct and pread read through Python threads calling preadv (engine_only: every row
    from the file, none from a cache), readahead madvises page by page; all give gguf's rows."""
    monkeypatch.setattr(native, "library", lambda config=None: (None, "no C compiler (test)"))
    ref = ggufs.reference(small_table)
    with gg.open_table(small_table, config=engine_only(engine="threads")) as t:
        ids = np.random.default_rng(2).integers(0, t.n_rows, 400)
        for backend in ("direct", "pread", "readahead"):
            np.testing.assert_array_equal(t.gather(ids, backend), ref[ids], err_msg=backend)
        for backend in ("direct", "pread"):
            r = t._readers[backend]
            assert "Python thread pool" in r.how and r.bytes_read >= np.unique(ids).size * t.row_bytes, backend


def test_odirect_refused_falls_back_to_buffered(small_table, ggufs, monkeypatch, caplog):
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)
    monkeypatch.setattr(direct.os, "open", no_direct)
    ref = ggufs.reference(small_table)
    with gg.open_table(small_table) as t:
        ids = np.arange(t.n_rows)[::-3]
        np.testing.assert_array_equal(t.gather(ids, "direct"), ref[ids])
        r = t._readers["direct"]
        assert not r.odirect and "O_DIRECT refused" in r.how
    assert any("O_DIRECT refused" in m for m in caplog.messages)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_tmpfs_table(small_table, ggufs):
    dst = f"/dev/shm/gds-gather-test-{os.getpid()}.gguf"
    shutil.copyfile(small_table, dst)
    try:
        ref = ggufs.reference(small_table)
        with gg.open_table(dst) as t:
            ids = np.random.default_rng(4).integers(0, t.n_rows, 300)
            np.testing.assert_array_equal(t.gather(ids, "direct"), ref[ids])
            assert not t._readers["direct"].odirect
    finally:
        os.unlink(dst)


# -- faults ------------------------------------------------------------------------------------------------

def _direct(t, cfg_engine):
    t.read_rows([0], "direct")
    return t._readers["direct"]


@pytest.mark.skipif(not uring.probe()[0], reason="io_uring unavailable here")
class TestUringFaults:
    def test_eintr_and_eagain_are_retried(self, small_table, ggufs):
        seen = set()

        def inject(res, idx):
            first = np.array([i not in seen for i in idx.tolist()])
            seen.update(idx.tolist())
            res[first & (idx % 2 == 0)] = -errno.EINTR
            res[first & (idx % 2 == 1)] = -errno.EAGAIN
            return res
        with gg.open_table(small_table, config=engine_only(engine="uring")) as t:
            r = _direct(t, "uring")
            r.inject = inject
            ids = np.arange(0, t.n_rows, 7)
            np.testing.assert_array_equal(t.gather(ids, "direct"), ggufs.reference(small_table)[ids])
            assert seen

    def test_short_reads_are_resumed(self, small_table, ggufs):
        calls = {"n": 0}

        def inject(res, idx):
            calls["n"] += 1
            if calls["n"] <= 2:           # the first completions claim half (block-aligned down) of what came
                res = np.where(res > 1024, res // 2, res)
            return res
        with gg.open_table(small_table, config=engine_only(engine="uring")) as t:
            r = _direct(t, "uring")
            r.inject = inject
            ids = np.arange(t.n_rows)
            np.testing.assert_array_equal(t.gather(ids, "direct"), ggufs.reference(small_table)[ids])

    def test_eio_raises_naming_file_and_offset(self, small_table):
        with gg.open_table(small_table, config=engine_only(engine="uring")) as t:
            r = _direct(t, "uring")
            r.inject = lambda res, idx: np.where(idx == idx.min(), -errno.EIO, res)
            with pytest.raises(gg.ReadError, match=r"small\.gguf: read of \d+ bytes at offset \d+ failed: "
                                                   r"Input/output error") as e:
                t.gather([5, 250], "direct")
            assert e.value.errno == errno.EIO

    def test_unexpected_eof_raises(self, small_table):
        with gg.open_table(small_table, config=engine_only(engine="uring")) as t:
            r = _direct(t, "uring")
            r.inject = lambda res, idx: np.zeros_like(res)
            with pytest.raises(gg.ReadError, match="unexpected end of file at offset"):
                t.gather([5], "direct")


class TestThreadPoolFaults:
    @pytest.fixture
    def t(self, small_table):
        if native.library()[0] is None:
            pytest.skip("no C compiler for the native thread pool")
        with gg.open_table(small_table, config=engine_only(engine="threads")) as t:
            _direct(t, "threads")
            yield t

    @pytest.mark.parametrize("backend", ["direct", "pread"])
    def test_eintr_retried_and_short_read_resumed(self, t, small_table, ggufs, backend):
        t.read_rows([0], backend)
        ref = ggufs.reference(small_table)
        ids = np.arange(0, t.n_rows, 3)
        for inj in ((0, errno.EINTR), (1, errno.EAGAIN), (0, -2)):
            t._readers[backend].inject = inj
            np.testing.assert_array_equal(t.gather(ids, backend), ref[ids])

    @pytest.mark.parametrize("backend", ["direct", "pread"])
    def test_eio_raises(self, t, backend):
        t.read_rows([0], backend)
        t._readers[backend].inject = (0, errno.EIO)
        with pytest.raises(gg.ReadError, match=r"small\.gguf: read at offset \d+ failed: Input/output error"):
            t.gather([3, 4], backend)


@pytest.mark.parametrize("backend", HOST)
def test_truncated_since_open(small_table, backend):
    with gg.open_table(small_table) as t:
        t.read_rows([1], backend)
        size = os.path.getsize(small_table)
        os.truncate(small_table, size - 5000)
        if backend == "resident":      # already loaded: still serves the rows it holds
            return
        with pytest.raises(gg.ReadError, match="resized from"):
            t.read_rows([t.n_rows - 1], backend)


@pytest.mark.parametrize("backend", ["direct", "mmap"])
def test_replaced_or_modified_since_open(small_table, tmp_path, backend):
    with gg.open_table(small_table) as t:
        t.read_rows([1], backend)
        copy = tmp_path / "copy.gguf"
        shutil.copyfile(small_table, copy)
        os.replace(copy, small_table)
        with pytest.raises(gg.ReadError, match="replaced"):
            t.read_rows([2], backend)
    with gg.open_table(small_table) as t:
        t.read_rows([1], backend)
        st = os.stat(small_table)
        os.utime(small_table, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        with pytest.raises(gg.ReadError, match="modified"):
            t.read_rows([2], backend)


@pytest.mark.parametrize("backend", ["direct", "mmap"])
def test_removed_since_open(small_table, backend):
    with gg.open_table(small_table, config=engine_only()) as t:
        t.read_rows([1], backend)
        os.unlink(small_table)
        with pytest.raises(gg.ReadError, match=r"small\.gguf: the file was removed after it was opened"):
            t.read_rows([2], backend)


def test_resident_load_past_the_end_is_an_error(small_table):
    """A region that runs past the end of the file (the file's own identity, taken at open): loading it stops at
    EOF with the offset, not with a short table."""
    with gg.open_table(small_table) as t:
        off, n, rb = t.data_offset, t.n_bytes, t.row_bytes
        plan = t.plan([0])
    size = os.path.getsize(small_table)
    r = readers.ResidentReader(small_table, off, n + 4096, config=engine_only())
    assert r.file_id[2] == size and r.resident(np.array([0]), rb) is None       # (resident does not tell)
    with pytest.raises(gg.ReadError, match=rf"unexpected end of file at offset {size} while loading the table"):
        r.read(plan)


def test_pread_splits_rows_larger_than_one_run_chunk(tmp_path, ggufs):
    """Rows of 280,000 B (> RUN_CHUNK): pread's exact-row reads are split into extents of at most RUN_CHUNK and
    still give the file's rows, in any order."""
    path, rows = table_file(tmp_path, ggufs, Q.F32, 70_000, 6)
    assert rows.shape[1] > direct.RUN_CHUNK
    with gg.open_table(path, config=engine_only()) as t:
        ids = np.array([5, 0, 3, 3, 1])
        np.testing.assert_array_equal(t.read_rows(ids, "pread"), rows[ids])
        assert t._readers["pread"].bytes_read == 4 * rows.shape[1]


def test_without_io_uring(small_table, ggufs, monkeypatch, caplog):
    """io_uring unusable here (as under a seccomp policy): engine=uring is an error saying why; engine=auto falls
    back to the native thread pool, says so in `how` and in a warning, and reads gguf's rows."""
    monkeypatch.setattr(uring, "probe", lambda: (False, "io_uring_setup failed: Operation not permitted"))
    with gg.open_table(small_table, config=engine_only(engine="uring")) as t:
        with pytest.raises(gg.ReadError, match="io_uring was requested but is not usable here: io_uring_setup failed"):
            t.read_rows([1], "direct")
    ref = ggufs.reference(small_table)
    with gg.open_table(small_table, config=engine_only(engine="auto")) as t:
        ids = np.arange(0, t.n_rows, 7)
        np.testing.assert_array_equal(t.gather(ids, "direct"), ref[ids])
        how = t._readers["direct"].how
    if filesystem(small_table) not in direct.MEMORY_FILESYSTEMS:
        assert "io_uring_setup failed: Operation not permitted: native thread pool instead" in how
        assert any("native thread pool instead" in m for m in caplog.messages)


def test_a_second_thread_waits_for_the_reader(small_table, ggufs):
    """A reader in use by one thread makes another wait (not fail); then it reads the right rows."""
    ref = ggufs.reference(small_table)
    with gg.open_table(small_table) as t:
        t.read_rows([1], "direct")
        r = t._readers["direct"]
        out = {}
        th = threading.Thread(target=lambda: out.setdefault("x", t.gather([2, 7], "direct")))
        with r._lock:          # as if another thread were inside a read
            th.start()
            th.join(0.3)
            assert th.is_alive() and "x" not in out      # waiting
        th.join(10)
        assert not th.is_alive()
        np.testing.assert_array_equal(out["x"], ref[[2, 7]])


def test_threads_with_one_table_each(small_table, ggufs):
    ref = ggufs.reference(small_table)
    errors = []

    def work(seed):
        try:
            with gg.open_table(small_table) as t:
                ids = np.random.default_rng(seed).integers(0, t.n_rows, 2000)
                for _ in range(20):
                    np.testing.assert_array_equal(t.gather(ids, "direct"), ref[ids])
        except Exception as e:     # pragma: no cover - reported below
            errors.append(e)
    ths = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    [th.start() for th in ths]
    [th.join() for th in ths]
    assert not errors


def _resources():
    with open("/proc/self/maps") as f:
        maps = sum(1 for _ in f)
    return len(os.listdir("/proc/self/fd")), maps


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_no_fd_map_or_ring_leaks(small_table):
    for backend in HOST:                       # warm up lazy imports and the native library
        with gg.open_table(small_table) as t:
            t.read_rows([0, 1], backend)
    before = _resources()
    for i in range(60):
        with gg.open_table(small_table) as t:
            for backend in HOST:
                t.read_rows([i % t.n_rows, 3], backend)
    with gg.open_table(small_table) as t:
        ids = np.random.default_rng(0).integers(0, t.n_rows, (20_000, 2))
        t.read_rows(ids[0], "direct")
        first = _resources()
        for row in ids:                        # many small gathers on one table: nothing grows
            t.read_rows(row, "direct")
        assert _resources() == first
    after = _resources()
    assert after[0] == before[0], (before, after)
    assert after[1] <= before[1] + 2, (before, after)


# -- bad input through the Table ------------------------------------------------------------------------------

@pytest.mark.parametrize("ids", [[[1, 2], [3]], [[0], [1, [2]]]])
def test_ragged_ids_through_the_table(small_table, ids):
    with gg.open_table(small_table) as t:
        for call in (t.read_rows, t.gather, t.plan):
            with pytest.raises(gg.BadIdsError, match="rectangular"):
                call(ids)


@pytest.mark.parametrize("dtype", ["int8", np.int32, "float64", "nonsense", 3, None, object(), "f4,f4"])
def test_bad_output_dtype_is_a_gather_error_naming_the_accepted_ones(small_table, dtype):
    with gg.open_table(small_table) as t:
        with pytest.raises(gg.GatherError, match="float32, float16, bfloat16") as e:
            t.gather([1, 2], dtype=dtype)
        assert isinstance(e.value, TypeError)      # still a TypeError for callers that caught that
    for good, name in ((np.float16, "float16"), ("bfloat16", "bfloat16"), ("float32", "float32")):
        from gds_gather.gpu.arrays import dtype_name
        assert dtype_name(good) == name


# -- any ids, gap, alignment, window cap and queue depth: the file's bytes ----------------------------------------

@pytest.fixture(scope="module")
def prop_table(tmp_path_factory):
    """7,000 rows of 170 B (1.2 MB) ending exactly at the end of the file."""
    from gds_gather.formats.quants import row_bytes
    rows = np.random.default_rng(11).integers(0, 256, (7000, row_bytes(Q.Q8_0, 160)), dtype=np.uint8)
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "_cf", os.path.join(os.path.dirname(os.path.dirname(__file__)), "conftest.py"))
    cf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cf)
    p = cf.write_gguf(tmp_path_factory.mktemp("prop") / "prop.gguf", rows, Q.Q8_0)
    with gg.open_table(p) as t:
        os.truncate(p, t.data_offset + t.n_bytes)
        oracle = np.fromfile(p, np.uint8, t.n_bytes, offset=t.data_offset).reshape(t.n_rows, t.row_bytes)
    return p, oracle


@st.composite
def _ids(draw, n_rows):
    mode = draw(st.sampled_from(["uniform", "clustered", "run"]))
    n = draw(st.integers(0, 400))
    if mode == "uniform":
        return np.array(draw(st.lists(st.integers(0, n_rows - 1), min_size=n, max_size=n)), np.int64)
    lo = draw(st.integers(0, n_rows - 1))
    if mode == "run":
        return np.arange(lo, min(n_rows, lo + n), dtype=np.int64)
    span = draw(st.integers(1, 3000))
    return np.array(draw(st.lists(st.integers(lo, min(n_rows - 1, lo + span)), min_size=n, max_size=n)), np.int64)


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_plan_settings_read_the_files_bytes(prop_table, data):
    path, rows = prop_table
    engines = (["uring"] if uring.probe()[0] else []) + (["threads"] if native.library()[0] is not None else [])
    cfg = engine_only(
        align=data.draw(st.sampled_from([0, 512, 4096, 65536])),
        max_gap=data.draw(st.one_of(st.just(0), st.integers(0, 300_000))),
        max_window=data.draw(st.one_of(st.sampled_from([0, 1, 4096, 65536]), st.integers(1, 1 << 20))),
        max_waste=data.draw(st.sampled_from([0.0, 1.0, 16.0, 1e9])),
        queue_depth=data.draw(st.sampled_from([1, 2, 3, 8, 128])),
        engine=data.draw(st.sampled_from(engines or ["auto"])))
    ids = data.draw(_ids(rows.shape[0]))
    with gg.open_table(path, config=cfg) as t:
        for backend in ("direct", "pread"):
            np.testing.assert_array_equal(t.read_rows(ids, backend), rows[ids], err_msg=f"{backend} {cfg}")
        p = t.plan(ids)
        if cfg.max_window and p.n_windows:
            over = p.win_lengths > max(cfg.max_window, t.align)
            assert not over.any() or t.row_bytes % t.align, "a window over the cap where every cut fits"


def test_buffered_exact_rows_read_runs_of_adjacent_rows_as_one_extent(small_table, monkeypatch):
    """direct's buffered path (tmpfs, or O_DIRECT refused) reads contiguous ids as one extent; pread (the
    llama.cpp baseline) keeps one read per row. Both exact against the file's bytes."""
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)
    monkeypatch.setattr(direct.os, "open", no_direct)
    with gg.open_table(small_table, config=engine_only(engine="threads")) as t:
        rows = np.fromfile(small_table, np.uint8, t.n_bytes, offset=t.data_offset).reshape(t.n_rows, t.row_bytes)
        ids = np.concatenate([np.arange(10, 150), [7, 200, 201, 202, 299, 11]])
        for backend, extents in (("direct", 4), ("pread", 145)):     # runs 7 | 10..149 | 200..202 | 299
            t.read_rows([0], backend)
            r = t._readers[backend]
            assert not r.odirect
            seen = []
            real_submit = r._submit

            def spy(o, ln, e, d, do, *more, real_submit=real_submit):
                seen.append(o.shape[0])
                return real_submit(o, ln, e, d, do, *more)
            monkeypatch.setattr(r, "_submit", spy)
            np.testing.assert_array_equal(t.read_rows(ids, backend), rows[ids])
            assert seen == [extents], (backend, seen)


def test_staging_grows_in_place_keeping_its_pages():
    """A larger batch keeps the staging's address and the pages already touched (no fresh buffer of the next
    power of two, faulted in and registered again); only growth past the reservation maps a new range."""
    st = readers.Staging()
    st.RESERVE_MIN = 64 << 20
    a = st.ensure(1000)
    base = a.ctypes.data
    a[:4] = [1, 2, 3, 4]
    b = st.ensure(5 << 20)
    assert b.ctypes.data == base and 5 << 20 <= b.nbytes <= (5 << 20) * 5 // 4 + st.GRAIN
    assert b[:4].tolist() == [1, 2, 3, 4] and st.grows == 2
    assert st.ensure(3000).nbytes == b.nbytes and st.grows == 2          # smaller: reused as is
    c = st.ensure(200 << 20)                                              # past the 64 MiB reservation
    assert c.nbytes >= 200 << 20 and st.grows == 3
    del a, b, c
    st.close()


@pytest.fixture
def pages(tmp_path):
    """pages(n, seed): a file of n random 4 KiB pages, opened: (fd, its bytes, offsets, lengths, a zeroed
    buffer, the buffer's page addresses); the fd is closed after the test."""
    fds = []

    def make(n: int, seed: int):
        path = tmp_path / f"pages-{n}-{seed}.bin"
        data = np.random.default_rng(seed).integers(0, 256, n << 12, dtype=np.uint8)
        data.tofile(path)
        fds.append(os.open(path, os.O_RDONLY))
        offs = np.arange(n, dtype=np.int64) * 4096
        dst = np.zeros(n * 4096, np.uint8)
        return fds[-1], data, offs, np.full(n, 4096, np.int64), dst, np.uint64(dst.ctypes.data) + offs.astype(np.uint64)
    yield make
    for fd in fds:
        os.close(fd)


@pytest.mark.skipif(not uring.probe()[0], reason="io_uring unavailable here")
def test_work_during_io_runs_once_while_reads_are_in_flight(pages):
    """Ring.reads(pause=True): SUBMITTED comes once, after the first submission and before the last completion is
    reaped (the caller's work `f` at that step);
    the rows are exact; an exception from f drains the ring, propagates, and the next read works."""
    fd, data, offs, lens, dst, addrs = pages(64, 3)
    with uring.Ring(64) as ring:
        seen = []

        def during():
            seen.append(ring.outstanding())
        _read_between(ring, fd, offs, lens, addrs, queue_depth=16, between=during)
        np.testing.assert_array_equal(dst, data)
        assert len(seen) == 1 and seen[0][0] == 0 and seen[0][1] > 0   # all taken by the kernel, some in flight
        assert ring.outstanding() == (0, 0)

        def boom():
            raise RuntimeError("boom")
        with pytest.raises(RuntimeError, match="boom"):
            _read_between(ring, fd, offs, lens, addrs, queue_depth=16, between=boom)
        assert ring.outstanding() == (0, 0) and not ring.broken
        dst[:] = 0
        ring.read(fd, offs, lens, addrs, queue_depth=16)
        np.testing.assert_array_equal(dst, data)


@pytest.mark.skipif(not uring.probe()[0], reason="io_uring unavailable here")
@pytest.mark.parametrize("max_chunk", [None, 1024])
def test_handover_sees_complete_extents_once_while_the_rest_are_read(pages, monkeypatch, max_chunk):
    """Ring.reads(marks=[n1, n2]): Complete comes once when at least n1 extents are complete and once more at n2,
    with the mask of the complete ones (their bytes already in place; the second mask covers the first), also when
    extents are cut into pieces and when completions come short (resubmitted); thresholds passed together give one
    call; an exception from f drains the ring and propagates."""
    fd, data, offs, lens, dst, addrs = pages(96, 4)
    if max_chunk:
        monkeypatch.setattr(uring.Ring, "max_chunk", max_chunk)
    with uring.Ring(64) as ring:
        for short in (False, True):
            if short:       # every first completion of a piece returns half its bytes: resubmitted
                seen_ud = set()

                def inject(res, ud):
                    first = np.array([int(u) not in seen_ud for u in ud])
                    seen_ud.update(int(u) for u in ud)
                    return np.where(first & (res > 1), res // 2, res)
                ring.inject = inject
            dst[:] = 0
            calls = []

            def hand(done):
                calls.append(done.copy())
                for i in np.flatnonzero(done):      # a complete extent's bytes are all there
                    np.testing.assert_array_equal(dst[i * 4096:(i + 1) * 4096], data[i * 4096:(i + 1) * 4096])
            _read_marks(ring, fd, offs, lens, addrs, queue_depth=16, marks=[72, 30], hand=hand)
            ring.inject = None
            np.testing.assert_array_equal(dst, data)
            assert 1 <= len(calls) <= 2 and all(c.shape == (96,) and c.dtype == bool for c in calls)
            assert calls[0].sum() >= (30 if len(calls) == 2 else 72) and calls[-1].sum() >= 72
            assert (calls[-1] >= calls[0]).all()
            assert ring.outstanding() == (0, 0)
        calls = []
        _read_marks(ring, fd, offs, lens, addrs, queue_depth=16, marks=[], hand=hand)
        _read_marks(ring, fd, offs, lens, addrs, queue_depth=16, marks=[96, 95], hand=hand)
        assert len(calls) == 1 and calls[0].all()           # (no thresholds: no call; two at the end: one)

        def boom(done):
            raise RuntimeError("boom")
        with pytest.raises(RuntimeError, match="boom"):
            _read_marks(ring, fd, offs, lens, addrs, queue_depth=16, marks=[10], hand=boom)
        assert ring.outstanding() == (0, 0) and not ring.broken


def test_direct_read_yields_in_flight_once_before_its_rows_on_every_engine(small_table):
    """parts(plan): IN_FLIGHT once, before any rows (the caller's overlapped work), then Parts covering every row
    once, exact; read(plan) gives the same rows as one array."""
    from gds_gather.io import measure
    cfgs = [gg.Config(engine="threads")] + ([gg.Config(engine="uring")] if uring.probe()[0] else [])
    for cfg in cfgs:
        measure.evict_file(small_table)          # rows the page cache holds are copied, no read: no IN_FLIGHT
        with gg.open_table(small_table, config=cfg) as t:
            r = t._reader("direct")
            plan = t.plan(np.arange(0, t.n_rows, 3))
            events, got = [], np.zeros((plan.n_unique, t.row_bytes), np.uint8)
            seen = np.zeros(plan.n_unique, int)
            with closing(r.parts(plan)) as steps:
                for step in steps:
                    if step is readers.IN_FLIGHT:
                        events.append("in flight")
                        continue
                    events.append("part")
                    step.rows.copy_to(got, step.positions)
                    seen[step.positions] += 1
            raw = np.fromfile(small_table, np.uint8, t.n_bytes, offset=t.data_offset).reshape(t.n_rows, -1)
            np.testing.assert_array_equal(got, raw[plan.unique_rows])
            assert events.count("in flight") == 1 and events[0] == "in flight" and (seen == 1).all()
            np.testing.assert_array_equal(r.read(plan), raw[plan.unique_rows])


def test_staging_of_a_closed_reader_is_reused_once(small_table):
    """A closed direct reader's staging goes to the pool and the next reader takes it (same memory, exact rows);
    two live readers never share one; closing twice pools it once."""
    raw = None
    with gg.open_table(small_table) as t:
        t.read_rows([1, 2], "direct")
        r = t._readers["direct"]
        if not r.odirect:
            pytest.skip("no O_DIRECT here")
        raw = np.fromfile(small_table, np.uint8, t.n_bytes, offset=t.data_offset).reshape(t.n_rows, -1)
        addr = r.staging.buf.ctypes.data
    r.close()                                   # again: nothing pooled twice
    with gg.open_table(small_table) as a, gg.open_table(small_table) as b:
        ids = np.arange(0, a.n_rows, 2)
        np.testing.assert_array_equal(a.read_rows(ids, "direct"), raw[ids])
        np.testing.assert_array_equal(b.read_rows(ids[::-1], "direct"), raw[ids[::-1]])
        sa, sb = a._readers["direct"].staging, b._readers["direct"].staging
        assert sa is not sb and sa.buf.ctypes.data != sb.buf.ctypes.data
        assert addr in (sa.buf.ctypes.data, sb.buf.ctypes.data)
    readers.release_staging_pool()
    assert not readers._POOL


def test_native_build_once_per_cache_dir(tmp_path, monkeypatch):
    """native.build compiles the helpers into <cache_dir>/native once (recorded in native.built) and then finds
    them there; a process loading them from that directory runs no compiler (what a new process's start-up
    costs); with no compiler it says so and builds nothing."""
    if native.compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(native, "built", [])
    so, why = native.build(tmp_path / "c")
    assert so is not None and so.is_file() and so.parent == tmp_path / "c" / "native" and why == ""
    assert native.built == [str(so)]
    assert native.build(tmp_path / "c") == (so, "") and native.built == [str(so)]       # found, not rebuilt
    lib, why = native.library(gg.Config(cache_dir=tmp_path / "c"))
    assert lib is not None and native.built == [str(so)]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CC", raising=False)
    assert native.build(tmp_path / "d") == (None, "no C compiler (cc) to build the native helpers")
    assert not (tmp_path / "d" / "native").exists() or not any((tmp_path / "d" / "native").iterdir())
