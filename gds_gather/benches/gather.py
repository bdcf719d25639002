"""bench gather: a real-text (or random) row-id trace through every backend, cold and warm, against fio."""
from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import numpy as np

from .. import measure
from ..config import Config
from .plot import bars, figure, panel_series
from .report import (GiB, HOST_BACKENDS, MiB, bench_facts, block_device, default_dir, go_cold, human_size,
                     machine_title, median_run, print_header, ratio_line, short_num, write_result)

def _gather_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--file", action="append", help="a GGUF with a PLE table (repeatable; default: build --tables)")
    p.add_argument("--tables", default="qwen4exp,gemma4-e4b",
                   help="tables to build and bench: qwen4exp (IQ4_NL, 90 B rows, 16 rows per token), gemma4-e4b "
                        "(Q5_K, 7,392 B rows, one per token); default both")
    p.add_argument("--rows", type=int, help="rows of the qwen4exp-geometry table (default 24,000,000 = 2.16 GB; "
                                            "--quick 200,000)")
    p.add_argument("--gemma-rows", type=int, help="rows of the gemma4-e4b table (default 262,144 = 1.94 GB, the "
                                                  "real one; --quick 4,096)")
    p.add_argument("--trace", choices=("text", "random"), default="text",
                   help="text: the row ids of a real English prompt, ubatch by ubatch (default); random: uniform "
                        "random ids (--ids, --batch)")
    p.add_argument("--prompt", help="text file for the trace (default: the Python documentation topics)")
    p.add_argument("--tokens", type=int, help="prompt tokens per pass (default 8192; --quick 2048)")
    p.add_argument("--ubatch", type=int, help="tokens per gather call (default 2048; --quick 1024)")
    p.add_argument("--ids", type=int, help="--trace random: ids per pass (default 100,000; --quick 5,000)")
    p.add_argument("--batch", type=int, help="--trace random: ids per gather call (default 16,384; --quick 1,000)")
    p.add_argument("--backends", help="comma list (default direct,pread,mmap,readahead,resident, and on a GPU the "
                                      "device destinations gpu:direct and gpu:gds)")
    p.add_argument("--warm", choices=("cache", "tmpfs", "none"), default="cache",
                   help="warm: cache = the same file after an untimed pass (page cache warm; O_DIRECT still reads "
                        "the drive); tmpfs = a copy of the table on --tmpfs; none")
    p.add_argument("--tmpfs", default="/dev/shm", help="where --warm tmpfs copies the table")
    p.add_argument("--no-cold", action="store_true")
    p.add_argument("--no-warm", action="store_true", help="same as --warm none")
    p.add_argument("--qd", type=int, default=128, help="queue depth of direct and of fio (default 128)")
    p.add_argument("--fio-runtime", type=int, help="seconds per fio run (default 5; --quick 1)")
    p.add_argument("--no-fio", action="store_true", help="skip fio")
    p.add_argument("--targets", action="store_true", help=argparse.SUPPRESS)


def _built_table(directory: Path, preset: str, rows: int) -> Path:
    from ..model import write_model
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
    from ..prefill import RowMapper
    from ..text import prompt_tokens
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
    return sum(getattr(r, "bytes_read", 0) for r in [*t._readers.values(), *t._sinks.values()])


def _fetch(t, b: str, plan, stream) -> None:
    if b.startswith("gpu:"):
        t.fetch_device(plan, b[4:], stream)
        stream.synchronize()
    else:
        t.read_plan(plan, b)


def _open_for(path, cfg, b: str, stream):
    """A fresh table whose reader for `b` is open (fd, ring, mapping; resident: loaded) outside the timing."""
    import gds_gather as gg
    t = gg.open_table(path, config=cfg)
    _fetch(t, b, t.plan(np.zeros(1, np.int64)), stream)
    return t


def _how(t, b: str) -> str:
    if b.startswith("gpu:"):
        return next(iter(t._sinks.values())).how
    return t._readers[b].how


def gather_pass(t, b: str, trace, stream=None) -> dict:
    """One timed pass over the trace; a gather is one row id (ns/gather = wall / row ids, as llama.cpp #137)."""
    path = t.path
    b0, res0, flt0 = _bytes_read(t), measure.resident_bytes(path), measure.major_faults()
    lat, useful, n_ids, uniq, wins = [], 0, 0, 0, 0
    t0 = time.perf_counter()
    for ids in trace:
        a = time.perf_counter()
        plan = t.plan(ids)
        _fetch(t, b, plan, stream)
        lat.append(time.perf_counter() - a)
        useful += plan.exact_bytes
        n_ids += plan.n_ids
        uniq += plan.n_unique
        wins += plan.n_windows
    wall = time.perf_counter() - t0
    read = _bytes_read(t) - b0
    return {"backend": b, "rows_per_s": n_ids / wall, "ns_per_gather": wall * 1e9 / n_ids, "seconds": wall,
            "ids": n_ids, "unique": uniq, "unique_rows_per_s": uniq / wall, "windows": wins,
            "bytes_read": read, "read_MiB_s": read / wall / MiB, "amplification": read / useful if useful else 0.0,
            "major_faults": measure.major_faults() - flt0,
            "page_cache_growth_MiB": (measure.resident_bytes(path) - res0) / MiB,
            "p50_ms": measure.percentile_ms(lat, 50), "p99_ms": measure.percentile_ms(lat, 99)}


def _gather_line(r: dict) -> str:
    return (f"  {r['backend']:<11} {r['cache']:<4} {r['ns_per_gather']:>9,.0f} ns/gather {r['rows_per_s']:>12,.0f} rows/s"
            f"  ampl {r['amplification']:6.1f}x  majflt {r['major_faults']:>7,}  cache +{r['page_cache_growth_MiB']:7.1f} MiB"
            f"  p50 {r['p50_ms']:7.2f} ms  p99 {r['p99_ms']:7.2f} ms   [{r['how']}]")


def _gpu_stream(backends):
    if not any(b.startswith("gpu:") for b in backends):
        return None
    import cupy
    return cupy.cuda.Stream(non_blocking=True)


def _gather_table(path: Path, label: str, a, cfg: Config, backends: list[str], facts_line) -> dict:
    import gds_gather as gg
    with gg.open_table(path, config=cfg) as t:
        trace, desc = _trace(t, a)
        data = t.path                       # the file holding the table (a shard of a split model)
        geo = dict(n_rows=t.n_rows, row_bytes=t.row_bytes, qtype=t.qtype.name, align=t.align, arch=t.arch,
                   table_bytes=t.n_bytes, window=t._typical_window())
    n_ids = sum(x.size for x in trace)
    print(f"\n## {label}: {path} ({geo['arch'] or '?'}, {geo['n_rows']:,} rows x {geo['row_bytes']:,} B "
          f"{geo['qtype']} = {geo['table_bytes'] / 1e9:.2f} GB; O_DIRECT alignment {geo['align']} B)")
    print(f"   trace: {desc}; {a.repeat} timed passes each, median shown; {facts_line(path)}", flush=True)
    out = {"label": label, "path": str(path), **geo, "trace": desc, "ids": n_ids, "runs": [], "fio": {}}
    stream = _gpu_stream(backends)
    cold_b = [b for b in backends if b != "resident"]
    med: dict = {}
    if not a.no_cold:
        how = go_cold(data, a.cold_method)
        print(f"cold ({how} before each pass; passes interleaved {'/'.join(cold_b)}; resident runs warm only: "
              f"its cold pass is a load of the whole table)", flush=True)
        runs: dict = {b: [] for b in cold_b}
        hows = {}
        for _ in range(a.repeat):
            for b in cold_b:
                with _open_for(path, cfg, b, stream) as t:
                    go_cold(data, a.cold_method)
                    runs[b].append(gather_pass(t, b, trace, stream))
                    hows[b] = _how(t, b)
        for b in cold_b:
            r = median_run(runs[b], "rows_per_s")
            r.update(cache="cold", how=hows[b])
            med[(b, "cold")] = r
            out["runs"].append(r)
            print(_gather_line(r), flush=True)
        if not a.no_fio:
            for bs in sorted({4096, geo["window"]}):
                name = "4k" if bs == 4096 else f"{bs}"
                f = measure.fio_randread(data, bs=name, direct=True, iodepth=a.qd, runtime=a.fio_runtime)
                out["fio"][f"cold_{bs}"] = f
                if f and "iops" in f:
                    print(f"  fio randread {_bs_name(bs)} O_DIRECT io_uring "
                          f"QD {a.qd}: {f['iops']:,.0f} IOPS, {f['bw_MiBps']:,.0f} MiB/s   [{f['cmd']}]")
                else:
                    print(f"  fio {name}: {'not installed' if f is None else f.get('error')}")
        d = med.get(("direct", "cold"))
        print("ratios (cold):")
        for bs in sorted({4096, geo["window"]}):
            f = out["fio"].get(f"cold_{bs}") or {}
            if d and f.get("iops"):
                tgt = 0.9 if a.targets and bs == 4096 else None
                # direct submits one read per window: its reads/s is what compares with fio's IOPS
                reads = d["windows"] / d["seconds"]
                print(ratio_line(f"direct rows/s / fio {_bs_name(bs)} IOPS", d["rows_per_s"], f["iops"], tgt)
                      + f";  direct's reads/s {reads:,.0f} = {reads / f['iops']:.2f}x, its MiB/s "
                        f"{d['read_MiB_s']:,.0f} = {d['read_MiB_s'] / f['bw_MiBps']:.2f}x fio's")
        for other, tgt in (("mmap", 3.0), ("pread", 1.3), ("readahead", None)):
            if (other, "cold") in med and d:
                print(ratio_line(f"direct / {other}", d["rows_per_s"], med[(other, "cold")]["rows_per_s"],
                             tgt if a.targets else None))
        for dev in ("gpu:direct", "gpu:gds"):
            if (dev, "cold") in med and d:
                print(ratio_line(f"{dev} / direct (host)", med[(dev, "cold")]["rows_per_s"], d["rows_per_s"]))
    warm = "none" if a.no_warm else a.warm
    if warm != "none":
        warm_path, copied = path, False
        if warm == "tmpfs":
            free = shutil.disk_usage(a.tmpfs).free
            if free < 2 * os.path.getsize(path):
                print(f"warm: skipped, {a.tmpfs} has {free / GiB:.1f} GiB free")
                warm_path = None
            else:
                warm_path = Path(a.tmpfs) / f"gds-gather-bench-{os.getpid()}.gguf"
                shutil.copyfile(path, warm_path)
                copied = True
        if warm_path is not None:
            try:
                out.update(_gather_warm(warm_path, warm, a, cfg, backends, trace, stream, med))
            finally:
                if copied:
                    warm_path.unlink(missing_ok=True)
    return out


def _gather_warm(path: Path, warm: str, a, cfg, backends, trace, stream, med) -> dict:
    from ..storage import filesystem
    where = ("the same file after one untimed pass per backend (O_DIRECT reads still go to the drive)"
             if warm == "cache" else f"a copy on {a.tmpfs} ({filesystem(path)})")
    print(f"warm ({where}; passes interleaved)", flush=True)
    extra = {"runs_warm": [], "fio_warm": None}
    tables = {}
    direct_threads = 1        # io_uring: one submitting thread; the native pool (memory filesystems): its threads
    try:
        for b in backends:
            tables[b] = _open_for(path, cfg, b, stream)
            gather_pass(tables[b], b, trace, stream)              # warm-up
            r = getattr(tables[b], "_readers", {}).get("direct") if b == "direct" else None
            if r is not None and getattr(r, "ring", None) is None:
                direct_threads = r.threads
        runs: dict = {b: [] for b in backends}
        for _ in range(a.repeat):
            for b in backends:
                runs[b].append(gather_pass(tables[b], b, trace, stream))
        for b in backends:
            r = median_run(runs[b], "rows_per_s")
            r.update(cache="warm", how=_how(tables[b], b))
            med[(b, "warm")] = r
            extra["runs_warm"].append(r)
            print(_gather_line(r), flush=True)
    finally:
        for t in tables.values():
            t.close()
    d = med.get(("direct", "warm"))
    jobs = direct_threads
    if warm == "tmpfs" and not a.no_fio:
        f = measure.fio_randread(path, bs="4k", direct=False, engine="psync", iodepth=1, numjobs=jobs,
                                 runtime=a.fio_runtime)
        extra["fio_warm"] = f
        if f and "iops" in f:
            print(f"  fio psync 4k, {jobs} job(s) (direct's thread count here): {f['iops']:,.0f} IOPS   "
                  f"[{f['cmd']}]")
    print("ratios (warm):")
    if extra["fio_warm"] and extra["fio_warm"].get("iops") and d:
        print(ratio_line(f"direct / fio psync 4k {jobs} job(s)", d["rows_per_s"], extra["fio_warm"]["iops"],
                     0.7 if a.targets else None))
    for other in ("mmap", "pread", "resident"):
        if (other, "warm") in med and d:
            print(ratio_line(f"direct / {other}", d["rows_per_s"], med[(other, "warm")]["rows_per_s"]))
    return extra


def default_backends(cfg: Config) -> list[str]:
    """The host backends, and on a GPU the device destinations (gpu:gds where KvikIO is usable)."""
    from ..platform import detect
    out = list(HOST_BACKENDS)
    plat = detect(cfg.platform)
    if plat.kind != "cpu":
        out.append("gpu:direct")
        if plat.kind == "discrete":
            from ..backends import gds_state
            if gds_state()[0]:
                out.append("gpu:gds")
    return out


def run_gather(a, cfg: Config) -> dict:
    q = a.quick
    a.rows = a.rows or (200_000 if q else 24_000_000)
    a.gemma_rows = a.gemma_rows or (4096 if q else 262_144)
    a.tokens = a.tokens or (2048 if q else 8192)
    a.ubatch = a.ubatch or (1024 if q else 2048)
    a.ids = a.ids or (5000 if q else 100_000)
    a.batch = a.batch or (1000 if q else 16_384)
    a.repeat = a.repeat or (2 if q else 3)
    a.fio_runtime = a.fio_runtime or (1 if q else 5)
    if min(a.rows, a.gemma_rows, a.tokens, a.ubatch, a.ids, a.batch, a.repeat, a.qd) < 1:
        raise ValueError("sizes, --repeat and --qd must be >= 1")
    cfg = cfg.with_(queue_depth=a.qd)
    data_dir = Path(a.dir or a.out or default_dir(cfg))
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
                tables.append(("qwen4exp geometry", _built_table(data_dir, "qwen4exp", a.rows)))
            elif name == "gemma4-e4b":
                tables.append(("gemma4-e4b geometry", _built_table(data_dir, "gemma4-e4b", a.gemma_rows)))
            else:
                raise ValueError(f"--tables: qwen4exp and/or gemma4-e4b, got {name!r} (use --file for others)")
    facts = bench_facts(tables[0][1], cfg)
    print_header("gather", facts)
    print(f"# backends {', '.join(backends)}; QD {a.qd}; a gather = one row id (ns/gather = wall / row ids); "
          f"ampl = bytes read / bytes of the unique rows; majflt = major page faults of this process; cache = growth "
          f"of the file's page-cache residency; p50/p99 per gather call", flush=True)

    def facts_line(p):
        from ..storage import filesystem
        return f"{filesystem(p)} on {block_device(p)}"

    result = {"bench": "gather", "facts": facts, "backends": backends, "trace": a.trace, "qd": a.qd,
              "repeat": a.repeat, "warm_mode": "none" if a.no_warm else a.warm, "tables": []}
    for label, path in tables:
        t = _gather_table(path, label, a, cfg, backends, facts_line)
        t["runs"] += t.pop("runs_warm", [])
        result["tables"].append(t)
    return write_result("gather", result, a, Path(a.out or data_dir), _plot_gather)



def _plot_gather(res: dict, out) -> None:
    tabs = res["tables"]
    if not tabs:
        raise ValueError("nothing was measured: no plot")
    fig, axes = figure(len(tabs), 6.6, 4.8)
    for ax, t in zip(axes, tabs):
        backends, caches, pick = panel_series(res["backends"], t["runs"])
        vals = {c: [pick(b, c, "rows_per_s") for b in backends] for c in caches}
        every = {c: [pick(b, c, "rows_per_s_all") or [0.0] for b in backends] for c in caches}
        bars(ax, backends, caches, vals, lo={c: [min(x) for x in every[c]] for c in caches},
              hi={c: [max(x) for x in every[c]] for c in caches}, log=True,
              ylabel="rows gathered per second (median)")
        f = (t.get("fio") or {}).get("cold_4096") or {}
        if f.get("iops"):
            ax.axhline(f["iops"], color="k", ls="--", lw=1,
                       label=f"fio 4K randread O_DIRECT QD {res['qd']}: {short_num(f['iops'])} IOPS")
        ax.set_title(f"{t['label']}: {t['n_rows']:,} rows x {t['row_bytes']:,} B {t['qtype']} "
                     f"({t['table_bytes'] / 1e9:.2f} GB)\n{short_num(t['ids'])} row ids per pass "
                     f"({'text trace' if res['trace'] == 'text' else 'random ids'}); whiskers: min-max",
                     fontsize=9)
        ax.legend(fontsize=8, loc="upper left")
    warm = {"cache": "page cache warm", "tmpfs": "a tmpfs copy", "none": "not run"}[res["warm_mode"]]
    fig.suptitle(f"gds-gather bench gather, cold (page cache dropped) and warm ({warm})\n"
                 f"{machine_title(res['facts'])}", fontsize=10)
    fig.savefig(out)


