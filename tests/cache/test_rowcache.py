"""The row cache: any sequence of batches returns exactly the file's rows (gguf's dequantization), the cache stays
within its budget, a changed file is refused, and the index and policy hold their invariants."""
from __future__ import annotations

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gds_gather as gg
from gds_gather.io import native
from gds_gather.cache import index, rowcache, sketch, store
from gds_gather.cache.index import HashIndex
from gds_gather.cache.rowcache import budget_for
from gds_gather.cache.store import RowCache, capacity_for

N_ROWS = 400
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def table(tmp_path_factory, ggufs):
    """(path, raw rows as the file holds them, gguf's dequantization of the table)."""
    return ggufs.table(tmp_path_factory.mktemp("rc") / "rc.gguf", N_ROWS, seed=3)


pytestmark = pytest.mark.usefixtures("fresh_row_caches")


batches = st.lists(st.lists(st.integers(0, N_ROWS - 1), max_size=150), min_size=1, max_size=10)


@SETTINGS
@given(batches=batches, budget=st.integers(0, 40_000), with_gather=st.booleans())
def test_any_batches_return_the_files_rows_within_budget(table, batches, budget, with_gather):
    path, raw, ref = table
    rowcache.drop_all()
    seen = 0
    with gg.open_table(path, config=gg.Config(cache_bytes=budget, page_cache_reads=0)) as t:
        for b in batches:
            ids = np.array(b, np.int64)
            np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
            seen += np.unique(ids).size
            if with_gather:
                np.testing.assert_array_equal(t.gather(ids, "direct"), ref[ids])
                seen += np.unique(ids).size
            c = rowcache._existing(t)
            if c is not None:
                assert c.nbytes <= c.budget == budget
                assert c.n_used <= c.capacity == min(capacity_for(budget, t.row_bytes), N_ROWS)
                used = c.slot_row[:c.n_used]
                assert np.unique(used).size == used.size               # a row lives in one slot
                np.testing.assert_array_equal(c.index.get(used), np.arange(c.n_used))
                np.testing.assert_array_equal(c.data[:c.n_used], raw[used])   # every slot holds its row
        s = t.stats()
        assert s["rows_from_cache"] + s["rows_from_page_cache"] + s["rows_from_device"] == seen
        assert s["cache_hits"] + s["cache_misses"] == (seen if budget and capacity_for(budget, t.row_bytes) else 0)
        assert s["cache_bytes"] <= budget == s["cache_budget_bytes"]


def test_repeats_are_served_by_the_cache_across_tables(table):
    path, raw, _ = table
    ids = np.array([5, 7, 5, 399, 0, 7])
    cfg = gg.Config(cache_bytes=1 << 20, page_cache_reads=0)    # every miss from the device: all admitted
    with gg.open_table(path, config=cfg) as t:
        t.read_rows(ids, "direct")
        b0 = t.stats()["bytes_requested"]
        np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
        s = t.stats()
        assert s["bytes_requested"] == b0 > 0 and s["rows_from_cache"] == 4 and s["cache_hit_rate"] == 0.5
    with gg.open_table(path, config=cfg) as t:    # a new Table: same file, same cache
        np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
        s = t.stats()
        assert s["rows_from_cache"] == 4 and s["bytes_requested"] == 0 and s["cache_bytes"] > 0


def test_disabled_and_baselines_read_every_time(table):
    path, raw, _ = table
    ids = np.arange(0, N_ROWS, 3)
    with gg.open_table(path, config=gg.Config(cache_bytes=0)) as t:
        for _ in range(2):
            np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
        assert t.stats()["rows_from_cache"] == 0 and t.stats()["cache_bytes"] == 0
    with gg.open_table(path, config=gg.Config(cache_bytes=1 << 20)) as t:
        for b in ("pread", "mmap", "readahead"):       # baselines stay faithful: no cache
            for _ in range(2):
                np.testing.assert_array_equal(t.read_rows(ids, b), raw[ids])
        assert t.stats()["rows_from_cache"] == 0


def test_changed_file_is_refused_and_never_served_stale(tmp_path, ggufs):
    rows_a = ggufs.rows(Q.IQ4_NL, 50, 160, seed=1)
    rows_b = ggufs.rows(Q.IQ4_NL, 50, 160, seed=2)
    path = ggufs.write(tmp_path / "c.gguf", rows_a, Q.IQ4_NL)
    ids = np.array([1, 2, 3])
    cfg = gg.Config(cache_bytes=1 << 20, page_cache_reads=0)
    with gg.open_table(path, config=cfg) as t:
        np.testing.assert_array_equal(t.read_rows(ids, "direct"), rows_a[ids])
        assert t.stats()["cache_bytes"] > 0
        st_ = os.stat(path)
        os.utime(path, ns=(st_.st_atime_ns, st_.st_mtime_ns + 10**9))
        with pytest.raises(gg.ReadError, match="modified"):
            t.read_rows(ids, "direct")             # every row is cached: refused all the same
    ggufs.write(tmp_path / "c.gguf", rows_b, Q.IQ4_NL)   # rewritten in place: new contents
    with gg.open_table(path, config=cfg) as t:
        np.testing.assert_array_equal(t.read_rows(ids, "direct"), rows_b[ids])
        assert t.stats()["rows_from_cache"] == 0


def test_budget_config_and_env():
    assert gg.Config.from_env({"GDS_GATHER_CACHE_BYTES": "1048576"}).cache_bytes == 1 << 20
    assert gg.Config().cache_bytes == -1
    assert budget_for(-1, 10 << 30) == rowcache.AUTO_MAX_BYTES and budget_for(-1, 1000) == 100
    assert budget_for(0, 10 << 30) == 0 and budget_for(12345, 1) == 12345
    with pytest.raises(ValueError):
        gg.Config(cache_bytes=-2)


@settings(max_examples=60, deadline=None)
@given(budget=st.integers(0, 1 << 24), row_bytes=st.integers(1, 20000))
def test_capacity_footprint_fits_the_budget(budget, row_bytes):
    c = capacity_for(budget, row_bytes)
    assert store._footprint(c, row_bytes) <= budget or c == 0
    assert store._footprint(c + 1, row_bytes) > budget


@pytest.mark.parametrize("native_index", [False, True], ids=["numpy", "native"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 300), max_size=60, unique=True)),
                    max_size=30))
def test_hash_index_matches_a_dict(native_index, ops):
    lib = None
    if native_index:
        lib = native.library()[0]
        if lib is None:
            pytest.skip("no C compiler for the native helpers")
    idx, model = HashIndex(300, lib), {}
    for insert, keys in ops:
        k = np.array(keys, np.int64)
        if insert:
            new = np.array([x for x in keys if x not in model], np.int64)
            idx.insert(new, new * 7)
            model.update({int(x): int(x) * 7 for x in new})
        else:
            idx.delete(k)
            for x in keys:
                model.pop(x, None)
        probe = np.arange(0, 301, dtype=np.int64)
        want = np.array([model.get(int(x), -1) for x in probe])
        np.testing.assert_array_equal(idx.get(probe), want)
        assert idx.live == len(model)
        assert idx.tombs == int((idx.keys == index.TOMB).sum())


def test_policy_protects_hits_and_keeps_frequent_rows():
    c = RowCache(row_bytes=8, budget=capacity_budget(64, 8))
    assert c.capacity == 64
    hot = np.arange(64, dtype=np.int64)
    for _ in range(5):                     # hot rows: seen often
        s = c.lookup(hot)
        c.admit(hot[s < 0], None)
    assert (c.lookup(hot) >= 0).all()
    cold = np.arange(1000, 1200, dtype=np.int64)     # one-hit rows do not push frequent ones out
    s = c.lookup(cold)
    c.admit(cold, None, protect=np.arange(64))
    assert (c.index.get(hot) >= 0).all()
    assert c.nbytes <= c.budget


def capacity_budget(slots: int, row_bytes: int) -> int:
    return store._footprint(slots, row_bytes)


@pytest.mark.gpu
def test_device_cache_returns_the_rows_and_serves_hits(table):
    import cupy as cp
    path, raw, ref = table
    ids = np.array([[3, 9, 3], [399, 0, 9]])
    with gg.open_table(path, config=gg.Config(cache_bytes=1 << 20)) as t:
        for k in range(3):
            got = t.read_rows(cp.asarray(ids), "direct")
            np.testing.assert_array_equal(cp.asnumpy(got), raw[ids])
            np.testing.assert_array_equal(cp.asnumpy(t.gather(cp.asarray(ids), "direct")), ref[ids])
        s = t.stats()
        assert s["rows_from_cache"] >= 4 * 4 and s["cache_bytes"] > 0
        dest = t.readers()[1][0]
        assert dest.cache is not None and dest.cache.n_used == 4


def test_a_cache_closed_while_a_table_uses_it_only_misses(table):
    """Another thread may close the cache a read already holds (drop_all, a stale identity, the LRU of files):
    the read then misses and reads the file, never indexes into freed rows."""
    path, raw, _ = table
    ids = np.arange(0, N_ROWS, 3)
    with gg.open_table(path, config=gg.Config(cache_bytes=1 << 20, page_cache_reads=0)) as t:
        t.read_rows(ids, "direct")
        c = rowcache._existing(t)
        assert c.n_used == ids.size
        c.close()                                      # as drop_all() in another thread would, mid-use
        assert c.capacity == c.n_used == 0
        slots = c.lookup(ids)
        assert (slots == -1).all() and (c.admit(ids, raw[ids]) == -1).all()
        real = rowcache.cache_for
        rowcache.cache_for = lambda table: c           # the read holds the closed cache
        try:
            np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw[ids])
        finally:
            rowcache.cache_for = real


def test_tables_of_one_file_keep_their_own_caches(tmp_path, ggufs):
    """Two tensors of one file (and two budgets of one tensor) do not replace each other's cache on every call."""
    path = ggufs.write(tmp_path / "two.gguf", ggufs.rows(Q.Q8_0, 200, 160, seed=5), Q.Q8_0)
    ids = np.arange(0, 3)
    with gg.open_table(path, config=gg.Config(cache_bytes=1 << 20, page_cache_reads=0)) as a, \
            gg.open_table(path, tensor="token_embd.weight", config=gg.Config(cache_bytes=1 << 20)) as b, \
            gg.open_table(path, config=gg.Config(cache_bytes=1 << 19, page_cache_reads=0)) as c:
        for _ in range(3):
            for t in (a, b, c):
                t.read_rows(ids, "direct")
        assert a.stats()["rows_from_cache"] == 6 and c.stats()["rows_from_cache"] == 6
        assert rowcache._existing(a) is not rowcache._existing(c)


def test_a_budget_above_the_table_holds_at_most_its_rows(table):
    path, raw, _ = table
    with gg.open_table(path, config=gg.Config(cache_bytes=1 << 42, page_cache_reads=0)) as t:   # 4 TiB
        ids = np.arange(N_ROWS)
        np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw)
        c = rowcache._existing(t)
        assert c.capacity == N_ROWS and c.n_used == N_ROWS
        np.testing.assert_array_equal(t.read_rows(ids, "direct"), raw)
        assert t.stats()["rows_from_cache"] == N_ROWS


def test_prefault_keeps_the_rows_and_the_budget():
    """prefault() only faults pages in: cached rows keep their bytes, later admissions land as before, and it
    never reaches past the cache's slots."""
    rb = 1000
    c = RowCache(row_bytes=rb, budget=1 << 20)
    rng = np.random.default_rng(5)
    rows = np.sort(rng.choice(10_000, 300, replace=False))
    data = rng.integers(0, 256, (300, rb), dtype=np.uint8)
    with c.lock:
        c.lookup(rows[:100])
        c.admit(rows[:100], data[:100])
    c.prefault(150)
    c.prefault(10 * c.capacity)
    assert c._faulted <= c.capacity * rb
    with c.lock:
        c.lookup(rows[100:])
        c.admit(rows[100:], data[100:])
        slots = c.lookup(rows)
    ok = slots >= 0
    assert ok[:100].all()
    np.testing.assert_array_equal(c.data[slots[ok]], data[ok])
    assert c.nbytes <= c.budget
    c.close()
    c.prefault(10)                      # closed: nothing to fault, no error


def test_hash_index_few_keys_path_agrees_with_the_vectorized_one():
    """get() on a decode step's few keys (scalar probes) gives what the vectorized find gives, through collisions,
    tombstones and a rebuild; the oracle is a dict of what was inserted and deleted."""
    rng = np.random.default_rng(3)
    h = HashIndex(600)
    truth = {}
    for _ in range(6):
        k = np.setdiff1d(np.unique(rng.integers(0, 1 << 40, 150)), np.fromiter(truth, np.int64, len(truth)))
        v = rng.integers(0, 1 << 20, k.shape[0])
        h.insert(k, v)
        truth.update(zip(k.tolist(), v.tolist()))
        gone = rng.choice(np.fromiter(truth, np.int64, len(truth)), 40, replace=False)
        h.delete(gone)
        for g in gone.tolist():
            del truth[g]
    q = np.concatenate([np.fromiter(truth, np.int64, len(truth)), rng.integers(0, 1 << 40, 300)])
    want = np.array([truth.get(x, -1) for x in q.tolist()])
    assert index.SCALAR_MAX >= 1
    few = np.concatenate([h.get(q[i:i + index.SCALAR_MAX]) for i in range(0, q.shape[0], index.SCALAR_MAX)])
    p = h.find(q)
    many = np.where(p >= 0, h.vals[np.maximum(p, 0)], -1)
    np.testing.assert_array_equal(few, want)
    np.testing.assert_array_equal(many, want)


def test_lookup_few_rows_counts_as_the_vectorized_path(monkeypatch):
    """lookup of <= SCALAR_MAX rows (Python counting) leaves the same slots, counters, sketch and aging as the
    numpy path (forced with SCALAR_MAX = 0) over a long run of small batches."""
    rng = np.random.default_rng(5)
    a, b = (RowCache(row_bytes=16, budget=1 << 14, max_rows=4000) for _ in range(2))
    for c in (a, b):
        rows = np.arange(0, 4000, 7)
        c.admit(rows, np.zeros((rows.shape[0], 16), np.uint8))
    for _ in range(3000):
        q = np.unique(rng.integers(0, 4000, rng.integers(1, index.SCALAR_MAX + 1)))
        got = a.lookup(q)
        with monkeypatch.context() as m:
            m.setattr(store, "SCALAR_MAX", 0)       # RowCache's counting and HashIndex.get: the numpy paths
            m.setattr(index, "SCALAR_MAX", 0)
            want = b.lookup(q)
        np.testing.assert_array_equal(got, want)
    assert (a.hits, a.misses, a._age) == (b.hits, b.misses, b._age) and a.hits > 0 and a.misses > 0
    np.testing.assert_array_equal(a.slot_freq, b.slot_freq)
    np.testing.assert_array_equal(a.sketch.table, b.sketch.table)


@given(batches=st.lists(st.lists(st.integers(0, (1 << 40) - 1), min_size=1, max_size=300, unique=True),
                        min_size=1, max_size=40))
@settings(max_examples=30, deadline=None)
def test_the_sketch_counts_as_count_min_does(batches):
    """FreqSketch, native and numpy, against a count-min written here with Python integers: the native helper counts
    every key of a batch in each row (saturating at 255); the numpy path may lose a count where two keys of one
    batch share a counter, never gains one; estimates are the minimum over the rows."""
    lib = native.library()[0]
    if lib is None:
        pytest.skip("no native helpers (no C compiler)")
    width_hint = 1024                       # 1024 counters a row: collisions happen in long batches
    fast, slow = sketch.FreqSketch(width_hint, 10, lib=lib), sketch.FreqSketch(width_hint, 10)
    shift = 64 - (fast.width.bit_length() - 1)
    oracle = np.zeros((4, fast.width), np.int64)
    for keys in batches:
        k = np.array(keys, np.int64)
        fast.add(k)
        slow.add(k)
        for key in keys:
            for d, seed in enumerate(int(s) for s in sketch.SKETCH_SEEDS):
                c = ((key * seed) & ((1 << 64) - 1)) >> shift
                oracle[d, c] = min(oracle[d, c] + 1, 255)
    np.testing.assert_array_equal(fast.table, oracle)
    assert (slow.table <= oracle).all()
    probe = np.array(sorted({x for b in batches for x in b}), np.int64)
    at = [((probe.astype(np.uint64) * sketch.SKETCH_SEEDS[d]) >> np.uint64(shift)).astype(np.int64) for d in range(4)]
    np.testing.assert_array_equal(fast.estimate(probe), np.minimum.reduce([oracle[d, at[d]] for d in range(4)]))
    np.testing.assert_array_equal(slow.estimate(probe), np.minimum.reduce([slow.table[d, at[d]] for d in range(4)]))
