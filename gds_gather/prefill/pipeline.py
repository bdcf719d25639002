"""The prefill pipeline: per ubatch, PLE row ids -> planned reads -> dequant-scatter -> trunk.

GPU (graph=True): two staging slots; while the GPU runs ubatch k-1, the host computes ubatch k's row ids, plans
and reads them into slot k%2, fills the slot's pinned index buffers and sets the slot's flag. One CUDA graph per
(ubatch size, slot) holds everything else: the wait on the flag, the copies of tokens/indices (and, with a
discrete GPU, of the compacted rows) from pinned memory, the dequant-scatter kernel, the flag re-arm, the
per-layer-input math and every trunk layer. Unified memory: the kernel reads the rows in place from GPU-mapped
staging (no copy). gds: cuFile reads into device staging complete before the replay (cuFile cannot be inside a
graph) and the graph holds the rest. graph=False runs the same steps eagerly (still overlapped). On ROCm the
pipeline runs eagerly (the wait-value node is a CUDA driver call; the reason is in `how` and the result).

The host-side order (stage, release, replay, slot reuse, and the release + drain on any error) is
gds_gather.gpu.schedule.run_ubatches; GpuPrefill is its device. Every buffer a graph captures is sized for the
largest plan the graph can see (schedule.staging_bound) and a plan beyond it is refused before it is read.

CPU (no GPU): the same steps in order on the host, with gguf's dequantizer and a torch CPU trunk; no graph.
"""
from __future__ import annotations

import functools
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ..backends import choose_device, resolve
from ..config import Config
from ..errors import BackendError
from ..gpu.dequant import BlockScales
from ..gpu.destinations import Spec, align_for, build, mode_for
from ..gpu.graph import refused_in
from ..gpu.schedule import graph_mode, run_ubatches, staging_bound_for

log = logging.getLogger(__name__)


@dataclass
class Stats:
    tokens: int = 0
    ple_rows: int = 0
    unique_rows: int = 0
    useful_bytes: int = 0
    bytes_read: int = 0
    io_seconds: float = 0.0            # host time inside reads
    index_seconds: float = 0.0         # host time computing row ids and plans
    ple_gpu_ms: list = field(default_factory=list)   # some ubatches: wait + copies + dequant on the GPU
    trunk_seconds: float = 0.0         # CPU pipeline: the main thread's time in the per-layer math and trunk

    def as_dict(self, wall: float, split: tuple | None = None) -> dict:
        """split: (ple_seconds, trunk_seconds, how) where the pipeline measured them (None: unknown)."""
        ple, trunk, how = split or (None, None, "not measured")
        return {
            "tokens": self.tokens, "ple_rows": self.ple_rows, "unique_rows": self.unique_rows,
            "useful_bytes": self.useful_bytes, "bytes_read": self.bytes_read,
            "read_amplification": self.bytes_read / self.useful_bytes if self.useful_bytes else 0.0,
            "seconds": wall, "tok_per_s": self.tokens / wall if wall else 0.0,
            "rows_per_s": self.ple_rows / wall if wall else 0.0,
            "io_seconds": self.io_seconds, "index_seconds": self.index_seconds,
            "ple_seconds": ple, "trunk_seconds": trunk, "split_method": how,
            "ple_share": ple / wall if ple is not None and wall else None,
            "ple_rows_per_s": self.ple_rows / ple if ple else None,
            "trunk_share": trunk / wall if trunk is not None and wall else None,
        }


def _trunk_for(table, mapper, device, dtype, trunk: str, seed: int):
    """The synthetic trunk matching the table's model (real shapes, or tiny for the CPU)."""
    from ..model.trunk import TrunkConfig
    preset, layout = mapper.family.trunk_preset()
    if trunk == "tiny":
        cfg = TrunkConfig.tiny(preset.arch, ple_width=mapper.family.ple_width, n_layer=layout.get("n_layer"))
    else:
        cfg = TrunkConfig.from_preset(preset, **layout)
    return _build_trunk(cfg, seed, str(device), dtype)


def trunk_label(trunk, kind: str) -> str:
    """What the trunk is, for the output: synthetic, its shape, random weights (it is no model's trunk)."""
    if trunk is None:
        return "none (the PLE step alone)"
    c = trunk.cfg
    return (f"synthetic {kind} ({c.arch} shape: {c.n_layer} layers, n_embd {c.n_embd}, {c.n_head} heads of "
            f"{c.head_dim}, n_ff {c.n_ff}), random weights")


@functools.lru_cache(maxsize=1)
def _build_trunk(cfg, seed: int, device: str, dtype):
    """The last trunk built is kept: benchmarks run many prefills of one model (a real trunk is GBs)."""
    from ..model.trunk import Trunk
    return Trunk(cfg, seed=seed, device=device, dtype=dtype)


class GpuPrefill:
    """The graph-captured GPU pipeline (see the module docstring) around one destination (destinations.py); every
    device operation goes through `accel` (accel.CudaAccel on a GPU, accel.HostAccel on the host)."""

    def __init__(self, table, mapper, *, backend="auto", ubatch=2048, graph=True, dtype="bfloat16", seed=0,
                 trunk="real", config: Config | None = None, accel=None):
        import torch
        from ..gpu import accel as accel_mod
        from ..platform import detect
        self.torch = torch
        self.t, self.mapper, self.graph, self.ubatch = table, mapper, graph, ubatch
        self.cfg = config or table.config
        self.accel = accel or accel_mod.get(self.cfg.accel)
        self.platform = detect(self.cfg.platform)
        self.graph, self.graph_why = graph_mode(graph, self.platform.kind)
        if graph and not self.graph:
            log.warning("prefill: %s", self.graph_why)
        self.dev = self.accel.device
        self.tdtype = getattr(torch, dtype)
        self.dtype = dtype
        self.R = mapper.rows_per_token
        self.N = ubatch * self.R
        name, mode, self.why = choose_device(table, backend, self.cfg, state=self.accel.gds_state)
        self.backend, self.mode = name, mode_for(name, mode)
        self.dest, self.closed, self.stream = None, False, None
        try:
            self._setup(table, mapper, ubatch, trunk, seed)
        except BaseException:
            self.close()
            raise

    def _setup(self, table, mapper, ubatch, trunk, seed) -> None:
        torch, a = self.torch, self.accel
        self.stream = a.stream()
        self.trunk = None if trunk == "none" else _trunk_for(table, mapper, self.dev, self.tdtype, trunk, seed)
        self.trunk_kind = trunk
        self.family = mapper.family       # the kernel's layout and the trunk's rows (family.py)
        self.kargs = self.family.kernel_args()
        self.tokens_pin = [a.pinned(ubatch, torch.int64) for _ in range(2)]
        self.inv_pin = [a.pinned(self.N, torch.int32) for _ in range(2)]
        with a.using(self.stream):      # allocated and zeroed in the order of the stream that uses them
            self.tokens_d = a.zeros(ubatch, torch.int64)
            self.inv_d = a.zeros(self.N, torch.int32)
        self.scales = self._scale_buffers(table)
        a.order(self.stream)            # the trunk's weights were written on the current (default) stream
        self.flags = None
        if self.graph:
            try:
                self.flags = a.flags(2)
                self.flags.probe(self.stream)
            except BackendError as e:   # no native release store, or no stream memory operations
                self._eager(f"eager: the captured wait on a host flag is not available here ({e})")
        self.events = [None, None]
        # captured sizes: the most window staging any plan of N ids can need, gaps included (never regrown)
        self.align = align_for(table, self.mode)
        spec = Spec(table, a, self.backend, self.N, staging_bound_for(table, self.N, self.align), stream=self.stream)
        self.dest, self.mode = build(spec, self.mode, a.prefill_device())
        a.synchronize(self.stream)      # the set-up's queued zeros and waits are done: close never finds them queued
        self.graphs: dict = {}
        self.g_events: dict = {}
        self.stats = Stats()
        self.how = f"{self.backend} -> {self.dest.how}; {self.graph_why}"

    def _scale_buffers(self, table):
        """A scaled float8 table's per-slot scales: pinned host rows (filled by _stage, one compact row of scales
        per unique row), their device copy and its fixed offsets (the kernel's block_scales); None unscaled."""
        sp, a = table.scales, self.accel
        if sp is None:
            return None
        nb = self.N * sp.kernel_row_bytes
        pins = [a.pinned_array(nb, np.uint8) for _ in range(2)]
        dev, offs = a.device_array(nb, np.uint8, self.stream), a.device_array(self.N, np.int64, self.stream)
        a.upload(offs, np.arange(self.N, dtype=np.int64) * sp.kernel_row_bytes, self.stream)
        return pins, BlockScales(dev, offs, sp.kernel_type, sp.block, sp.kernel_smul)

    @property
    def readers(self) -> list:
        return self.dest.readers if self.dest is not None else []

    def _eager(self, why: str) -> None:
        """Run eagerly from now on (before any replay: the graphs made so far are dropped)."""
        log.warning("prefill: %s", why)
        self.graph, self.graph_why, self.flags, self.graphs = False, why, None, {}

    # -- the device step: everything that is captured -----------------------------------------------------------
    def _step(self, n: int, s: int, wait: bool, ev=None):
        with self.torch.no_grad():
            return self._step_body(n, s, wait, ev)

    def _step_body(self, n: int, s: int, wait: bool, ev=None):
        a, t, st = self.accel, self.t, self.stream
        if ev is not None:
            ev[0].record(st)
        if wait:
            self.flags.wait(st, s, 1)
        N = n * self.R
        a.copy(self.tokens_d[:n], self.tokens_pin[s][:n], st)
        a.copy(self.inv_d[:N], self.inv_pin[s][:N], st)
        staging, offs = self.dest.inputs(s, N, st)
        bs = None
        if self.scales is not None:
            pins, bs = self.scales
            a.h2d(bs.sstaging, pins[s], pins[s].nbytes, st)
        rows = a.gather(staging, offs, self.inv_d[:N], t.qtype, t.row_elems, dtype=self.dtype, stream=st,
                        block_scales=bs, **self.kargs)
        self.dest.after(s, st)
        if wait:
            self.flags.write(st, s, 0)
        if ev is not None:
            ev[1].record(st)
        if self.trunk is None:        # the PLE step alone (as CpuPrefill's trunk="none")
            return rows, None
        tok = self.tokens_d[:n]
        h0 = self.trunk.embed(tok)
        ple = self.trunk.ple_inputs(self.family.trunk_rows(rows, n), h0)
        return ple, self.trunk(tok, ple)

    def _graph(self, n: int, s: int):
        key = (n, s)
        if key not in self.graphs:
            a = self.accel
            self.dest.warm()
            a.warmup([self.t.qtype], self.dtype)
            with a.using(self.stream):
                for _ in range(2):               # warm up outside capture (allocations, autotuning, JIT)
                    a.defer(self.stream, lambda: self._step(n, s, wait=False))
            a.synchronize(self.stream)
            try:
                ev = (a.event(timing=True, external=True), a.event(timing=True, external=True))
            except TypeError:
                ev = None
            try:
                g, out = a.capture(self.stream, lambda: self._step(n, s, wait=True, ev=ev))
            except Exception as e:      # a refused wait node (torch's capture_end may raise over it): eager
                refused = refused_in(e)
                if refused is None:
                    raise
                self._eager(f"eager: the driver refused the captured wait on a host flag ({refused})")
                return None
            self.graphs[key] = (g, out)
            self.g_events[key] = ev
        return self.graphs[key]

    # -- the host side ----------------------------------------------------------------------------------------
    def _stage(self, tok: np.ndarray, s: int) -> None:
        """Row ids, plan, reads and the slot's pinned buffers for one ubatch (host only, no device call)."""
        t, st = self.t, self.stats
        a = time.perf_counter()
        ids = self.mapper(tok)
        plan = t.plan(ids, align=self.align)
        self.dest.check(plan, s)
        b = time.perf_counter()
        n, N = tok.shape[0], plan.n_ids
        self.dest.stage(plan, s)
        c = time.perf_counter()
        self.tokens_pin[s].numpy()[:n] = tok
        self.inv_pin[s].numpy()[:N] = plan.inverse
        if self.scales is not None:
            sc = t.scale_rows(plan.unique_rows).reshape(-1)
            self.scales[0][s][:sc.size] = sc
        st.tokens += n
        st.ple_rows += N
        st.unique_rows += plan.n_unique
        st.useful_bytes += plan.exact_bytes
        st.index_seconds += b - a
        st.io_seconds += c - b

    # -- the device half of gds_gather.gpu.schedule's contract ------------------------------------------------------
    def slot_free(self, k: int, s: int) -> None:
        if self.events[s] is not None:
            self.events[s].synchronize()          # ubatch k-2 is done with slot s
            self._collect_timing(k - 2, self._ub, s)

    def launch(self, n: int, s: int) -> None:
        captured = self._graph(n, s) if self.graph else None
        if captured is not None:
            g, out = captured
            g.replay()                            # waits on the device for flag s
        else:
            a = self.accel
            ev = (a.event(timing=True), a.event(timing=True))
            out = []

            def step():
                out[:] = self._step(n, s, wait=False, ev=ev)
            a.defer(self.stream, step)
            self.g_events[("eager", s)] = ev
        self._out = out

    def release(self, s: int) -> None:
        if self.flags is not None:
            self.flags.set(s, 1)

    def scrub(self, s: int) -> None:
        """Zero the slot's pinned tokens and indices: a released step then reads row 0 at offset 0 (in bounds)."""
        for buf in (self.tokens_pin[s], self.inv_pin[s]):
            buf.numpy()[:] = 0
        if self.scales is not None:
            self.scales[0][s][:] = 0
        self.dest.scrub(s)

    def done(self, k: int, s: int) -> None:
        e = self.accel.event()
        e.record(self.stream)
        self.events[s] = e

    def drain(self) -> None:
        self.accel.synchronize(self.stream)

    def rearm(self) -> None:
        if self.flags is not None:
            self.flags.host[:] = 0
        self.events = [None, None]

    def run(self, tokens: np.ndarray, progress=None, collect: bool = False) -> dict:
        a = self.accel
        if self.closed:
            raise ValueError("this GpuPrefill is closed")
        ub = self._ub = [tokens[k:k + self.ubatch] for k in range(0, tokens.size, self.ubatch)]
        if self.graph:                       # capture before the clock starts (one graph per size and slot)
            for n in sorted({u.size for u in ub}):
                for s in (0, 1):
                    if self.graph:          # (a refused capture turns the prefill eager)
                        self._graph(n, s)
        for r in self.readers:
            r.bytes_read = 0
        outs = []

        def after(k, tok):
            if collect:
                out = self._out
                a.defer(self.stream, lambda: outs.append(tuple(x if x is None else x.clone() for x in out)))
            if progress:
                progress(tok.size)
        mode = self.dest.schedule if self.graph else "eager"
        t0 = time.perf_counter()
        try:
            with a.using(self.stream):
                run_ubatches(ub, self._stage, self, mode, after=after)
        except BaseException:
            self.dest.failed()
            raise
        wall = time.perf_counter() - t0
        for k in (len(ub) - 2, len(ub) - 1):
            if k >= 0:
                self._collect_timing(k, ub, k % 2)
        self.stats.bytes_read += sum(r.bytes_read for r in self.readers)
        res = self.stats.as_dict(wall, self._split(wall, len(ub)))
        res.update(pipeline="gpu", trunk=trunk_label(self.trunk, self.trunk_kind), graph=self.graph,
                   graph_reason=self.graph_why, schedule=mode,
                   backend=self.backend, destination=self.mode, backend_reason=self.why, how=self.how,
                   ubatch=self.ubatch, ubatches=len(ub), accel=a.name)
        if self.dest.dc is not None:
            res.update(cache_where="gpu", device_cache_bytes=self.dest.dc.index.nbytes)
        if collect:
            res["outputs"] = [tuple(x if x is None else x.float().cpu() for x in o) for o in outs]
        return res

    def _split(self, wall: float, n_ub: int):
        """The PLE step's device time (events around it in the last ubatches, scaled to all of them); the
        trunk is the rest of the wall time."""
        ms = self.stats.ple_gpu_ms
        if not ms:
            return None
        ple = min(wall, sum(ms) / len(ms) / 1e3 * n_ub)
        return ple, wall - ple, (f"CUDA events around the PLE step (wait, copies, dequant) of {len(ms)} of {n_ub} "
                                 "ubatches, scaled; the trunk is the rest of the wall time")

    def _collect_timing(self, k: int, ub, s: int) -> None:
        if k < 0:
            return
        ev = self.g_events.get(("eager", s)) if not self.graph else self.g_events.get((ub[k].size, s))
        if ev:
            try:
                self.stats.ple_gpu_ms.append(ev[0].elapsed_time(ev[1]))
            except RuntimeError:
                pass

    def close(self) -> None:
        """Never blocks (a step left waiting on a host flag would wait forever): with work still queued on the
        stream, the readers' staging, which that work may read, is kept mapped for the process's life instead of
        unpinned and unmapped, and the device row cache is never lent again."""
        self.closed = True
        self.graphs = {}
        busy = self.stream is not None and not self.accel.query(self.stream)
        if busy:
            log.error("prefill: work still queued at close; its staging is kept and its device row cache discarded")
        if self.dest is not None:
            self.dest.close(busy)


def _as_torch(a: np.ndarray):
    try:
        import torch
    except ImportError:
        return a
    return torch.from_numpy(a)


class CpuPrefill:
    """The same steps on the host: reads, gguf's dequantizer, the per-layer math and a torch CPU trunk."""

    def __init__(self, table, mapper, *, backend="auto", ubatch=2048, seed=0, trunk="tiny",
                 config: Config | None = None, **_):
        self.t, self.mapper, self.ubatch = table, mapper, ubatch
        self.backend, self.why = resolve(backend, config or table.config)
        self.torch = self.trunk = None
        self.trunk_kind = trunk
        if trunk != "none":
            import torch
            self.torch = torch
            self.trunk = _trunk_for(table, mapper, torch.device("cpu"), torch.float32, trunk, seed)
        self.family = mapper.family
        self.stats = Stats()
        self.how = f"{self.backend} (host)"
        table.open_reader(self.backend)      # engine start-up before the clock (and residency learned meanwhile)
        table.prefetch([], self.backend)     # ... and the prefetch's ring

    def per_layer_rows(self, rows_f32: np.ndarray, n: int):
        """The trunk's per-layer rows from the kernel-equivalent layout (family.kernel_rows)."""
        f = self.family
        return f.trunk_rows(f.kernel_rows(self.torch.from_numpy(rows_f32), n), n)

    def _fetch(self, tokens: np.ndarray, k: int):
        """Row ids, plan and raw rows of the ubatch at token k (run in order, on the reader thread). The next
        ubatch's row ids go to Table.prefetch first: the device reads them while this one is read and used."""
        t, ub = self.t, self.ubatch
        a = time.perf_counter()
        ids = self._ahead.pop(k, None)
        if ids is None:
            ids = self.mapper(tokens[k:k + ub])
        if k + ub < tokens.size:
            self._ahead[k + ub] = nxt = self.mapper(tokens[k + ub:k + 2 * ub])
            t.prefetch(nxt, self.backend)
        plan = t.plan(ids)
        b = time.perf_counter()
        raw = t.read_plan(plan, self.backend)
        return plan, raw, b - a, time.perf_counter() - b

    def run(self, tokens: np.ndarray, progress=None, collect: bool = False) -> dict:
        """Ubatch k+1 is read on a reader thread while ubatch k is dequantized (and run through the trunk) here,
        as the GPU pipeline reads into the other staging slot: the reads' waits release the GIL and numpy's
        dequantization mostly does too. One reader thread, so the ubatches are mapped and read in order."""
        outs = []
        starts = list(range(0, tokens.size, self.ubatch))
        self._ahead: dict = {}        # token index -> row ids of a ubatch handed to prefetch, for its read
        bytes0 = self.t.stats()["bytes_requested"]     # (every reader's: the table's and its prefetches')
        t0 = time.perf_counter()
        with ThreadPoolExecutor(1, thread_name_prefix="gds-gather-prefill-read") as ex:
            nxt = ex.submit(self._fetch, tokens, 0) if starts else None
            for i, k in enumerate(starts):
                tok = tokens[k:k + self.ubatch]
                plan, raw, t_index, t_io = nxt.result()
                if i + 1 < len(starts):
                    nxt = ex.submit(self._fetch, tokens, starts[i + 1])
                try:
                    self._consume(tok, plan, raw, t_index, t_io, outs, collect)
                except BaseException:
                    nxt.cancel()
                    raise
                if progress:
                    progress(tok.size)
        wall = time.perf_counter() - t0
        self.stats.bytes_read += self.t.stats()["bytes_requested"] - bytes0   # (each ubatch's prefetch was taken)
        return self._result(wall, tokens, outs, collect)

    def _consume(self, tok, plan, raw, t_index, t_io, outs, collect) -> None:
        torch, t, st = self.torch, self.t, self.stats
        rows = t.dequantize(raw, plan.unique_rows)[plan.inverse]
        st.tokens += tok.size
        st.ple_rows += plan.n_ids
        st.unique_rows += plan.n_unique
        st.useful_bytes += plan.exact_bytes
        st.index_seconds += t_index
        st.io_seconds += t_io
        if self.trunk is not None:
            a = time.perf_counter()
            with torch.no_grad():
                tk = torch.from_numpy(tok.astype(np.int64))
                ple = self.trunk.ple_inputs(self.per_layer_rows(rows, tok.size), self.trunk.embed(tk))
                hid = self.trunk(tk, ple)
            st.trunk_seconds += time.perf_counter() - a
            if collect:
                outs.append((ple.clone(), hid.clone()))
        elif collect:       # torch when it is installed, like the trunk's outputs
            outs.append((_as_torch(rows), None))

    def _result(self, wall, tokens, outs, collect) -> dict:
        trunk = self.stats.trunk_seconds
        res = self.stats.as_dict(wall, (wall - trunk, trunk, "host clock: the trunk (with the per-layer "
                                        "projection) timed, the PLE step (waits for reads, dequant) is the rest"))
        res.update(pipeline="cpu", trunk=trunk_label(self.trunk, self.trunk_kind), graph=False,
                   backend=self.backend, destination="host",
                   backend_reason=self.why, how=self.how, ubatch=self.ubatch,
                   ubatches=math.ceil(tokens.size / self.ubatch) if tokens.size else 0)
        if collect:
            res["outputs"] = outs
        return res

    def close(self) -> None:
        pass
