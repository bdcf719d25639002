"""pagecache.Residency's failure branches (issue 17): a path that cannot be stat'ed is not trusted, a cachestat
the kernel refuses disables itself for good, and page-cache rows of a file truncated since are an end-of-file
ReadError naming the offset, where the rows before it are the file's bytes."""
from __future__ import annotations

import os

import numpy as np
import pytest

from gds_gather.io import native
from gds_gather.io import pagecache
from gds_gather.config import Config
from gds_gather.errors import ReadError

ROW = 2048       # >= PREAD_MIN_ROW: page-cache rows are pread


@pytest.fixture()
def table(tmp_path):
    path = tmp_path / "t.bin"
    data = np.random.default_rng(11).integers(0, 256, 64 * ROW, dtype=np.uint8)
    data.tofile(path)
    return path, data


def test_an_unstatable_path_is_not_trusted(tmp_path, table):
    assert pagecache._mincore_trusted(tmp_path / "absent.bin") is False
    assert pagecache._mincore_trusted(table[0]) is True          # owned by this user


@pytest.mark.skipif(not pagecache.SYS_CACHESTAT, reason="no cachestat syscall number on this architecture")
def test_a_refused_cachestat_turns_itself_off(table):
    path, data = table
    res = pagecache.Residency(path, 0, data.size)
    try:
        res._learned()                                           # the background map is made: no other user
        assert res.cached() is not None                          # this kernel has cachestat (6.5+)
        r = os.open(path, os.O_PATH)
        os.close(res._fd)
        res._fd = r                                              # an O_PATH fd: cachestat refuses it (EBADF)
        assert res.cached() is None
        with pytest.raises(OSError):
            os.fstat(r)                                          # the refused fd was closed
        assert res._fd == -1 and res.cached() is None            # and never asked again
    finally:
        res.close()


def test_rows_of_a_file_truncated_since_are_an_end_of_file_error(table, tmp_path):
    path, data = table
    if native.library(Config(cache_dir=tmp_path / "cache"))[0] is None:
        pytest.skip("no native helpers: rows are copied from the mapping")
    res = pagecache.Residency(path, 0, data.size, config=Config(cache_dir=tmp_path / "cache"))
    try:
        out = np.zeros((3, ROW), np.uint8)
        res.take(np.array([1, 2, 40]), ROW, out)
        assert np.array_equal(out, data.reshape(-1, ROW)[[1, 2, 40]])
        os.truncate(path, 10 * ROW)
        out[:] = 0
        with pytest.raises(ReadError, match=rf"^{path}: reading page-cache rows at offset {40 * ROW} failed: "
                                            r"unexpected end of file$"):
            res.take(np.array([3, 40]), ROW, out[:2])
        assert np.array_equal(out[0], data.reshape(-1, ROW)[3])
    finally:
        res.close()
