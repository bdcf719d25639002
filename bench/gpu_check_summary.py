#!/usr/bin/env python3
"""The one JSON summary of bench/gpu_check.sh: OUTDIR/summary.json, and a short text version on stdout.

    python3 bench/gpu_check_summary.py OUTDIR STEPS.tsv MISSING.json GPU(0|1) [JUNIT_DIR [CAPS.tsv [COMPILE.json]]]

Reads what the steps left in OUTDIR (bench_kernels.json, bench_{storage,gather,prefill}.json, and STEP.log: a test
step's pytest -v output, streamed as it ran), the test steps' junit XMLs (JUNIT_DIR/STEP.xml, one per test step;
merged into OUTDIR/gpu_tests.xml; without JUNIT_DIR, OUTDIR/gpu_tests.xml itself), the step table (name, status,
seconds and, as a 4th column, the limit it ran under), the caps of every step (CAPS.tsv: name, seconds; summed as
caps_sum_s) and the compile step's parts (COMPILE.json). Every step is listed; a test step has its per-test lines
("tests": node id -> passed / failed: message / skipped: reason / ...), from its junit XML or, where the step
left none (killed by its cap), from its log, which also names the test it was in when killed. The gpu tests that no
step ran (JUNIT_DIR/all.ids, from the gpu-list step) are listed as "not in the first run", and not counted as a
failure. Exit status: 0 when every step is ok or skipped (no GPU, no wheels to install, not selected), 1 otherwise.
"""
from __future__ import annotations

import json
import os
import re
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


_STATES = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped", "XFAIL": "xfailed",
           "XPASS": "xpassed"}
_LINE = re.compile(r"^(tests/\S+::\S+)(?: (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?: \((.*)\))?)?\s*$")
RUNNING = "running when the step ended (killed by its cap?)"


def _count_key(result: str) -> str:
    head = result.split(":")[0].split(" ")[0]
    return {"passed": "passed", "xpassed": "passed", "failed": "failed", "error": "errors", "skipped": "skipped",
            "xfailed": "skipped"}.get(head, "errors")


def _node_id(case) -> str:
    """pytest's node id of a junit testcase: classname tests.test_x[.Class] + name."""
    f = case.get("file")
    parts = (case.get("classname") or "").split(".")
    mod = max((i for i, p in enumerate(parts) if p.startswith("test")), default=len(parts) - 1)
    path = f or ("/".join(parts[:mod + 1]) + ".py")
    return "::".join([path, *parts[mod + 1:], case.get("name", "?")])


def junit_tests(xml: Path) -> dict | None:
    """node id -> result of one step's junit XML (None: no readable file)."""
    try:
        root = ET.parse(xml).getroot()
    except (OSError, ET.ParseError):
        return None
    out = {}
    for case in root.iter("testcase"):
        kids = {c.tag: c for c in case}
        for tag, word in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            if tag in kids:
                msg = (kids[tag].get("message") or "").strip().splitlines()
                out[_node_id(case)] = f"{word}: {msg[0][:300]}" if msg else word
                break
        else:
            out[_node_id(case)] = "passed"
    return out


def log_tests(log: Path) -> dict | None:
    """node id -> result from a pytest -v log (None: no log). A node id without a result is the test the step
    was in when it ended."""
    if not log.is_file():
        return None
    out: dict = {}
    for line in log.read_text(errors="replace").splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        nid, word, why = m.groups()
        if word is None:
            out.setdefault(nid, RUNNING)
            continue
        res = _STATES[word] + (f": {why}" if why else "")
        prev = out.get(nid)
        if prev in (None, RUNNING) or _count_key(res) in ("failed", "errors"):   # teardown errors win
            out[nid] = res if prev in (None, RUNNING) or word != "ERROR" else f"{res} (after {prev})"
    return out


def step_tests(name: str, out: Path, junit_dir: Path | None) -> tuple[dict | None, str | None]:
    """(per-test results, where from) of one test step: its junit XML, else its log."""
    got = junit_tests(junit_dir / f"{name}.xml") if junit_dir is not None else None
    if got is not None:
        return got, "junit"
    got = log_tests(out / f"{name}.log")
    return (got, "log") if got is not None else (None, None)


def counts(tests: dict) -> dict:
    c = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for r in tests.values():
        c[_count_key(r)] += 1
    return c


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


def storage_summary(res) -> dict | None:
    """bench storage: one line per measured path and I/O size (GiB/s, IOPS, latency of the median run)."""
    if not isinstance(res, dict):
        return None
    lines = []
    for c in res.get("results", []):
        m = c.get("median") or {}
        lines.append({"path": c.get("path"), "io_size": c.get("io_size"), "pattern": c.get("pattern"),
                      **{k: m.get(k) for k in ("gib_s", "iops", "mean_lat_us", "p99_lat_us") if k in m}})
    return {"file_bytes": res.get("file_bytes"), "lines": lines, "skipped": res.get("skipped"),
            "json_file": res.get("json_file")}


def bench_brief(res) -> dict | None:
    if not isinstance(res, dict):
        return None
    keep = ("pipeline", "backends", "facts", "skipped")
    return {k: res[k] for k in keep if k in res} | {"json_file": res.get("json_file")}


def main(argv) -> int:
    out, steps_tsv, missing_json, gpu = Path(argv[0]), Path(argv[1]), Path(argv[2]), argv[3] == "1"
    junit_dir = Path(argv[4]) if len(argv) > 4 else None
    caps_tsv = Path(argv[5]) if len(argv) > 5 else None
    compile_json = Path(argv[6]) if len(argv) > 6 else None
    steps = {}
    for line in steps_tsv.read_text().splitlines():
        name, status, secs, *rest = line.split("\t")
        steps[name] = {"status": status, "seconds": int(secs)}
        if rest and rest[0]:
            steps[name]["limit"] = int(rest[0])
    caps = {}
    if caps_tsv is not None and caps_tsv.is_file():
        for line in caps_tsv.read_text().split("\n"):
            if line.strip():
                name, sec = line.split()
                caps[name] = int(sec)
    for name, v in steps.items():
        if name in caps:
            v["cap"] = caps[name]
    if "compile" in steps and compile_json is not None:
        steps["compile"]["parts"] = _load(compile_json) or "none: the step wrote no compile.json"
    test_steps = [n for n in steps if n.startswith("test-")]
    if junit_dir is not None:
        with_junit = set(merge_junit(junit_dir, out / "gpu_tests.xml"))
        for name in test_steps:
            v = steps[name]
            v["junit"] = (True if name in with_junit else
                          "skipped: no GPU" if not gpu and v["status"] == "skipped: no GPU" else
                          f"none: the step wrote no junit XML ({v['status']})")
    ran: dict = {}
    for name in test_steps:
        per, src = step_tests(name, out, junit_dir)
        v = steps[name]
        if per is None:
            continue
        v["tests_from"], v["counts"], v["tests"] = src, counts(per), per
        running = [t for t, r in per.items() if r == RUNNING]
        if running:
            v["running_when_ended"] = running
        for t in per:
            ran.setdefault(t, []).append(name)
    missing = _load(missing_json) or {"required": None, "optional": None}
    tests = tests_summary(out / "gpu_tests.xml") if (out / "gpu_tests.xml").is_file() else None
    if tests is None and ran:
        tests = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "collected": 0, "per_step": {},
                 "per_file": {}, "failures": []}
    if tests is not None:
        for name in test_steps:         # a step without junit: its counts from its log
            v = steps[name]
            if v.get("tests_from") == "log":
                tests["per_step"][name] = dict(v["counts"])
                for k in ("passed", "failed", "errors", "skipped"):
                    tests[k] += v["counts"][k]
                tests["collected"] += len(v["tests"])
                tests["failures"] += [t for t, r in v["tests"].items() if _count_key(r) in ("failed", "errors")]
        if not gpu:
            tests["note"] = "no GPU: every gpu test skipped (the per-test lines list what each step holds)"
        every = junit_dir / "all.ids" if junit_dir is not None else None
        if every is not None and every.is_file():
            ids = [i for i in every.read_text().split("\n") if i.strip()]
            tests["gpu_tests_in_all"] = len(ids)
            tests["not_in_first_run"] = [i for i in ids if i not in ran]
            tests["in_two_steps"] = {t: s_ for t, s_ in ran.items() if len(s_) > 1}
    budget = int(os.environ.get("GPU_CHECK_BUDGET", "540"))
    s = {
        "gpu": gpu,
        "ok": all(v["status"] == "ok" or v["status"].startswith("skipped") for v in steps.values()),
        "budget_s": budget,
        "caps_sum_s": sum(caps.values()) if caps else None,
        "caps": caps or None,
        "steps": steps,
        "missing_imports": missing,
        "tests": tests if tests is not None else ("skipped: no GPU" if not gpu else None),
        "kernels": kernels_summary(_load(out / "bench_kernels.json")) if gpu else "skipped: no GPU",
        "prefill": prefill_summary(_load(out / "bench_prefill.json")) if gpu else "skipped: no GPU",
        "storage": storage_summary(_load(out / "bench_storage.json")) if gpu else "skipped: no GPU",
        "gather": bench_brief(_load(out / "bench_gather.json")) if gpu else "skipped: no GPU",
        "log": str(out / "gpu_check.log"),
    }
    if gpu and isinstance(s["tests"], dict) and s["tests"]["collected"] == 0:
        s["ok"] = False
    if isinstance(tests, dict) and tests.get("in_two_steps"):
        s["ok"] = False             # a selection mistake: the test costs its time twice
    if caps and sum(caps.values()) > budget - 15:
        s["ok"] = False
        s["caps_over_budget"] = f"the caps sum to {sum(caps.values())} s, over the {budget} s budget less 15 s"
    (out / "summary.json").write_text(json.dumps(s, indent=1, default=str))
    t = s["tests"]
    for name, v in steps.items():
        counts_ = (t["per_step"].get(name) if isinstance(t, dict) else None)
        extra = (f"  {counts_['passed']} passed, {counts_['failed']} failed, {counts_['errors']} errors, "
                 f"{counts_['skipped']} skipped" if counts_ and gpu else
                 f"  junit: {v['junit']}" if isinstance(v.get("junit"), str) and gpu else "")
        if v.get("running_when_ended"):
            extra += f"; ended in {v['running_when_ended'][0]}"
        cap_ = f"/{v['cap']}" if "cap" in v else ""
        print(f"  {name:<14} {v['status']:<34} {v['seconds']:>4}{cap_} s{extra}")
        if isinstance(v.get("parts"), dict):
            for part, p in v["parts"].items():
                print(f"      {part:<14} {p.get('status')}: {str(p.get('detail', ''))[:150]}")
    if caps:
        print(f"  caps: {sum(caps.values())} s in all (budget {budget} s)")
    if isinstance(t, dict):
        print(f"  gpu tests: {t['passed']} passed, {t['failed']} failed, {t['errors']} errors, {t['skipped']} skipped"
              + (f"; {len(t['not_in_first_run'])} of {t['gpu_tests_in_all']} not in the first run"
                 if "not_in_first_run" in t else ""))
        for f in t["failures"][:20]:
            print(f"    FAILED {f}")
    k = s["kernels"]
    if isinstance(k, dict) and k.get("gathers"):
        print(f"  kernels: D2D {k['d2d_GBps']:,.0f} GB/s; "
              + ", ".join(f"{g['type']}/{g['dtype']} {g['ratio_to_d2d']:.2f}" for g in k["gathers"]))
    st = s["storage"]
    if isinstance(st, dict):
        for ln in st["lines"]:
            print(f"  storage {ln['path']} {ln['io_size']} B: {ln.get('gib_s') or 0:.2f} GiB/s")
        for sk in st.get("skipped") or []:
            print(f"  storage {sk.get('path')}: skipped: {sk.get('why')}")
    p = s["prefill"]
    if isinstance(p, dict):
        for m in p["models"]:
            tps = {k: round(v) for k, v in m["tok_per_s_median"].items() if v}
            print(f"  prefill {m['table']}: median tok/s {tps}; graph/eager {m['graph_vs_eager']}")
    print(f"  summary: {out / 'summary.json'} ({'ok' if s['ok'] else 'NOT ok'})")
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
