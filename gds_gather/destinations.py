"""Where the GPU prefill's rows go: one object per destination, each with or without the device row cache.

Every destination owns its two staging slots. Host side, `stage(plan, s)` reads the ubatch's rows (through the
row cache or the device row cache) and fills slot s's pinned buffers; device side, inside the (captured) step,
`inputs(s, N)` queues the slot's copies and gives the kernel its (staging, row offsets), and `after(s)` queues
what follows the kernel (the cache's admissions). `scrub(s)` makes a step released without its staging harmless.
Every buffer is allocated once, sized for the largest plan (schedule.staging_bound); `check(plan, s)` refuses a
plan beyond a slot's captured staging before anything is read. Device work goes through `accel` only.
"""
from __future__ import annotations

import logging

import numpy as np

from . import devcache, rowcache
from .schedule import check_fits

log = logging.getLogger(__name__)


class Destination:
    name = "?"
    dc = None               # the device row cache (devcache.DeviceRowCache) of the cached destinations

    def __init__(self, p, readers=()):
        self.p, self.accel, self.t = p, p.accel, p.t
        self.readers = list(readers)
        self.capacity = [None, None]          # bytes of captured staging per slot (None: compact, N rows fit)
        self.odirect = False

    @property
    def how(self) -> str:
        return f" ({self.readers[0].how})" if self.readers else ""

    def check(self, plan, s: int) -> None:
        if self.capacity[s] is not None:
            check_fits(plan, self.capacity[s], self.odirect, f"captured staging of slot {s}")

    def stage(self, plan, s: int) -> None:
        raise NotImplementedError

    def inputs(self, s: int, N: int):
        raise NotImplementedError

    def after(self, s: int) -> None:
        pass

    def scrub(self, s: int) -> None:
        pass

    def warm(self) -> None:
        """Before the warm-up steps that run for real."""

    def failed(self) -> None:
        """A run failed: the device may not have done what the host recorded."""

    def close(self, busy: bool) -> None:
        pass


class _Offsets(Destination):
    """Destinations whose kernel reads rows at per-slot byte offsets (pinned, copied up in the step)."""

    def __init__(self, p, readers=()):
        super().__init__(p, readers)
        a, N = self.accel, p.N
        self.offs_pin = [a.pinned(N, p.torch.int64) for _ in range(2)]
        self.offs_d = a.zeros(N, p.torch.int64)
        self.views = [None, None]

    def put(self, s: int, offs: np.ndarray) -> None:
        self.offs_pin[s].numpy()[:offs.shape[0]] = offs

    def inputs(self, s, N):
        self.accel.copy(self.offs_d[:N], self.offs_pin[s][:N], self.p.stream)
        return self.views[s], self.offs_d

    def scrub(self, s):
        self.offs_pin[s].numpy()[:] = 0


class Resident(_Offsets):
    """The upper bound: the whole table in device memory, no I/O at all."""
    name = "resident"

    def __init__(self, p):
        super().__init__(p)
        r = self.t.region
        self.table_d = self.accel.to_device(np.fromfile(r.path, np.uint8, r.n_bytes, offset=r.data_offset))
        self.views = [self.table_d, self.table_d]

    def stage(self, plan, s):
        self.put(s, plan.row_offsets - self.t.data_offset)


class Copy(Destination):
    """A host reader (through the row cache) compacts rows into pinned memory; the step copies N x row_bytes up."""
    name = "copy"

    def __init__(self, p, readers):
        super().__init__(p, readers)
        a, torch, nb = self.accel, p.torch, p.N * self.t.row_bytes
        self.rows_pin = [a.pinned(nb, torch.uint8) for _ in range(2)]
        self.rows_d = a.zeros(nb, torch.uint8)
        self.offs_compact = a.to_device(np.arange(p.N, dtype=np.int64) * self.t.row_bytes)

    def stage(self, plan, s):
        rows = rowcache.read_through(self.t, self.readers[s], plan)
        self.rows_pin[s].numpy()[:rows.size] = rows.reshape(-1)

    def inputs(self, s, N):
        nb = N * self.t.row_bytes
        self.accel.copy(self.rows_d[:nb], self.rows_pin[s][:nb], self.p.stream)
        return self.rows_d, self.offs_compact


class ZeroCopy(_Offsets):
    """Unified memory: the kernel reads the compact rows in place in the slot's GPU-mapped staging."""
    name = "zero-copy"

    def __init__(self, p, readers, bound: int):
        super().__init__(p, readers)
        a, rb = self.accel, self.t.row_bytes
        for s, r in enumerate(self.readers):
            a.pin(r.staging, mapped=True)
            host = r.staging.ensure(bound if r.odirect else p.N * rb)   # fixed address from now on
            self.capacity[s] = int(host.nbytes)
            self.views[s] = a.tensor(a.device_view(host))
        self.odirect = self.readers[0].odirect

    def stage(self, plan, s):
        rows = rowcache.read_through(self.t, self.readers[s], plan)
        self.readers[s].staging.buf[:rows.size] = rows.reshape(-1)
        self.put(s, np.arange(plan.n_unique, dtype=np.int64) * self.t.row_bytes)


class Gds(_Offsets):
    """cuFile reads each slot's windows into the slot's device staging before the step."""
    name = "gds"

    def __init__(self, p, readers, bound: int):
        super().__init__(p, readers)
        for s, r in enumerate(self.readers):
            buf = r.dev.ensure(bound)
            self.capacity[s] = int(buf.nbytes)
            self.views[s] = self.accel.tensor(buf)
        self.odirect = True

    def stage(self, plan, s):
        self.readers[s].read_windows(plan)
        self.put(s, plan.row_staging)


class _Cached(_Offsets):
    """The device row cache (devcache.py): one pool [slots | fresh area]; per slot the pinned control counts and
    admissions. Every address is fixed from here on (graphs capture them)."""

    def __init__(self, p, readers, dc):
        super().__init__(p, readers)
        a, torch, N = self.accel, p.torch, p.N
        self.dc = dc
        self.ctl_pin = [a.pinned(2, torch.int64) for _ in range(2)]
        self.adm_pin = [a.pinned(2 * N, torch.int64) for _ in range(2)]
        self.ctl_d = a.zeros(2, torch.int64)
        self.adm_d = a.zeros(2 * N, torch.int64)

    @property
    def how(self) -> str:
        return super().how + f"; device row cache of {self.dc.index.capacity:,} rows in GPU memory"

    def _pool(self, pool) -> None:
        self.pool = pool
        self.pool_view = self.accel.tensor(pool)
        self.views = [self.pool_view, self.pool_view]

    def put_staged(self, s: int, got) -> None:
        n_adm = got.adm_src.shape[0]
        adm = self.adm_pin[s].numpy()
        adm[:n_adm] = got.adm_src
        adm[self.p.N:self.p.N + n_adm] = got.adm_dst
        self.ctl_pin[s].numpy()[:] = (got.fresh_words, n_adm)
        self.put(s, got.offsets)

    def inputs(self, s, N):
        a, st = self.accel, self.p.stream
        a.copy(self.ctl_d, self.ctl_pin[s], st)
        a.copy(self.adm_d, self.adm_pin[s], st)
        self.fresh_up(s)
        return super().inputs(s, N)

    def fresh_up(self, s: int) -> None:
        pass

    def after(self, s):     # admissions: after the dequant read this ubatch's rows
        a = self.accel
        adm = a.ptr(self.adm_d)
        a.copy_rows(a.ptr(self.pool_view), adm, adm + 8 * self.p.N, a.ptr(self.ctl_d), self.t.row_bytes, self.p.N,
                    self.p.stream, self.dc.device_id)

    def scrub(self, s):
        super().scrub(s)
        self.ctl_pin[s].numpy()[:] = 0

    def warm(self):
        for c in self.ctl_pin:      # warm-up steps run for real: no stale copies or admissions
            c.numpy()[:] = 0

    def failed(self):
        self.dc.clear()

    def close(self, busy):
        if busy:
            devcache.discard(self.dc)
        else:
            devcache.release(self.dc)   # nothing queued: the next holder (another stream) may use the pool


class CachedCopy(_Cached):
    """Hits in the pool's slots; misses read into the slot's pinned, GPU-mapped host buffer and copied into the
    fresh area by gg_copy_words (whose size the device reads: only misses cross PCIe)."""
    name = "copy"

    def __init__(self, p, readers, dc):
        super().__init__(p, readers, dc)
        nb = -(-p.N * self.t.row_bytes // 8) * 8
        self._pool(dc.ensure(nb))
        self.fresh = [self.accel.mapped(nb) for _ in range(2)]     # (host view, device pointer, owner)
        self.fresh_words_max = nb // 8

    def stage(self, plan, s):
        self.put_staged(s, devcache.stage(self.dc, self.t, self.readers[s], plan, fresh=self.fresh[s][0]))

    def fresh_up(self, s):
        a = self.accel
        a.copy_words(self.fresh[s][1], a.ptr(self.pool_view) + self.dc.fresh_base, a.ptr(self.ctl_d),
                     self.fresh_words_max, self.p.stream, self.dc.device_id)


class CachedGds(_Cached):
    """Hits in the pool's slots; cuFile reads the misses' windows into the slot's region of the fresh area."""
    name = "gds"

    def __init__(self, p, readers, dc, bound: int):
        super().__init__(p, readers, dc)
        step = -(-bound // devcache.FRESH_ALIGN) * devcache.FRESH_ALIGN
        pool = dc.ensure(2 * step)
        self.region = [dc.fresh_base + s * step for s in range(2)]
        for s, r in enumerate(self.readers):
            r.dev.buf = pool[self.region[s]:self.region[s] + bound]     # cuFile reads land in the pool
            self.capacity[s] = bound
        self.odirect = True
        self._pool(pool)

    def stage(self, plan, s):
        self.put_staged(s, devcache.stage(self.dc, self.t, self.readers[s], plan, region=self.region[s]))


def build(p, mode: str, bound: int, dc):
    """The destination of `mode` (with `dc`, the device row cache, where given) for prefill `p`; (destination,
    mode): zero-copy needs readers with staging, and becomes copy (said in the log) without."""
    if mode == "resident":
        return Resident(p), mode
    readers = [p.new_reader(), p.new_reader()]
    try:
        if mode == "zero-copy" and readers[0].staging is None:
            log.info("prefill: %s returns fresh arrays (no staging to map): copy instead of zero-copy",
                     readers[0].name)
            mode = "copy"
        if dc is not None:
            return (CachedGds(p, readers, dc, bound) if mode == "gds" else CachedCopy(p, readers, dc)), mode
        return {"gds": lambda: Gds(p, readers, bound), "zero-copy": lambda: ZeroCopy(p, readers, bound),
                "copy": lambda: Copy(p, readers)}[mode](), mode
    except BaseException:
        for r in readers:
            r.close()
        raise
