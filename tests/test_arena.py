"""Recycled result memory (arena.py): a result's memory is reused only once nothing refers to it, and rows read
through every host backend stay exact while earlier results are kept, dropped or viewed."""
from __future__ import annotations

import gc

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from hypothesis import given, settings, strategies as st, HealthCheck

import gds_gather as gg
from gds_gather import arena


@pytest.fixture(autouse=True)
def small_results(monkeypatch):
    """Every result of these tests' small tables goes through the arena; free lists start empty."""
    monkeypatch.setattr(arena, "MIN_BYTES", 1)
    arena.clear()
    yield
    arena.clear()


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_rows_is_a_writable_contiguous_uint8_array():
    a = arena.rows(7, 130)
    assert a.shape == (7, 130) and a.dtype == np.uint8 and a.flags.c_contiguous and a.flags.writeable
    a[:] = 5
    assert int(a.sum()) == 5 * 7 * 130


def test_small_results_are_plain_arrays(monkeypatch):
    monkeypatch.setattr(arena, "MIN_BYTES", 1 << 20)
    a = arena.rows(4, 100)
    assert a.flags.owndata and not arena._free


def test_memory_is_reused_only_after_every_view_is_gone():
    a = arena.rows(100, 100)
    a[:] = 7
    addr = _addr(a)
    v = a[10:].view(np.uint16)          # a view outlives the array it came from
    del a
    gc.collect()
    b = arena.rows(100, 100)            # same size class: must not take the memory v still shows
    assert _addr(b) != addr
    b[:] = 9
    assert (v == 0x0707).all()
    del v
    gc.collect()
    c = arena.rows(90, 100)             # now free: the same mapping comes back, its pages already touched
    assert _addr(c) == addr


def test_free_lists_keep_at_most_keep_mappings():
    held = [arena.rows(50, 1000) for _ in range(arena.KEEP + 3)]
    del held
    gc.collect()
    assert sum(len(q) for q in arena._free.values()) == arena.KEEP


def test_sizes_share_a_class_only_when_they_fit():
    a = arena.rows(1, 3000)             # class 4 KiB
    addr = _addr(a)
    del a
    b = arena.rows(1, 5000)             # class 8 KiB: not the 4 KiB mapping
    assert _addr(b) != addr
    b[:] = 1                            # (the whole array is writable memory)


@pytest.fixture(scope="module")
def table(tmp_path_factory, ggufs):
    rows = ggufs.rows(Q.Q8_0, 400, 1024, seed=11)
    path = ggufs.write(tmp_path_factory.mktemp("arena") / "t.gguf", rows, Q.Q8_0)
    with gg.open_table(path) as t:
        raw = np.fromfile(path, np.uint8, t.n_bytes, offset=t.data_offset).reshape(t.n_rows, t.row_bytes)
    return path, raw


@pytest.mark.parametrize("backend", ["direct", "pread", "mmap"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=st.lists(st.lists(st.integers(0, 399), min_size=1, max_size=120), min_size=2, max_size=6),
       keep=st.lists(st.booleans(), min_size=6, max_size=6))
def test_kept_results_stay_exact_while_later_reads_recycle(table, backend, batches, keep):
    """Batches read one after another through the row cache; some results are kept (some only as a view), the
    others dropped at once so their memory is recycled by the next reads: every kept result still holds its rows."""
    path, raw = table
    kept = []
    with gg.open_table(path, config=gg.Config(cache_bytes=64 << 10)) as t:
        for i, ids in enumerate(batches):
            ids = np.unique(np.asarray(ids, np.int64))
            out = t.read_plan(t.plan(ids), backend)        # the unique rows: the arena's array itself
            np.testing.assert_array_equal(out, raw[ids])
            if keep[i]:
                kept.append((ids, out[::-1] if i % 2 else out))
            del out
            gc.collect()
        for ids, out in kept:
            want = raw[ids][::-1] if out.strides[0] < 0 else raw[ids]
            np.testing.assert_array_equal(out, want)
