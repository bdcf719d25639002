"""bench gather: a real-text (or random) row-id trace through every backend in three passes, against fio.

Per table, in rounds (--repeat), the backends taking turns: (a) cold: the table's file evicted from the page
cache, a new Table; (b) again: the same open Table, more passes over the same trace (a row cache pays off here;
mmap's mapping is warm); (c) warm: a new Table on the same file whose trace pages are now in the page cache (or on
a tmpfs copy with --warm tmpfs), in sweeps across the backends; then the passes in new processes (newproc,
restart). Passes (b) and (c) last a few ms: each round takes --samples of them. Each pass reports rows/s, ns per
gather, the bytes requested and the bytes the storage delivered (/proc/self/io, and the block device's counter),
page-cache growth and the row cache's figures where the Table has them (Table.stats()).
"""
from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path
from statistics import median

import numpy as np

from ..cache import hotrows
from ..io import measure
from ..io import native
from ..config import Config
from .plot import bars, figure, panel_series
from .report import (COUNT, ROWS, TOKENS, UBATCH, GiB, HOST_BACKENDS, MiB, apply_cache_option, bench_facts,
                     block_device, cold_method, data_dir, fit, go_cold, human_size, machine_title, median_run,
                     out_dir, print_header, ratio_line, short_num, target, write_result)

PASSES = ("cold", "again", "warm")
NEW_PROCESS = ("newproc", "restart")          # passes run in new processes (child_main), after the three above
ALL_PASSES = PASSES + NEW_PROCESS
PASS_TITLE = {"cold": "cold: the file evicted from the page cache, the row cache emptied, a new Table",
              "again": "same table again: the same open Table (and row cache), more passes over the trace",
              "warm": "new table, warm page cache: a new Table (row cache emptied) on the file whose trace pages "
                      "are in the page cache",
              "newproc": "new process, warm box: another process read the trace through a mapping (hot-row files "
                         "removed); engine start-up (open + one row) off the clock",
              "restart": "restart: a new process after the same backend's own cold pass in a process before it "
                         "(hot-row files on, as by default); engine start-up off the clock"}
# the targets: cold direct >= the best of the buffered/mapped baselines; the others direct >= 0.8 x mmap
TARGETS = {"cold": (("pread", "mmap", "readahead"), 1.0), "again": (("mmap",), 0.8), "warm": (("mmap",), 0.8),
           "newproc": (("mmap",), 0.8), "restart": (("mmap",), 0.8)}

# A virtual disk caches on its host: on the development VM the first cold read of a trace ran 2-3x slower than later
# ones for whichever backend read it first, whatever the backend (docs/decisions/cold-pass-method.md), and direct always came first.
PRIME_NOTE = ("cold: an untimed priming round (one cold pass per backend) puts the device's own caches (a virtual "
              "disk's host cache) in the same state for every timed round, and the backends take turns going first "
              "(round r starts with backend r); resident, which loads and frees the whole table, goes last in every "
              "round")


def _gather_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--file", action="append", help="a GGUF with a PLE table (repeatable; default: build --tables)")
    p.add_argument("--tables", default="qwen4exp,gemma4-e4b",
                   help="tables to build and bench: qwen4exp (IQ4_NL, 90 B rows, 16 rows per token), gemma4-e4b "
                        "(Q5_K, 7,392 B rows, one per token); default both")
    p.add_argument("--rows", type=ROWS, help="rows of the qwen4exp-geometry table (default 24,000,000 = 2.16 GB; "
                                             "--quick 200,000)")
    p.add_argument("--gemma-rows", type=ROWS, help="rows of the gemma4-e4b table (default 262,144 = 1.94 GB, the "
                                                   "real one; --quick 4,096)")
    p.add_argument("--trace", choices=("text", "random"), default="text",
                   help="text: the row ids of a real English prompt, ubatch by ubatch (default); random: uniform "
                        "random ids (--ids, --batch)")
    p.add_argument("--prompt", help="text file for the trace (default: the Python documentation topics)")
    p.add_argument("--tokens", type=TOKENS, help="prompt tokens per pass (default 8192; --quick 2048)")
    p.add_argument("--ubatch", type=UBATCH, help="tokens per gather call (default 2048; --quick 1024)")
    p.add_argument("--ids", type=COUNT, help="--trace random: ids per pass (default 100,000; --quick 5,000)")
    p.add_argument("--batch", type=COUNT, help="--trace random: ids per gather call (default 16,384; --quick 1,000)")
    p.add_argument("--backends", help="comma list (default direct,pread,mmap,readahead,resident, and on a GPU the "
                                      "device destinations gpu:direct and gpu:gds)")
    p.add_argument("--warm", choices=("cache", "tmpfs", "none"), default="cache",
                   help="pass (c): cache = a new Table on the same file after an untimed buffered pass put the "
                        "trace's pages in the page cache (default); tmpfs = a new Table on a copy of the table on "
                        "--tmpfs; none = no pass (c)")
    p.add_argument("--tmpfs", default="/dev/shm", help="where --warm tmpfs copies the table")
    p.add_argument("--samples", type=COUNT,
                   help="passes (b) and (c) per round (default 3; --quick 1): they last a few ms, so each round "
                        "takes several, (b) in a row on the same Table, (c) in sweeps across the backends")
    p.add_argument("--no-cold", action="store_true", help="no pass (a)")
    p.add_argument("--no-again", action="store_true", help="no pass (b)")
    p.add_argument("--no-warm", action="store_true", help="no pass (c) (same as --warm none)")
    p.add_argument("--no-newproc", action="store_true", help="no new-process pass on a warm box")
    p.add_argument("--no-restart", action="store_true", help="no restart pass")
    p.add_argument("--cache", help="row cache budget (e.g. 64M, 0 = off): Config(cache_bytes=...) where this build "
                                   "has a row cache; default GDS_GATHER_CACHE_BYTES or the built-in default")
    p.add_argument("--qd", type=COUNT, help="queue depth of direct and of fio (default: Config.queue_depth, "
                                           "GDS_GATHER_QUEUE_DEPTH or 256)")
    p.add_argument("--fio-runtime", type=COUNT, help="seconds per fio run (default 5; --quick 1)")
    p.add_argument("--no-fio", action="store_true", help="skip fio")
    p.add_argument("--no-prime", action="store_true",
                   help="no untimed priming round of cold passes before the timed rounds (see PRIME_NOTE)")
    p.add_argument("--no-prefetch", action="store_true",
                   help="direct reads one batch at a time as the baselines do (Config.prefetch=0); by default each "
                        "pass hands the next batch's ids to Table.prefetch before a read, as a prefill does, and "
                        "direct reads them while it reads the current one")
    p.add_argument("--targets", action="store_true", help=argparse.SUPPRESS)


def _built_table(directory: Path, preset: str, rows: int) -> Path:
    from ..model.synth import write_model
    path = Path(directory) / f"{preset}-{rows}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"building {path} (once, not timed)", flush=True)
        write_model(path, preset, rows=rows, progress=True)
    return path


def _trace(t, a) -> tuple[list[np.ndarray], str]:
    if a.trace == "random":
        ids = np.random.default_rng(0).integers(0, t.n_rows, a.ids)
        return ([ids[k:k + a.batch] for k in range(0, ids.size, a.batch)],
                f"{a.ids:,} uniform random row ids in gathers of {a.batch:,}")
    from ..prefill.run import RowMapper
    from ..prefill.prompts import prompt_tokens
    mapper = RowMapper(t)
    tokenizer = getattr(mapper, "tokenizer", None)       # the model's own tokenizer, where the file carries one
    tokens = prompt_tokens(mapper.n_vocab, mapper.reserved, a.prompt, a.tokens,
                           **({"tokenizer": tokenizer} if tokenizer is not None else {}))
    trace = [mapper(tokens[k:k + a.ubatch]) for k in range(0, tokens.size, a.ubatch)]
    n = sum(x.size for x in trace)
    return trace, (f"{tokens.size:,} tokens of {'the default text (Python docs)' if a.prompt is None else a.prompt} -> "
                   f"{n:,} row ids ({mapper.rows_per_token} per token) in {len(trace)} gather call(s) of up to "
                   f"{min(a.ubatch, tokens.size):,} tokens")


def _bs_name(bs: int) -> str:
    return human_size(bs) if bs % 1024 == 0 else f"{bs} B"


def _bytes_read(t) -> int:
    return t.stats()["bytes_requested"]      # every reader's: the table's, its device destinations', its prefetches'


def _fetch(t, b: str, plan, stream) -> None:
    if b.startswith("gpu:"):
        t.fetch_device(plan, b[4:], stream)
        stream.synchronize()
    else:
        t.read_plan(plan, b)


def _open_for(path, cfg, b: str, stream):
    """A fresh table whose reader for `b` is open (fd, ring, mapping; resident: loaded; the engine's prefetch
    ring) outside the timing."""
    import gds_gather as gg
    t = gg.open_table(path, config=cfg)
    _fetch(t, b, t.plan(np.zeros(1, np.int64)), stream)
    if not b.startswith("gpu:"):
        t.prefetch([], b)
    return t


def _how(t, b: str) -> str:
    if b.startswith("gpu:"):
        return t.readers()[1][0].how        # the one destination _open_for's fetch opened
    return t.open_reader(b).how


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
    return r


def amplification_fields(got: dict, requested: int, useful: int) -> dict:
    """Bytes requested / delivered / device beside useful, and read amplification = delivered / useful."""
    ratio = (lambda x: x / useful if useful and x is not None else None)   # noqa: E731
    return {"bytes_delivered": got["delivered_bytes"], "bytes_device": got["device_bytes"],
            "ampl_requested": ratio(requested), "ampl_delivered": ratio(got["delivered_bytes"]),
            "ampl_device": ratio(got["device_bytes"]), "delivered_method": got["delivered_method"],
            "device_method": got["device_method"]}


def _mib(x) -> str:
    return "n/a" if x is None else f"{x / MiB:,.1f}"


def _x(x) -> str:
    return "n/a" if x is None else f"{x:.1f}x"


def gather_line(r: dict) -> str:
    """Two lines per pass: speed, then bytes and how it ran."""
    every = r.get("rows_per_s_all") or []
    spread = f"  (of {len(every)}: {short_num(min(every))}-{short_num(max(every))})" if len(every) > 1 else ""
    return (f"  {r['backend']:<11} {r['cache']:<7} {r['ns_per_gather']:>9,.0f} ns/gather {r['rows_per_s']:>12,.0f} "
            f"rows/s{spread}  p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms\n"
            + fit((f"      start-up {r['startup_s'] * 1e3:,.0f} ms"
                   f"{' (it built the native helpers)' if r.get('native_built') else ''},"
                   f" {r['hot_rows_loaded']:,} hot rows;"
                   if "startup_s" in r else "     ")
                  + f" MiB requested {_mib(r['bytes_requested'])} delivered {_mib(r['bytes_delivered'])} "
                  f"device {_mib(r['bytes_device'])}  ampl {_x(r['ampl_delivered'])}  majflt {r['major_faults']:,.0f}"
                  f"  page cache {r['page_cache_growth_MiB']:+.1f} MiB  [{r['how']}]", " " * 8))


def cache_line(rc: dict | None) -> str | None:
    """The row cache's figures of one pass, where the Table exposes them and the pass consulted the cache."""
    if not rc or not (rc.get("cache_hits") or rc.get("cache_misses") or rc.get("rows_from_cache")
                      or rc.get("rows_from_page_cache")):
        return None
    def fmt(k, v):
        if isinstance(v, float) and "rate" in k:
            return f"{k} {v:.1%}"
        if isinstance(v, (int, float)) and "bytes" in k:
            return f"{k} {v / MiB:,.1f} MiB"
        return f"{k} {v:,.0f}" if isinstance(v, (int, float)) else f"{k} {v}"
    return fit("               row cache: " + ", ".join(fmt(k, v) for k, v in rc.items() if k != "hot_rows_file"),
               " " * 27)


def _gpu_stream(backends, cfg: Config):
    if not any(b.startswith("gpu:") for b in backends):
        return None
    if cfg.accel != "cuda":                 # HostAccel: one of its streams (any HostStream serves every table)
        from ..gpu import accel
        return accel.get(cfg.accel).stream()
    import cupy
    return cupy.cuda.Stream(non_blocking=True)


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


def _warm_page_cache(path, cfg, trace) -> None:
    """Put the trace's pages in the page cache: one untimed buffered pass (pread, a POSIX_FADV_RANDOM fd)."""
    import gds_gather as gg
    with gg.open_table(path, config=cfg) as t:
        for ids in trace:
            t.read_plan(t.plan(ids), "pread")


def _passes(a) -> list[str]:
    skip = {"cold": a.no_cold, "again": a.no_again, "warm": a.no_warm or a.warm == "none"}
    return [p for p in PASSES if not skip[p]]


def backend_passes(path: Path, b: str, a, cfg, trace, stream, passes) -> dict:
    """Passes (a) and (b) of one backend, in that order: {pass: [runs]}; (b) is a.samples passes in a row on the
    same Table (each finds the state the cold pass left: every row of the trace in the row cache, the mapping or
    the page cache). Pass (c) is warm_passes'."""
    out = {}
    emptied = empty_row_cache()
    t = _open_for(path, cfg, b, stream)
    try:
        if b == "resident" or "cold" not in passes:      # resident: its first use loads the whole table
            gather_pass(t, b, trace, stream)             # untimed first pass
        else:
            how = go_cold(t.path, a.drop_caches, (t.data_offset, t.n_bytes))   # after the reader was opened
            left = measure.resident_bytes(t.path, t.data_offset, t.n_bytes)
            r = gather_pass(t, b, trace, stream)
            r.update(cold_how=how, cold_left_MiB=left / MiB, row_cache_emptied=emptied)
            out["cold"] = [r]
        if "again" in passes:
            out["again"] = [gather_pass(t, b, trace, stream) for _ in range(a.samples)]
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
            _warm_page_cache(warm_path, cfg, trace)
        for b in order:
            empty_row_cache()
            with _open_for(warm_path, cfg, b, stream) as t:
                before = measure.resident_bytes(t.path)
                r = gather_pass(t, b, trace, stream)
            r["page_cache_before_MiB"] = before / MiB
            out.setdefault(b, []).append(r)
    return out


def _new_process_passes(a) -> list[str]:
    return [p for p in NEW_PROCESS if not getattr(a, f"no_{p}")]


def child_pass(path: Path, b: str, trace_file: Path, cfg: Config, hot_dir: Path) -> dict:
    """One pass of backend b over the trace in a NEW process (python -m gds_gather.benches.gather): its engine
    start-up (open + one row) is off the clock, its hot-row files live in hot_dir. Returns the pass's figures."""
    import json
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "gds_gather.benches.gather", str(path), b, str(trace_file), str(hot_dir),
           str(cfg.cache_bytes), str(cfg.queue_depth)]
    env = dict(os.environ, GDS_GATHER_PREFETCH=str(cfg.prefetch))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"bench child ({' '.join(cmd[2:5])}) failed: {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def child_main(argv: list[str]) -> None:
    """The new process of child_pass: prints the pass's figures as one JSON line."""
    import json
    path, b, trace_file, hot_dir, cache_bytes, qd = argv
    cfg = Config.from_env(hot_rows=1, cache_dir=Path(hot_dir), cache_bytes=int(cache_bytes), queue_depth=int(qd))
    with np.load(trace_file) as z:
        trace = [z[k] for k in sorted(z.files, key=int)]
    t0 = time.perf_counter()
    t = _open_for(path, cfg, b, None)
    startup = time.perf_counter() - t0
    try:
        r = gather_pass(t, b, trace)          # (the untimed pass that primes a restart runs it too)
        r.update(startup_s=startup, hot_rows_loaded=(table_stats(t) or {}).get("hot_rows_loaded", 0),
                 native_built=bool(native.built))
    finally:
        t.close()                     # (writes the hot rows, as a user's process does at close)
    print(json.dumps(r, default=float))


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
        out[p] = r = child_pass(path, b, trace_file, cfg, hot_dir)
        r["page_cache_before_MiB"] = before / MiB
        r["hot_file_MiB"] = sum(f.stat().st_size for f in hotrows.directory(hot_dir).glob("*.rows")) / MiB
    return out


def _gather_table(path: Path, label: str, a, cfg: Config, backends: list[str], facts_line) -> dict:
    import gds_gather as gg
    with gg.open_table(path, config=cfg) as t:
        trace, desc = _trace(t, a)
        data = t.path                       # the file holding the table (a shard of a split model)
        geo = dict(n_rows=t.n_rows, row_bytes=t.row_bytes, qtype=t.qtype.name, align=t.align, arch=t.arch,
                   table_bytes=t.n_bytes, window=t.typical_window)
    n_ids = sum(x.size for x in trace)
    passes = _passes(a)
    print("\n" + fit(f"## {label}: {path} ({geo['arch'] or '?'}, {geo['n_rows']:,} rows x {geo['row_bytes']:,} B "
                     f"{geo['qtype']} = {geo['table_bytes'] / 1e9:.2f} GB; O_DIRECT alignment {geo['align']} B)",
                     "   "))
    print(fit(f"   trace: {desc}; {a.repeat} round(s) of the passes {', '.join(passes)}: per backend in turn its "
              f"cold pass then {a.samples} again pass(es) on that Table, then {a.samples} sweep(s) of warm passes "
              f"across the backends; median of every pass shown; {facts_line(path)}", "     "), flush=True)
    out = {"label": label, "path": str(path), **geo, "trace": desc, "ids": n_ids, "passes": passes, "runs": [],
           "fio": {}, "fio_warm": None}
    stream = _gpu_stream(backends, cfg)
    warm_path, copied = path, False
    if "warm" in passes and a.warm == "tmpfs":
        free = shutil.disk_usage(a.tmpfs).free
        if free < 2 * os.path.getsize(path):
            print(f"warm: skipped, {a.tmpfs} has {free / GiB:.1f} GiB free")
            warm_path = None
        else:
            warm_path = Path(a.tmpfs) / f"gds-gather-bench-{os.getpid()}.gguf"
            shutil.copyfile(path, warm_path)
            copied = True
    runs: dict = {}
    hows: dict = {}
    newp = _new_process_passes(a)
    scratch = Path(out_dir(a, cfg)) / f"gather-{os.getpid()}"
    trace_file, hot_dir = scratch / "trace.npz", scratch / "hot-cache"
    if newp:
        scratch.mkdir(parents=True, exist_ok=True)
        np.savez(trace_file, **{str(k): x for k, x in enumerate(trace)})
        # the children's cache directory holds their hot rows; the native helpers are built into it once, here, as
        # a user's new process finds them built (else each child's start-up would be a compiler run)
        native.build(hot_dir)
    try:
        if "cold" in passes and not a.no_prime:
            out["prime"] = prime_round(path, backends, a, cfg, trace, stream)
        turns = [b for b in backends if b != "resident"]      # resident, which loads and frees the whole table,
        last = [b for b in backends if b == "resident"]       # goes last: no cold pass follows that memory churn
        for rep in range(a.repeat):
            k = rep % len(turns) if turns else 0
            order = turns[k:] + turns[:k] + last
            for b in order:
                for p, rs in backend_passes(path, b, a, cfg, trace, stream, passes).items():
                    runs.setdefault((b, p), []).extend(rs)
                hows[b] = _how_after(path, cfg, b, stream)
            if "warm" in passes and warm_path is not None:
                for b, rs in warm_passes(warm_path, order, a, cfg, trace, stream).items():
                    runs.setdefault((b, "warm"), []).extend(rs)
            for b in (x for x in order if not x.startswith("gpu:") and x != "resident"):
                for p, r in new_process_passes(path, b, a, cfg, trace_file, hot_dir, newp).items():
                    runs.setdefault((b, p), []).append(r)
            print(f"    round {rep + 1}/{a.repeat} done", flush=True)
    finally:
        if copied:
            warm_path.unlink(missing_ok=True)
        shutil.rmtree(scratch, ignore_errors=True)
    out["passes"] = passes = passes + newp
    med: dict = {}
    for p in passes:
        if not any((b, p) in runs for b in backends):
            continue
        print(fit(PASS_TITLE[p] + (f" (a copy on {a.tmpfs})" if p == "warm" and a.warm == "tmpfs" else "")),
              flush=True)
        if p == "cold":
            how = next((r.get("cold_how") for b in backends for r in runs.get((b, p), [])), "")
            print(fit(f"  went cold by: {how}"))
            if "resident" in backends:
                print("  resident: no cold pass (its first use loads the whole table)")
        for b in backends:
            if (b, p) not in runs:
                continue
            r = median_run(runs[(b, p)], "rows_per_s")
            r["ns_per_gather"] = 1e9 / r["rows_per_s"]        # consistent with the median rows/s
            r.update(cache=p, how=hows[b])
            med[(b, p)] = r
            out["runs"].append(r)
            print(gather_line(r), flush=True)
            line = cache_line(r.get("row_cache"))
            if line:
                print(line)
            if p == "cold" and (r.get("row_cache") or {}).get("rows_from_cache") and not r.get("row_cache_emptied"):
                print(f"               NOTE: the cold pass served {r['row_cache']['rows_from_cache']:,.0f} rows from "
                      "a row cache this bench could not empty first: not fully cold")
    if "cold" in passes and not a.no_fio:
        for bs in sorted({4096, geo["window"]}):
            name = "4k" if bs == 4096 else f"{bs}"
            go_cold(data, a.drop_caches)
            f = measure.fio_randread(data, bs=name, direct=True, iodepth=a.qd, runtime=a.fio_runtime)
            out["fio"][f"cold_{bs}"] = f
            if f and "iops" in f:
                print(fit(f"  fio randread {_bs_name(bs)} O_DIRECT io_uring "
                          f"QD {a.qd}: {f['iops']:,.0f} IOPS, {f['bw_MiBps']:,.0f} MiB/s   [{f['cmd']}]"))
            else:
                print(f"  fio {name}: {'not installed' if f is None else f.get('error')}")
    if "warm" in passes and a.warm == "tmpfs" and not a.no_fio and warm_path is not None:
        out["fio_warm"] = _fio_tmpfs(path, a, _direct_threads(path, cfg))
    _ratios(out, med, geo, a)
    return out


def prime_round(path: Path, backends: list[str], a, cfg, trace, stream) -> dict:
    """One untimed cold pass per backend (resident: none, it loads the whole table), printed: the first read of the
    trace on this machine. Returns {backend: rows/s}."""
    got = {b: backend_passes(path, b, a, cfg, trace, stream, ["cold"])["cold"][0]["rows_per_s"]
           for b in backends if b != "resident"}
    print(fit("  priming round (untimed, cold; the first read of the trace here): "
              + ", ".join(f"{b} {v / 1e3:,.1f}k rows/s" for b, v in got.items()), "     "), flush=True)
    return got


def _how_after(path, cfg, b, stream) -> str:
    with _open_for(path, cfg, b, stream) as t:
        return _how(t, b)


def _direct_threads(path, cfg) -> int:
    """direct's submitting threads on a memory filesystem (the native pread pool), else 1 (io_uring)."""
    import gds_gather as gg
    with gg.open_table(path, config=cfg) as t:
        r = t.open_reader("direct")
        return r.threads if getattr(r, "ring", None) is None else 1


def _fio_tmpfs(path, a, jobs) -> dict | None:
    warm_path = Path(a.tmpfs) / f"gds-gather-bench-fio-{os.getpid()}.gguf"
    shutil.copyfile(path, warm_path)
    try:
        f = measure.fio_randread(warm_path, bs="4k", direct=False, engine="psync", iodepth=1, numjobs=jobs,
                                 runtime=a.fio_runtime)
    finally:
        warm_path.unlink(missing_ok=True)
    if f and "iops" in f:
        print(fit(f"  fio psync 4k on {a.tmpfs}, {jobs} job(s) (direct's thread count there): {f['iops']:,.0f} IOPS   "
                  f"[{f['cmd']}]"))
        f["jobs"] = jobs
    return f


def _per_round(d: dict, other: dict) -> list[float] | None:
    """direct / the other backend, round by round (the cold passes: one per backend a round, the order rotating),
    where both have every round: a paired view that the VM's drift within a run does not move as it moves the
    ratio of two medians."""
    x, y = d.get("rows_per_s_all") or [], other.get("rows_per_s_all") or []
    if len(x) < 2 or len(x) != len(y) or not all(y):
        return None
    return [u / v for u, v in zip(x, y)]


def _ratios(out: dict, med: dict, geo: dict, a) -> None:
    """Ratios against baselines measured in the same run: direct vs the other backends per pass (with their
    targets), direct vs fio's IOPS on the same file, and the --targets ones (cold direct vs mmap, pread, fio)."""
    out["ratios"] = {}
    print("ratios (median rows/s):")
    for p, (others, tgt) in TARGETS.items():
        d = med.get(("direct", p))
        have = [(o, med[(o, p)]["rows_per_s"]) for o in others if (o, p) in med]
        if not d or not have:
            continue
        best, v = max(have, key=lambda x: x[1])
        name = f"{p}: direct / " + (f"best of {'/'.join(o for o, _ in have)} ({best})" if len(have) > 1 else best)
        rounds = _per_round(d, med[(best, p)]) if p == "cold" else None
        note = "" if not rounds else (f"; round by round {' '.join(f'{x:.2f}' for x in rounds)} (direct ahead in "
                                      f"{sum(x >= 1 for x in rounds)} of {len(rounds)}, median {median(rounds):.2f}x)")
        print(ratio_line(name, d["rows_per_s"], v, target(a, tgt), note))
        out["ratios"][p] = {"vs": best, "ratio": d["rows_per_s"] / v, "target": target(a, tgt), "per_round": rounds}
    d = med.get(("direct", "cold"))
    for bs in sorted({4096, geo["window"]}):
        f = out["fio"].get(f"cold_{bs}") or {}
        if d and f.get("iops"):
            tgt = target(a, 0.9) if a.targets and bs == 4096 else None
            reads = d["windows"] / d["seconds"]           # direct submits one read per window
            print(ratio_line(f"cold: direct rows/s / fio {_bs_name(bs)} IOPS", d["rows_per_s"], f["iops"], tgt,
                             f";  direct's reads/s {reads:,.0f} = {reads / f['iops']:.2f}x, its MiB/s requested "
                             f"{d['read_MiB_s']:,.0f} = {d['read_MiB_s'] / f['bw_MiBps']:.2f}x fio's"))
    if d and a.targets:
        for other, tgt in (("mmap", 3.0), ("pread", 1.3)):
            if (other, "cold") in med:
                print(ratio_line(f"cold: direct / {other}", d["rows_per_s"], med[(other, "cold")]["rows_per_s"],
                                 target(a, tgt)))
    for dev in ("gpu:direct", "gpu:gds"):
        if (dev, "cold") in med and d:
            print(ratio_line(f"cold: {dev} / direct (host)", med[(dev, "cold")]["rows_per_s"], d["rows_per_s"]))
    w, f = med.get(("direct", "warm")), out.get("fio_warm") or {}
    if w and f.get("iops"):
        print(ratio_line(f"warm: direct / fio psync 4k {f['jobs']} job(s)", w["rows_per_s"], f["iops"],
                         target(a, 0.7) if a.targets else None))
    if ("resident", "warm") in med and w:
        print(ratio_line("warm: direct / resident", w["rows_per_s"], med[("resident", "warm")]["rows_per_s"]))


def default_backends(cfg: Config) -> list[str]:
    """The host backends, and on a GPU the device destinations (gpu:gds where KvikIO is usable)."""
    from ..platform import detect
    out = list(HOST_BACKENDS)
    plat = detect(cfg.platform)
    if plat.kind != "cpu":
        out.append("gpu:direct")
        if plat.kind == "discrete":
            from ..gpu import accel
            if accel.get(cfg.accel).gds_state()[0]:     # (the GPU's: backends.gds_state)
                out.append("gpu:gds")
    return out


def run_gather(a, cfg: Config) -> dict:
    q = a.quick
    a.rows = (200_000 if q else 24_000_000) if a.rows is None else a.rows
    a.gemma_rows = (4096 if q else 262_144) if a.gemma_rows is None else a.gemma_rows
    a.tokens = (2048 if q else 8192) if a.tokens is None else a.tokens
    a.ubatch = (1024 if q else 2048) if a.ubatch is None else a.ubatch
    a.ids = (5000 if q else 100_000) if a.ids is None else a.ids
    a.batch = (1000 if q else 16_384) if a.batch is None else a.batch
    a.repeat = (2 if q else 5) if a.repeat is None else a.repeat   # (short passes on a drifting machine: a median)
    a.samples = (1 if q else 3) if a.samples is None else a.samples
    a.fio_runtime = (1 if q else 5) if a.fio_runtime is None else a.fio_runtime
    if a.qd is None:
        a.qd = cfg.queue_depth
    if min(a.rows, a.gemma_rows, a.tokens, a.ubatch, a.ids, a.batch, a.repeat, a.samples, a.qd, a.fio_runtime) < 1:
        raise ValueError("sizes, --repeat, --samples, --qd and --fio-runtime must be >= 1")
    # no hot-row files in this process's passes: cold means nothing from an earlier process (hotrows.py)
    cfg = cfg.with_(queue_depth=a.qd, hot_rows=0, prefetch=0 if a.no_prefetch else None)
    cfg, cache_note = apply_cache_option(cfg, a.cache)
    made = data_dir(a, cfg)
    backends = [b.strip() for b in a.backends.split(",") if b.strip()] if a.backends else default_backends(cfg)
    for b in backends:
        if b not in HOST_BACKENDS and b not in ("gpu:direct", "gpu:pread", "gpu:mmap", "gpu:readahead", "gpu:gds"):
            raise ValueError(f"unknown backend {b!r}; known: {', '.join(HOST_BACKENDS)}, gpu:direct, gpu:gds")
    tables: list[tuple[str, Path]] = []
    if a.file:
        tables = [(Path(f).name, Path(f)) for f in a.file]
    else:
        for name in [x.strip() for x in a.tables.split(",") if x.strip()]:
            if name == "qwen4exp":
                tables.append(("qwen4exp geometry", _built_table(made, "qwen4exp", a.rows)))
            elif name == "gemma4-e4b":
                tables.append(("gemma4-e4b geometry", _built_table(made, "gemma4-e4b", a.gemma_rows)))
            else:
                raise ValueError(f"--tables: qwen4exp and/or gemma4-e4b, got {name!r} (use --file for others)")
    facts = bench_facts(tables[0][1], cfg)
    ahead = ("direct is handed the next batch's ids before each read and reads them while it reads the current "
             "batch (Table.prefetch, Config.prefetch=1; the baselines read one batch at a time)" if cfg.prefetch
             else "direct reads one batch at a time (Config.prefetch=0)")
    notes = [cold_method(a), cache_note] + ([] if a.no_prime else [PRIME_NOTE]) + ([ahead] if ahead else [])
    print_header("gather", facts, notes, quick=a.quick)
    print(fit(f"# backends {', '.join(backends)}; QD {a.qd}; a gather = one row id (ns/gather = 1e9 / median "
              f"rows/s); MiB requested = what the readers asked for, delivered = the bytes counter above, device = "
              f"the block device's counter (system-wide); ampl = delivered / bytes of the unique rows; majflt = major "
              f"page faults of this process; page cache = growth of the file's page-cache residency; p50/p99 per "
              f"gather call", "#   "), flush=True)

    def facts_line(p):
        from ..io.storage import filesystem
        return f"{filesystem(p)} on {block_device(p)}"

    result = {"bench": "gather", "facts": facts, "backends": backends, "trace": a.trace, "qd": a.qd,
              "repeat": a.repeat, "samples": a.samples, "warm_mode": "none" if a.no_warm else a.warm,
              "passes": _passes(a) + _new_process_passes(a),
              "drop_caches": bool(a.drop_caches), "row_cache": cache_note, "primed": not a.no_prime, "tables": []}
    for label, path in tables:
        result["tables"].append(_gather_table(path, label, a, cfg, backends, facts_line))
    return write_result("gather", result, a, out_dir(a, cfg), _plot_gather)


def _plot_gather(res: dict, out) -> None:
    """One panel per table; groups = the passes, one bar per backend (median rows/s, whiskers min-max)."""
    tabs = res["tables"]
    if not tabs:
        raise ValueError("nothing was measured: no plot")
    fig, axes = figure(len(tabs), 7.2, 4.8)
    for ax, t in zip(axes, tabs):
        backends, passes, pick = panel_series(res["backends"], t["runs"], ALL_PASSES)
        vals = {b: [pick(b, p, "rows_per_s") for p in passes] for b in backends}
        every = {b: [pick(b, p, "rows_per_s_all") or [0.0] for p in passes] for b in backends}
        names = {"cold": "cold\n(new table)", "again": "same table\nagain", "warm": "new table,\nwarm page cache",
                 "newproc": "new process,\nwarm box", "restart": "restart"}
        bars(ax, [names[p] for p in passes], backends, vals, lo={b: [min(x) for x in every[b]] for b in backends},
             hi={b: [max(x) for x in every[b]] for b in backends}, log=True,
             ylabel="rows gathered per second (median)")
        f = (t.get("fio") or {}).get("cold_4096") or {}
        if f.get("iops"):
            ax.axhline(f["iops"], color="k", ls="--", lw=1,
                       label=f"fio 4K randread O_DIRECT QD {res['qd']}: {short_num(f['iops'])} IOPS")
        ax.set_title(f"{t['label']}: {t['n_rows']:,} rows x {t['row_bytes']:,} B {t['qtype']} "
                     f"({t['table_bytes'] / 1e9:.2f} GB)\n{short_num(t['ids'])} row ids per pass "
                     f"({'text trace' if res['trace'] == 'text' else 'random ids'}); whiskers: min-max",
                     fontsize=9)
        ax.legend(fontsize=7, loc="upper left", ncol=3)
    warm = {"cache": "page cache warm", "tmpfs": "a tmpfs copy", "none": "not run"}[res["warm_mode"]]
    newp = [p for p in NEW_PROCESS if p in res["passes"]]
    fig.suptitle(f"gds-gather bench gather: cold (file evicted), same table again, new table ({warm})"
                 + ("; new processes: " + ", ".join({"newproc": "warm box", "restart": "restart"}[p] for p in newp)
                    if newp else "") + "\n"
                 f"{machine_title(res['facts'])}", fontsize=10)
    fig.savefig(out)


if __name__ == "__main__":
    import sys
    child_main(sys.argv[1:])
