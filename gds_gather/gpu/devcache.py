"""The device-resident row cache of the cached destinations (destinations.py: the GPU prefill's, inside its
captured graph, and Table's device path): rows that hit stay in GPU memory.

One device byte pool per cache: ``[cache slots: capacity x row_bytes | fresh area]``. The host keeps the index and
the policy (a `rowcache.RowCache(store=False)`, the same TinyLFU policy and budget as the host cache); the bytes
of cached rows exist only in the pool. Per batch the host (source.through with `source.DeviceRows`) looks the
unique rows up, reads only the misses, and writes for the device: one offsets array (hits: ``slot x row_bytes``;
misses: where the fresh row will be in the pool), the admissions (fresh offset -> slot offset) and two counts. The
device then, in stream order:

1. "copy" (discrete GPU, host reader): copies the fresh rows from the slot's pinned, GPU-mapped host buffer into
   the fresh area with `gg_copy_words`, whose size it reads from device memory, so only misses cross PCIe (a
   graph's memcpy node has a fixed size); "gds": cuFile already read the misses' windows into the slot's region
   of the fresh area, before the replay;
2. the dequant kernel reads hits and fresh rows through the one offsets array, in the same launch;
3. `gg_copy_rows` copies the admitted fresh rows into their slots (the prefill queues it after the kernel; Table
   before the caller's kernel, which is as safe: an admission never overwrites a slot this batch hits).

Why a hit is never a wrong row: the host index changes only in that host step, in batch order, and the device
applies each batch's admissions on one stream, in the same order; a slot the host evicts for batch k+1 is
rewritten by k+1's step, which runs after k's step finished reading it; the current batch's hits are never
victims (`protect`). The fresh area is shared by the slots' steps (copy) or split per slot (gds: cuFile writes
slot k+1's region while the device may still run k). Hits are only as fresh as the file: an all-hit batch checks
the file's identity as a read would. On any error the holder clears the index (the device may not have made what
the host recorded), and `scrub` makes a released step copy nothing.

A cache belongs to one file identity and device, and is lent to one holder at a time (`acquire`/`release`: a
prefill, or a Table's device destination for the Table's life), so a long-lived process keeps its hot rows across
prompts; a second concurrent holder of the same table gets a private cache. Unified memory ("zero-copy") uses the
host cache.
"""
from __future__ import annotations

import functools
import threading

import numpy as np

from . import kernel_sources, nvrtc
from ..cache import rowcache
from .arrays import cupy_stream

FRESH_ALIGN = 4096          # the fresh area and the gds slot regions start page-aligned (cuFile, 8-byte copies)
COPY_BLOCK = 256
COPY_GRID_MAX = 1024
MAX_POOLS = 4
_POOLS: dict = {}
_LOCK = threading.Lock()


def _up(x: int, a: int) -> int:
    return -(-int(x) // a) * a


class DeviceRowCache:
    """The index (host) and the pool (device) of one cache; `fresh_base` is where the fresh area starts."""

    def __init__(self, index: rowcache.RowCache, device_id: int, accel, key=None):
        self.index, self.device_id, self.accel, self.key = index, device_id, accel, key
        self.row_bytes = index.row_bytes
        self.cache_bytes = index.capacity * index.row_bytes
        self.fresh_base = _up(self.cache_bytes, FRESH_ALIGN)
        self.pool = None            # device uint8 array, fixed while a prefill holds the cache
        self.in_use = False

    def ensure(self, fresh_bytes: int):
        """The pool with room for `fresh_bytes` after the slots (grown before capture; cached rows kept)."""
        need = self.fresh_base + _up(max(int(fresh_bytes), 8), FRESH_ALIGN)
        if self.pool is None or self.pool.nbytes < need:
            self.pool = self.accel.grow(self.pool, need, self.cache_bytes, self.device_id)
        return self.pool

    def clear(self) -> None:
        """Forget every cached row (the pool's bytes no longer matter)."""
        self.index.clear()


def acquire(table, device_id: int, accel) -> DeviceRowCache | None:
    """This table's device cache on `device_id` of `accel` (None when the budget is 0 or the backend has no
    cache)."""
    budget = rowcache.budget_for(table.config.cache_bytes, table.n_bytes)
    if budget <= 0 or rowcache.capacity_for(budget, table.row_bytes) == 0:
        return None
    key = rowcache.cache_key(table, budget) + (accel.name, int(device_id))

    def new(k):
        return DeviceRowCache(rowcache.RowCache(row_bytes=table.row_bytes, budget=budget, file_id=table.file_id,
                                                store=False, max_rows=table.n_rows), int(device_id), accel, k)
    with _LOCK:
        for k in [k for k, v in _POOLS.items() if k[0] == key[0] and k[1] != key[1] and not v.in_use]:
            del _POOLS[k]                                   # same path, another file identity: stale
        dc = _POOLS.get(key)
        if dc is not None and dc.in_use:
            dc = new(None)                                  # held by another prefill: a private one
        elif dc is None:
            dc = _POOLS[key] = new(key)
            idle = [k for k, v in _POOLS.items() if not v.in_use and k != key]
            while len(_POOLS) > MAX_POOLS and idle:
                del _POOLS[idle.pop(0)]
        else:
            _POOLS[key] = _POOLS.pop(key)                   # most recently used last
        dc.in_use = True
        return dc


def release(dc: DeviceRowCache | None) -> None:
    """Give the cache back (the caller's stream must be done with the pool)."""
    if dc is not None:
        with _LOCK:
            dc.in_use = False


def discard(dc: DeviceRowCache) -> None:
    """Never lend this cache again (its pool may still be written by work that was left queued)."""
    with _LOCK:
        if dc.key is not None and _POOLS.get(dc.key) is dc:
            del _POOLS[dc.key]


def drop_all() -> None:
    """Free every idle device cache of this process."""
    with _LOCK:
        for k in [k for k, v in _POOLS.items() if not v.in_use]:
            del _POOLS[k]


# -- the device side -------------------------------------------------------------------------------------------

@functools.cache
def _function(device_id: int, name: str):
    """A kernel of copy.cu, looked up once (the eager warm-up steps do it, never a captured one)."""
    import cupy as cp
    with cp.cuda.Device(device_id):
        return nvrtc.module(kernel_sources.source("copy.cu"), device_id=device_id).get_function(name)


def _grid(n: int) -> int:
    return max(1, min(COPY_GRID_MAX, -(-int(n) // COPY_BLOCK)))


def copy_words(src_ptr: int, dst_ptr: int, ctl_ptr: int, max_words: int, stream_handle: int, device_id: int):
    """Queue gg_copy_words (ctl[0] words src -> dst) with a grid fixed by `max_words` (capturable)."""
    import cupy as cp
    fn = _function(device_id, "gg_copy_words")
    with cp.cuda.Device(device_id), cupy_stream(stream_handle):
        fn((_grid(max_words),), (COPY_BLOCK,), (np.uint64(src_ptr), np.uint64(dst_ptr), np.uint64(ctl_ptr)))


def copy_rows(pool_ptr: int, src_ptr: int, dst_ptr: int, ctl_ptr: int, row_bytes: int, max_rows: int,
              stream_handle: int, device_id: int):
    """Queue gg_copy_rows (ctl[1] rows of the pool, src[r] -> dst[r]) with a grid fixed by `max_rows`."""
    import cupy as cp
    grid = max(1, min(COPY_GRID_MAX, int(max_rows)))
    fn = _function(device_id, "gg_copy_rows")
    with cp.cuda.Device(device_id), cupy_stream(stream_handle):
        fn((grid,), (COPY_BLOCK,), (np.uint64(pool_ptr), np.uint64(src_ptr), np.uint64(dst_ptr),
                                    np.uint64(ctl_ptr), np.int64(row_bytes)))
