"""Rows out of a staging buffer (native.RowsAt, numpy and native) with no rows, and closing a reader's fd that was
already closed (issue 17)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from gds_gather.io import native
from gds_gather.io import direct


@pytest.mark.parametrize("use_lib", [False, True], ids=["numpy", "native"])
def test_rows_at_of_no_rows_and_of_some(use_lib):
    lib = native.library()[0] if use_lib else None
    if use_lib and lib is None:
        pytest.skip("no C compiler for the native helpers")
    staging = np.arange(40, dtype=np.uint8)
    none = native.RowsAt(staging, np.zeros(0, np.int64), 4, lib).array()
    assert none.shape == (0, 4) and none.dtype == np.uint8
    got = native.RowsAt(staging, np.array([8, 0, 36], np.int64), 4, lib).array()
    np.testing.assert_array_equal(got, [staging[8:12], staging[0:4], staging[36:40]])


def test_closing_an_fd_closed_elsewhere_is_quiet(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    direct._close_fd(fd)
    direct._close_fd(fd)                    # EBADF now: a finalizer after an explicit close
    try:
        os.fstat(fd)
        raise AssertionError("the fd is still open")
    except OSError as e:
        assert e.errno == 9
