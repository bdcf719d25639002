"""uring.Ring's refusals and error paths, read by read against the file's own bytes: registration the kernel
refuses (reads still exact, unregistered), a set-up that fails half-way (its fd and mappings released), a ring
that is closed / inherited / broken, a bad latency array, io_uring refused by the kernel, and the drain's wait
on a kernel without IORING_FEAT_EXT_ARG."""
from __future__ import annotations

import errno
import mmap
import os

from contextlib import closing

import numpy as np
import pytest

from gds_gather.io import uring, uring_abi
from gds_gather.errors import ReadError

pytestmark = pytest.mark.skipif(not uring.probe()[0], reason="io_uring unavailable here")


def _uring_fds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[io_uring]"
        except OSError:
            pass
    return n


@pytest.fixture()
def raw(tmp_path):
    path = tmp_path / "raw.bin"
    data = np.random.default_rng(4).integers(0, 256, 256 << 10, dtype=np.uint8)
    data.tofile(path)
    fd = os.open(path, os.O_RDONLY)
    yield path, data, fd, np.zeros(256 << 10, np.uint8)
    os.close(fd)


def _read_between(ring, *a, between, **kw):
    """Ring.reads(pause=True) with `between` run at its SUBMITTED step: a caller's work while the reads are in
    flight; an exception from it closes the generator (the ring drains)."""
    with closing(ring.reads(*a, pause=True, **kw)) as steps:
        for step in steps:
            if step is uring.SUBMITTED:
                between()


def _read_all(ring, fd, dst, path, n=64, size=4096, **kw):
    offs = np.arange(n, dtype=np.int64)[::-1] * size          # backwards: no two reads in file order
    addrs = np.uint64(dst.ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(size)
    if "between" in kw:
        _read_between(ring, fd, offs, np.full(n, size, np.int64), addrs, path=path, **kw)
    else:
        ring.read(fd, offs, np.full(n, size, np.int64), addrs, path=path, **kw)
    return offs


def test_refused_registrations_fall_back_to_plain_reads(raw):
    path, data, fd, dst = raw
    with uring.Ring(16) as ring:
        assert ring.register_buffer(np.zeros(0, np.uint8)) is False and not ring.buffer_registered
        closed = os.open(path, os.O_RDONLY)
        os.close(closed)
        assert ring.register_file(closed) is False and not ring.files_registered
        offs = _read_all(ring, fd, dst, path)
        for i, o in enumerate(offs.tolist()):
            assert np.array_equal(dst[i * 4096:(i + 1) * 4096], data[o:o + 4096])
        assert ring.register_file(fd) and ring.register_file(fd)        # re-registration replaces the table
        assert ring.register_buffer(dst) and ring.register_buffer(dst)
        dst[:] = 0
        _read_all(ring, 0, dst, path)               # fixed file and buffer: the fd argument is not used
        assert np.array_equal(dst[:4096], data[63 * 4096:64 * 4096])


def test_set_up_failing_half_way_releases_the_ring(monkeypatch):
    before = _uring_fds()

    def refuse(*a, **kw):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")
    monkeypatch.setattr(uring.mmap, "mmap", refuse)
    with pytest.raises(OSError, match="Cannot allocate memory"):
        uring.Ring(8)
    monkeypatch.undo()
    assert _uring_fds() == before


def test_probe_says_why_io_uring_is_refused(monkeypatch):
    class Refused:
        def __init__(self, depth):
            raise OSError(errno.EPERM, os.strerror(errno.EPERM))
    monkeypatch.setattr(uring, "Ring", Refused)
    ok, why = uring.probe.__wrapped__()
    assert not ok and why == ("io_uring_setup failed: Operation not permitted (kernel < 5.6, io_uring_disabled, "
                              "or seccomp)")


def test_unusable_rings_refuse_clearly(raw, monkeypatch):
    path, data, fd, dst = raw
    ring = uring.Ring(8)
    with pytest.raises(ValueError, match=r"lat_ns must be int64 of shape \(64,\), got float64 \(64,\)"):
        _read_all(ring, fd, dst, path, lat_ns=np.zeros(64))
    monkeypatch.setattr(ring, "pid", os.getpid() + 1)           # as in a child after fork()
    with pytest.raises(ReadError, match=r"raw\.bin: this io_uring ring was created in process \d+ and inherited"):
        _read_all(ring, fd, dst, path)
    monkeypatch.undo()
    ring.broken = "reads still in flight 60 s after a fault"
    with pytest.raises(ReadError, match=r"unusable after an earlier fault \(reads still in flight 60 s after a "
                                        r"fault\); reopen the table"):
        _read_all(ring, fd, dst, path)
    ring.broken = ""
    ring.close()
    with pytest.raises(ReadError, match=r"raw\.bin: the io_uring ring is closed"):
        _read_all(ring, fd, dst, path)


def test_drain_waits_without_ext_arg(tmp_path):
    """An exception while reads are in flight (the `between` hook) drains the ring through the plain blocking
    io_uring_enter of kernels without IORING_FEAT_EXT_ARG; the next reads are exact. O_DIRECT reads of 1 MiB
    from an evicted file, so that they are still in flight when the hook raises."""
    path = tmp_path / "big.bin"
    data = np.random.default_rng(5).integers(0, 256, 32 << 20, dtype=np.uint8)
    data.tofile(path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    dst = np.frombuffer(mmap.mmap(-1, 32 << 20), np.uint8)        # page-aligned, as O_DIRECT needs
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        with uring.Ring(64) as ring:
            ring.features &= ~uring_abi.FEAT_EXT_ARG

            def boom():
                raise RuntimeError("caller's work failed")
            with pytest.raises(RuntimeError, match="caller's work failed"):
                _read_all(ring, fd, dst, path, n=32, size=1 << 20, between=boom)
            assert ring.outstanding() == (0, 0) and ring.drains == 1 and not ring.broken
            dst[:] = 0
            offs = _read_all(ring, fd, dst, path, n=32, size=1 << 20)
            assert np.array_equal(dst.reshape(32, -1), data.reshape(32, -1)[offs // (1 << 20)])
    finally:
        os.close(fd)


def test_a_second_reader_in_the_same_ring_is_refused(raw):
    """A read started while this ring is reading (here from the `between` hook, as another thread would) is
    refused with the reason; the first read's ring is drained and usable."""
    path, data, fd, dst = raw
    with uring.Ring(16) as ring:
        def again():
            _read_all(ring, fd, dst, path)
        with pytest.raises(ReadError, match=r"raw\.bin: this reader is already reading in another thread; use one "
                                            r"reader \(one Table\) per thread"):
            _read_all(ring, fd, dst, path, between=again)
        assert ring.outstanding() == (0, 0)
        offs = _read_all(ring, fd, dst, path)
        assert np.array_equal(dst[:4096], data[offs[0]:offs[0] + 4096])
