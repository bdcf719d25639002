#!/usr/bin/env python3
"""The one JSON summary of bench/gpu_check.sh: OUTDIR/summary.json, and a short text version on stdout.

    python3 bench/gpu_check_summary.py OUTDIR STEPS.tsv MISSING.json GPU(0|1) [JUNIT_DIR]

Reads what the steps left in OUTDIR (bench_kernels.json, bench_{storage,gather,prefill}.json), the test steps'
junit XMLs (JUNIT_DIR/STEP.xml, one per test step; merged into OUTDIR/gpu_tests.xml; without JUNIT_DIR,
OUTDIR/gpu_tests.xml itself) and the step table (name, status, seconds). Every step is listed; a test step that
left no junit XML (killed by its time limit, or not run) says so next to its status. Exit status: 0 when every
step is ok or skipped (no GPU, no wheels to install, not selected), 1 otherwise.
"""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

KERNEL_TARGET = 0.70        # dequant-scatter GB/s over the device-to-device copy's


def _load(path: Path):
    if not path.is_file():
        return None
    text = path.read_text(errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        start = text.find("{")          # a JSON object after log lines
        try:
            return json.loads(text[start:]) if start >= 0 else None
        except ValueError:
            return None


def merge_junit(junit_dir: Path, out: Path) -> list[str]:
    """The test steps' junit XMLs (junit_dir/STEP.xml) as one <testsuites> file `out`; the steps merged."""
    root = ET.Element("testsuites")
    steps = []
    for xml in sorted(junit_dir.glob("*.xml")):
        try:
            r = ET.parse(xml).getroot()
        except ET.ParseError:
            continue            # a half-written file of a killed step: that step reads as "no junit"
        for suite in ([r] if r.tag == "testsuite" else r.iter("testsuite")):
            suite.set("name", xml.stem)
            root.append(suite)
        steps.append(xml.stem)
    if steps:
        ET.ElementTree(root).write(out, encoding="utf-8", xml_declaration=True)
    return steps


def tests_summary(xml: Path) -> dict | None:
    """passed / failed / errors / skipped, in all, per test step (testsuite name) and per test file, from
    pytest's junit XML."""
    if not xml.is_file():
        return None
    root = ET.parse(xml).getroot()
    per = defaultdict(lambda: {"passed": 0, "failed": 0, "errors": 0, "skipped": 0})
    per_step = defaultdict(lambda: {"passed": 0, "failed": 0, "errors": 0, "skipped": 0})
    failures = []
    cases = [(suite.get("name", ""), case) for suite in ([root] if root.tag == "testsuite" else root.iter("testsuite"))
             for case in suite.iter("testcase")]
    for step, case in cases:
        f = case.get("file") or (case.get("classname", "").replace(".", "/") + ".py")
        kids = {c.tag for c in case}
        state = ("failed" if "failure" in kids else "errors" if "error" in kids else
                 "skipped" if "skipped" in kids else "passed")
        per[f][state] += 1
        per_step[step][state] += 1
        if state in ("failed", "errors"):
            failures.append(f"{case.get('classname')}::{case.get('name')}")
    total = {k: sum(v[k] for v in per.values()) for k in ("passed", "failed", "errors", "skipped")}
    return {**total, "collected": sum(total.values()), "per_step": dict(per_step), "per_file": dict(per),
            "failures": failures}


def kernels_summary(res) -> dict | None:
    if not isinstance(res, dict):
        return None
    if "skipped" in res:
        return {"skipped": res["skipped"]}
    d2d = (res.get("d2d_copy") or {}).get("GBps")
    rows = [{"type": g.get("type"), "dtype": g.get("dtype"), "GBps": g.get("GBps"),
             "ratio_to_d2d": g.get("ratio_to_copy"), "meets_70pct": g.get("pass"), "exact": g.get("exact")}
            for g in res.get("gathers", [])]
    return {"device": res.get("device"), "d2d_GBps": d2d, "target_ratio": KERNEL_TARGET, "gathers": rows,
            "all_meet_target": all(r["meets_70pct"] for r in rows) if rows else None,
            "all_exact": all(r["exact"] for r in rows) if rows else None,
            "ubatch_latency": [{k: u.get(k) for k in ("name", "dtype", "gpu_us", "GBps", "host_call_us", "exact")}
                               for u in res.get("ubatch", [])]}


def prefill_summary(res) -> dict | None:
    if not isinstance(res, dict):
        return None
    out = []
    for m in res.get("models", []):
        get = {(r["backend"], r["cache"]): r.get("tok_per_s_median") for r in m.get("runs", [])}

        def ratio(a, b):
            return get[a] / get[b] if get.get(a) and get.get(b) else None
        caches = sorted({c for _, c in get})
        out.append({
            "model": m.get("model"), "table": m.get("table"),
            "tok_per_s_median": {f"{b}/{c}": v for (b, c), v in get.items()},
            "graph_vs_eager": {c: ratio(("direct", c), ("direct:nograph", c)) for c in caches},
            "ratios": {f"direct/{o} ({c})": ratio(("direct", c), (o, c))
                       for c in caches for o in ("mmap", "pread", "readahead", "resident", "gds")},
            "targets": m.get("targets"),
        })
    return {"pipeline": res.get("pipeline"), "models": out}


def bench_brief(res) -> dict | None:
    if not isinstance(res, dict):
        return None
    keep = ("pipeline", "backends", "facts", "skipped")
    return {k: res[k] for k in keep if k in res} | {"json_file": res.get("json_file")}


def main(argv) -> int:
    out, steps_tsv, missing_json, gpu = Path(argv[0]), Path(argv[1]), Path(argv[2]), argv[3] == "1"
    junit_dir = Path(argv[4]) if len(argv) > 4 else None
    steps = {}
    for line in steps_tsv.read_text().splitlines():
        name, status, secs = line.split("\t")
        steps[name] = {"status": status, "seconds": int(secs)}
    if junit_dir is not None:
        with_junit = set(merge_junit(junit_dir, out / "gpu_tests.xml")) if gpu else set()
        for name, v in steps.items():
            if name.startswith("test-"):
                v["junit"] = (True if name in with_junit else "skipped: no GPU" if not gpu else
                              f"none: the step wrote no junit XML ({v['status']})")
    missing = _load(missing_json) or {"required": None, "optional": None}
    s = {
        "gpu": gpu,
        "ok": all(v["status"] == "ok" or v["status"].startswith("skipped") for v in steps.values()),
        "steps": steps,
        "missing_imports": missing,
        "tests": tests_summary(out / "gpu_tests.xml") if gpu else "skipped: no GPU",
        "kernels": kernels_summary(_load(out / "bench_kernels.json")) if gpu else "skipped: no GPU",
        "prefill": prefill_summary(_load(out / "bench_prefill.json")) if gpu else "skipped: no GPU",
        "storage": bench_brief(_load(out / "bench_storage.json")) if gpu else "skipped: no GPU",
        "gather": bench_brief(_load(out / "bench_gather.json")) if gpu else "skipped: no GPU",
        "log": str(out / "gpu_check.log"),
    }
    if gpu and isinstance(s["tests"], dict) and s["tests"]["collected"] == 0:
        s["ok"] = False
    every = junit_dir / "all.collected" if junit_dir is not None else None
    if gpu and isinstance(s["tests"], dict) and every is not None and every.is_file() and \
            all(v.get("junit") is True for k, v in steps.items() if k.startswith("test-")):
        s["tests"]["in_no_step"] = int(every.read_text().strip() or 0) - s["tests"]["collected"]
        if s["tests"]["in_no_step"]:        # a gpu test that no test step ran (or one that ran twice)
            s["ok"] = False
    (out / "summary.json").write_text(json.dumps(s, indent=1, default=str))
    t = s["tests"]
    for name, v in steps.items():
        counts = (t["per_step"].get(name) if isinstance(t, dict) else None)
        extra = (f"  {counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
                 f"{counts['skipped']} skipped" if counts else
                 f"  junit: {v['junit']}" if isinstance(v.get("junit"), str) and gpu else "")
        print(f"  {name:<14} {v['status']:<34} {v['seconds']:>4} s{extra}")
    if isinstance(t, dict):
        print(f"  gpu tests: {t['passed']} passed, {t['failed']} failed, {t['errors']} errors, {t['skipped']} skipped")
        for f in t["failures"][:20]:
            print(f"    FAILED {f}")
    k = s["kernels"]
    if isinstance(k, dict) and k.get("gathers"):
        print(f"  kernels: D2D {k['d2d_GBps']:,.0f} GB/s; "
              + ", ".join(f"{g['type']}/{g['dtype']} {g['ratio_to_d2d']:.2f}" for g in k["gathers"]))
    p = s["prefill"]
    if isinstance(p, dict):
        for m in p["models"]:
            print(f"  prefill {m['table']}: graph/eager {m['graph_vs_eager']}")
    print(f"  summary: {out / 'summary.json'} ({'ok' if s['ok'] else 'NOT ok'})")
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
