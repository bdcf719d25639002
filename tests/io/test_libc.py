"""io/libc.py: one C library handle for the package, its shared functions typed once."""
from __future__ import annotations

import ctypes
import mmap
import os
import platform

import numpy as np
import pytest

from gds_gather.io.libc import libc


def test_one_handle_with_errno():
    assert libc() is libc()
    assert libc().syscall.restype is ctypes.c_long


@pytest.mark.skipif(platform.machine() != "x86_64", reason="getpid's syscall number is x86_64's here")
def test_syscall_returns_a_long():
    assert libc().syscall(ctypes.c_long(39)) == os.getpid()          # SYS_getpid on x86_64


def test_mincore_and_errno():
    buf = mmap.mmap(-1, 2 * mmap.PAGESIZE)
    try:
        arr = np.frombuffer(buf, np.uint8)
        arr[0] = 1                                       # touch the first page only
        vec = np.zeros(2, np.uint8)
        addr = arr.ctypes.data
        assert libc().mincore(addr, 2 * mmap.PAGESIZE, vec.ctypes.data) == 0 and vec[0] & 1
        assert libc().mincore(addr + 1, mmap.PAGESIZE, vec.ctypes.data) == -1     # not page-aligned: EINVAL
        assert ctypes.get_errno() == 22
        del arr
    finally:
        buf.close()
