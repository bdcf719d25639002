"""Row ids -> a read plan: deduplicated rows in file order, exact extents, aligned O_DIRECT windows, staging layout.

Everything here is vectorized numpy; the hot path never loops over rows in Python.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import numpy as np

from .errors import BadIdsError


@dataclass(frozen=True)
class Windows:
    """The O_DIRECT layout of a plan's rows (see ReadPlan): windows w, and where each unique row lies in them."""
    offsets: np.ndarray       # int64 [W], multiples of align
    lengths: np.ndarray       # int64 [W], multiples of align
    staging: np.ndarray       # int64 [W], offset of each window in window staging
    row_window: np.ndarray    # int64 [U]
    row_staging: np.ndarray   # int64 [U], offset of each unique row in window staging

    @classmethod
    def packed(cls, offsets: np.ndarray, lengths: np.ndarray, row_window: np.ndarray, within: np.ndarray) -> "Windows":
        """The windows back to back in staging, in order; `within`: each row's byte offset inside its window."""
        staging = np.zeros_like(lengths)
        if lengths.shape[0]:
            np.cumsum(lengths[:-1], out=staging[1:])
        return cls(offsets, lengths, staging, row_window, staging[row_window] + within)


@dataclass(frozen=True, eq=False)
class ReadPlan:
    """How to fetch the rows behind a batch of ids.

    Rows are `row_bytes` long, packed back to back from the absolute file offset `data_offset`.

    Exact layout (buffered reads): unique row u is read from `row_offsets[u]` (row_bytes long) into
    compact staging at `u * row_bytes`.

    Window layout (O_DIRECT): window w covers [win_offsets[w], win_offsets[w] + win_lengths[w]), both
    multiples of `align`, and lands in window staging at `win_staging[w]`; unique row u lies in window
    `row_window[u]`, at staging offset `row_staging[u]`. Windows are sorted and never overlap. They are made on
    first use (`layout` may be the function that makes them): a batch read from the page cache, by a buffered
    reader or from the row cache never pays for them.
    """

    shape: tuple            # shape of the ids this plan serves
    row_bytes: int
    data_offset: int
    align: int
    unique_rows: np.ndarray   # int64 [U], ascending (= file order)
    inverse: np.ndarray       # int64 [N]: ids.ravel() == unique_rows[inverse]
    layout: "Windows | Callable[[], Windows]"

    @cached_property
    def windows(self) -> Windows:
        return self.layout if isinstance(self.layout, Windows) else self.layout()

    @property
    def win_offsets(self) -> np.ndarray:
        return self.windows.offsets

    @property
    def win_lengths(self) -> np.ndarray:
        return self.windows.lengths

    @property
    def win_staging(self) -> np.ndarray:
        return self.windows.staging

    @property
    def row_window(self) -> np.ndarray:
        return self.windows.row_window

    @property
    def row_staging(self) -> np.ndarray:
        return self.windows.row_staging

    @property
    def n_ids(self) -> int:
        return int(self.inverse.shape[0])

    @property
    def n_unique(self) -> int:
        return int(self.unique_rows.shape[0])

    @property
    def n_windows(self) -> int:
        return int(self.win_offsets.shape[0])

    @property
    def row_offsets(self) -> np.ndarray:
        """Absolute file offset of each unique row (exact extents, buffered reads)."""
        return self.data_offset + self.unique_rows * self.row_bytes

    @property
    def exact_bytes(self) -> int:
        return self.n_unique * self.row_bytes

    @property
    def window_bytes(self) -> int:
        return int(self.win_lengths.sum())

    def summary(self) -> dict:
        return {
            "ids": self.n_ids, "unique_rows": self.n_unique, "windows": self.n_windows,
            "row_bytes": self.row_bytes, "align": self.align,
            "useful_bytes": self.exact_bytes, "window_bytes": self.window_bytes,
            "amplification": (self.window_bytes / self.exact_bytes) if self.exact_bytes else 0.0,
        }


def check_ids(ids, n_rows: int) -> np.ndarray:
    """Validate row ids and return them as a contiguous int64 array of the same shape.

    Raises BadIdsError for non-integer ids and for any id outside [0, n_rows), naming one bad value.
    """
    try:
        arr = np.asarray(ids)
    except (ValueError, TypeError) as e:      # ragged nesting ([[1, 2], [3]]) and other non-arrays
        raise BadIdsError(f"row ids must form a rectangular integer array: {e}") from None
    if arr.size == 0:   # no value can be bad (np.asarray([]) is float64)
        return np.zeros(arr.shape, np.int64)
    if arr.dtype.kind not in "iu":
        raise BadIdsError(f"row ids must be integers, got dtype {arr.dtype}"
                          + (f" (e.g. {arr.flat[0]!r})" if arr.size else ""))
    lo, hi = arr.min(), arr.max()
    if lo < 0 or hi >= n_rows:
        bad_mask = (arr < 0) | (arr >= n_rows)
        pos = int(np.flatnonzero(bad_mask.ravel())[0])
        bad = arr.ravel()[pos]
        raise BadIdsError(
            f"row id {int(bad)} at flat position {pos} is outside [0, {n_rows})"
            f" (ids span {int(lo)}..{int(hi)})")
    return np.asarray(arr, dtype=np.int64, order="C")   # (ascontiguousarray would make 0-d ids 1-d)


def dedup(flat: np.ndarray, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(unique ascending, inverse) for int64 ids in [0, n_rows).

    One sort of packed (row, position) keys beats np.unique(return_inverse=True), which argsorts.
    """
    n = flat.shape[0]
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    rbits = max(1, int(n_rows - 1).bit_length())
    pbits = max(1, int(n - 1).bit_length())
    if rbits + pbits > 63:
        return np.unique(flat, return_inverse=True)
    keys = (flat.astype(np.uint64) << np.uint64(pbits)) | np.arange(n, dtype=np.uint64)
    keys.sort()
    rows = (keys >> np.uint64(pbits)).view(np.int64)        # < 2**63: the view is exact
    pos = (keys & np.uint64((1 << pbits) - 1)).view(np.int64)
    new = np.empty(n, bool)
    new[0] = True
    np.not_equal(rows[1:], rows[:-1], out=new[1:])
    slot = np.cumsum(new) - 1
    inverse = np.empty(n, np.int64)
    inverse[pos] = slot
    return rows[new], inverse


def windows(start: np.ndarray, extent: int, align: int, max_gap: int = 0, max_window: int = 0,
            max_waste: float | None = None):
    """Aligned, non-overlapping windows covering extents [start, start + extent) given in ascending order.

    Returns (offsets, lengths, window of each extent). Each extent spans aligned blocks [first, last]; as all
    extents have the same size `last` is nondecreasing. Extent j joins the window of extent j - 1 when
    - it shares an aligned block with it (always: windows never overlap), or
    - the unread bytes between them (whole blocks; 0 when they touch) are at most `max_gap` bytes and at most
      `max_waste` x `extent` (bytes read for nothing per useful byte the merge brings in; None: no such cap).
    With max_window > 0 (bytes, counted in whole blocks, at least one), a merged run longer than that is cut,
    window by window, at the last place a cut fits (between extents that share no block) before the window
    would outgrow max_window. A window is longer only where no cut fits: one extent longer than the cap, or
    extents packed across block boundaries (contiguous 4097-byte rows at 4096 alignment share blocks for
    16 MiB); it then ends at the first place a cut fits. Vectorized: the gap rule in one pass, the size cap by
    walking all long merged runs at once (one numpy step per window of the longest run).
    """
    n = start.shape[0]
    if n == 0:
        z = np.zeros(0, np.int64)
        return z, z, z
    first = start // align
    last = (start + extent - 1) // align
    limit = max_gap if max_waste is None or max_waste * extent >= max_gap else int(max_waste * extent)
    gap = first[1:] - last[:-1] - 1              # unread blocks before extent j (-1: a shared block)
    brk = np.empty(n, bool)
    brk[0] = True
    np.greater(gap, limit // align, out=brk[1:])
    if max_window > 0:
        cap = max(1, max_window // align)         # blocks
        heads = np.flatnonzero(brk)
        ends = np.append(heads[1:], n)            # one past each merged run's last extent
        long = (last[ends - 1] - first[heads] + 1) > cap
        if long.any():
            cut = np.empty(n + 1, bool)           # a window may start at j (no block shared with j - 1)
            cut[0] = cut[n] = True
            np.greater_equal(gap, 0, out=cut[1:n])
            at = np.arange(n + 1)
            nextcut = np.minimum.accumulate(np.where(cut, at, n)[::-1])[::-1]
            prevcut = np.maximum.accumulate(np.where(cut, at, 0))
            run_end = np.repeat(ends, ends - heads)
            frontier = heads[long]
            while frontier.size:                  # the window from h: up to the last cut at or before the first
                far = np.searchsorted(last, first[frontier] + cap - 1, side="right")   # extent that does not fit
                back = prevcut[np.minimum(far, n)]
                nxt = np.where(back > frontier, back, nextcut[frontier + 1])
                frontier = nxt[nxt < run_end[frontier]]
                brk[frontier] = True
    heads = np.flatnonzero(brk)
    tails = np.append(heads[1:], n) - 1
    win_first = first[heads]
    return win_first * align, (last[tails] - win_first + 1) * align, np.cumsum(brk) - 1


def split_extents(offsets: np.ndarray, lengths: np.ndarray, expect: np.ndarray, dst: np.ndarray, chunk: int):
    """Extents cut into pieces of at most `chunk` bytes (a multiple of the alignment keeps O_DIRECT pieces
    aligned): (offsets, lengths, expect, dst, index of each piece's extent), all int64, vectorized."""
    k = np.maximum(1, -(-lengths // chunk))
    src = np.repeat(np.arange(lengths.shape[0], dtype=np.int64), k)
    skip = (np.arange(src.shape[0], dtype=np.int64) - np.repeat(np.cumsum(k) - k, k)) * chunk
    ln = np.minimum(chunk, lengths[src] - skip)
    return offsets[src] + skip, ln, np.clip(expect[src] - skip, 0, ln), dst[src] + skip, src


def row_runs(unique_rows: np.ndarray, row_bytes: int, data_offset: int):
    """Runs of consecutive rows as single extents for exact-row reads into compact staging:
    (file offsets, lengths, staging offsets)."""
    n = unique_rows.shape[0]
    brk = np.empty(n, bool)
    brk[:1] = True
    np.not_equal(np.diff(unique_rows), 1, out=brk[1:])
    heads = np.flatnonzero(brk)
    counts = np.diff(np.append(heads, n))
    return data_offset + unique_rows[heads] * row_bytes, counts * row_bytes, heads * row_bytes


def plan_rows(ids, *, n_rows: int, row_bytes: int, data_offset: int, align: int = 4096,
              max_gap: int = 0, max_window: int = 0, max_waste: float | None = None) -> ReadPlan:
    """Plan the reads for `ids` (any shape) of a table of `n_rows` rows of `row_bytes` at `data_offset`.

    align:      window alignment (the file's logical block size for O_DIRECT), a power of two.
    max_gap:    merge two windows when at most this many unread BYTES (whole aligned blocks) separate them
                (0: merge only windows that touch or share a block).
    max_window: cap on a window's bytes (0: none); see `windows` for when a window may still exceed it.
    max_waste:  a gap is bridged only if it is at most max_waste x row_bytes (None: no such cap).
    """
    if align <= 0 or align & (align - 1):
        raise ValueError(f"align must be a positive power of two, got {align}")
    if row_bytes <= 0 or n_rows < 0 or data_offset < 0 or max_gap < 0 or max_window < 0 \
            or (max_waste is not None and not max_waste >= 0):
        raise ValueError("row_bytes must be > 0; n_rows, data_offset, max_gap, max_window, max_waste >= 0")
    arr = check_ids(ids, n_rows)
    unique, inverse = dedup(arr.ravel(), n_rows)
    return plan_unique(unique, row_bytes=row_bytes, data_offset=data_offset, align=align, max_gap=max_gap,
                       max_window=max_window, max_waste=max_waste, inverse=inverse, shape=tuple(arr.shape))


def plan_unique(unique: np.ndarray, *, row_bytes: int, data_offset: int, align: int = 4096, max_gap: int = 0,
                max_window: int = 0, max_waste: float | None = None, inverse: np.ndarray | None = None,
                shape: tuple | None = None) -> ReadPlan:
    """The plan of rows already unique and ascending (int64, in range: the caller checked them), e.g. the misses
    of a plan's rows: no validation, no second sort (inverse defaults to the identity)."""
    if inverse is None:
        inverse = np.arange(unique.shape[0], dtype=np.int64)

    def layout() -> Windows:
        start = data_offset + unique * row_bytes
        offs, lens, row_window = windows(start, row_bytes, align, max_gap, max_window, max_waste)
        return Windows.packed(offs, lens, row_window, start - offs[row_window])
    return ReadPlan(shape=(unique.shape[0],) if shape is None else shape, row_bytes=int(row_bytes),
                    data_offset=int(data_offset), align=int(align), unique_rows=unique, inverse=inverse,
                    layout=layout)


def replan(plan: ReadPlan, config, rows: np.ndarray | None = None, align: int | None = None) -> ReadPlan:
    """The same table geometry planned again with the Config's window settings, at `align` (default the plan's):
    `rows` (unique, ascending, from plan.unique_rows: e.g. a batch's row-cache misses; windows only, no second
    dedup), or every row of the plan, keeping its inverse and shape."""
    whole = rows is None
    return plan_unique(plan.unique_rows if whole else rows, row_bytes=plan.row_bytes, data_offset=plan.data_offset,
                       align=align or plan.align, max_gap=config.max_gap, max_window=config.max_window,
                       max_waste=config.max_waste, inverse=plan.inverse if whole else None,
                       shape=plan.shape if whole else None)


def subplan(plan: ReadPlan, keep: np.ndarray) -> ReadPlan | None:
    """The plan of the rows `keep` (bool [U]) picks, made of the plan's own windows: those holding a picked row;
    None where a window holds both picked rows and others (replan would read less there). A batch's row-cache
    misses are usually whole windows of its plan (wide rows: one row a window), and this costs less than half of
    replanning them (docs/decisions/handover.md)."""
    rw = plan.row_window
    heads = np.flatnonzero(np.r_[True, rw[1:] != rw[:-1]])       # first row of each window
    some = np.logical_or.reduceat(keep, heads)
    if not np.array_equal(some, np.logical_and.reduceat(keep, heads)):
        return None
    rows = np.flatnonzero(keep)
    new_w = (np.cumsum(some) - 1)[rw[rows]]
    layout = Windows.packed(plan.win_offsets[some], plan.win_lengths[some], new_w,
                            plan.row_staging[rows] - plan.win_staging[rw[rows]])
    return ReadPlan(shape=(rows.shape[0],), row_bytes=plan.row_bytes, data_offset=plan.data_offset,
                    align=plan.align, unique_rows=plan.unique_rows[rows],
                    inverse=np.arange(rows.shape[0], dtype=np.int64), layout=layout)


def misses(plan: ReadPlan, keep: np.ndarray, config) -> ReadPlan:
    """The plan of the rows `keep` (bool [U]) picks, e.g. a batch's row-cache misses, its windows made on first use:
    the plan's own where they hold only picked rows (subplan), else planned anew (replan). Rows the page cache
    serves are never windowed."""
    rows = plan.unique_rows[keep]

    def layout() -> Windows:
        return (subplan(plan, keep) or replan(plan, config, rows)).windows
    return ReadPlan(shape=(rows.shape[0],), row_bytes=plan.row_bytes, data_offset=plan.data_offset,
                    align=plan.align, unique_rows=rows, inverse=np.arange(rows.shape[0], dtype=np.int64),
                    layout=layout)


def realign(plan: ReadPlan, align: int, config) -> ReadPlan:
    """The plan itself where its windows are already multiples of `align`, else the same rows (same inverse and
    shape) planned at `align` with the Config's window settings."""
    return plan if plan.align % align == 0 else replan(plan, config, align=align)
