"""Where rows that must end in device memory go: one object per destination, each with or without the device row
cache. The GPU prefill (two slots, sized once, inside CUDA graphs) and Table's device path (one slot, grown as
plans need) build the same objects.

Every destination owns its slots (one reader each). Host side, `stage(plan, s)` reads the batch's rows (through
the cached source, source.through) and fills slot s's pinned buffers; device side, `inputs(s, n, stream)` queues
the slot's copies and gives the kernel its (staging, row offsets) for a batch of n ids, and `after(s, stream)`
queues what follows the kernel (the cache's admissions). `scrub(s)` makes a step released without its staging
harmless. Every buffer is allocated at construction, sized by `Spec`; `check(plan, s)` refuses a plan beyond a
slot's staging before anything is read. Device work goes through `accel` only, with numpy dtypes: no torch here.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from . import devcache
from ..cache import rowcache
from ..cache import source
from ..errors import StagingCapacityError
from ..io.direct import HOST_READERS
from .schedule import check_fits

log = logging.getLogger(__name__)
KEPT_WHILE_QUEUED: list = []    # (readers, destination) closed with device work queued: never freed


@dataclass(frozen=True)
class Spec:
    """What a destination is built for: `table`'s rows on `accel`, read by `backend` (or cuFile for gds), at most
    `n_ids` row ids per batch, `slots` staging slots, `bound` bytes of window staging per slot (a plan's windows
    must fit; schedule.staging_bound_for gives the most any plan of n_ids can need). `stream`: the stream whose
    work first uses the destination's device buffers (None: the accel's current one); they are zeroed there, since
    a memset on another stream (cupy's legacy stream) is not ordered with that work and may land after it."""
    table: object
    accel: object
    backend: str
    n_ids: int
    bound: int
    slots: int = 2
    stream: object = None

    def new_reader(self, mode: str):
        t = self.table
        if mode == "gds":
            from .device import GdsReader
            return t.region.open(GdsReader, t.config, accel=self.accel)
        return t.region.open(HOST_READERS[self.backend], t.config)


def mode_for(backend: str, mode: str) -> str:
    """The destination mode for rows of `backend` that must end in device memory, given choose_device's `mode`:
    the "resident" backend (the upper bound: the whole table in memory, no I/O) keeps the whole table in device
    memory (Resident); every other backend keeps `mode`."""
    return "resident" if backend == "resident" else mode


def align_for(table, mode: str) -> int:
    """The window alignment of plans for `mode`: KvikIO uses GPU-direct only for 4 KiB-aligned windows (gds);
    the host engine's may be finer (wide rows)."""
    return table.gds_align if mode == "gds" else table.align


class Destination:
    name = "?"
    dc = None               # the device row cache (devcache.DeviceRowCache) of the cached destinations
    schedule = "overlap"    # schedule.run_ubatches' mode with graphs: staging may be read while the last step runs

    def __init__(self, spec: Spec, readers=()):
        self.spec, self.accel, self.t, self.N = spec, spec.accel, spec.table, spec.n_ids
        self.readers = list(readers)
        self.capacity = [None] * spec.slots     # bytes of window staging per slot (None: compact, N rows fit)
        self.odirect = False

    @property
    def how(self) -> str:
        return f"{self.name} ({self.readers[0].how})" if self.readers else self.name

    @property
    def bytes_read(self) -> int:
        return sum(r.bytes_read for r in self.readers)

    @property
    def cache(self):
        """The device cache's index (rowcache.RowCache), or None."""
        return self.dc.index if self.dc is not None else None

    def check(self, plan, s: int) -> None:
        if plan.n_unique > self.N:
            raise StagingCapacityError(f"this batch has {plan.n_unique:,} unique rows; a slot of this destination "
                                       f"holds {self.N:,}")
        if self.capacity[s] is not None:
            check_fits(plan, self.capacity[s], self.odirect, f"captured staging of slot {s}")

    def stage(self, plan, s: int) -> None:
        raise NotImplementedError

    def inputs(self, s: int, n: int, stream):
        raise NotImplementedError

    def after(self, s: int, stream) -> None:
        pass

    def scrub(self, s: int) -> None:
        pass

    def warm(self) -> None:
        """Before the warm-up steps that run for real."""

    def failed(self) -> None:
        """A run failed: the device may not have done what the host recorded."""

    def close(self, busy: bool) -> None:
        """Close the readers and give the device cache back. busy: device work that may read this destination's
        buffers (pinned host memory included: cupy's pool would lend it again) or its readers' staging is still
        queued: all of it is kept for the process's life instead, and the cache is never lent again."""
        readers, self.readers = self.readers, []
        if busy:
            KEPT_WHILE_QUEUED.append((readers, self))
        first = None
        for r in [] if busy else readers:
            try:
                r.close()
            except BaseException as e:      # noqa: B036 (every close is tried, then the first error raised)
                first = first or e
        if self.dc is not None:
            (devcache.discard if busy else devcache.release)(self.dc)
            self.dc = None
        if first is not None:
            raise first


class _Offsets(Destination):
    """Destinations whose kernel reads rows at per-slot byte offsets (pinned, copied up in the step)."""

    def __init__(self, spec, readers=()):
        super().__init__(spec, readers)
        a, N = self.accel, self.N
        self.offs_pin = [a.pinned_array(N, np.int64) for _ in range(spec.slots)]
        self.offs_d = a.device_array(N, np.int64, spec.stream)
        self.views = [None] * spec.slots

    def put(self, s: int, offs: np.ndarray) -> None:
        self.offs_pin[s][:offs.shape[0]] = offs

    def inputs(self, s, n, stream):
        self.accel.h2d(self.offs_d, self.offs_pin[s], 8 * n, stream)
        return self.views[s], self.offs_d

    def scrub(self, s):
        self.offs_pin[s][:] = 0


class Resident(_Offsets):
    """The upper bound: the whole table in device memory, no I/O at all."""
    name = "resident"

    def __init__(self, spec):
        super().__init__(spec)
        r, a = self.t.region, self.accel
        self.table_d = a.empty(r.n_bytes)
        a.upload(self.table_d, np.fromfile(r.path, np.uint8, r.n_bytes, offset=r.data_offset), None)
        a.synchronize(None)
        self.views = [self.table_d] * spec.slots

    def stage(self, plan, s):
        self.put(s, plan.row_offsets - self.t.data_offset)


class Copy(Destination):
    """A host reader (through the row cache) compacts rows into pinned memory; the step copies n x row_bytes up."""
    name = "copy"

    def __init__(self, spec, readers):
        super().__init__(spec, readers)
        a, N, rb = self.accel, self.N, self.t.row_bytes
        self.rows_pin = [a.pinned_array(N * rb, np.uint8) for _ in range(spec.slots)]
        self.rows_d = a.empty(N * rb)
        self.offs_compact = a.device_array(N, np.int64, spec.stream)    # row k at k x row_bytes, by the first step
        self.offs_ready = False

    def stage(self, plan, s):
        rows = rowcache.read_through(self.t, self.readers[s], plan)
        self.rows_pin[s][:rows.size] = rows.reshape(-1)

    def inputs(self, s, n, stream):
        a = self.accel
        if not self.offs_ready:     # (on the caller's stream; a prefill's warm-up step runs it before capture)
            a.upload(self.offs_compact, np.arange(self.N, dtype=np.int64) * self.t.row_bytes, stream)
            self.offs_ready = True
        a.h2d(self.rows_d, self.rows_pin[s], n * self.t.row_bytes, stream)
        return self.rows_d, self.offs_compact


class ZeroCopy(_Offsets):
    """Unified memory: the kernel reads the compact rows in place in the slot's GPU-mapped staging."""
    name = "zero-copy"

    def __init__(self, spec, readers):
        super().__init__(spec, readers)
        a, rb = self.accel, self.t.row_bytes
        for s, r in enumerate(self.readers):
            a.pin(r.staging, mapped=True)
            host = r.staging.ensure(spec.bound if r.odirect else self.N * rb)   # fixed address from now on
            self.capacity[s] = int(host.nbytes)
            self.views[s] = a.device_view(host)
        self.odirect = self.readers[0].odirect

    def stage(self, plan, s):
        rows = rowcache.read_through(self.t, self.readers[s], plan)
        self.readers[s].staging.buf[:rows.size] = rows.reshape(-1)
        self.put(s, np.arange(plan.n_unique, dtype=np.int64) * self.t.row_bytes)


class Gds(_Offsets):
    """cuFile reads each slot's windows into the slot's device staging before the step."""
    name = "gds"
    schedule = "staged"     # cuFile is not stream-ordered: its reads complete before the replay

    def __init__(self, spec, readers):
        super().__init__(spec, readers)
        for s, r in enumerate(self.readers):
            self.views[s] = r.dev.ensure(spec.bound)
            self.capacity[s] = int(self.views[s].nbytes)
        self.odirect = True

    def stage(self, plan, s):
        self.readers[s].read_windows(plan)
        self.put(s, plan.row_staging)


class _Cached(_Offsets):
    """The device row cache (devcache.py): one pool [slots | fresh area]; per slot the pinned control counts and
    admissions. Every address is fixed from here on (graphs capture them)."""

    def __init__(self, spec, readers, dc):
        super().__init__(spec, readers)
        a, N = self.accel, self.N
        self.dc = dc
        self.ctl_pin = [a.pinned_array(2, np.int64) for _ in range(spec.slots)]
        self.adm_pin = [a.pinned_array(2 * N, np.int64) for _ in range(spec.slots)]
        self.ctl_d = a.device_array(2, np.int64, spec.stream)
        self.adm_d = a.device_array(2 * N, np.int64, spec.stream)

    @property
    def how(self) -> str:
        return super().how + f"; device row cache of {self.dc.index.capacity:,} rows in GPU memory"

    def _pool(self, pool) -> None:
        self.pool = pool
        self.views = [pool] * self.spec.slots

    def stage_rows(self, plan, s: int, store) -> None:
        got = source.through(self.t, self.readers[s], plan, store)
        n_adm = got.adm_src.shape[0]
        adm = self.adm_pin[s]
        adm[:n_adm] = got.adm_src
        adm[self.N:self.N + n_adm] = got.adm_dst
        self.ctl_pin[s][:] = (got.fresh_words, n_adm)
        self.put(s, got.offsets)

    def inputs(self, s, n, stream):
        a = self.accel
        a.h2d(self.ctl_d, self.ctl_pin[s], 16, stream)
        a.h2d(self.adm_d, self.adm_pin[s], 16 * self.N, stream)
        self.fresh_up(s, stream)
        return super().inputs(s, n, stream)

    def fresh_up(self, s: int, stream) -> None:
        pass

    def after(self, s, stream):     # admissions: after the dequant read this batch's rows
        a = self.accel
        adm = a.ptr(self.adm_d)
        a.copy_rows(a.ptr(self.pool), adm, adm + 8 * self.N, a.ptr(self.ctl_d), self.t.row_bytes, self.N,
                    stream, self.dc.device_id)

    def scrub(self, s):
        super().scrub(s)
        self.ctl_pin[s][:] = 0

    def warm(self):
        for c in self.ctl_pin:      # warm-up steps run for real: no stale copies or admissions
            c[:] = 0

    def failed(self):
        self.dc.clear()


class CachedCopy(_Cached):
    """Hits in the pool's slots; misses read into the slot's pinned, GPU-mapped host buffer and copied into the
    fresh area by gg_copy_words (whose size the device reads: only misses cross PCIe)."""
    name = "copy"

    def __init__(self, spec, readers, dc):
        super().__init__(spec, readers, dc)
        nb = -(-self.N * self.t.row_bytes // 8) * 8
        self._pool(dc.ensure(nb))
        self.fresh = [self.accel.mapped(nb) for _ in range(spec.slots)]     # (host view, device pointer, owner)
        self.fresh_words_max = nb // 8

    def stage(self, plan, s):
        self.stage_rows(plan, s, source.DeviceRows(self.dc, fresh=self.fresh[s][0]))

    def fresh_up(self, s, stream):
        a = self.accel
        a.copy_words(self.fresh[s][1], a.ptr(self.pool) + self.dc.fresh_base, a.ptr(self.ctl_d),
                     self.fresh_words_max, stream, self.dc.device_id)


class CachedGds(_Cached):
    """Hits in the pool's slots; cuFile reads the misses' windows into the slot's region of the fresh area."""
    name = "gds"
    schedule = "staged"

    def __init__(self, spec, readers, dc):
        super().__init__(spec, readers, dc)
        step = -(-spec.bound // devcache.FRESH_ALIGN) * devcache.FRESH_ALIGN
        pool = dc.ensure(spec.slots * step)
        self.region = [dc.fresh_base + s * step for s in range(spec.slots)]
        for s, r in enumerate(self.readers):
            r.dev.buf = pool[self.region[s]:self.region[s] + spec.bound]     # cuFile reads land in the pool
            self.capacity[s] = spec.bound
        self.odirect = True
        self._pool(pool)

    def stage(self, plan, s):
        self.stage_rows(plan, s, source.DeviceRows(self.dc, region=self.region[s]))


def build(spec: Spec, mode: str, device_id: int | None = None) -> tuple[Destination, str]:
    """The destination of `mode` for `spec`; (destination, mode): zero-copy needs readers with staging, and
    becomes copy (said in the log) without. With `device_id`, copy and gds of the engine's backends get the
    device row cache of that device (discrete GPUs; zero-copy goes through the host cache). On an error the
    readers opened and the cache are given back."""
    if mode == "resident":
        return Resident(spec), mode
    if mode not in ("gds", "zero-copy", "copy"):
        raise ValueError(f"unknown destination mode {mode!r}")
    dc = (devcache.acquire(spec.table, device_id, spec.accel)
          if device_id is not None and mode in ("copy", "gds") and spec.backend in rowcache.CACHED_BACKENDS else None)
    readers = []
    try:
        readers = [spec.new_reader(mode) for _ in range(spec.slots)]
        if mode == "zero-copy" and readers[0].staging is None:
            log.info("%s returns fresh arrays (no staging to map): copy instead of zero-copy", readers[0].name)
            mode = "copy"
        if dc is not None:
            return (CachedGds(spec, readers, dc) if mode == "gds" else CachedCopy(spec, readers, dc)), mode
        return {"gds": Gds, "zero-copy": ZeroCopy, "copy": Copy}[mode](spec, readers), mode
    except BaseException:
        devcache.release(dc)
        for r in readers:
            r.close()
        raise


class LastStream:
    """The stream of the last device work that reads a destination's staging (and the caller's stream object,
    kept alive), to wait for before the staging is rewritten by another stream, unpinned, unmapped or freed."""

    def __init__(self, accel):
        self.accel, self.caller, self.stream, self.key = accel, None, None, None

    def used(self, caller, stream) -> None:
        self.caller, self.stream, self.key = caller, stream, self.accel.key(stream)

    def wait(self) -> None:
        s, self.caller, self.stream, self.key = self.stream, None, None, None
        if s is not None:
            self.accel.synchronize(s)
