"""The row cache: quantized rows kept across batches (and across Tables of one file) within a byte budget.

Real text repeats tokens and n-grams across ubatches, and O_DIRECT re-reads every row an earlier batch already
read; the cache keeps rows by row id so a row is read from the file once while it stays hot. One cache (a
store.RowCache) per file identity (device, inode, size, mtime), shared by every Table of this process:
`cache_for` keys caches by it, so a new Table on an unchanged file finds the rows an earlier one cached, and a
changed file never meets a stale row (the table refuses it and its cache is dropped). Its hot rows are saved when
a Table closes and at exit (hotrows.py). `read_through` and `read_unique` are a table's reads through its file's
cache (source.through).
"""
from __future__ import annotations

import atexit
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..errors import MemoryBudgetError
from ..io import forksafe, memory
from . import hotrows
from ..io import native
from . import source
from .store import RowCache, capacity_for

log = logging.getLogger(__name__)

CACHED_BACKENDS = ("direct", "gds")   # the engine; the baselines stay faithful to what they emulate (no cache)
AUTO_MAX_BYTES = 256 << 20            # auto budget: 10% of the table, at most this and AUTO_MEMORY_SHARE
AUTO_MEMORY_SHARE = 8                 # auto budget: at most 1/8 of the memory this process may still use (the
#                                       staging, the model and the page cache of the rows it misses need the rest)
MAX_FILES = 4                         # caches kept per process (least recently used first out)


@dataclass(frozen=True)
class Budget:
    bytes: int
    reason: str         # why this size, in words ("auto: 10% of the table", "set (...)", "off")


def budget(cfg_bytes: int, table_bytes: int, available: int | None = None) -> Budget:
    """The byte budget: cfg_bytes when >= 0 (0 disables), else auto = the least of 10% of the table, AUTO_MAX_BYTES
    and 1/AUTO_MEMORY_SHARE of `available` (the bytes this process may still use, memory.available; None: no
    such term)."""
    if cfg_bytes >= 0:
        return Budget(int(cfg_bytes), "set (GDS_GATHER_CACHE_BYTES or --cache)" if cfg_bytes else "off")
    terms = [(table_bytes // 10, "10% of the table"), (AUTO_MAX_BYTES, f"the {AUTO_MAX_BYTES >> 20} MiB cap")]
    if available is not None:
        terms.append((available // AUTO_MEMORY_SHARE, f"1/{AUTO_MEMORY_SHARE} of the memory available"))
    size, why = min(terms, key=lambda t: t[0])
    return Budget(int(size), "auto: " + why)


def budget_for(cfg_bytes: int, table_bytes: int, available: int | None = None) -> int:
    """budget(...)'s bytes."""
    return budget(cfg_bytes, table_bytes, available).bytes


def table_budget(table, limits: memory.Limits | None = None) -> Budget:
    """This table's row cache budget against `limits` (default: this process's, read once: memory.limits)."""
    limits = memory.limits(table.config.memory_root) if limits is None else limits
    return budget(table.config.cache_bytes, table.n_bytes, memory.available(limits))


def too_large(cfg_bytes: int, table_bytes: int, available: int | None) -> bool:
    """Whether an explicit budget's memory, min(budget, the table), exceeds what this process may still use."""
    return cfg_bytes > 0 and available is not None and min(cfg_bytes, table_bytes) > available


def check_budget(cfg_bytes: int, table_bytes: int, limits: memory.Limits) -> None:
    """Refuse (one line) an explicit budget that is too_large: the cache would be killed for memory, not hold the
    rows."""
    avail = memory.available(limits)
    if too_large(cfg_bytes, table_bytes, avail):
        raise MemoryBudgetError(f"row cache budget {cfg_bytes:,} B (GDS_GATHER_CACHE_BYTES or --cache) exceeds the "
                                f"{avail:,} B this process may use ({memory.source(limits)})")


# -- one cache per file identity, shared by every Table of this process ------------------------------------------

_CACHES: OrderedDict = OrderedDict()
_CACHES_LOCK = threading.Lock()
_GENERATION = 0                       # generation(): moved by drop_all, empty_all and in a forked child


def cache_for(table) -> RowCache | None:
    """The process-wide cache of this table's file (None when the budget is 0); created on first use."""
    limits = memory.limits(table.config.memory_root)
    budget = table_budget(table, limits).bytes
    if budget <= 0:
        return None
    key = cache_key(table, budget)
    with _CACHES_LOCK:
        c = _CACHES.get(key)
        if c is not None:
            _CACHES.move_to_end(key)
            return c
        if capacity_for(budget, table.row_bytes) == 0:
            return None
        check_budget(table.config.cache_bytes, table.n_bytes, limits)
        for k in [k for k in _CACHES if k[0] == key[0] and k[1] != key[1]]:   # same path, other identity: stale
            _CACHES.pop(k).close()
        c = _CACHES[key] = RowCache(row_bytes=table.row_bytes, budget=budget, file_id=table.file_id,
                                    max_rows=table.n_rows, lib=native.library(table.config)[0])
        while len(_CACHES) > MAX_FILES:
            _CACHES.popitem(last=False)[1].close()
        log.info("%s: row cache of %d rows (%d bytes budget)", table.path.name, c.capacity, budget)
        c.hot = hotrows.Target.of(table) if table.config.hot_rows else None
        if c.hot is not None:
            got = hotrows.load(c.hot, c.capacity)
            c.hot_loaded = c.restore(*got) if got else 0
            c.hot_saved = c.gen            # what is on disk now
        return c


def save_hot(table=None) -> None:
    """Write the hot rows of this table's file (every file's, without a table) where they changed since they
    were read or last written (hotrows.py). Called when a Table closes and at exit."""
    if table is None:
        with _CACHES_LOCK:
            caches = list(_CACHES.values())
    else:
        caches = [c for c in [_existing(table)] if c]
    for c in caches:
        if c.hot is None or c.gen == c.hot_saved:
            continue
        gen, snap = c.gen, c.snapshot()
        if snap is not None and hotrows.save(c.hot, *snap) is not None:
            c.hot_saved = gen


atexit.register(save_hot)


def empty_all() -> None:
    """Forget every row of every row cache of this process, keeping their memory (benchmarks: a cold pass of a
    process whose cache has been used, without a first touch of fresh memory that a virtual machine sometimes
    makes 20x slower; docs/decisions/cold-pass-method.md)."""
    global _GENERATION
    with _CACHES_LOCK:
        _GENERATION += 1
        caches = list(_CACHES.values())
    for c in caches:
        c.clear()


def drop_all() -> None:
    """Close every row cache of this process (their memory goes back; the next use makes new ones)."""
    global _GENERATION
    with _CACHES_LOCK:
        _GENERATION += 1
        while _CACHES:
            _CACHES.popitem()[1].close()


def read_unique(table, reader, rows: np.ndarray, ahead=None) -> np.ndarray:
    """read_through for sorted unique row ids, planned only where the row cache lacks some (a decode step's one or
    few tokens: planning one row costs more than the whole hit path; docs/decisions/transformers-offload.md). Rows
    the page cache held are admitted too: for a few rows the page-cache path's per-call cost, not the I/O, is what a
    hit saves."""
    cache = cache_for(table) if reader.name in CACHED_BACKENDS else None
    if cache is None or not rows.shape[0]:
        return read_through(table, reader, table.plan(rows), ahead=ahead)
    return source.through(table, reader, None, source.HostRows(cache, admit_page_cache=True), rows=rows,
                          ahead=ahead)


def read_hits(cache: RowCache, reader, rows: np.ndarray, io: dict) -> np.ndarray | None:
    """read_unique's all-hit case alone: the bytes of sorted unique `rows` where `cache` holds every one (counted
    into io, the file checked as source.through does), else None with nothing counted."""
    with cache.lock:
        out = cache.take_all(rows)
        if out is None:
            return None
        io["cache_hits"] += out.shape[0]
        io["rows_from_cache"] += out.shape[0]
    reader.check_file()             # no read follows: hits must not outlive a change of the file
    return out


def generation() -> int:
    """Changes whenever the caches cache_for handed out may all have been dropped or emptied (drop_all, empty_all,
    a forked child): a holder of one, or of rows from one, checks it before using its copy."""
    return _GENERATION


def read_through(table, reader, plan, io: dict | None = None, ahead=None) -> np.ndarray:
    """The plan's unique rows (uint8 [U, row_bytes]) through this file's row cache (source.through with host
    storage), or straight from `reader` for a backend without one. Counts into io (default table.io); ahead: see
    source.through (without a cache: the caller starts its prefetches after the read)."""
    cache = cache_for(table) if reader.name in CACHED_BACKENDS else None
    if cache is None or plan.n_unique == 0:
        io = table.io if io is None else io
        pc0 = reader.rows_from_page_cache
        out = reader.read(plan) if plan.n_unique else np.empty((0, plan.row_bytes), np.uint8)
        source.count_reader(io, reader, pc0, plan.n_unique)
        return out
    return source.through(table, reader, plan, source.HostRows(cache), io=io, ahead=ahead)


IO_COUNTERS = ("rows_from_cache", "rows_from_page_cache", "rows_from_device", "rows_buffered", "cache_hits",
               "cache_misses", "rows_prefetched")


def cache_key(table, budget: int) -> tuple:
    # the file's identity, where the table lies in it, and the budget (Tables of one file with different budgets
    # keep caches of their own instead of replacing each other's on every call)
    return str(table.path), table.file_id, table.data_offset, table.row_bytes, budget


def _existing(table) -> RowCache | None:
    with _CACHES_LOCK:
        return _CACHES.get(cache_key(table, table_budget(table).bytes))


def _forget_in_child() -> None:
    # a forked child: another parent thread may have been changing a cache (or held this lock) at fork()
    global _CACHES_LOCK, _GENERATION
    _CACHES_LOCK = threading.Lock()
    _GENERATION += 1
    _CACHES.clear()


forksafe.on_child(_forget_in_child)


def stats(table, device_caches: list, bytes_requested: int) -> dict:
    """Table.stats(): the table's counters, its file's row cache and the device caches' sizes."""
    io = dict(table.io)
    main = _existing(table)
    caches = [c for c in [main, *device_caches] if c]
    looked = io["cache_hits"] + io["cache_misses"]
    b = table_budget(table)
    io.update(hot_rows_loaded=main.hot_loaded if main else 0,
              hot_rows_file=str(hotrows.path_for(main.hot)) if main and main.hot else None,
              hot_rows_changed=bool(main and main.hot and main.gen != main.hot_saved))
    io.update(cache_hit_rate=io["cache_hits"] / looked if looked else 0.0,
              cache_bytes=sum(c.nbytes for c in caches),
              cache_budget_bytes=b.bytes, cache_budget_reason=b.reason,
              bytes_requested=bytes_requested)
    return io
