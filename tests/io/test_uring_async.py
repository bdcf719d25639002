"""uring.Ring.start / finish (reads left in flight, collected later; prefetch.py), against the file's own bytes:
two groups in flight at once collected in either order, a window past the end of the file, a failed or short
read (False, never True), the ring's room, refusals, and an exception while collecting (the ring drained, no
read left in flight)."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from gds_gather.io import uring, uring_groups
from gds_gather.errors import ReadError

pytestmark = pytest.mark.skipif(not uring.probe()[0], reason="io_uring unavailable here")
SIZE = 4096


@pytest.fixture()
def raw(tmp_path):
    path = tmp_path / "raw.bin"
    data = np.random.default_rng(7).integers(0, 256, 64 * SIZE + 1000, dtype=np.uint8)   # a partial last block
    data.tofile(path)
    fd = os.open(path, os.O_RDONLY)
    yield data, fd
    os.close(fd)


def _group(dst, blocks):
    """(offsets, lengths, addrs) reading the given blocks into dst, one block each, in the order given."""
    blocks = np.asarray(blocks, np.int64)
    addrs = np.uint64(dst.ctypes.data) + np.arange(blocks.size, dtype=np.uint64) * np.uint64(SIZE)
    return blocks * SIZE, np.full(blocks.size, SIZE, np.int64), addrs


def _check(dst, blocks, data):
    for i, b in enumerate(blocks):
        want = data[b * SIZE:(b + 1) * SIZE]
        np.testing.assert_array_equal(dst[i * SIZE:i * SIZE + want.size], want)


@pytest.mark.parametrize("order", [(1, 2), (2, 1)])
def test_two_groups_in_flight_are_collected_in_either_order(raw, order):
    data, fd = raw
    a_blocks, b_blocks = [5, 0, 63, 17], [40, 41, 3]
    a, b = np.zeros(4 * SIZE, np.uint8), np.zeros(3 * SIZE, np.uint8)
    with uring_groups.GroupRing(8) as ring:
        for tag, dst, blocks in ((1, a, a_blocks), (2, b, b_blocks)):
            offs, lens, addrs = _group(dst, blocks)
            ring.start(tag, fd, offs, lens, addrs, lens)
        assert ring.room() == min(ring.sq_entries, ring.cq_entries - 7)
        for tag in order:
            assert ring.finish(tag) is True
        assert ring.outstanding() == (0, 0) and ring.room() == min(ring.sq_entries, ring.cq_entries)
    _check(a, a_blocks, data)
    _check(b, b_blocks, data)


def test_a_window_past_the_end_of_file_is_whole_when_expected_so(raw):
    data, fd = raw
    dst = np.zeros(2 * SIZE, np.uint8)
    offs, lens, addrs = _group(dst, [64, 2])            # block 64 holds only the file's last 1000 bytes
    with uring_groups.GroupRing(8) as ring:
        ring.start(3, fd, offs, lens, addrs, np.array([1000, SIZE]))
        assert ring.finish(3) is True
        ring.start(4, fd, offs, lens, addrs, lens)       # expecting a whole block there: short, so False
        assert ring.finish(4) is False
    _check(dst, [64, 2], data)


def test_failed_reads_make_the_group_false_and_leave_nothing_behind(raw):
    data, fd = raw
    dst = np.zeros(8 * SIZE, np.uint8)
    offs, lens, addrs = _group(dst, range(8))
    with uring_groups.GroupRing(16) as ring:
        ring.inject = lambda res, idx: np.where(idx == 5, -errno.EIO, res)
        ring.start(9, fd, offs, lens, addrs, lens)
        assert ring.finish(9) is False
        assert ring.outstanding() == (0, 0)
        ring.inject = None
        ring.start(9, fd, offs, lens, addrs, lens)       # the tag is free again
        assert ring.finish(9) is True
    _check(dst, range(8), data)


def test_refusals(raw):
    _, fd = raw
    dst = np.zeros(8 * SIZE, np.uint8)
    offs, lens, addrs = _group(dst, range(8))
    with uring_groups.GroupRing(4) as ring:
        assert ring.finish(12) is False                  # never queued
        for bad in (0, 1 << 31):
            with pytest.raises(ValueError, match="bad tag"):
                ring.start(bad, fd, offs[:1], lens[:1], addrs[:1], lens[:1])
        with pytest.raises(ValueError, match="room"):
            ring.start(1, fd, offs, lens, addrs, lens)  # 8 reads > a 4-entry ring
        ring.start(1, fd, offs[:2], lens[:2], addrs[:2], lens[:2])
        with pytest.raises(ValueError, match="already queued"):
            ring.start(1, fd, offs[2:3], lens[2:3], addrs[2:3], lens[2:3])
        with pytest.raises(ValueError, match="max_chunk"):
            ring.start(2, fd, offs[:1], np.array([ring.max_chunk + SIZE]), addrs[:1], lens[:1])
        assert ring.finish(1) is True
    with pytest.raises(ReadError, match="closed"):
        ring.start(1, fd, offs[:1], lens[:1], addrs[:1], lens[:1])


def test_an_exception_while_collecting_drains_every_group(raw):
    _, fd = raw
    a, b = np.zeros(4 * SIZE, np.uint8), np.zeros(4 * SIZE, np.uint8)
    with uring_groups.GroupRing(16) as ring:
        for tag, dst in ((1, a), (2, b)):
            offs, lens, addrs = _group(dst, range(4))
            ring.start(tag, fd, offs, lens, addrs, lens)

        def interrupt(res, idx):
            raise KeyboardInterrupt
        ring.inject = interrupt
        with pytest.raises(KeyboardInterrupt):
            ring.finish(1)
        assert ring.outstanding() == (0, 0)              # no read of either group is left in flight
        ring.inject = None
        assert ring.finish(2) is False                   # its reads were reaped by the drain: not to be used
