"""RowCache after an interrupted restore (issue 17): the half-filled cache is dirty, and the next admission or
restore empties it first, so none of the half-restored rows is ever a hit; a restore into a cache that holds
rows takes none; an empty sketch query."""
from __future__ import annotations

import numpy as np
import pytest

from gds_gather.cache.sketch import FreqSketch
from gds_gather.cache.store import RowCache

ROW = 64


def _rows(ids):
    return (np.asarray(ids, np.int64)[:, None] * 7 + np.arange(ROW)).astype(np.uint8)


def _half_restored():
    cache = RowCache(row_bytes=ROW, budget=1 << 20)
    ids = np.array([5, 9, 11], np.int64)
    with pytest.raises(ValueError):              # rows of the wrong width: fails after the slots were claimed
        cache.restore(ids, np.ones(3, np.uint8), np.zeros((3, ROW + 1), np.uint8))
    return cache


def test_admission_after_an_interrupted_restore_starts_empty():
    cache = _half_restored()
    with cache.lock:
        slots = cache.admit(np.array([20, 21], np.int64), _rows([20, 21]))
    assert (np.asarray(slots) >= 0).all()
    with cache.lock:
        got = cache.lookup(np.array([5, 9, 11, 20, 21], np.int64))
    assert got[:3].tolist() == [-1, -1, -1] and (got[3:] >= 0).all()
    assert cache.n_used == 2
    np.testing.assert_array_equal(cache.data[got[3:]], _rows([20, 21]))


def test_restore_after_an_interrupted_restore_and_into_a_full_cache():
    cache = _half_restored()
    ids = np.array([3, 4], np.int64)
    assert cache.restore(ids, np.array([2, 9], np.uint8), _rows(ids)) == 2
    with cache.lock:
        slots = cache.lookup(np.array([3, 4, 5], np.int64))
    assert slots[2] == -1 and (slots[:2] >= 0).all()
    np.testing.assert_array_equal(cache.data[slots[:2]], _rows(ids))
    assert cache.restore(np.array([7], np.int64), np.ones(1, np.uint8), _rows([7])) == 0     # holds rows: none
    with cache.lock:
        assert cache.lookup(np.array([7], np.int64)).tolist() == [-1]


def test_an_empty_sketch_query():
    sk = FreqSketch(64, period=640)
    sk.add(np.array([1, 1, 2], np.int64))
    est = sk.estimate(np.zeros(0, np.int64))
    assert est.dtype == np.uint8 and est.shape == (0,)
    assert sk.estimate(np.array([1], np.int64))[0] >= 1
