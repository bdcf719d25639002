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
gds_gather.schedule.run_ubatches; GpuPrefill is its device. Every buffer a graph captures is sized for the
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

from . import devcache, quants, rowcache
from .backends import choose_device, resolve
from .config import Config
from .errors import BackendError
from .graph import refused_in
from .readers import HOST_READERS
from .schedule import check_fits, graph_mode, run_ubatches, staging_bound_for

log = logging.getLogger(__name__)
_KEPT_WHILE_QUEUED: list = []   # readers of prefills closed with GPU work queued: their staging is never unmapped


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
    from .model import TrunkConfig
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
    from .model import Trunk
    return Trunk(cfg, seed=seed, device=device, dtype=dtype)


class GpuPrefill:
    """The graph-captured GPU pipeline (see the module docstring)."""

    def __init__(self, table, mapper, *, backend="auto", ubatch=2048, graph=True, dtype="bfloat16", seed=0,
                 trunk="real", config: Config | None = None):
        import torch
        from . import dequant_gpu
        from .platform import detect
        self.torch, self.kern = torch, dequant_gpu
        self.t, self.mapper, self.graph, self.ubatch = table, mapper, graph, ubatch
        self.cfg = config or table.config
        self.platform = detect(self.cfg.platform)
        self.graph, self.graph_why = graph_mode(graph, self.platform.kind)
        if graph and not self.graph:
            log.warning("prefill: %s", self.graph_why)
        self.dev = torch.device("cuda")
        self.tdtype = getattr(torch, dtype)
        self.dtype = dtype
        self.R = mapper.rows_per_token
        self.N = ubatch * self.R
        name, mode, self.why = choose_device(table, backend, self.cfg)
        if name == "resident":
            mode = "resident"
        self.backend, self.mode = name, mode
        # device-resident row cache (devcache.py): discrete GPUs, the engine's backends; unified memory reads the
        # host cache in place
        self.dc = (devcache.acquire(table, torch.cuda.current_device())
                   if mode in ("copy", "gds") and name in rowcache.CACHED_BACKENDS else None)
        self.readers, self.closed = [], False
        try:
            self._setup(table, mapper, ubatch, dtype, trunk, seed, name, mode)
        except BaseException:
            self.close()            # the cache goes back (or a half-built pipeline would hold it forever)
            raise

    def _setup(self, table, mapper, ubatch, dtype, trunk, seed, name, mode) -> None:
        from .graph import HostFlags
        torch, rb = self.torch, table.row_bytes
        self.stream = torch.cuda.Stream()
        self.trunk = _trunk_for(table, mapper, self.dev, self.tdtype, trunk, seed)
        self.trunk_kind = trunk
        # kernel geometry: gemma writes [n_layer, T, per_layer] scaled by sqrt(per_layer); qwen4exp [T*16, 160]
        self.gemma = mapper.gemma
        self.kargs = (dict(layout="per_layer", n_layer=mapper.n_layer, scale=mapper.row_scale) if self.gemma
                      else dict(layout="flat"))
        pin = dict(pin_memory=True)
        self.tokens_pin = [torch.zeros(ubatch, dtype=torch.int64, **pin) for _ in range(2)]
        self.inv_pin = [torch.zeros(self.N, dtype=torch.int32, **pin) for _ in range(2)]
        self.offs_pin = [torch.zeros(self.N, dtype=torch.int64, **pin) for _ in range(2)]
        self.tokens_d = torch.zeros(ubatch, dtype=torch.int64, device=self.dev)
        self.inv_d = torch.zeros(self.N, dtype=torch.int32, device=self.dev)
        self.offs_d = torch.zeros(self.N, dtype=torch.int64, device=self.dev)
        self.flags = None
        if self.graph:
            try:
                self.flags = HostFlags(2)
                self.flags.probe(self.stream.cuda_stream)
            except BackendError as e:   # no native release store, or no stream memory operations
                self._eager(f"eager: the captured wait on a host flag is not available here ({e})")
        self.events = [None, None]
        self.readers, self.staging_views = [], []
        # captured sizes: the most window staging any plan of N ids can need, gaps included (never regrown)
        # gds: KvikIO uses GPU-direct only for 4 KiB-aligned windows; the host engine's may be finer (wide rows)
        self.align = table.gds_align if mode == "gds" else table.align
        bound = staging_bound_for(table, self.N, self.align)
        self.capacity = [None, None]          # bytes of captured staging per slot (None: not captured)
        if self.dc is not None:
            self._cache_buffers(bound)
        elif mode == "gds":
            for s in range(2):
                r = self._new_reader()
                buf = r.dev.ensure(bound)
                self.capacity[s] = int(buf.nbytes)
                self.staging_views.append(torch.as_tensor(buf, device=self.dev))
                self.readers.append(r)
        elif mode == "resident":        # the upper bound: the whole table in device memory, no I/O at all
            data = np.fromfile(table.path, np.uint8, table.n_bytes, offset=table.data_offset)
            self.table_d = torch.from_numpy(data).to(self.dev)
            self.staging_views = [self.table_d, self.table_d]
        else:
            from .device import device_view, pin_staging
            for _ in range(2):
                r = self._new_reader()
                if mode == "zero-copy" and not hasattr(r, "staging"):
                    mode = self.mode = "copy"
                self.readers.append(r)
            if mode == "zero-copy":
                for s, r in enumerate(self.readers):
                    pin_staging(r.staging, mapped=True)
                    host = r.staging.ensure(bound if r.odirect else self.N * rb)   # fixed address from now on
                    self.capacity[s] = int(host.nbytes)
                    self.staging_views.append(torch.as_tensor(device_view(host), device=self.dev))
            else:   # copy: the host compacts rows into pinned memory; the graph copies N x row_bytes up
                self.rows_pin = [torch.zeros(self.N * rb, dtype=torch.uint8, **pin) for _ in range(2)]
                self.rows_d = torch.zeros(self.N * rb, dtype=torch.uint8, device=self.dev)
                self.offs_compact = torch.arange(self.N, dtype=torch.int64, device=self.dev) * rb
        self.graphs: dict = {}
        self.g_events: dict = {}
        self.stats = Stats()
        self.how = (f"{name} -> {mode}" + (f" ({self.readers[0].how})" if self.readers else "")
                    + (f"; device row cache of {self.dc.index.capacity:,} rows in GPU memory" if self.dc else "")
                    + f"; {self.graph_why}")

    def _eager(self, why: str) -> None:
        """Run eagerly from now on (before any replay: the graphs made so far are dropped)."""
        log.warning("prefill: %s", why)
        self.graph, self.graph_why, self.flags, self.graphs = False, why, None, {}

    def _new_reader(self):
        """A reader of the table for one staging slot: KvikIO for gds, else the host backend."""
        t = self.t
        if self.mode == "gds":
            from .device import GdsReader
            return GdsReader(t.path, t.data_offset, t.n_bytes, config=self.cfg, file_id=t.file_id)
        return HOST_READERS[self.backend](t.path, t.data_offset, t.n_bytes, config=self.cfg, file_id=t.file_id)

    def _cache_buffers(self, bound: int) -> None:
        """Buffers of the device row cache (devcache.py): one pool [slots | fresh area], per slot the pinned control
        counts and admissions, and (copy) a pinned, GPU-mapped host buffer for the slot's fresh rows or (gds) the
        slot's region of the fresh area for cuFile. Every address is fixed from here on (graphs capture them)."""
        import cupy as cp
        torch, t, dc, N = self.torch, self.t, self.dc, self.N
        pin = dict(pin_memory=True)
        self.ctl_pin = [torch.zeros(2, dtype=torch.int64, **pin) for _ in range(2)]
        self.adm_pin = [torch.zeros(2 * N, dtype=torch.int64, **pin) for _ in range(2)]
        self.ctl_d = torch.zeros(2, dtype=torch.int64, device=self.dev)
        self.adm_d = torch.zeros(2 * N, dtype=torch.int64, device=self.dev)
        self.region = [None, None]
        if self.mode == "gds":
            step = -(-bound // devcache.FRESH_ALIGN) * devcache.FRESH_ALIGN
            pool = dc.ensure(2 * step)
            for s in range(2):
                r = self._new_reader()
                self.region[s] = dc.fresh_base + s * step
                r.dev.buf = pool[self.region[s]:self.region[s] + bound]     # cuFile reads land in the pool
                self.capacity[s] = bound
                self.readers.append(r)
        else:
            nb = -(-N * t.row_bytes // 8) * 8
            pool = dc.ensure(nb)
            self.fresh_mem = [cp.cuda.alloc_pinned_memory(nb) for _ in range(2)]   # cudaHostAlloc: mapped (UVA)
            self.fresh_host = [np.frombuffer(m, np.uint8, nb) for m in self.fresh_mem]
            self.fresh_dev = [int(cp.cuda.runtime.pointerGetAttributes(m.ptr).devicePointer) for m in self.fresh_mem]
            self.fresh_words_max = nb // 8
            for _ in range(2):
                self.readers.append(self._new_reader())
        self.pool_view = torch.as_tensor(pool, device=self.dev)
        self.staging_views = [self.pool_view, self.pool_view]

    # -- the device step: everything that is captured -----------------------------------------------------------
    def _step(self, n: int, s: int, wait: bool, ev=None):
        with self.torch.no_grad():
            return self._step_body(n, s, wait, ev)

    def _step_body(self, n: int, s: int, wait: bool, ev=None):
        torch, t = self.torch, self.t
        stream = torch.cuda.current_stream()
        h = stream.cuda_stream
        if ev is not None:
            ev[0].record(stream)
        if wait:
            self.flags.wait(h, s, 1)
        N = n * self.R
        self.tokens_d[:n].copy_(self.tokens_pin[s][:n], non_blocking=True)
        self.inv_d[:N].copy_(self.inv_pin[s][:N], non_blocking=True)
        dc = self.dc
        if dc is not None:      # hits in the pool's slots, misses copied (or read) into its fresh area
            self.ctl_d.copy_(self.ctl_pin[s], non_blocking=True)
            self.adm_d.copy_(self.adm_pin[s], non_blocking=True)
            self.offs_d[:N].copy_(self.offs_pin[s][:N], non_blocking=True)
            if self.mode == "copy":
                devcache.copy_words(self.fresh_dev[s], self.pool_view.data_ptr() + dc.fresh_base,
                                    self.ctl_d.data_ptr(), self.fresh_words_max, h, dc.device_id)
            staging, offs = self.pool_view, self.offs_d
        elif self.mode == "copy":
            nb = N * t.row_bytes
            self.rows_d[:nb].copy_(self.rows_pin[s][:nb], non_blocking=True)
            staging, offs = self.rows_d, self.offs_compact
        else:
            self.offs_d[:N].copy_(self.offs_pin[s][:N], non_blocking=True)
            staging, offs = self.staging_views[s], self.offs_d
        rows = self.kern.gather_rows(staging, offs, self.inv_d[:N], t.qtype, t.row_elems, dtype=self.dtype,
                                     stream=stream, **self.kargs)
        if dc is not None:      # admissions: after the dequant read this ubatch's rows
            a = self.adm_d.data_ptr()
            devcache.copy_rows(self.pool_view.data_ptr(), a, a + 8 * self.N, self.ctl_d.data_ptr(), t.row_bytes,
                               self.N, h, dc.device_id)
        if wait:
            self.flags.write(h, s, 0)
        if ev is not None:
            ev[1].record(stream)
        tok = self.tokens_d[:n]
        h0 = self.trunk.embed(tok)
        ple = self.trunk.ple_inputs(rows if self.gemma else rows.view(n, -1), h0)
        return ple, self.trunk(tok, ple)

    def _graph(self, n: int, s: int):
        key = (n, s)
        if key not in self.graphs:
            torch = self.torch
            if self.dc is not None:      # warm-up steps run for real: no stale copies or admissions
                for c in self.ctl_pin:
                    c.numpy()[:] = 0
            self.kern.warmup([self.t.qtype], dtypes=(self.dtype,), index_dtypes=("int32",))
            with torch.cuda.stream(self.stream):
                for _ in range(2):               # warm up outside capture (allocations, autotuning, JIT)
                    self._step(n, s, wait=False)
            self.stream.synchronize()
            try:
                ev = (torch.cuda.Event(enable_timing=True, external=True),
                      torch.cuda.Event(enable_timing=True, external=True))
            except TypeError:
                ev = None
            g = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(g, stream=self.stream):
                    out = self._step(n, s, wait=True, ev=ev)
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
        """Row ids, plan, reads and the slot's pinned buffers for one ubatch (host only, no CUDA call)."""
        t, st = self.t, self.stats
        a = time.perf_counter()
        ids = self.mapper(tok)
        plan = t.plan(ids, align=self.align)
        self._check_capacity(plan, s)
        b = time.perf_counter()
        n, N = tok.shape[0], plan.n_ids
        if self.mode == "resident":
            offs = plan.row_offsets - t.data_offset
        elif self.dc is not None:
            gds = self.mode == "gds"
            got = devcache.stage(self.dc, t, self.readers[s], plan, fresh=None if gds else self.fresh_host[s],
                                 region=self.region[s] if gds else None)
            offs, n_adm = got.offsets, got.adm_src.shape[0]
            adm = self.adm_pin[s].numpy()
            adm[:n_adm] = got.adm_src
            adm[self.N:self.N + n_adm] = got.adm_dst
            self.ctl_pin[s].numpy()[:] = (got.fresh_words, n_adm)
        elif self.mode == "gds":
            _, d_offs = self.readers[s].fetch(plan, wait=False)
            offs = plan.row_staging
        elif not hasattr(self.readers[s], "fetch"):      # mmap, readahead, resident: compact rows come back
            rows = self.readers[s].read(plan)
            self.rows_pin[s].numpy()[:rows.size] = rows.reshape(-1)
        else:       # the table's row cache (hits) + fresh reads, compact
            rows = rowcache.read_through(t, self.readers[s], plan)
            if self.mode == "copy":
                self.rows_pin[s].numpy()[:rows.size] = rows.reshape(-1)
            else:   # zero-copy: the kernel reads the compact rows in place in the slot's fixed, mapped staging
                self.readers[s].staging.buf[:rows.size] = rows.reshape(-1)
                offs = np.arange(plan.n_unique, dtype=np.int64) * t.row_bytes
        c = time.perf_counter()
        self.tokens_pin[s].numpy()[:n] = tok
        self.inv_pin[s].numpy()[:N] = plan.inverse
        if self.mode != "copy" or self.dc is not None:
            self.offs_pin[s].numpy()[:plan.n_unique] = offs
        st.tokens += n
        st.ple_rows += N
        st.unique_rows += plan.n_unique
        st.useful_bytes += plan.exact_bytes
        st.index_seconds += b - a
        st.io_seconds += c - b

    def _check_capacity(self, plan, s: int) -> None:
        """Refuse a plan the slot's captured staging cannot hold, before anything is read into it."""
        if self.capacity[s] is not None:
            check_fits(plan, self.capacity[s], self.mode == "gds" or self.readers[s].odirect,
                       f"captured staging of slot {s}")

    # -- the device half of gds_gather.schedule's contract ------------------------------------------------------
    def slot_free(self, k: int, s: int) -> None:
        if self.events[s] is not None:
            self.events[s].synchronize()          # ubatch k-2 is done with slot s
            self._collect_timing(k - 2, self._ub, s)

    def launch(self, n: int, s: int) -> None:
        captured = self._graph(n, s) if self.graph else None
        if captured is not None:
            g, out = captured
            g.replay()                            # waits on the GPU for flag s
        else:
            torch = self.torch
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            out = self._step(n, s, wait=False, ev=ev)
            self.g_events[("eager", s)] = ev
        self._out = out

    def release(self, s: int) -> None:
        if self.flags is not None:
            self.flags.set(s, 1)

    def scrub(self, s: int) -> None:
        """Zero the slot's pinned tokens and indices: a released step then reads row 0 at offset 0 (in bounds)."""
        ctl = getattr(self, "ctl_pin", None)
        for buf in (self.tokens_pin[s], self.inv_pin[s], self.offs_pin[s]) + ((ctl[s],) if ctl else ()):
            buf.numpy()[:] = 0

    def done(self, k: int, s: int) -> None:
        e = self.torch.cuda.Event()
        e.record(self.stream)
        self.events[s] = e

    def drain(self) -> None:
        self.stream.synchronize()

    def rearm(self) -> None:
        if self.flags is not None:
            self.flags.host[:] = 0
        self.events = [None, None]

    def run(self, tokens: np.ndarray, progress=None, collect: bool = False) -> dict:
        torch = self.torch
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
                outs.append(tuple(x.clone() for x in self._out))
            if progress:
                progress(tok.size)
        mode = "eager" if not self.graph else "staged" if self.mode == "gds" else "overlap"
        t0 = time.perf_counter()
        try:
            with torch.cuda.stream(self.stream):
                run_ubatches(ub, self._stage, self, mode, after=after)
        except BaseException:
            if self.dc is not None:      # the device may not have made the admissions the host recorded
                self.dc.clear()
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
                   ubatch=self.ubatch, ubatches=len(ub))
        if self.dc is not None:
            res.update(cache_where="gpu", device_cache_bytes=self.dc.index.nbytes)
        if collect:
            res["outputs"] = [tuple(x.float().cpu() for x in o) for o in outs]
        return res

    def _split(self, wall: float, n_ub: int):
        """The PLE step's device time (CUDA events around it in the last ubatches, scaled to all of them); the
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
        stream = getattr(self, "stream", None)
        busy = stream is not None and not stream.query()
        if busy:
            log.error("prefill: work still queued at close; its staging is kept and its device row cache discarded")
            _KEPT_WHILE_QUEUED.append(self.readers)
        else:
            for r in self.readers:
                r.close()
        self.readers = []
        if self.dc is not None:
            if busy:
                devcache.discard(self.dc)
            else:
                devcache.release(self.dc)   # nothing queued: the next holder (another stream) may use the pool
            self.dc = None


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
        table.prefetch([], self.backend)     # ... and the prefetch readers

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
        rows = quants.dequantize_rows(raw, t.qtype, t.row_elems)[plan.inverse]
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
