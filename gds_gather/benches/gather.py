"""bench gather: a real-text (or random) row-id trace through every backend in three passes, against fio.

Per table, in rounds (--repeat), the backends taking turns: (a) cold: the table's file evicted from the page
cache, a new Table; (b) again: the same open Table, more passes over the same trace (a row cache pays off here;
mmap's mapping is warm); (c) warm: a new Table on the same file whose trace pages are now in the page cache (or on
a tmpfs copy with --warm tmpfs), in sweeps across the backends; then the passes in new processes (newproc,
restart). Passes (b) and (c) last a few ms: each round takes --samples of them. Each pass reports rows/s, ns per
gather, the bytes requested and the bytes the storage delivered (/proc/self/io, and the block device's counter),
page-cache growth and the row cache's figures where the Table has them (Table.stats()).

This module runs the rounds; the passes and their figures are gather_passes', the printed lines, ratios and plot
gather_report's.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from ..config import Config
from ..io import measure, native
from ..units import fit, human_bytes, parse_size
from .gather_passes import (NEW_PROCESS, PASSES, backend_passes, new_process_passes, open_for, reader_how,
                            warm_passes)
from . import memcap
from .gather_report import bs_name, pass_medians, plot_gather, print_ratios
from .report import (COUNT, ROWS, TOKENS, UBATCH, GiB, HOST_BACKENDS, apply_cache_option, bench_facts, block_device,
                     cold_method, data_dir, go_cold, out_dir, print_header, write_result)

# A virtual disk caches on its host: on the development VM the first cold read of a trace ran 2-3x slower than later
# ones for whichever backend read it first, whatever the backend (docs/decisions/cold-pass-method.md), and direct
# always came first.
PRIME_NOTE = ("cold: an untimed priming round (one cold pass per backend) puts the device's own caches (a virtual "
              "disk's host cache) in the same state for every timed round, and the backends take turns going first "
              "(round r starts with backend r); resident, which loads and frees the whole table, goes last in every "
              "round")


def _cap_size(text: str) -> int:
    """An argparse type: a memory cap of at least 16 MiB."""
    v = parse_size(text)
    if v < 16 << 20:
        raise argparse.ArgumentTypeError(f"a memory cap of at least 16M, got {text!r}")
    return v


def _gather_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--file", action="append",
                   help="a GGUF or safetensors checkpoint with a PLE table (repeatable; default: build --tables)")
    p.add_argument("--tables", default="qwen4exp,gemma4-e4b",
                   help="tables to build and bench: qwen4exp (IQ4_NL, 90 B rows, 16 rows per token), qwen4exp-fp8 "
                        "(the same rows as F8_E4M3, 160 B, a safetensors checkpoint), gemma4-e4b (Q5_K, 7,392 B rows, "
                        "one per token); default qwen4exp,gemma4-e4b")
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
    p.add_argument("--memory-limit", type=_cap_size, metavar="SIZE",
                   help="run the passes in a memory cgroup of SIZE (e.g. 512M; cgroup v1 or v2, refused where none can "
                        "be made): each pass's peak memory and the page cache charged to it are reported, and a pass "
                        "killed for memory is reported as such while the others' results are still written")
    p.add_argument("--targets", action="store_true", help=argparse.SUPPRESS)


def _built_table(directory: Path, preset: str, rows: int, qtype: str | None = None) -> Path:
    """The bench table of `preset` with `rows` rows, built once: a GGUF, or for a float8 qtype a safetensors
    checkpoint directory (model/checkpoint.py)."""
    if qtype is None:
        from ..model.synth import write_model
        path = Path(directory) / f"{preset}-{rows}.gguf"
        build = functools.partial(write_model, path, preset, rows=rows, progress=True)
    else:
        from ..model.checkpoint import write_fp8_checkpoint
        path = Path(directory) / f"{preset}-{rows}-{qtype.lower()}"
        build = functools.partial(write_fp8_checkpoint, path, preset, qtype, rows=rows, progress=True)
    done = path / "model.safetensors" if qtype else path
    if not done.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        if qtype is not None and path.exists():
            shutil.rmtree(path)         # an interrupted build: its directory holds no model.safetensors
        print(f"building {path} (once, not timed)", flush=True)
        build()
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


def _gpu_stream(backends, cfg: Config):
    if not any(b.startswith("gpu:") for b in backends):
        return None
    if cfg.accel != "cuda":                 # HostAccel: one of its streams (any HostStream serves every table)
        from ..gpu import accel
        return accel.get(cfg.accel).stream()
    import cupy
    return cupy.cuda.Stream(non_blocking=True)


def _passes(a) -> list[str]:
    skip = {"cold": a.no_cold, "again": a.no_again, "warm": a.no_warm or a.warm == "none"}
    return [p for p in PASSES if not skip[p]]


def _new_process_passes(a) -> list[str]:
    return [p for p in NEW_PROCESS if not getattr(a, f"no_{p}")]


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
    out["died"] = [{"backend": b, "pass": p, "why": r["died"]} for (b, p), rs in runs.items() for r in rs
                   if "died" in r]
    med = pass_medians(runs, backends, passes, hows, a)
    out["runs"].extend(med.values())
    if "cold" in passes and not a.no_fio:
        for bs in sorted({4096, geo["window"]}):
            name = "4k" if bs == 4096 else f"{bs}"
            go_cold(data, a.drop_caches)
            f = measure.fio_randread(data, bs=name, direct=True, iodepth=a.qd, runtime=a.fio_runtime)
            out["fio"][f"cold_{bs}"] = f
            if f and "iops" in f:
                print(fit(f"  fio randread {bs_name(bs)} O_DIRECT io_uring "
                          f"QD {a.qd}: {f['iops']:,.0f} IOPS, {f['bw_MiBps']:,.0f} MiB/s   [{f['cmd']}]"))
            else:
                print(f"  fio {name}: {'not installed' if f is None else f.get('error')}")
    if "warm" in passes and a.warm == "tmpfs" and not a.no_fio and warm_path is not None:
        out["fio_warm"] = _fio_tmpfs(path, a, _direct_threads(path, cfg))
    print_ratios(out, med, geo, a)
    return out


def run_capped(a, cfg: Config) -> dict:
    """The bench in a new process inside a memory cgroup of a.memory_limit bytes (memcap.py); this process stays
    outside and writes what the child could not when it was killed: the passes it finished, and the one it died in."""
    cap = memcap.MemoryCap.make(a.memory_limit)
    print(f"memory cap: {human_bytes(a.memory_limit)} ({cap.kind} {cap.dir}); the bench runs in a new process inside "
          f"it, its new-process passes too", flush=True)
    inner = argparse.Namespace(**{k: v for k, v in vars(a).items() if not callable(v) and k != "memory_limit"},
                               capped=a.memory_limit)      # (the child's report applies the capped targets)
    scratch = Path(tempfile.mkdtemp(prefix="gds-gather-capped-"))
    try:
        job, log = scratch / "job.pickle", scratch / "passes.jsonl"
        job.write_bytes(pickle.dumps((inner, cfg)))
        env = dict(os.environ, **cap.env(), **{memcap.PASSLOG: str(log)})
        child = subprocess.Popen([sys.executable, "-m", "gds_gather.benches.gather_capped", str(job)], env=env)
        try:
            with memcap.terminate_exits():
                rc = child.wait()
        except BaseException:       # interrupted or terminated: the child and its passes end before the cgroup goes
            cap.kill()
            child.wait()
            raise
        shutil.rmtree(out_dir(a, cfg) / f"gather-{child.pid}", ignore_errors=True)   # a killed child's scratch
        done = memcap.read_log(log)
        kills = cap.oom_kills()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        cap.close()
    cap_fields = {"memory_limit": a.memory_limit, "cgroup": cap.kind, "oom_kills": kills}
    if rc == 0:
        path = out_dir(a, cfg) / (a.json_name or "bench_gather.json")
        result = json.loads(path.read_text())
        result.update(cap_fields)
        path.write_text(json.dumps(result, indent=1))
        print(f"memory cap: every pass completed; {kills} process(es) killed for memory (new-process passes that died "
              f"are listed above)")
        return result
    finished = [r for r in done if r["state"] == "done"]
    started = [r for r in done if r["state"] == "started"]
    last = started[-1] if len(started) > len(finished) else None
    why = (f"killed by signal {-rc}" if rc < 0 else f"exit {rc}") + (f", {kills} OOM kill(s) in the cgroup" if kills
                                                                        else "")
    print(fit(f"memory cap: the bench process died ({why})" + (f" in the {last['pass']} pass of {last['backend']}"
                                                                 if last else "") +
              f"; {len(finished)} pass(es) had finished:", "   "))
    for r in finished:
        run = r["run"]
        line = (f"died: {run['died']}" if "died" in run else
                f"{run['rows_per_s']:,.0f} rows/s, peak {run.get('peak_MiB') or 0:,.0f} MiB")
        print(f"  {r['backend']:<11} {r['pass']:<9} {line}")
    result = {"bench": "gather", **cap_fields, "died": {"why": why, "in": last}, "passes_done": finished}
    return write_result("gather", result, a, out_dir(a, cfg), lambda *_: None)


def prime_round(path: Path, backends: list[str], a, cfg, trace, stream) -> dict:
    """One untimed cold pass per backend (resident: none, it loads the whole table), printed: the first read of the
    trace on this machine. Returns {backend: rows/s}."""
    got = {b: backend_passes(path, b, a, cfg, trace, stream, ["cold"])["cold"][0]["rows_per_s"]
           for b in backends if b != "resident"}
    print(fit("  priming round (untimed, cold; the first read of the trace here): "
              + ", ".join(f"{b} {v / 1e3:,.1f}k rows/s" for b, v in got.items()), "     "), flush=True)
    return got


def _how_after(path, cfg, b, stream) -> str:
    with open_for(path, cfg, b, stream) as t:
        return reader_how(t, b)


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
    if getattr(a, "memory_limit", None):
        return run_capped(a, cfg)
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
            elif name == "qwen4exp-fp8":
                tables.append(("qwen4exp geometry, F8_E4M3 (160 B rows)",
                               _built_table(made, "qwen4exp", a.rows, "F8_E4M3")))
            elif name == "gemma4-e4b":
                tables.append(("gemma4-e4b geometry", _built_table(made, "gemma4-e4b", a.gemma_rows)))
            else:
                raise ValueError(f"--tables: qwen4exp, qwen4exp-fp8 and/or gemma4-e4b, got {name!r} (use --file for "
                                 f"others)")
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
    return write_result("gather", result, a, out_dir(a, cfg), plot_gather)
