"""Host memory for the rows a read returns, recycled once the caller lets go of it.

A batch's rows come back as an array the caller owns. Fresh memory costs its first touch, one page fault per 4 KiB:
on the development VM as much as the copy itself (docs/decisions.md, "recycled result memory"). A caller that
drops each batch's rows before or while it reads the next (a prefill, the bench) would pay it every batch. So a
result of MIN_BYTES or more lives in an anonymous private mapping of a power-of-two size class; the array handed
out is the only owner of that mapping's memory (every view numpy makes of it keeps it alive: numpy collapses a
view's base to the first array whose base is not an array), and when it is collected the mapping goes back to a
free list (at most KEEP per size class) for the next result of that class, its pages already touched.

Memory taken by address only (a raw pointer kept after the array is dropped) is reused: as with any array freed.
Free lists are deques (append and pop are atomic): a finalizer may run in any thread, inside any allocation, so
it takes no lock.
"""
from __future__ import annotations

import mmap
import weakref
from collections import deque

import numpy as np

MIN_BYTES = 256 << 10       # smaller results: np.empty (malloc reuses small blocks itself)
KEEP = 2                    # free mappings kept per size class: the rows in use while the next batch is read, + 1

_free: dict[int, deque] = {}
_FLAGS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)


def rows(n: int, row_bytes: int) -> np.ndarray:
    """An uninitialised uint8 [n, row_bytes] C-contiguous array for a read's rows."""
    nbytes = int(n) * int(row_bytes)
    if nbytes < MIN_BYTES or not _FLAGS:
        return np.empty((n, row_bytes), np.uint8)
    size = 1 << (nbytes - 1).bit_length()
    free = _free.setdefault(size, deque())
    try:
        mm = free.pop()
    except IndexError:
        mm = mmap.mmap(-1, size, flags=_FLAGS)
    owner = np.frombuffer(mm, np.uint8, count=nbytes)
    weakref.finalize(owner, _back, free, mm)
    return owner.reshape(n, row_bytes)


def _back(free: deque, mm: mmap.mmap) -> None:
    if len(free) < KEEP:
        free.append(mm)
    # else: dropped; unmapped once the dying array's buffer export is released


def clear() -> None:
    """Forget every free mapping (tests; memory given back to the system once nothing uses it)."""
    _free.clear()
