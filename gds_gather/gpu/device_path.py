"""A Table's device path: rows that must end in GPU memory.

One DevicePath per Table owns its accel (Config.accel, made on first use), one destination per (backend, mode)
with one slot (destinations.py, grown as plans need), the stream that last read their staging, the gds-or-direct
choice per backend (backends.choose_device) and the gds-vs-direct timing. It reads the table's metadata and plans
through the `table` it is given and never imports table.py. The table is a weakref.proxy: the Table's finalizer
holds this object (closes()), which must not keep the Table alive.
"""
from __future__ import annotations

import functools
import logging
import time

import numpy as np

from . import accel as accel_mod
from . import arrays
from . import destinations
from .dequant import BlockScales
from ..backends import choose_device
from ..errors import BackendError, StagingCapacityError
from ..io.readers import GDS_ALIGN
from ..planner import ReadPlan, realign

log = logging.getLogger(__name__)


class DevicePath:
    """The device half of `table` (a weakref.proxy of a Table); the Table serializes calls (its lock)."""

    def __init__(self, table):
        self.table = table
        self._accel = None
        self.dests: dict = {}           # (backend, mode) -> its destination, on first use
        self.last = None                # destinations.LastStream of the device fetches, once there was one
        self.closed_bytes = 0           # bytes requested by destinations closed since (rebuilt, timed)
        self._choices: dict = {}        # backend -> choose_device's answer (it probes kvikio and cuFile)
        self._verdict = None            # (gds faster?, detail), measured once where real GDS exists

    @property
    def accel(self):
        """The device of the GPU path (accel.get(config.accel)), made on first use."""
        if self._accel is None:
            self._accel = accel_mod.get(self.table.config.accel)
        return self._accel

    # -- the choice ----------------------------------------------------------------------------------------
    def device_choice(self, backend: str = "auto") -> tuple[str, str, str]:
        """(backend, destination mode, why), asked once per backend (the one gds-or-direct decision,
        backends.choose_device; the "resident" backend keeps the whole table in device memory:
        destinations.mode_for)."""
        if backend not in self._choices:
            t = self.table
            name, mode, why = choose_device(t, backend, t.config, state=self.accel.gds_state)
            self._choices[backend] = (name, destinations.mode_for(name, mode), why)
        return self._choices[backend]

    def gds_faster(self) -> tuple[bool, str]:
        """Time gds against direct + pinned copy on 512 random rows of the table (best of 3 batches of rows of
        their own), once (real GDS only), each through a destination of its own without a device cache."""
        if self._verdict is None:
            t = self.table
            rng = np.random.default_rng(0)
            plans = [t.plan(rng.integers(0, t.n_rows, min(512, t.n_rows))) for _ in range(3)]
            tg, td = self._timed(plans, "gds", "gds"), self._timed(plans, "direct", "copy")
            self._verdict = (tg < td, f"512 rows: gds {tg * 1e3:.2f} ms, direct {td * 1e3:.2f} ms")
        return self._verdict

    def _timed(self, plans: list, name: str, mode: str) -> float:
        """Best seconds of `plans` through a fresh (name, mode) destination, closed after."""
        a = self.accel
        ps = [realign(p, GDS_ALIGN, self.table.config) if mode == "gds" else p for p in plans]
        spec = destinations.Spec(self.table, a, name, max(p.n_unique for p in ps),
                                 max(max(p.window_bytes for p in ps), 1), slots=1)
        d, _ = destinations.build(spec, mode)
        best = float("inf")
        try:
            for p in ps:                # rows of their own each time: every repeat reads
                t0 = time.perf_counter()
                through_slot(d, p, a.current(None))
                a.synchronize(None)
                best = min(best, time.perf_counter() - t0)
        finally:
            self.closed_bytes += d.bytes_read
            d.close(False)
        return best

    # -- fetches -------------------------------------------------------------------------------------------
    def fetch(self, plan: ReadPlan, backend: str, stream):
        """Table.fetch_device: the plan's rows in GPU memory, (device staging, device offset of each unique row),
        after the previous batch's consumers on `stream` are done with the staging."""
        name, mode, _ = self.device_choice(backend)
        s = self._turn(stream)
        self.accel.synchronize(s)
        return self._fetch(plan, name, mode, s)

    def fetch_ids(self, ids, backend: str, stream, host_ids=None):
        """(plan, device staging, device row offsets) for device ids, planned on the host. The ids are copied
        down on `stream` and the host waits for that copy, so every earlier consumer of the staging on `stream` is
        done: the destination need not wait again (one synchronization per gather). host_ids: the caller's copy of
        the ids' values, made on `stream` after its earlier work (then no synchronization here)."""
        if arrays.kind(ids) == "host-device" and self.accel.name != "host":
            raise BackendError("HostAccel ids on a table whose Config.accel is not 'host'")
        name, mode, _ = self.device_choice(backend)
        s = self._turn(stream)
        host = self.accel.to_host(ids, stream) if host_ids is None else np.asarray(host_ids)
        plan = self.table.plan(host, align=destinations.align_for(self.table, mode))
        return (plan, *self._fetch(plan, name, mode, s))

    def read_rows(self, ids, backend: str, stream):
        """Raw rows behind device ids, on the ids' device and of their kind (Table.read_rows)."""
        stream = arrays.launch_stream(stream, ids)
        plan, staging, offs = self.fetch_ids(ids, backend, stream)
        out = self.accel.take_rows(staging, offs, plan.inverse, self.table.row_bytes, plan.shape, stream)
        return arrays.like(out, ids)

    def gather(self, ids, backend: str, dtype: str, stream, host_ids=None):
        """Dequantized rows behind device ids (Table.gather's GPU flavour): rows fetched, dequantized and
        scattered by the kernel on `stream`, one stream for the copies and the kernel."""
        stream = arrays.launch_stream(stream, ids)
        plan, staging, offs = self.fetch_ids(ids, backend, stream, host_ids)
        inv = self.accel.ids_like(plan.inverse.reshape(plan.shape), ids, stream)
        t = self.table
        return self.accel.gather(staging, offs, inv, t.qtype, t.row_elems, dtype=dtype, stream=stream,
                                 block_scales=self.block_scales(plan.unique_rows, ids, stream))

    def block_scales(self, rows, like, stream):
        """The scales beside the unique `rows` on the device (dequant.BlockScales; None for an unscaled table):
        read on the host (Table.scale_rows: small, row-cached) and uploaded as they are stored, one compact row of
        scales per table row, of `like`'s kind."""
        t = self.table
        raw = t.scale_rows(rows)
        if raw is None:
            return None
        a, sp = self.accel, t.scales
        offs = np.arange(raw.shape[0], dtype=np.int64) * raw.shape[1]
        return BlockScales(a.ids_like(np.ascontiguousarray(raw).reshape(-1), like, stream),
                           a.ids_like(offs, like, stream), sp.kernel_type, sp.block, sp.kernel_smul)

    def _fetch(self, plan: ReadPlan, name: str, mode: str, s):
        """The plan through the (name, mode) destination's one slot, on the accel stream `s`, which the caller
        made the staging's (_turn) and waited for."""
        if mode == "gds":
            plan = realign(plan, GDS_ALIGN, self.table.config)     # windows KvikIO reads with GDS: 4 KiB-aligned
        return through_slot(self._destination(name, mode, plan, s), plan, s)

    def _turn(self, stream):
        """`stream` (as the accel's stream object) becomes the one that reads the staging: the last other stream
        that read it is waited for first."""
        a = self.accel
        s = a.current(stream)
        if self.last is None:
            self.last = destinations.LastStream(a)
        if self.last.key is not None and self.last.key != a.key(s):
            self.last.wait()
        self.last.used(stream, s)
        return s

    def _destination(self, name: str, mode: str, plan: ReadPlan, s):
        """The (name, mode) destination, built (or rebuilt at least twice as large) where `plan` does not fit its
        slot, its device buffers zeroed on `s`, the stream that uses them first (a later stream waits for the last
        one: _turn); the streams that used the old one are done with it (its caller waited, or with host_ids the
        caller did)."""
        key = (name, mode)
        d = self.dests.get(key)
        if d is not None:
            try:
                d.check(plan, 0)
                return d
            except StagingCapacityError:
                del self.dests[key]
                self.closed_bytes += d.bytes_read
                d.close(False)
        a = self.accel
        n = 1 << max(10, (2 * plan.n_unique - 1).bit_length())
        need = max(plan.window_bytes, plan.n_unique * self.table.row_bytes, 1 << 19)
        bound = 1 << (2 * need - 1).bit_length()
        if d is not None:               # never smaller than the slot it replaces (no rebuild back and forth)
            n, bound = max(n, 2 * d.N), max(bound, 2 * d.spec.bound)
        spec = destinations.Spec(self.table, a, name, n, bound, slots=1, stream=s)
        d, _ = destinations.build(spec, mode, a.dev_id())
        self.dests[key] = d
        log.info("%s: GPU rows via %s -> %s (a slot of %d rows)", self.table.path.name, name, d.how, n)
        return d

    # -- accounting and lifetime ---------------------------------------------------------------------------
    def destinations(self) -> list:
        """The destinations opened so far, in the order opened."""
        return list(self.dests.values())

    def caches(self) -> list:
        """The device row caches of the destinations (for Table.stats)."""
        return [d.cache for d in self.dests.values() if d.cache is not None]

    @property
    def bytes_read(self) -> int:
        """Bytes the destinations asked of the file, closed ones included."""
        return sum(d.bytes_read for d in self.dests.values()) + self.closed_bytes

    def closes(self) -> list:
        """What releasing this path takes, in order (the Table's finalizer tries each and clears): wait for the
        stream of the last device fetch to be done with the staging, then close every destination."""
        waits = [self.last.wait] if self.last is not None else []
        return waits + [functools.partial(d.close, False) for d in self.dests.values()]


def through_slot(dest, plan: ReadPlan, s):
    """One batch through a destination's slot 0 on stream s (queued): (staging, offset of each unique row). On an
    error the destination's device cache is cleared: its index may hold rows the device never received."""
    n = plan.n_unique
    try:
        dest.stage(plan, 0)
        staging, offs = dest.inputs(0, n, s)
        dest.after(0, s)
    except BaseException:
        dest.failed()
        raise
    return staging, offs[:n]
