"""bench prefill: run_prefill with the backends interleaved (A/B/A/B), cold and warm, tok/s min/median/max."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..config import Config
from ..io.measure import counter_name
from .gather import default_backends
from .gather_passes import empty_row_cache
from .gather_report import cache_line
from .plot import bars, figure, panel_series
from .report import (TOKENS, UBATCH, HOST_BACKENDS, MiB, apply_cache_option, bench_facts, cold_method, go_cold,
                     machine_title, median, median_run, out_dir, print_header, ratio_line, target, write_result)
from ..units import fit

def _prefill_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", help="GGUF model (repeatable; default: the built-in qwen4exp model)")
    p.add_argument("--prompt", help="text file (default: the Python documentation topics)")
    p.add_argument("--tokens", type=TOKENS, help="prompt tokens (default 8192; --quick 2048)")
    p.add_argument("--ubatch", type=UBATCH, help="tokens per ubatch (default 2048; --quick 1024)")
    p.add_argument("--backends", help="comma list (default direct,pread,mmap,readahead,resident, and gds on a "
                                      "discrete GPU with KvikIO)")
    p.add_argument("--no-cold", action="store_true",
                   help="no cold runs (the file evicted, the row cache emptied first), nor carried ones")
    p.add_argument("--no-warm", action="store_true",
                   help="no warm runs (the file in the page cache, the row cache emptied first)")
    p.add_argument("--trunk", choices=("real", "tiny", "none"),
                   help="synthetic trunk, random weights (default: none on the CPU, the PLE step alone; real on a GPU)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"),
                   help="GPU dequant output and trunk dtype (default bfloat16)")
    p.add_argument("--no-graph", action="store_true", help="GPU: run the steps eagerly (no CUDA graph)")
    p.add_argument("--cache", help="row cache budget (e.g. 16M, 0 = off): Config(cache_bytes=...) where this build "
                                   "has a row cache; default GDS_GATHER_CACHE_BYTES or the built-in default")
    p.add_argument("--targets", action="store_true",
                   help="the prefill's targets: adds direct:nograph (GPU), fio's IOPS on the same file, and "
                        "direct cold vs min(resident, storage-bound tok/s) and vs mmap")


def run_prefill_bench(a, cfg: Config) -> dict:
    import gds_gather as gg
    from ..platform import detect
    from ..prefill.run import PrefillOptions, default_model, default_trunk, run_prefill
    q = a.quick
    a.tokens = (2048 if q else 8192) if a.tokens is None else a.tokens
    a.ubatch = (1024 if q else 2048) if a.ubatch is None else a.ubatch
    a.repeat = (2 if q else 3) if a.repeat is None else a.repeat
    if min(a.tokens, a.ubatch, a.repeat) < 1:
        raise ValueError("--tokens, --ubatch and --repeat must be >= 1")
    plat = detect(cfg.platform)
    gpu = plat.kind != "cpu"
    trunk = a.trunk or default_trunk(gpu)
    if a.backends:
        backends = [b.strip() for b in a.backends.split(",") if b.strip()]
    else:
        backends = list(HOST_BACKENDS) + (["gds"] if "gpu:gds" in default_backends(cfg) else [])
    if a.targets:
        backends = list(dict.fromkeys(["direct", "mmap", "resident"] + backends
                                      + (["direct:nograph"] if gpu and not a.no_graph else [])))
    # no hot-row files: cold means nothing from an earlier process either (hotrows.py)
    cfg, cache_note = apply_cache_option(cfg.with_(hot_rows=0), a.cache)
    models = [Path(m) for m in a.model] if a.model else [default_model(cfg, progress=True)]
    with gg.open_table(models[0], config=cfg) as t:
        facts = bench_facts(t.path, cfg)
    print_header("prefill", facts, [cold_method(a), cache_note], quick=q)
    pipeline = ("GPU pipeline (graph-captured fetch-dequant + trunk)" if gpu and not a.no_graph else
                "GPU pipeline, eager" if gpu else "CPU pipeline (no GPU here)")
    trunk_note = {"none": "none: the PLE fetch + dequant alone (the CPU default; --trunk tiny|real adds a synthetic "
                          "torch trunk)",
                  "tiny": "tiny synthetic torch trunk, random weights",
                  "real": "synthetic trunk with the real shapes, random weights"}[trunk]
    print(fit(f"# {pipeline}; trunk {trunk_note}", "#   "))
    print(f"# {a.tokens:,} tokens in ubatches of {a.ubatch:,}; backends interleaved {'/'.join(backends)}; one "
          f"warm-up run each,")
    print(f"# then {a.repeat} runs per backend cold (the table's file evicted before each run) and warm; tok/s "
          "min/median/max")
    print(f"# MiB delivered = {counter_name(facts['delivered_method'])}; ampl = delivered / the bytes of the rows read "
          "from the device", flush=True)
    if "resident" in backends:
        print("# resident: the table is loaded into memory before the clock starts (untimed); the runs time the "
              "prefill alone", flush=True)
    result = {"bench": "prefill", "facts": facts, "backends": backends, "trunk": trunk, "pipeline": pipeline,
              "tokens": a.tokens, "ubatch": a.ubatch, "repeat": a.repeat, "models": []}
    base = PrefillOptions(prompt=a.prompt, n_tokens=a.tokens, ubatch=a.ubatch, graph=not a.no_graph, trunk=trunk,
                          dtype=a.dtype, progress=False, log=None)
    for model in models:
        with gg.open_table(model, config=cfg) as t:
            table_path, desc = t.path, (f"{t.arch or '?'}, {t.qtype.name} table of {t.n_rows:,} rows x "
                                        f"{t.row_bytes:,} B")
            table_bytes = t.n_bytes
        print("\n" + fit(f"## {model} ({desc})", "   "), flush=True)
        def one(b):                             # "direct:nograph" is direct run eagerly (graph vs no-graph)
            name, _, mod = b.partition(":")
            return run_prefill(model, cfg, base, backend=name, graph=base.graph and mod != "nograph")
        for b in backends:                      # warm-up: first-use costs (native build, kernels, graphs)
            one(b)
        m = {"model": str(model), "table": desc, "runs": []}
        series = [c for c in ("cold", "warm") if not getattr(a, f"no_{c}")]
        if "cold" in series and "direct" in backends:
            series.append("carried")
        for cache in series:
            # cold and warm start with this process's row caches empty; "carried" (direct only) is cold for the
            # page cache but keeps the row cache the previous run of the same prompt filled (a long-lived process)
            bs = ["direct"] if cache == "carried" else backends
            if cache == "carried":              # untimed: the prompt once, the file cold (the row cache admits
                empty_row_cache()               # what the device delivered, not what the page cache held)
                go_cold(table_path, a.drop_caches)
                one("direct")
            runs: dict = {b: [] for b in bs}
            for rep in range(a.repeat):
                for b in bs:
                    if cache != "carried":
                        empty_row_cache()
                    if cache != "warm":
                        go_cold(table_path, a.drop_caches)
                    runs[b].append(one(b))
                print(f"    {cache} run {rep + 1}/{a.repeat}: "
                      + "  ".join(f"{b} {runs[b][-1]['tok_per_s']:,.0f}" for b in bs) + " tok/s", flush=True)
            if cache == "carried":
                print(fit("  carried: the table file evicted before each run, the row cache kept from the run "
                          "before (the same prompt again in one process)"))
            for b in bs:
                tok = [r["tok_per_s"] for r in runs[b]]
                mid = median_run(runs[b], "tok_per_s")
                s = {"backend": b, "cache": cache, "tok_per_s_min": min(tok), "tok_per_s_median": median(tok),
                     "tok_per_s_max": max(tok), "tok_per_s_all": tok, "rows_per_s": mid["rows_per_s"],
                     "useful_bytes": mid["useful_bytes"], "bytes_requested": mid["bytes_read"],
                     "bytes_delivered": mid.get("bytes_delivered"), "bytes_device": mid.get("bytes_device"),
                     "read_amplification": mid["read_amplification"], "amplification_of": mid["amplification_of"],
                     "ple_seconds": mid["ple_seconds"], "trunk_seconds": mid["trunk_seconds"],
                     "page_cache_growth_MiB": mid["page_cache_growth_bytes"] / MiB, "ple_rows": mid["ple_rows"],
                     "unique_rows": mid["unique_rows"], "io_seconds": mid["io_seconds"], "how": mid["how"],
                     "pipeline": mid["pipeline"], "row_cache": row_cache_fields(mid)}
                m["runs"].append(s)
                print(f"  {b:<10} {cache:<7} tok/s  min {s['tok_per_s_min']:>10,.0f}  "
                      f"median {s['tok_per_s_median']:>10,.0f}  max {s['tok_per_s_max']:>10,.0f}   "
                      f"PLE rows/s {s['rows_per_s']:>11,.0f}", flush=True)
                print(f"    MiB requested {_mib(s['bytes_requested'])} delivered {_mib(s['bytes_delivered'])} "
                      f"device {_mib(s['bytes_device'])}  ampl {_x(s['read_amplification'])}  "
                      f"page cache {s['page_cache_growth_MiB']:+.1f} MiB", flush=True)
                print(fit(f"    how: {s['how']}", " " * 9), flush=True)
                line = cache_line(s["row_cache"])
                if line:
                    print(line)
        get = {(r["backend"], r["cache"]): r["tok_per_s_median"] for r in m["runs"]}
        print("ratios (median tok/s):")
        resident = get.get(("resident", "warm")) or get.get(("resident", "cold"))
        if ("direct", "cold") in get and resident:       # the row cache's target: cold direct near resident
            rc = next((r["row_cache"] for r in m["runs"] if r["backend"] == "direct" and r["cache"] == "cold"
                       and r["row_cache"]), None) or {}
            budget = rc.get("cache_budget_bytes")
            note = ("  [row cache budget "
                    + (f"{budget / MiB:,.1f} MiB" if isinstance(budget, (int, float)) else cache_note.split(": ", 1)[1])
                    + f" for a {table_bytes / MiB:,.1f} MiB table]")
            print(ratio_line("direct cold (row cache empty at the start) / resident (in memory before the clock)",
                             get[("direct", "cold")], resident, target(a, 0.9), note))
            if ("direct", "carried") in get:
                print(ratio_line("direct cold, row cache carried from the previous prompt of this process / "
                                 "resident", get[("direct", "carried")], resident, target(a, 0.9), note))
            _storage_bound(table_path, m["runs"], a, get[("direct", "cold")], resident)
        for cache in series:
            for other in ("mmap", "pread") + (() if resident else ("resident",)):   # resident: printed above
                if ("direct", cache) in get and (other, cache) in get:
                    print(ratio_line(f"direct / {other} ({cache})", get[("direct", cache)], get[(other, cache)]))
        if a.targets and ("direct", "cold") in get:
            m["targets"] = _prefill_targets(table_path, get, m["runs"], a)
        result["models"].append(m)
    return write_result("prefill", result, a, out_dir(a, cfg), _plot_prefill)


def _storage_bound(path, runs: list, a, direct: float, resident: float) -> None:
    """What the device allows a cold prefill with an empty row cache: rows it must read per token / IOPS."""
    cold = next((r for r in runs if r["backend"] == "direct" and r["cache"] == "cold"), None)
    rc = (cold or {}).get("row_cache") or {}
    dev = rc.get("rows_from_device")
    if not cold or not isinstance(dev, (int, float)) or not dev or not cold.get("io_seconds"):
        return
    per_tok = dev / max(1, a.tokens)
    iops = dev / cold["io_seconds"]
    print(fit(f"  bound: a cold run with an empty row cache reads {per_tok:.2f} rows per token from the device; at the "
          f"{iops:,.0f} rows/s direct's reads reached here that alone allows {iops / per_tok:,.0f} tok/s "
          f"= {iops / per_tok / resident:.2f}x resident (direct cold reached {direct / resident:.2f}x)"))


def row_cache_fields(res: dict) -> dict | None:
    """The row cache's figures a prefill result carries (rows served by the cache, the page cache, the device;
    hits, hit rate, size), where this build has them."""
    keys = ("rows_from_", "cache_")
    out = {k: v for k, v in res.items() if k.startswith(keys)}
    for k in ("row_cache", "cache"):
        if isinstance(res.get(k), dict):
            out.update(res[k])
    return out or None


def _mib(x) -> str:
    return "n/a" if x is None else f"{x / MiB:,.1f}"


def _x(x) -> str:
    return "n/a" if x is None else f"{x:.1f}x"


def _prefill_targets(path, get: dict, runs: list, a) -> dict:
    """The prefill's targets: cold direct >= 0.9 x min(resident, storage-bound), >= 3 x cold mmap."""
    from ..io import measure
    cold = next(r for r in runs if r["backend"] == "direct" and r["cache"] == "cold")
    rows_per_tok = cold["unique_rows"] / max(1, a.tokens)
    fio = measure.fio_randread(path, bs="4k", direct=True, iodepth=128, runtime=3 if a.quick else 5)
    iops = fio.get("iops") if fio else None
    bound = iops / rows_per_tok if iops else None
    resident = get.get(("resident", "warm")) or get.get(("resident", "cold"))
    d = get[("direct", "cold")]
    t = {"direct_cold_tok_s": d, "unique_rows_per_token": rows_per_tok, "fio_4k_iops": iops,
         "storage_bound_tok_s": bound, "resident_tok_s": resident}
    print("targets:")
    if iops:
        print(f"  storage-bound tok/s = fio 4K randread {iops:,.0f} IOPS / {rows_per_tok:.2f} unique rows per token "
              f"= {bound:,.0f}")
    limits = [x for x in (resident, bound) if x]
    if limits:
        print(ratio_line("direct cold / min(resident, storage-bound)", d, min(limits), target(a, 0.9)))
    if ("mmap", "cold") in get:
        print(ratio_line("direct cold / mmap cold", d, get[("mmap", "cold")], target(a, 3.0)))
    for cache in ("cold", "warm"):
        if ("direct:nograph", cache) in get:
            print(ratio_line(f"graph / no-graph ({cache})", get[("direct", cache)], get[("direct:nograph", cache)]))
    return t


def _plot_prefill(res: dict, out) -> None:
    models = res["models"]
    if not models:
        raise ValueError("nothing was measured: no plot")
    fig, axes = figure(len(models), 6.6, 4.6)
    for ax, m in zip(axes, models):
        backends, caches, pick = panel_series(res["backends"], m["runs"])
        bars(ax, backends, caches, {c: [pick(b, c, "tok_per_s_median") for b in backends] for c in caches},
             lo={c: [pick(b, c, "tok_per_s_min") for b in backends] for c in caches},
             hi={c: [pick(b, c, "tok_per_s_max") for b in backends] for c in caches},
             log=True, ylabel="tokens per second (median; whiskers: min-max)")
        ax.set_title(f"{Path(m['model']).name}: {m['table']}", fontsize=9)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"gds-gather bench prefill: {res['pipeline']}, trunk {res['trunk']}, {res['tokens']:,} tokens, "
                 f"ubatch {res['ubatch']:,}\n{machine_title(res['facts'])}", fontsize=10)
    fig.savefig(out)


