"""A file that ends inside an aligned block before the bytes an extent expects (truncated after the table
was opened): every engine raises an end-of-file ReadError naming the offset, where each used to re-read the
same block forever. Also the Python pool's error branches (issue 17)."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from gds_gather.io import native
from gds_gather.io import direct
from gds_gather.io import uring
from gds_gather.config import Config
from gds_gather.errors import ReadError

SIZE, ALIGN, EXPECT, WINDOW = 700, 512, 1000, 1024     # ends 188 bytes into its second 512-byte block


@pytest.fixture()
def short_file(tmp_path):
    path = tmp_path / "t.bin"
    data = np.random.default_rng(9).integers(0, 256, SIZE, dtype=np.uint8)
    data.tofile(path)
    fd = os.open(path, os.O_RDONLY)
    yield path, data, fd
    os.close(fd)


def _one(v):
    return np.array([v], np.int64)


def test_python_pool_refuses_a_file_ending_inside_an_aligned_block(short_file):
    path, data, fd = short_file
    dst = np.zeros(WINDOW, np.uint8)
    with pytest.raises(ReadError, match=rf"^{path}: unexpected end of file at offset {SIZE}: was the file "
                                        r"truncated\?$"):
        direct._python_pool(fd, path, _one(0), _one(WINDOW), _one(EXPECT), dst, _one(0), ALIGN, 1)
    assert np.array_equal(dst[:SIZE], data)              # what the file has did arrive


def test_python_pool_reads_up_to_the_expected_end_then_stops(short_file):
    path, data, fd = short_file
    dst = np.zeros(WINDOW, np.uint8)
    direct._python_pool(fd, path, _one(0), _one(WINDOW), _one(SIZE), dst, _one(0), ALIGN, 1)
    assert np.array_equal(dst[:SIZE], data) and not dst[SIZE:].any()


def test_python_pool_names_offset_and_errno_of_a_failed_read(short_file):
    path, data, fd = short_file
    r, w = os.pipe()                                     # preadv on a pipe: ESPIPE, a real kernel error
    try:
        with pytest.raises(ReadError, match=rf"^\[Errno {errno.ESPIPE}\] {path}: read at offset 100 failed: "
                                            rf"{os.strerror(errno.ESPIPE)}$") as ei:
            direct._python_pool(r, path, _one(100), _one(16), _one(16), np.zeros(16, np.uint8), _one(0), 1, 1)
        assert ei.value.errno == errno.ESPIPE
    finally:
        os.close(r)
        os.close(w)


def test_python_pool_retries_an_interrupted_read(short_file, monkeypatch):
    path, data, fd = short_file
    real, calls = os.preadv, []

    def eintr_once(*a):
        calls.append(a[-1])
        if len(calls) == 1:
            raise InterruptedError(errno.EINTR, "Interrupted system call")
        return real(*a)
    monkeypatch.setattr(direct.os, "preadv", eintr_once)
    dst = np.zeros(64, np.uint8)
    direct._python_pool(fd, path, _one(300), _one(64), _one(64), dst, _one(0), 1, 1)
    assert calls == [300, 300] and np.array_equal(dst, data[300:364])


@pytest.mark.skipif(not uring.probe()[0], reason="io_uring unavailable here")
def test_uring_refuses_a_file_ending_inside_an_aligned_block(short_file):
    path, data, fd = short_file
    dst = np.zeros(WINDOW, np.uint8)
    with uring.Ring(8) as ring:
        with pytest.raises(ReadError, match=rf"^{path}: unexpected end of file at offset {SIZE} \({EXPECT - SIZE} "
                                            r"bytes missing\): was the file truncated\?$"):
            ring.read(fd, _one(0), _one(WINDOW), np.array([dst.ctypes.data], np.uint64), expect=_one(EXPECT),
                      align=ALIGN, path=path)
        assert ring.outstanding() == (0, 0) and not ring.broken
        assert np.array_equal(dst[:SIZE], data)
        dst[:] = 0
        ring.read(fd, _one(0), _one(WINDOW), np.array([dst.ctypes.data], np.uint64), expect=_one(SIZE),
                  align=ALIGN, path=path)
        assert np.array_equal(dst[:SIZE], data)


def test_native_pool_refuses_a_file_ending_inside_an_aligned_block(short_file, tmp_path):
    lib, why = native.library(Config(cache_dir=tmp_path / "cache"))
    if lib is None:
        pytest.skip(why)
    path, data, fd = short_file
    dst = np.zeros(WINDOW, np.uint8)
    assert native.pread_pool(lib, fd, _one(0), _one(WINDOW), _one(EXPECT), dst, _one(0), align=ALIGN,
                             threads=1) == (0, -1)       # extent 0, end of file
    assert np.array_equal(dst[:SIZE], data)
    assert native.pread_pool(lib, fd, _one(0), _one(WINDOW), _one(SIZE), dst, _one(0), align=ALIGN,
                             threads=1) == (-1, 0)


def test_python_pool_names_the_offset_of_an_extent_past_the_end(short_file):
    path, data, fd = short_file
    with pytest.raises(ReadError, match=rf"^{path}: unexpected end of file at offset {SIZE + 100}: was the file "
                                        r"truncated\?$"):
        direct._python_pool(fd, path, _one(SIZE + 100), _one(8), _one(8), np.zeros(8, np.uint8), _one(0), 1, 1)
