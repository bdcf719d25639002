"""uring.Ring's drain after a fault, with reads that really stay in flight: reads from an empty pipe complete
only when the test writes to it. Covers the drain's timeout, its wait timing out (ETIME) and being interrupted,
a drain that gives up, entries placed but never submitted, and a hook that closes the ring (issue 17)."""
from __future__ import annotations

import errno
import os

from contextlib import closing

import numpy as np
import pytest

from gds_gather.io import uring, uring_abi
from gds_gather.errors import ReadError

pytestmark = pytest.mark.skipif(not uring.probe()[0], reason="io_uring unavailable here")

N, SIZE = 4, 4096

def _read_between(ring, *a, between, **kw):
    """Ring.reads(pause=True) with `between` run at its SUBMITTED step: a caller's work while the reads are in
    flight; an exception from it closes the generator (the ring drains)."""
    with closing(ring.reads(*a, pause=True, **kw)) as steps:
        for step in steps:
            if step is uring.SUBMITTED:
                between()



@pytest.fixture()
def pipe():
    r, w = os.pipe()
    yield r, w
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass


def _leave_in_flight(ring, rfd, dst, monkeypatch):
    """A read of N pipe extents whose hook fails, with the ring's own drain skipped: the reads stay in flight."""
    addrs = np.uint64(dst.ctypes.data) + np.arange(N, dtype=np.uint64) * np.uint64(SIZE)

    def boom():
        raise RuntimeError("caller's work failed")
    monkeypatch.setattr(ring, "drain", lambda path, timeout_s=60.0: None)
    with pytest.raises(RuntimeError, match="caller's work failed"):
        _read_between(ring, rfd, np.zeros(N, np.int64), np.full(N, SIZE, np.int64), addrs, path="pipe", between=boom)
    monkeypatch.undo()
    assert ring.outstanding() == (0, N)


def _finish(ring, w):
    """Let the reads still in flight complete (end of file) so the ring closes without waiting."""
    os.close(w)


def test_drain_times_out_on_reads_that_never_complete(pipe, monkeypatch):
    r, w = pipe
    dst = np.zeros(N * SIZE, np.uint8)
    ring = uring.Ring(8)
    assert ring.features & uring_abi.FEAT_EXT_ARG, "this kernel waits without a timeout: the ETIME path is not run"
    _leave_in_flight(ring, r, dst, monkeypatch)
    assert ring.drain("pipe", timeout_s=1.0) is None      # one 1 s wait ends with ETIME, then the deadline
    assert ring.broken == "reads still in flight 1 s after a fault"
    assert ring.outstanding() == (0, N)
    with pytest.raises(ReadError, match=r"^t\.bin: the reader is unusable after an earlier fault \(reads still in "
                                        r"flight 1 s after a fault\); reopen the table$"):
        ring.read(r, np.zeros(1, np.int64), np.ones(1, np.int64), np.array([dst.ctypes.data], np.uint64),
                  path="t.bin")
    _finish(ring, w)
    ring.close()


def test_next_read_drains_first_and_refuses_when_the_drain_fails(pipe, tmp_path, monkeypatch):
    r, w = pipe
    dst = np.zeros(N * SIZE, np.uint8)
    ring = uring.Ring(8)
    _leave_in_flight(ring, r, dst, monkeypatch)

    monkeypatch.setattr(ring, "fd", w)        # the real io_uring_enter, on an fd that is no ring: it fails
    with pytest.raises(ReadError, match=r"^t\.bin: the reader is unusable after an earlier fault \(io_uring_enter "
                                        r"failed while reaping the reads in flight: \[Errno %d\] %s\); reopen the "
                                        r"table$" % (errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))):
        ring.read(r, np.zeros(1, np.int64), np.ones(1, np.int64), np.array([dst.ctypes.data], np.uint64),
                  path="t.bin")
    monkeypatch.undo()
    _finish(ring, w)
    ring.close()


def test_an_interrupt_while_draining_is_raised_after_the_drain(pipe, tmp_path, monkeypatch):
    """The next read drains first; a KeyboardInterrupt met in that drain's wait does not stop it: the reads are
    reaped (they land the pipe's bytes), then the interrupt is raised, and the read after is exact."""
    r, w = pipe
    dst = np.zeros(N * SIZE, np.uint8)
    ring = uring.Ring(8)
    _leave_in_flight(ring, r, dst, monkeypatch)
    payload = np.random.default_rng(2).integers(0, 256, N * SIZE, dtype=np.uint8)
    real_wait, calls = ring.wait, []

    def interrupted_once(n):
        calls.append(n)
        if len(calls) == 1:
            raise KeyboardInterrupt
        if len(calls) == 2:
            os.write(w, payload.tobytes())
        real_wait(n)
    monkeypatch.setattr(ring, "wait", interrupted_once)
    path = tmp_path / "file.bin"
    data = np.random.default_rng(3).integers(0, 256, 8192, dtype=np.uint8)
    data.tofile(path)
    out = np.zeros(8192, np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(KeyboardInterrupt):
            ring.read(fd, np.array([4096], np.int64), np.array([4096], np.int64), np.array([out.ctypes.data],
                      np.uint64), path=str(path))
        assert calls[:2] == [N, N] and ring.outstanding() == (0, 0) and not ring.broken
        got = np.sort(dst.reshape(N, SIZE), axis=0)         # which extent got which 4 KiB of the pipe is the kernel's
        assert np.array_equal(got, np.sort(payload.reshape(N, SIZE), axis=0))
        assert not out.any(), "the interrupted read must not have run"
        monkeypatch.undo()
        ring.read(fd, np.array([4096, 0], np.int64), np.array([4096, 4096], np.int64),
                  np.uint64(out.ctypes.data) + np.array([0, 4096], np.uint64), path=str(path))
        assert np.array_equal(out[:4096], data[4096:]) and np.array_equal(out[4096:], data[:4096])
    finally:
        os.close(fd)
        ring.close()


def test_a_drain_interrupted_every_time_gives_up(pipe, monkeypatch):
    r, w = pipe
    dst = np.zeros(N * SIZE, np.uint8)
    ring = uring.Ring(8)
    _leave_in_flight(ring, r, dst, monkeypatch)
    calls = []

    def always(n):
        calls.append(n)
        raise KeyboardInterrupt
    monkeypatch.setattr(ring, "wait", always)
    with pytest.raises(ReadError, match=r"unusable after an earlier fault \(interrupted too often while reaping "
                                        r"the reads in flight\); reopen the table$"):
        ring.read(r, np.zeros(1, np.int64), np.ones(1, np.int64), np.array([dst.ctypes.data], np.uint64),
                  path="t.bin")
    assert len(calls) == uring.DRAIN_TRIES
    monkeypatch.undo()
    _finish(ring, w)
    ring.close()


def test_entries_placed_but_never_submitted_are_taken_back(tmp_path, monkeypatch):
    """An interrupt between placing entries in the submission ring and io_uring_enter (here: in the latency
    stamp, the one call in between): the drain takes them back; the kernel never reads them."""
    path = tmp_path / "file.bin"
    data = np.random.default_rng(5).integers(0, 256, 16 * SIZE, dtype=np.uint8)
    data.tofile(path)
    out = np.zeros(16 * SIZE, np.uint8)
    addrs = np.uint64(out.ctypes.data) + np.arange(16, dtype=np.uint64) * np.uint64(SIZE)
    offs = np.arange(16, dtype=np.int64)[::-1] * SIZE
    lens = np.full(16, SIZE, np.int64)
    fd = os.open(path, os.O_RDONLY)
    try:
        with uring.Ring(16) as ring:
            real = uring.time.perf_counter_ns
            seen = []

            def stamp():
                seen.append(1)
                raise KeyboardInterrupt
            monkeypatch.setattr(uring.time, "perf_counter_ns", stamp)
            with pytest.raises(KeyboardInterrupt):
                ring.read(fd, offs, lens, addrs, path=str(path), lat_ns=np.zeros(16, np.int64))
            monkeypatch.setattr(uring.time, "perf_counter_ns", real)
            assert seen == [1] and ring.drained == 16 and ring.outstanding() == (0, 0) and not ring.broken
            assert not out.any(), "the kernel read entries it was never given"
            lat = np.zeros(16, np.int64)
            ring.read(fd, offs, lens, addrs, path=str(path), lat_ns=lat)
            assert np.array_equal(out.reshape(16, SIZE), data.reshape(16, SIZE)[::-1]) and (lat > 0).all()
    finally:
        os.close(fd)


def test_a_hook_that_closes_the_ring_then_fails(tmp_path):
    path = tmp_path / "file.bin"
    np.arange(8 * SIZE, dtype=np.uint8).tofile(path)
    out = np.zeros(8 * SIZE, np.uint8)
    fd = os.open(path, os.O_RDONLY)
    ring = uring.Ring(8)

    def close_then_fail():
        ring.close()
        raise RuntimeError("hook failed after closing")
    try:
        with pytest.raises(RuntimeError, match="hook failed after closing"):   # not a TypeError from the drain
            _read_between(ring, fd, np.arange(8, dtype=np.int64) * SIZE, np.full(8, SIZE, np.int64),
                      np.uint64(out.ctypes.data) + np.arange(8, dtype=np.uint64) * np.uint64(SIZE),
                      path=str(path), between=close_then_fail)
        assert ring.fd == -1
        with pytest.raises(ReadError, match=r"file\.bin: the io_uring ring is closed"):
            ring.read(fd, np.zeros(1, np.int64), np.ones(1, np.int64), np.array([out.ctypes.data], np.uint64),
                      path=str(path))
    finally:
        os.close(fd)


def test_close_tolerates_an_fd_already_closed_elsewhere():
    before = set(os.listdir("/proc/self/fd"))
    ring = uring.Ring(8)
    os.close(ring.fd)                       # as a careless caller (or a fork helper) may do
    ring.close()                            # unmaps, then closing the fd again fails quietly
    assert ring.fd == -1 and set(os.listdir("/proc/self/fd")) == before
