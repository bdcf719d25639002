"""bench gather's passes: one timed pass over a row-id trace (gather_pass) and its figures, and the kinds of pass
the bench runs: cold then again on one Table (backend_passes), warm across the backends (warm_passes), and in new
processes (new_process_passes, each pass a `python -m gds_gather.benches.gather_child`)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ..cache import hotrows
from ..config import Config
from ..io import measure
from . import memcap
from .report import MiB, go_cold

PASSES = ("cold", "again", "warm")
NEW_PROCESS = ("newproc", "restart")          # passes run in new processes (gather_child), after the three above
ALL_PASSES = PASSES + NEW_PROCESS


def _fetch(t, b: str, plan, stream) -> None:
    if b.startswith("gpu:"):
        t.fetch_device(plan, b[4:], stream)
        stream.synchronize()
    else:
        t.read_plan(plan, b)


def open_for(path, cfg, b: str, stream):
    """A fresh table whose reader for `b` is open (fd, ring, mapping; resident: loaded; the engine's prefetch
    ring) outside the timing."""
    import gds_gather as gg
    t = gg.open_table(path, config=cfg)
    _fetch(t, b, t.plan(np.zeros(1, np.int64)), stream)
    if not b.startswith("gpu:"):
        t.prefetch([], b)
    return t


def reader_how(t, b: str) -> str:
    if b.startswith("gpu:"):
        return t.readers()[1][0].how        # the one destination open_for's fetch opened
    return t.open_reader(b).how


def _bytes_read(t) -> int:
    return t.stats()["bytes_requested"]      # every reader's: the table's, its device destinations', its prefetches'


def table_stats(t) -> dict | None:
    """The row cache's figures where the Table has them (Table.stats()), else None."""
    f = getattr(t, "stats", None)
    if not callable(f):
        return None
    try:
        return dict(f())
    except Exception as e:          # a figure the bench cannot read is a fact, not a crash
        return {"error": f"{type(e).__name__}: {e}"}


def _is_gauge(k: str) -> bool:
    return "rate" in k or "budget" in k or k in ("cache_bytes", "cache_rows", "cache_entries", "hot_rows_loaded")


def stats_delta(before: dict | None, after: dict | None) -> dict | None:
    """One pass's row-cache figures: counters as the pass's increase, gauges (size, budget) as they are after."""
    if after is None:
        return None
    out = {}
    for k, v in after.items():
        b = (before or {}).get(k)
        num = isinstance(v, (int, float)) and not isinstance(v, bool)
        out[k] = v - b if num and not _is_gauge(k) and isinstance(b, (int, float)) else v
    hits, misses = out.get("cache_hits"), out.get("cache_misses")
    if isinstance(hits, (int, float)) and isinstance(misses, (int, float)) and hits + misses > 0:
        out["cache_hit_rate"] = hits / (hits + misses)
    return out


def gather_pass(t, b: str, trace, stream=None) -> dict:
    """One timed pass over the trace; a gather is one row id (ns/gather = wall / row ids, as llama.cpp #137).
    Beside the bytes the readers requested: the bytes the storage delivered (measure.ReadCounter). Before it reads a
    batch, the pass hands the next batch's ids to Table.prefetch, as a prefill that knows its next ubatch does;
    only the engine's backends act on it (the baselines read one batch at a time; Config.prefetch=0: none)."""
    path = t.path
    mem = memcap.PassMemory()           # (a capped bench: the cgroup's peak from here)
    st0 = table_stats(t)
    b0, res0, flt0 = _bytes_read(t), measure.resident_bytes(path), measure.major_faults()
    lat, useful, n_ids, uniq, wins = [], 0, 0, 0, 0
    io = measure.ReadCounter(path)
    t0 = time.perf_counter()
    ahead = not b.startswith("gpu:")
    for i, ids in enumerate(trace):
        a = time.perf_counter()
        if ahead and i + 1 < len(trace):
            t.prefetch(trace[i + 1], b)
        plan = t.plan(ids)
        _fetch(t, b, plan, stream)
        lat.append(time.perf_counter() - a)
        useful += plan.exact_bytes
        n_ids += plan.n_ids
        uniq += plan.n_unique
        wins += plan.n_windows
    wall = time.perf_counter() - t0
    got = io.stop()
    read = _bytes_read(t) - b0
    r = {"backend": b, "rows_per_s": n_ids / wall, "ns_per_gather": wall * 1e9 / n_ids, "seconds": wall,
         "ids": n_ids, "unique": uniq, "unique_rows_per_s": uniq / wall, "windows": wins, "useful_bytes": useful,
         "bytes_requested": read, "read_MiB_s": read / wall / MiB,
         "major_faults": measure.major_faults() - flt0,
         "page_cache_growth_MiB": (measure.resident_bytes(path) - res0) / MiB,
         "p50_ms": measure.percentile_ms(lat, 50), "p99_ms": measure.percentile_ms(lat, 99)}
    r.update(amplification_fields(got, read, useful))
    r["row_cache"] = stats_delta(st0, table_stats(t))
    r.update(mem.fields())
    return r


def amplification_fields(got: dict, requested: int, useful: int) -> dict:
    """Bytes requested / delivered / device beside useful, and read amplification = delivered / useful."""
    ratio = (lambda x: x / useful if useful and x is not None else None)   # noqa: E731
    return {"bytes_delivered": got["delivered_bytes"], "bytes_device": got["device_bytes"],
            "ampl_requested": ratio(requested), "ampl_delivered": ratio(got["delivered_bytes"]),
            "ampl_device": ratio(got["device_bytes"]), "delivered_method": got["delivered_method"],
            "device_method": got["device_method"]}


def empty_row_cache() -> bool:
    """Empty this process's row caches (they outlive Tables) where this build has one; True when it did."""
    try:
        from ..cache import rowcache
    except ImportError:
        return False
    drop = getattr(rowcache, "empty_all", None) or getattr(rowcache, "drop_all", None)   # (older builds: drop)
    if drop is None:
        return False
    drop()
    return True


def warm_page_cache(path, cfg, trace) -> None:
    """Put the trace's pages in the page cache: one untimed buffered pass (pread, a POSIX_FADV_RANDOM fd)."""
    import gds_gather as gg
    with gg.open_table(path, config=cfg) as t:
        for ids in trace:
            t.read_plan(t.plan(ids), "pread")


def backend_passes(path: Path, b: str, a, cfg, trace, stream, passes) -> dict:
    """Passes (a) and (b) of one backend, in that order: {pass: [runs]}; (b) is a.samples passes in a row on the
    same Table (each finds the state the cold pass left: every row of the trace in the row cache, the mapping or
    the page cache). Pass (c) is warm_passes'."""
    out = {}
    emptied = empty_row_cache()
    t = open_for(path, cfg, b, stream)
    try:
        if b == "resident" or "cold" not in passes:      # resident: its first use loads the whole table
            gather_pass(t, b, trace, stream)             # untimed first pass
        else:
            how = go_cold(t.path, a.drop_caches, (t.data_offset, t.n_bytes))   # after the reader was opened
            left = measure.resident_bytes(t.path, t.data_offset, t.n_bytes)
            memcap.log_pass(b, "cold", None)
            r = gather_pass(t, b, trace, stream)
            r.update(cold_how=how, cold_left_MiB=left / MiB, row_cache_emptied=emptied)
            memcap.log_pass(b, "cold", r)
            out["cold"] = [r]
        if "again" in passes:
            for _ in range(a.samples):
                memcap.log_pass(b, "again", None)
                out.setdefault("again", []).append(r := gather_pass(t, b, trace, stream))
                memcap.log_pass(b, "again", r)
    finally:
        t.close()
    return out


def warm_passes(warm_path: Path, order: list[str], a, cfg, trace, stream) -> dict:
    """Pass (c) of every backend, a.samples sweeps of the backends in `order` (b1, b2, ..., b1, b2, ...), each a new
    Table (row cache emptied) on the file whose trace pages a buffered pass has just put in the page cache:
    {backend: [runs]}. Interleaved because these passes last a few ms on a VM whose speed drifts over seconds: the
    backends are compared within a moment of one another."""
    out: dict = {}
    for _ in range(a.samples):
        if a.warm == "cache":
            warm_page_cache(warm_path, cfg, trace)
        for b in order:
            empty_row_cache()
            memcap.log_pass(b, "warm", None)
            with open_for(warm_path, cfg, b, stream) as t:
                before = measure.resident_bytes(t.path)
                r = gather_pass(t, b, trace, stream)
            r["page_cache_before_MiB"] = before / MiB
            memcap.log_pass(b, "warm", r)
            out.setdefault(b, []).append(r)
    return out


def child_pass(path: Path, b: str, trace_file: Path, cfg: Config, hot_dir: Path) -> dict:
    """One pass of backend b over the trace in a NEW process (python -m gds_gather.benches.gather_child): its engine
    start-up (open + one row) is off the clock, its hot-row files live in hot_dir. Returns the pass's figures, or
    {"backend": b, "died": why} where the process did not finish (killed for memory, an error): the bench goes on."""
    cmd = [sys.executable, "-m", "gds_gather.benches.gather_child", str(path), b, str(trace_file), str(hot_dir),
           str(cfg.cache_bytes), str(cfg.queue_depth)]
    env = dict(os.environ, GDS_GATHER_PREFETCH=str(cfg.prefetch))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if r.returncode != 0:
        why = (f"killed by signal {-r.returncode}" + (" (SIGKILL: the OOM killer, where memory is capped)"
                                                       if r.returncode == -9 else "") if r.returncode < 0
               else f"exit {r.returncode}: {' '.join(r.stderr.strip().splitlines()[-1:])}")
        print(f"  {b}: a new-process pass died ({why})", flush=True)
        return {"backend": b, "died": why}
    return json.loads(r.stdout.strip().splitlines()[-1])


def new_process_passes(path: Path, b: str, a, cfg: Config, trace_file: Path, hot_dir: Path, passes) -> dict:
    """The passes in new processes of one backend: newproc (the file warmed by another process's mapped pass,
    no hot rows) and restart (after this backend's own cold pass in the process before)."""
    out = {}
    for p in passes:
        shutil.rmtree(hotrows.directory(hot_dir), ignore_errors=True)   # (the native helpers built there stay)
        go_cold(path, a.drop_caches)
        child_pass(path, "mmap" if p == "newproc" else b, trace_file, cfg, hot_dir)     # untimed: the process before
        if p == "newproc":
            shutil.rmtree(hotrows.directory(hot_dir), ignore_errors=True)
        before = measure.resident_bytes(path)
        memcap.log_pass(b, p, None)
        out[p] = r = child_pass(path, b, trace_file, cfg, hot_dir)
        r["page_cache_before_MiB"] = before / MiB
        r["hot_file_MiB"] = sum(f.stat().st_size for f in hotrows.directory(hot_dir).glob("*.rows")) / MiB
        memcap.log_pass(b, p, r)
    return out
