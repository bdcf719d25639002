"""Property tests of the row planner (gds_gather.planner).

Every property is checked against an independent, straightforward computation (plain Python or a
different numpy routine), never against the planner's own arithmetic.
"""
from __future__ import annotations

import importlib.util
import math
import pathlib
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gds_gather import planner
from gds_gather.errors import BadIdsError, GatherError
from gds_gather.planner import ReadPlan, check_ids, dedup, plan_rows

# When a property fails, hypothesis' pytest plugin imports hypothesis.extra._patching -> libcst, which emits a
# DeprecationWarning (mypy_extensions.TypedDict) that pyproject's filterwarnings="error" turns into an
# INTERNALERROR hiding the real failure. Import it once here with that warning silenced.
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import hypothesis.extra._patching  # noqa: F401
except Exception:  # pragma: no cover - optional dependency (libcst) absent or changed
    pass

PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ALIGNS = (512, 4096, 65536)
SPECIAL_ROW_BYTES = (1, 2, 90, 170, 511, 512, 513, 4095, 4096, 4097, 7392, 8192, 20000)


# ------------------------------------------------------------------------------------------------ strategies

row_bytes_st = st.one_of(st.sampled_from(SPECIAL_ROW_BYTES), st.integers(1, 20000))
align_st = st.sampled_from(ALIGNS)
# max_gap is in BYTES: whole numbers of blocks, odd byte counts, and wide gaps
max_gap_st = st.one_of(st.just(0), st.integers(0, 3).map(lambda k: k * 4096), st.integers(0, 300_000))
max_window_st = st.one_of(st.just(0), st.sampled_from([1, 512, 4096, 8192, 65536, 1 << 20]), st.integers(1, 1 << 21))
max_waste_st = st.one_of(st.none(), st.sampled_from([0.0, 1.0, 16.0]), st.floats(0, 100))


@st.composite
def data_offsets(draw, align=None):
    """Mostly unaligned offsets; sometimes exactly on (or one byte off) an aligned boundary."""
    a = align or 4096
    return draw(st.one_of(
        st.integers(0, 10**6),
        st.integers(0, 10**6 // a).map(lambda k: k * a),
        st.integers(1, 10**6 // a).map(lambda k: k * a - 1),
    ))


@st.composite
def shapes(draw, max_size=240):
    kind = draw(st.sampled_from(["0d", "1d", "2d", "empty"]))
    if kind == "0d":
        return ()
    if kind == "1d":
        return (draw(st.integers(1, max_size)),)
    if kind == "2d":
        a = draw(st.integers(1, 16))
        return (a, draw(st.integers(1, max(1, max_size // a))))
    return draw(st.sampled_from([(0,), (0, 3), (4, 0), (0, 0)]))


@st.composite
def id_arrays(draw, n_rows, max_size=240):
    """Unsorted ids with duplicates: uniform, clustered (adjacent rows -> merged windows) or from a small pool."""
    shape = draw(shapes(max_size))
    mode = draw(st.sampled_from(["uniform", "clustered", "pool"]))
    if mode == "uniform":
        elems = st.integers(0, n_rows - 1)
    elif mode == "clustered":
        lo = draw(st.integers(0, n_rows - 1))
        span = draw(st.integers(0, 64))
        elems = st.integers(lo, min(n_rows - 1, lo + span))
    else:
        pool = draw(st.lists(st.integers(0, n_rows - 1), min_size=1, max_size=8))
        elems = st.sampled_from(pool)
    dtype = draw(st.sampled_from([np.int64, np.int64, np.int32, np.uint64, np.uint32]))
    if n_rows - 1 > np.iinfo(dtype).max:
        dtype = np.int64
    return draw(hnp.arrays(dtype, shape, elements=elems))


@st.composite
def geometries(draw, max_table_bytes=None):
    align = draw(align_st)
    row_bytes = draw(row_bytes_st)
    hi = 5000
    if max_table_bytes is not None:
        hi = max(1, min(hi, max_table_bytes // row_bytes))
    n_rows = draw(st.one_of(st.integers(1, hi), st.sampled_from([1, 2, hi])))
    data_offset = draw(data_offsets(align))
    max_gap = draw(max_gap_st)
    ids = draw(id_arrays(n_rows))
    return dict(ids=ids, n_rows=n_rows, row_bytes=row_bytes, data_offset=data_offset, align=align,
                max_gap=max_gap, max_window=draw(max_window_st), max_waste=draw(max_waste_st))


CAPS = ("max_gap", "max_window", "max_waste")


def _plan(g) -> ReadPlan:
    return plan_rows(g["ids"], n_rows=g["n_rows"], row_bytes=g["row_bytes"], data_offset=g["data_offset"],
                     align=g["align"], **{k: g.get(k, plan_rows.__kwdefaults__[k]) for k in CAPS})


# ------------------------------------------------------------------------------------------ reference model

def ref_windows(rows, row_bytes, data_offset, align, max_gap, max_window=0, max_waste=None):
    """Plain-Python windows by definition. Rows in file order form runs: a row joins the run of the row before
    when it shares an aligned block with it, or when the unread bytes between them (whole blocks) are at most
    max_gap and at most max_waste * row_bytes. With max_window (whole blocks, at least one) a run is cut window
    by window: a window ends at the last row boundary where no block is shared ("a cut") before its first row
    that does not fit, or, if there is no such cut, at the first cut after. Returns [[first_block,
    last_block, [rows...]], ...]."""
    limit = max_gap if max_waste is None else min(max_gap, math.floor(max_waste * row_bytes))
    cap = max(1, max_window // align) if max_window else None
    span = [((data_offset + r * row_bytes) // align, (data_offset + r * row_bytes + row_bytes - 1) // align)
            for r in rows]
    runs, wins = [], []
    for i in range(len(rows)):
        gap = span[i][0] - span[i - 1][1] - 1 if i else None
        if i and (gap < 0 or gap * align <= limit):
            runs[-1].append(i)
        else:
            runs.append([i])
    for run in runs:
        k = 0
        while k < len(run):
            head = run[k]
            cuts = [j for j in range(k + 1, len(run)) if span[run[j]][0] > span[run[j - 1]][1]]
            end = len(run)
            if cap is not None:
                misfit = next((j for j in range(k, len(run)) if span[run[j]][1] - span[head][0] + 1 > cap), None)
                if misfit is not None:
                    before = [j for j in cuts if j <= misfit]
                    after = [j for j in cuts if j > misfit]
                    end = before[-1] if before else (after[0] if after else len(run))
            idx = run[k:end]
            wins.append([span[idx[0]][0], max(span[i][1] for i in idx), [rows[i] for i in idx]])
            k = end
    return wins


def _ints(a) -> list[int]:
    return [int(x) for x in np.asarray(a).tolist()]


def check_plan_invariants(p: ReadPlan, ids, n_rows, row_bytes, data_offset, align, max_gap, max_window=0,
                          max_waste=None):
    ids = np.asarray(ids)
    flat = [int(x) for x in ids.ravel().tolist()]
    U = sorted(set(flat))

    # --- shape, dtypes, dedup
    assert p.shape == ids.shape
    assert (p.row_bytes, p.data_offset, p.align) == (row_bytes, data_offset, align)
    for name in ("unique_rows", "inverse", "win_offsets", "win_lengths", "win_staging", "row_window",
                 "row_staging"):
        arr = getattr(p, name)
        assert arr.dtype == np.int64, name
        assert arr.ndim == 1, name
    assert _ints(p.unique_rows) == U
    assert all(a < b for a, b in zip(_ints(p.unique_rows), _ints(p.unique_rows)[1:]))   # strictly ascending
    assert p.inverse.shape == (len(flat),)
    assert [U[i] for i in _ints(p.inverse)] == flat
    assert p.n_ids == len(flat) and p.n_unique == len(U)
    assert p.row_window.shape == p.row_staging.shape == (len(U),)
    assert _ints(p.row_offsets) == [data_offset + r * row_bytes for r in U]

    # --- windows: alignment, positivity, order, staging layout
    W = p.n_windows
    offs, lens, stag = _ints(p.win_offsets), _ints(p.win_lengths), _ints(p.win_staging)
    assert len(offs) == len(lens) == len(stag) == W
    assert all(o % align == 0 and o >= 0 for o in offs)
    assert all(n % align == 0 and n > 0 for n in lens)
    assert all(offs[w] + lens[w] <= offs[w + 1] for w in range(W - 1))          # sorted, disjoint
    acc, expect_stag = 0, []
    for n in lens:
        expect_stag.append(acc)
        acc += n
    assert stag == expect_stag and p.window_bytes == acc
    if W:
        # no window reaches before the table's first block or past the block holding its last byte
        table_end = data_offset + n_rows * row_bytes
        assert offs[0] >= (data_offset // align) * align
        assert offs[-1] + lens[-1] <= -(-table_end // align) * align

    # --- merge rule, from its definition: consecutive windows are apart by more than the allowed gap, or the
    # first window would have outgrown max_window by taking the next one's first row
    limit = max_gap if max_waste is None else min(max_gap, math.floor(max_waste * row_bytes))
    cap = max(1, max_window // align) * align if max_window else None
    rw = _ints(p.row_window)
    for w in range(W - 1):
        last_block_w = (offs[w] + lens[w]) // align - 1
        first_block_next = offs[w + 1] // align
        gap_bytes = (first_block_next - last_block_w - 1) * align
        # the next window's first rows up to its first cut: they could only have joined this window together
        nxt = [data_offset + U[u] * row_bytes for u in range(len(U)) if rw[u] == w + 1]
        k = 1
        while k < len(nxt) and nxt[k] // align == (nxt[k - 1] + row_bytes - 1) // align:
            k += 1
        through = ((nxt[k - 1] + row_bytes - 1) // align + 1) * align - offs[w]
        assert gap_bytes > limit or (cap is not None and through > cap), (w, gap_bytes, limit, through, cap)

    # --- every unique row lies in exactly one window, the one row_window names
    rw, rs = _ints(p.row_window), _ints(p.row_staging)
    if U:
        for u, r in enumerate(U):
            s = data_offset + r * row_bytes
            e = s + row_bytes
            holders = [w for w in range(W) if offs[w] <= s and e <= offs[w] + lens[w]]
            assert holders == [rw[u]], (r, holders, rw[u])
            assert rs[u] == stag[rw[u]] + (s - offs[rw[u]])
    # row_window is nondecreasing and every window holds at least one row
    assert all(a <= b for a, b in zip(rw, rw[1:]))
    assert sorted(set(rw)) == list(range(W))

    # --- caps: inside a window, the unread bytes between rows are each <= the gap limit, and a window longer
    # than max_window has no place a cut fits: every row after its first shares a block with the row before
    for w in range(W):
        rows_w = [data_offset + U[u] * row_bytes for u in range(len(U)) if rw[u] == w]
        for a, b in zip(rows_w, rows_w[1:]):
            assert max(0, b // align - (a + row_bytes - 1) // align - 1) * align <= limit
            if cap is not None and lens[w] > cap:
                assert b // align == (a + row_bytes - 1) // align, ("cap exceeded where a cut fits", w)

    # --- windows are exactly the reference windows (tight: first block of first row .. last block of last row)
    ref = ref_windows(U, row_bytes, data_offset, align, max_gap, max_window, max_waste)
    assert [(o // align, (o + n) // align - 1) for o, n in zip(offs, lens)] == [(f, l) for f, l, _ in ref]
    assert [[U[u] for u in range(len(U)) if rw[u] == w] for w in range(W)] == [rows for _, _, rows in ref]

    # --- summary consistency
    s = p.summary()
    assert s["ids"] == len(flat) and s["unique_rows"] == len(U) and s["windows"] == W
    assert s["useful_bytes"] == len(U) * row_bytes == p.exact_bytes
    assert s["window_bytes"] == acc
    if U:
        assert s["amplification"] == pytest.approx(acc / (len(U) * row_bytes))
        assert s["amplification"] >= 1.0
    else:
        assert s["amplification"] == 0.0


# ------------------------------------------------------------------------------------------- property tests

@PROPS
@given(geometries())
def test_plan_invariants_random_geometry(g):
    p = _plan(g)
    check_plan_invariants(p, g["ids"], g["n_rows"], g["row_bytes"], g["data_offset"], g["align"], g["max_gap"],
                          g["max_window"], g["max_waste"])


@FEW
@given(st.integers(0, 2**32 - 1), row_bytes_st, align_st, max_gap_st, st.integers(0, 10**6), max_window_st,
       max_waste_st)
def test_plan_invariants_large_batches(seed, row_bytes, align, max_gap, data_offset, max_window, max_waste):
    """Bigger batches (thousands of ids) than hypothesis draws element by element, checked vectorized."""
    rng = np.random.default_rng(seed)
    n_rows = int(rng.integers(1, 5001))
    n = int(rng.integers(1, 6000))
    ids = rng.integers(0, n_rows, size=n)
    if rng.random() < 0.5:                                    # dense, clustered ids -> long merged windows
        lo = int(rng.integers(0, n_rows))
        ids = np.minimum(lo + rng.integers(0, 300, size=n), n_rows - 1)
    ids = ids.reshape(-1, 2) if n % 2 == 0 and rng.random() < 0.5 else ids
    p = plan_rows(ids, n_rows=n_rows, row_bytes=row_bytes, data_offset=data_offset, align=align,
                  max_gap=max_gap, max_window=max_window, max_waste=max_waste)
    uniq, inv = np.unique(ids, return_inverse=True)
    np.testing.assert_array_equal(p.unique_rows, uniq)
    np.testing.assert_array_equal(p.unique_rows[p.inverse], ids.ravel())
    assert p.shape == ids.shape
    # windows against the plain-Python reference
    ref = ref_windows(_ints(uniq), row_bytes, data_offset, align, max_gap, max_window, max_waste)
    np.testing.assert_array_equal(p.win_offsets, [f * align for f, _, _ in ref])
    np.testing.assert_array_equal(p.win_lengths, [(l - f + 1) * align for f, l, _ in ref])
    np.testing.assert_array_equal(p.win_staging, np.concatenate([[0], np.cumsum(p.win_lengths)[:-1]]))
    # each row inside its window
    s = data_offset + uniq * row_bytes
    w = p.row_window
    assert np.all(p.win_offsets[w] <= s) and np.all(s + row_bytes <= p.win_offsets[w] + p.win_lengths[w])
    np.testing.assert_array_equal(p.row_staging, p.win_staging[w] + (s - p.win_offsets[w]))


def _read_through_plan(file: np.ndarray, p: ReadPlan, n_rows: int):
    """Gather rows the two ways a backend would: through the aligned windows, and through exact extents."""
    rb = p.row_bytes
    # O_DIRECT path: every window lands at win_staging in one staging buffer of window_bytes
    staging = np.full(p.window_bytes, 0xEE, np.uint8)
    for off, n, st_off in zip(_ints(p.win_offsets), _ints(p.win_lengths), _ints(p.win_staging)):
        chunk = file[off:off + n]
        assert chunk.shape[0] == n                       # the test file is padded to an aligned size
        staging[st_off:st_off + n] = chunk
    if p.n_unique:
        idx = p.row_staging[:, None] + np.arange(rb)[None, :]
        rows_win = staging[idx]
    else:
        rows_win = np.zeros((0, rb), np.uint8)
    via_windows = rows_win[p.inverse].reshape(p.shape + (rb,))
    # buffered path: exact extents into compact staging at u * row_bytes
    compact = np.full(p.n_unique * rb, 0xEE, np.uint8)
    for u, off in enumerate(_ints(p.row_offsets)):
        compact[u * rb:(u + 1) * rb] = file[off:off + rb]
    via_exact = compact.reshape(p.n_unique, rb)[p.inverse].reshape(p.shape + (rb,))
    return via_windows, via_exact


def _random_file(rng, data_offset, n_rows, row_bytes, align):
    end = data_offset + n_rows * row_bytes
    size = -(-end // align) * align                       # like a real file: whole blocks readable via O_DIRECT
    return rng.integers(0, 256, size=size, dtype=np.uint8)


@PROPS
@given(geometries(max_table_bytes=1 << 21), st.integers(0, 2**32 - 1))
def test_read_through_windows_and_extents_gives_the_rows(g, seed):
    rng = np.random.default_rng(seed)
    file = _random_file(rng, g["data_offset"], g["n_rows"], g["row_bytes"], g["align"])
    p = _plan(g)
    via_windows, via_exact = _read_through_plan(file, p, g["n_rows"])
    ids = np.asarray(g["ids"])
    rb, do = g["row_bytes"], g["data_offset"]
    expect = np.zeros(ids.shape + (rb,), np.uint8)
    for pos, r in zip(np.ndindex(*ids.shape), ids.ravel().tolist()):   # plain slicing, one id at a time
        expect[pos] = file[do + int(r) * rb: do + int(r) * rb + rb]
    np.testing.assert_array_equal(via_windows, expect)
    np.testing.assert_array_equal(via_exact, expect)


# --------------------------------------------------------------------------------------------- edge cases

def test_row_straddling_an_aligned_boundary_gets_one_window_over_both_blocks():
    # row 0 of 90 B at 4050 covers bytes 4050..4139: blocks 0 and 1
    p = plan_rows([0], n_rows=10, row_bytes=90, data_offset=4050, align=4096)
    assert _ints(p.win_offsets) == [0] and _ints(p.win_lengths) == [8192]
    assert _ints(p.row_staging) == [4050]
    # a row wider than a block straddling two boundaries: 3 blocks
    p = plan_rows([0], n_rows=1, row_bytes=4098, data_offset=4095, align=4096)   # bytes 4095..8192
    assert _ints(p.win_offsets) == [0] and _ints(p.win_lengths) == [3 * 4096]
    assert _ints(p.row_staging) == [4095]
    # exactly one aligned block: no straddle
    p = plan_rows([1], n_rows=4, row_bytes=4096, data_offset=0, align=4096)
    assert _ints(p.win_offsets) == [4096] and _ints(p.win_lengths) == [4096]
    assert _ints(p.row_staging) == [0]


@pytest.mark.parametrize("row_bytes,data_offset,align", [
    (90, 100, 4096), (90, 0, 4096), (4096, 0, 4096), (4096, 1, 512), (7392, 999_999, 65536), (1, 4095, 4096),
    (170, 4096 - 170 * 3, 4096),
])
def test_last_row_ending_exactly_at_table_end(row_bytes, data_offset, align):
    n_rows = 1000 if row_bytes < 4096 else 20
    p = plan_rows(np.array([n_rows - 1, 0, n_rows - 1]), n_rows=n_rows, row_bytes=row_bytes,
                  data_offset=data_offset, align=align)
    end = data_offset + n_rows * row_bytes
    last = p.n_windows - 1
    win_end = int(p.win_offsets[last] + p.win_lengths[last])
    assert end <= win_end < end + align
    assert win_end == -(-end // align) * align
    assert int(p.row_window[-1]) == last
    rng = np.random.default_rng(1)
    file = _random_file(rng, data_offset, n_rows, row_bytes, align)
    via_windows, via_exact = _read_through_plan(file, p, n_rows)
    np.testing.assert_array_equal(via_windows[0], file[end - row_bytes:end])
    np.testing.assert_array_equal(via_exact[2], file[end - row_bytes:end])
    np.testing.assert_array_equal(via_windows[1], file[data_offset:data_offset + row_bytes])


def test_merge_rule_examples():
    # 4096-B rows at an aligned offset: row r is block r.
    def wins(ids, max_gap):       # max_gap in blocks of 4096 here, passed in bytes
        p = plan_rows(ids, n_rows=64, row_bytes=4096, data_offset=0, align=4096, max_gap=max_gap * 4096)
        return [(int(o) // 4096, int(n) // 4096) for o, n in zip(p.win_offsets, p.win_lengths)]

    # same block shared by two rows always merges (90-B rows 0 and 1 share block 0)
    p = plan_rows([1, 0], n_rows=100, row_bytes=90, data_offset=0, align=4096, max_gap=0)
    assert p.n_windows == 1 and _ints(p.row_staging) == [0, 90]
    # touching rows (no unread block between) merge even at max_gap=0
    assert wins([0, 1], 0) == [(0, 2)]
    # one unread block between: separate for max_gap 0, merged from max_gap 1
    assert wins([0, 2], 0) == [(0, 1), (2, 1)]
    assert wins([0, 2], 1) == [(0, 3)]
    assert wins([0, 3], 1) == [(0, 1), (3, 1)]
    assert wins([0, 3], 2) == [(0, 4)]
    # merged windows also read the unread block in between, and staging follows
    p = plan_rows([2, 0], n_rows=64, row_bytes=4096, data_offset=0, align=4096, max_gap=3 * 4096)
    assert _ints(p.row_staging) == [0, 8192] and p.window_bytes == 3 * 4096


def test_max_gap_counts_unread_bytes():
    p = plan_rows([0, 1], n_rows=4, row_bytes=4096, data_offset=0, align=4096, max_gap=0)
    assert p.n_windows == 1 and p.window_bytes == 8192
    p = plan_rows([0, 2], n_rows=4, row_bytes=4096, data_offset=0, align=4096, max_gap=4095)    # a block is 4096
    assert p.n_windows == 2 and p.window_bytes == 2 * 4096
    p = plan_rows([0, 2], n_rows=4, row_bytes=4096, data_offset=0, align=4096, max_gap=4096)
    assert p.n_windows == 1 and p.window_bytes == 3 * 4096
    # at 512-byte alignment, 4096 bytes are 8 blocks: 90-byte rows 8 blocks apart merge, 9 blocks apart do not
    p = plan_rows([0, 9 * 512 // 90 + 1], n_rows=100, row_bytes=90, data_offset=0, align=512, max_gap=4096)
    assert p.n_windows == 1
    p = plan_rows([0, 1000 // 90 * 9], n_rows=1000, row_bytes=90, data_offset=0, align=512, max_gap=4096)
    assert p.n_windows == 2


def test_gap_in_bytes_and_caps_bound_the_issue_case():
    """The issue's case: GDS_GATHER_MAX_GAP=4096 at 512-B alignment planned one 321 MB window for 1,000 random
    90-B rows of a 5.4 GB table, and 1 MiB one 5.4 GB window. Now the gap is in bytes and the caps hold."""
    n_rows = 60_000_000
    ids = np.random.default_rng(0).integers(0, n_rows, 1000)
    for gap in (4096, 1 << 20):
        p = plan_rows(ids, n_rows=n_rows, row_bytes=90, data_offset=12345, align=512, max_gap=gap,
                      max_window=1 << 20, max_waste=16.0)
        assert int(p.win_lengths.max()) <= 1 << 20
        # per row: at most its own two blocks plus a bridged gap of at most 16 x 90 bytes (whole blocks: 1,024)
        assert p.window_bytes <= p.n_unique * (2 * 512 + 1024), p.summary()
    p = plan_rows(np.arange(0, 2_000_000), n_rows=n_rows, row_bytes=90, data_offset=0, align=512,
                  max_window=1 << 20)
    assert p.n_windows >= 171 and int(p.win_lengths.max()) <= 1 << 20      # 180 MB of contiguous rows


def test_window_cap_is_exceeded_only_where_no_cut_fits():
    # contiguous 4097-byte rows at 4096 alignment share a block with their neighbour for 4096 rows (16 MiB)
    p = plan_rows(np.arange(100), n_rows=5000, row_bytes=4097, data_offset=0, align=4096, max_window=65536)
    assert p.n_windows == 1
    # 4096-byte rows never share blocks: 16 rows per 64 KiB window
    p = plan_rows(np.arange(100), n_rows=5000, row_bytes=4096, data_offset=0, align=4096, max_window=65536)
    assert _ints(p.win_lengths) == [65536] * 6 + [4 * 4096]
    # one row larger than the cap is a window of its own
    p = plan_rows([0, 1, 2], n_rows=3, row_bytes=25 * 4096, data_offset=0, align=4096, max_window=65536)
    assert _ints(p.win_lengths) == [25 * 4096] * 3


def test_waste_cap_limits_bridged_gaps():
    # 4096-B rows 0 and 2: the gap is one block (4096 B); bridged only if max_waste x 4096 >= 4096
    assert plan_rows([0, 2], n_rows=4, row_bytes=4096, data_offset=0, align=4096, max_gap=1 << 20,
                     max_waste=1.0).n_windows == 1
    assert plan_rows([0, 2], n_rows=4, row_bytes=4096, data_offset=0, align=4096, max_gap=1 << 20,
                     max_waste=0.99).n_windows == 2


def test_zero_d_ids():
    # (np.ascontiguousarray would turn 0-d ids into shape (1,))
    assert check_ids(np.int64(7), 10).shape == () and check_ids(7, 10).shape == ()
    p = plan_rows(np.int64(7), n_rows=10, row_bytes=90, data_offset=123, align=512)
    assert p.shape == () and _ints(p.unique_rows) == [7] and _ints(p.inverse) == [0]
    p = plan_rows(np.array(3, np.uint16), n_rows=10, row_bytes=90, data_offset=123, align=512)
    assert p.shape == () and _ints(p.unique_rows) == [3]
    p = plan_rows(3, n_rows=10, row_bytes=90, data_offset=123, align=512)
    assert p.shape == () and _ints(p.unique_rows) == [3]


@pytest.mark.parametrize("ids,shape", [
    (np.zeros(0, np.int64), (0,)), (np.zeros((0, 3), np.int32), (0, 3)), (np.zeros((4, 0), np.uint64), (4, 0)),
    (np.zeros((0, 0), np.int8), (0, 0)), (np.array([], object), (0,)),
    (np.zeros(0, np.float64), (0,)),             # no value can be bad: any empty array plans (np.asarray([]) is f8)
    ([], (0,)), ((), (0,)), ([[], []], (2, 0)),
])
def test_empty_ids_give_an_empty_plan_with_the_right_shape(ids, shape):
    assert check_ids(ids, 10).shape == shape and check_ids(ids, 10).dtype == np.int64
    for n_rows in (0, 1, 10):
        p = plan_rows(ids, n_rows=n_rows, row_bytes=90, data_offset=12345)
        assert p.shape == shape
        assert p.n_ids == p.n_unique == p.n_windows == 0
        assert p.window_bytes == p.exact_bytes == 0
        assert p.summary()["amplification"] == 0.0
        for a in (p.unique_rows, p.inverse, p.win_offsets, p.win_lengths, p.win_staging, p.row_window,
                  p.row_staging, p.row_offsets):
            assert a.shape == (0,)


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                                   np.uint64])
def test_integer_dtypes_are_accepted_and_widened(dtype):
    ids = np.array([[5, 1], [5, 100]], dtype=dtype)
    out = check_ids(ids, 200)
    assert out.dtype == np.int64 and out.shape == (2, 2) and out.flags.c_contiguous
    assert out.tolist() == [[5, 1], [5, 100]]
    p = plan_rows(ids, n_rows=200, row_bytes=90, data_offset=7)
    assert _ints(p.unique_rows) == [1, 5, 100]


def test_uint64_ids_near_the_top_of_a_huge_table():
    n_rows = 2**40
    ids = np.array([n_rows - 1, 0, n_rows - 1], np.uint64)
    p = plan_rows(ids, n_rows=n_rows, row_bytes=2, data_offset=1)
    assert _ints(p.unique_rows) == [0, n_rows - 1]
    with pytest.raises(BadIdsError, match=rf"{n_rows}\b.*\[0, {n_rows}\)"):
        plan_rows(np.array([0, n_rows], np.uint64), n_rows=n_rows, row_bytes=2, data_offset=1)
    with pytest.raises(BadIdsError, match=r"18446744073709551615"):
        plan_rows(np.array([2**64 - 1], np.uint64), n_rows=10, row_bytes=2, data_offset=1)


@pytest.mark.parametrize("ids,n_rows,bad", [
    ([0, -1, 2], 10, -1),
    ([0, 10, 2], 10, 10),
    ([[3, 4], [10**12, -5]], 10, 10**12),          # the first bad value in flat (C) order
    (np.array([-3], np.int8), 5, -3),
    (np.array([2**31 - 1], np.int32), 2**31 - 1, 2**31 - 1),
    (np.array(11), 11, 11),                          # 0-d
    ([0], 0, 0),                                     # empty table: every id is bad
])
def test_out_of_range_ids_name_the_value_and_the_range(ids, n_rows, bad):
    with pytest.raises(BadIdsError) as ei:
        plan_rows(ids, n_rows=n_rows, row_bytes=90, data_offset=0)
    msg = str(ei.value)
    assert str(bad) in msg
    assert f"[0, {n_rows})" in msg
    assert isinstance(ei.value, GatherError) and isinstance(ei.value, IndexError)
    with pytest.raises(BadIdsError):
        check_ids(ids, n_rows)


@PROPS
@given(st.integers(1, 5000), st.data())
def test_any_out_of_range_id_is_rejected_naming_the_first_one(n_rows, data):
    good = st.integers(0, n_rows - 1)
    bad = st.one_of(st.integers(-(2**62), -1), st.integers(n_rows, 2**62))
    vals = data.draw(st.lists(st.one_of(good, bad), min_size=1, max_size=50))
    ids = np.array(vals, np.int64)
    first_bad = next((v for v in vals if not 0 <= v < n_rows), None)
    if first_bad is None:
        assert check_ids(ids, n_rows).tolist() == vals
        return
    with pytest.raises(BadIdsError) as ei:
        check_ids(ids, n_rows)
    msg = str(ei.value)
    assert f"row id {first_bad} " in msg and f"[0, {n_rows})" in msg


@pytest.mark.parametrize("ids,dtype_name", [
    (np.array([1.0, 2.0]), "float64"),
    ([1.5], "float64"),
    (np.array([1, 2], np.float32), "float32"),
    ([True, False], "bool"),                          # bool is not an integer row id
    (np.array(True), "bool"),
    (np.array([0, 1], bool), "bool"),
    (np.array(["1"]), "<U1"),
    ([1 + 2j], "complex128"),
    ([2**70], "object"),                             # too wide for any integer dtype
    (np.array([1, 2], object), "object"),
])
def test_non_integer_ids_are_rejected(ids, dtype_name):
    with pytest.raises(BadIdsError, match="integers") as ei:
        plan_rows(ids, n_rows=10, row_bytes=90, data_offset=0)
    assert dtype_name in str(ei.value)


@pytest.mark.parametrize("align", [0, 3, -4096, 4095, 6000, -1])
def test_bad_align_raises_value_error(align):
    with pytest.raises(ValueError, match="align"):
        plan_rows([1, 2], n_rows=10, row_bytes=90, data_offset=0, align=align)


@pytest.mark.parametrize("kw", [dict(row_bytes=0), dict(row_bytes=-90), dict(n_rows=-1), dict(data_offset=-1),
                                dict(max_gap=-1), dict(max_window=-1), dict(max_waste=-0.5),
                                dict(max_waste=float("nan"))])
def test_bad_geometry_raises_value_error(kw):
    args = dict(n_rows=10, row_bytes=90, data_offset=0, align=4096, max_gap=0)
    args.update(kw)
    with pytest.raises(ValueError):
        plan_rows([1, 2], **args)


def test_plan_does_not_alias_or_modify_the_ids():
    ids = np.array([[9, 3], [3, 1]], np.int64)
    before = ids.copy()
    p = plan_rows(ids, n_rows=10, row_bytes=90, data_offset=0)
    assert np.array_equal(ids, before)
    assert not np.shares_memory(p.unique_rows, ids) and not np.shares_memory(p.inverse, ids)


# ------------------------------------------------------------------------------------------------- dedup

@PROPS
@given(st.data())
def test_dedup_matches_np_unique(data):
    n_rows = data.draw(st.one_of(st.integers(1, 10**6), st.sampled_from([1, 2, 2**31, 2**40, 2**53, 2**62,
                                                                          2**63 - 1])))
    vals = data.draw(st.lists(st.one_of(st.integers(0, n_rows - 1), st.integers(max(0, n_rows - 3), n_rows - 1)),
                              max_size=300))
    flat = np.array(vals, np.int64)
    u, inv = dedup(flat, n_rows)
    ru, rinv = np.unique(flat, return_inverse=True)
    assert u.dtype == np.int64 and inv.dtype == np.int64
    np.testing.assert_array_equal(u, ru)
    np.testing.assert_array_equal(inv, rinv.ravel())
    assert u.tolist() == sorted(set(vals))


def _packs(n, n_rows):
    """Whether n ids of a table of n_rows fit packed (row, position) uint64 keys below 2**63."""
    return (max(1, (n_rows - 1).bit_length()) + max(1, (n - 1).bit_length())) <= 63


@pytest.mark.parametrize("n_rows,n", [
    (2**62, 1), (2**62, 2), (2**62, 3), (2**62, 1000),     # 62 + 1 bits pack; 62 + 2 bits fall back
    (2**53, 1024), (2**53, 1025),                          # exactly 63 bits; one more position bit
    (2**63 - 1, 5), (10, 1), (10, 100000),
])
def test_dedup_packed_and_fallback_branches(monkeypatch, n_rows, n):
    rng = np.random.default_rng(n)
    top = np.array([n_rows - 1, n_rows - 2, 0, n_rows - 1], np.int64)
    flat = np.concatenate([top, rng.integers(0, n_rows, size=n, dtype=np.int64)])[:n]
    ref_u, ref_inv = np.unique(flat, return_inverse=True)            # reference before any patching

    calls = []
    real_unique = np.unique

    def spy(*a, **k):
        calls.append(1)
        return real_unique(*a, **k)

    monkeypatch.setattr(planner.np, "unique", spy)
    u, inv = dedup(flat, n_rows)
    monkeypatch.undo()
    assert bool(calls) == (not _packs(n, n_rows))
    np.testing.assert_array_equal(u, ref_u)
    np.testing.assert_array_equal(inv, ref_inv.ravel())
    np.testing.assert_array_equal(u[inv], flat)
    assert u.dtype == np.int64 and inv.dtype == np.int64 and inv.shape == (n,)


def test_dedup_empty():
    u, inv = dedup(np.zeros(0, np.int64), 10)
    assert u.shape == inv.shape == (0,) and u.dtype == inv.dtype == np.int64


def test_plan_on_a_huge_table_uses_the_fallback_and_is_still_right():
    n_rows = 2**62
    ids = np.array([[n_rows - 1, 5, 5], [0, n_rows - 1, 7]], np.int64)
    p = plan_rows(ids, n_rows=n_rows, row_bytes=1, data_offset=0, align=4096)
    assert _ints(p.unique_rows) == [0, 5, 7, n_rows - 1]
    np.testing.assert_array_equal(p.unique_rows[p.inverse].reshape(ids.shape), ids)
    assert p.n_windows == 2
    assert _ints(p.win_offsets) == [0, ((n_rows - 1) // 4096) * 4096]


# ---------------------------------------------------------------------------------------- bench smoke test

def test_bench_planner_runs_tiny():
    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "bench_planner.py"
    if not path.exists():
        pytest.skip("bench/bench_planner.py not present")
    spec = importlib.util.spec_from_file_location("bench_planner_smoke", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.main(["--ids", "2000", "--rows", "100000", "--repeat", "2", "--gemma-ids", "500", "--json"])
    assert isinstance(res, dict)
    q = res["qwen4exp"]
    assert q["plan"]["ids"] == 2000 and q["plan"]["unique_rows"] <= 2000
    assert q["plan_ms"]["median"] > 0 and q["np_unique_ms"]["median"] > 0 and q["ratio"] > 0
    assert res["gemma4_e4b"]["plan"]["ids"] == 500
    assert res["target"]["verdict"] in ("PASS", "FAIL", "N/A")


@pytest.mark.parametrize("ids", [[[1, 2], [3]], [[1], 2], [[[0]], [1, 2]], [1, [2, 3]]])
def test_ragged_ids_raise_bad_ids_error(ids):
    with pytest.raises(BadIdsError, match="rectangular"):
        check_ids(ids, 10)
    with pytest.raises(BadIdsError):
        plan_rows(ids, n_rows=10, row_bytes=90, data_offset=0)


@given(seed=st.integers(0, 2**31), row_bytes=st.sampled_from([90, 4096, 7392, 9000]))
@settings(max_examples=60, deadline=None)
def test_realign_gives_the_same_rows_in_4k_windows(seed, row_bytes):
    """Plans read by KvikIO (GdsReader) are realigned to 4 KiB: same rows, inverse and shape; windows of the new
    alignment; a plan already aligned is returned as is."""
    from gds_gather.config import Config
    rng = np.random.default_rng(seed)
    n_rows, off = 5000, int(rng.integers(0, 3)) * 512 + 64
    ids = rng.integers(0, n_rows, (3, int(rng.integers(1, 200))))
    cfg = Config(max_gap=int(rng.choice([0, 8192])))
    fine = plan_rows(ids, n_rows=n_rows, row_bytes=row_bytes, data_offset=off, align=512, max_gap=cfg.max_gap,
                     max_window=cfg.max_window, max_waste=cfg.max_waste)
    p = planner.realign(fine, 4096, cfg)
    assert p.align == 4096 and p.shape == fine.shape
    np.testing.assert_array_equal(p.unique_rows, fine.unique_rows)
    np.testing.assert_array_equal(p.inverse, fine.inverse)
    check_plan_invariants(p, ids, n_rows, row_bytes, off, 4096, cfg.max_gap, cfg.max_window, cfg.max_waste)
    assert planner.realign(p, 4096, cfg) is p
