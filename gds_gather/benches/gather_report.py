"""bench gather's report: a pass's lines, the ratios against the baselines measured in the same run (with their
targets), and the plot."""
from __future__ import annotations

from statistics import median

from ..units import fit, human_size
from .gather_passes import ALL_PASSES, NEW_PROCESS
from .plot import bars, figure, panel_series
from .report import MiB, machine_title, median_run, ratio_line, short_num, target

PASS_TITLE = {"cold": "cold: the file evicted from the page cache, the row cache emptied, a new Table",
              "again": "same table again: the same open Table (and row cache), more passes over the trace",
              "warm": "new table, warm page cache: a new Table (row cache emptied) on the file whose trace pages "
                      "are in the page cache",
              "newproc": "new process, warm box: another process read the trace through a mapping (hot-row files "
                         "removed); engine start-up (open + one row) off the clock",
              "restart": "restart: a new process after the same backend's own cold pass in a process before it "
                         "(hot-row files on, as by default); engine start-up off the clock"}
# the targets: cold direct >= the best of the buffered/mapped baselines; the others direct >= 0.8 x mmap
TARGETS = {"cold": (("pread", "mmap", "readahead"), 1.0), "again": (("mmap",), 0.8), "warm": (("mmap", "pread"), 1.0),
           "newproc": (("mmap",), 0.8), "restart": (("mmap",), 0.8)}
# under --memory-limit (the page cache cannot hold the table: issue 37's regime) the row cache must carry again
# and restart well ahead of every mapping
CAPPED = {"again": (("mmap", "readahead"), 1.5), "restart": (("mmap", "readahead"), 1.5)}


def bs_name(bs: int) -> str:
    return human_size(bs) if bs % 1024 == 0 else f"{bs} B"


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


def pass_medians(runs: dict, backends: list[str], passes: list[str], hows: dict, a) -> dict:
    """Each backend's median run of each pass ({(backend, pass): runs} -> {(backend, pass): median run}, pass by
    pass), printed under the pass's title."""
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
            died = [r["died"] for r in runs[(b, p)] if "died" in r]
            alive = [r for r in runs[(b, p)] if "died" not in r]
            if died:
                print(fit(f"  {b:<11} {p:<9} {len(died)} of {len(runs[(b, p)])} run(s) died: {died[0]}", "      "))
            if not alive:
                continue
            r = median_run(alive, "rows_per_s")
            r["ns_per_gather"] = 1e9 / r["rows_per_s"]        # consistent with the median rows/s
            r.update(cache=p, how=hows[b])
            med[(b, p)] = r
            print(gather_line(r), flush=True)
            line = cache_line(r.get("row_cache"))
            if line:
                print(line)
            if r.get("peak_MiB") is not None:
                print(f"               memory: peak {r['peak_MiB']:,.0f} MiB "
                      f"({'this pass' if r.get('peak_since') == 'pass' else 'since the cap was made'}), page cache "
                      f"charged {r.get('cache_charged_MiB') or 0:,.0f} MiB (the cgroup, every process in it)")
            if p == "cold" and (r.get("row_cache") or {}).get("rows_from_cache") and not r.get("row_cache_emptied"):
                print(f"               NOTE: the cold pass served {r['row_cache']['rows_from_cache']:,.0f} rows from "
                      "a row cache this bench could not empty first: not fully cold")
    return med


def _per_round(d: dict, other: dict) -> list[float] | None:
    """direct / the other backend, round by round (the cold passes: one per backend a round, the order rotating),
    where both have every round: a paired view that the VM's drift within a run does not move as it moves the
    ratio of two medians."""
    x, y = d.get("rows_per_s_all") or [], other.get("rows_per_s_all") or []
    if len(x) < 2 or len(x) != len(y) or not all(y):
        return None
    return [u / v for u, v in zip(x, y)]


def print_ratios(out: dict, med: dict, geo: dict, a) -> None:
    """Ratios against baselines measured in the same run: direct vs the other backends per pass (with their
    targets), direct vs fio's IOPS on the same file, and the --targets ones (cold direct vs mmap, pread, fio)."""
    out["ratios"] = {}
    print("ratios (median rows/s):")
    for p, (others, tgt) in (TARGETS | (CAPPED if getattr(a, "capped", None) else {})).items():
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
            print(ratio_line(f"cold: direct rows/s / fio {bs_name(bs)} IOPS", d["rows_per_s"], f["iops"], tgt,
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


def plot_gather(res: dict, out) -> None:
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
