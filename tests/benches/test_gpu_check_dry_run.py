"""bench/gpu_check.sh, the one call of a GPU machine (issue 34): its dry run on a machine without a GPU writes
summary.json with the compile step and every test step's per-test lines, within caps that sum under 540 s; the
summary reads a killed step's streamed pytest log where the step left no junit XML."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_check.sh"
SUMMARY = REPO / "bench" / "gpu_check_summary.py"


def script_caps() -> dict[str, int]:
    """The caps as the script declares them (its CAPS="..." block), read from its text."""
    block = re.search(r'^CAPS="(.*?)"$', SCRIPT.read_text(), re.S | re.M).group(1)
    return {name: int(sec) for name, sec in (ln.split() for ln in block.splitlines() if ln.strip())}


def script_test_steps() -> list[str]:
    block = re.search(r'^TEST_STEPS="(.*?)"$', SCRIPT.read_text(), re.S | re.M).group(1)
    return [ln.split("|")[0] for ln in block.splitlines() if ln.strip()]


def test_caps_sum_under_the_budget_with_a_margin():
    caps = script_caps()
    assert sum(caps.values()) <= 500 < 540, caps
    assert {"compile", "gpu-list", "bench-storage", "bench-prefill"} <= set(caps)
    assert set(script_test_steps()) <= set(caps)
    assert list(caps)[list(caps).index("compile") + 1] == "test-kernels"      # compile before every test step


def _driver_here() -> bool:
    smi = shutil.which("nvidia-smi")
    return bool(smi) and subprocess.run([smi, "-L"], capture_output=True).returncode == 0


@pytest.mark.slow
def test_dry_run_writes_the_summary_with_compile_and_per_test_lines(tmp_path):
    if _driver_here():
        pytest.skip("an NVIDIA driver answers here: gpu_check.sh would run the real check (minutes of GPU work)")
    if not shutil.which("timeout"):
        pytest.skip("coreutils timeout missing")
    out, work = tmp_path / "out", tmp_path / "work"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    env.update(PYTHON=sys.executable, GPU_CHECK_WORK=str(work))
    r = subprocess.run(["bash", str(SCRIPT), str(out)], env=env, capture_output=True, text=True, timeout=420)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["ok"] and s["gpu"] is False

    # the budgets: every step's cap, summed under 540 s (and equal to what the script declares)
    caps = script_caps()
    assert s["caps"] == caps and s["caps_sum_s"] == sum(caps.values()) < 540
    for name, v in s["steps"].items():
        assert v["cap"] == caps[name] and v["seconds"] <= v["cap"] + 10, (name, v)

    # the compile step: a status and its parts; NVRTC skipped without a GPU, the host builds done
    c = s["steps"]["compile"]
    assert c["status"] == "ok", c
    parts = c["parts"]
    assert set(parts) == {"host-build", "native", "nvrtc-dequant", "nvrtc-copy", "disk-cache"}
    assert parts["nvrtc-dequant"]["status"] == parts["nvrtc-copy"]["status"] == "skipped: no GPU"
    assert parts["native"]["status"] in ("ok", "skipped: no C compiler")
    assert parts["host-build"]["status"] in ("ok", "skipped: no host C++ compiler")
    assert list(s["steps"]).index("compile") < list(s["steps"]).index("test-kernels")

    # every test step: its per-test lines (each gpu test skipped by conftest.py), from its junit and in its log
    owned = {}
    for name in script_test_steps():
        v = s["steps"][name]
        assert v["status"] == f"skipped: no GPU ({len(v['tests'])} collected)", v["status"]
        assert v["tests"] and v["tests_from"] == "junit"
        assert all(t.startswith("tests/") and "::" in t for t in v["tests"])
        assert all(res.startswith("skipped: gpu") for res in v["tests"].values()), v["tests"]
        assert v["counts"] == {"passed": 0, "failed": 0, "errors": 0, "skipped": len(v["tests"])}
        log = (out / f"{name}.log").read_text()
        for t in v["tests"]:
            assert f"{t} SKIPPED" in log
        for t in v["tests"]:
            owned.setdefault(t, []).append(name)
    t = s["tests"]
    assert t["in_two_steps"] == {} and all(len(v) == 1 for v in owned.values())
    assert t["gpu_tests_in_all"] == len(owned) + len(t["not_in_first_run"])
    assert not set(owned) & set(t["not_in_first_run"])
    assert t["skipped"] == len(owned) and t["passed"] == t["failed"] == t["errors"] == 0
    # the first run's matrix
    kernels = s["steps"]["test-kernels"]["tests"]
    assert any("test_gather_exact_cupy" in k for k in kernels)
    faults = s["steps"]["test-faults"]["tests"]
    assert faults and all("read_error" in k for k in faults)
    prefill = s["steps"]["test-prefill"]["tests"]
    assert sum("per_layer_inputs_match_cpu" in k for k in prefill) == 3
    assert any("graph_prefill_equals_eager_resident[qwen4exp" in k for k in prefill)
    for name in ("bench-storage", "bench-prefill"):
        assert s["steps"][name]["status"] == "skipped: no GPU"
    assert (out / "gpu_check.log").is_file()


def test_summary_reads_a_killed_steps_log(tmp_path):
    """A step killed by its cap left no junit XML: its per-test lines come from its streamed -v log, the test it
    was in is named, its counts join the totals; the gpu tests of no step are listed, not failed."""
    out, junit = tmp_path / "out", tmp_path / "junit"
    out.mkdir()
    junit.mkdir()
    steps = [("compile", "ok", 40, 70), ("test-kernels", "ok", 30, 55), ("test-prefill", "timeout after 85 s", 90, 85)]
    (tmp_path / "steps.tsv").write_text("".join(f"{a}\t{b}\t{c}\t{d}\n" for a, b, c, d in steps))
    (tmp_path / "caps.tsv").write_text("compile\t70\ntest-kernels\t55\ntest-prefill\t85\n")
    (tmp_path / "missing.json").write_text('{"required": [], "optional": []}')
    (tmp_path / "compile.json").write_text(json.dumps({"nvrtc-dequant": {"status": "ok", "seconds": 30}}))
    (junit / "test-kernels.xml").write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="test-kernels" tests="2">'
        '<testcase classname="tests.gpu.test_kernels_gpu" name="test_streams"/>'
        '<testcase classname="tests.gpu.test_kernels_gpu" name="test_empty_ids"><failure message="boom"/>'
        "</testcase></testsuite></testsuites>")
    p = "tests/prefill/test_prefill.py::"
    (out / "test-prefill.log").write_text(
        "============ test session starts ============\ncollecting ... collected 13 items\n\n"
        f"{p}test_a[qwen4exp-direct-discrete] PASSED\n"
        f"{p}test_a[qwen4exp-pread-discrete] FAILED\n"
        f"{p}test_b[gemma4-e2b] SKIPPED (kvikio missing)\n"
        f"{p}test_c[qwen4exp] PASSED\n{p}test_c[qwen4exp] ERROR\n"
        "tests/prefill/test_prefill.py:12: AssertionError\n"
        f"{p}test_d[qwen4exp-roomy] ")                     # killed here: no result, no newline
    (junit / "all.ids").write_text("".join(f"{i}\n" for i in (
        "tests/gpu/test_kernels_gpu.py::test_streams", "tests/gpu/test_kernels_gpu.py::test_empty_ids",
        f"{p}test_a[qwen4exp-direct-discrete]", f"{p}test_a[qwen4exp-pread-discrete]", f"{p}test_b[gemma4-e2b]",
        f"{p}test_c[qwen4exp]", f"{p}test_d[qwen4exp-roomy]", "tests/prefill/test_trunk.py::test_graph")))
    r = subprocess.run([sys.executable, str(SUMMARY), str(out), str(tmp_path / "steps.tsv"),
                        str(tmp_path / "missing.json"), "1", str(junit), str(tmp_path / "caps.tsv"),
                        str(tmp_path / "compile.json")], capture_output=True, text=True)
    assert r.returncode == 1, r.stderr            # a step timed out
    s = json.loads((out / "summary.json").read_text())
    assert s["caps_sum_s"] == 210 and s["steps"]["compile"]["parts"]["nvrtc-dequant"]["status"] == "ok"
    k = s["steps"]["test-kernels"]
    kg = "tests/gpu/test_kernels_gpu.py::"
    assert k["tests_from"] == "junit"
    assert k["tests"] == {f"{kg}test_streams": "passed", f"{kg}test_empty_ids": "failed: boom"}
    v = s["steps"]["test-prefill"]
    assert v["junit"].startswith("none: the step wrote no junit XML (timeout")
    assert v["tests_from"] == "log" and v["limit"] == 85 and v["cap"] == 85
    assert v["tests"][f"{p}test_a[qwen4exp-direct-discrete]"] == "passed"
    assert v["tests"][f"{p}test_a[qwen4exp-pread-discrete]"] == "failed"
    assert v["tests"][f"{p}test_b[gemma4-e2b]"] == "skipped: kvikio missing"
    assert v["tests"][f"{p}test_c[qwen4exp]"].startswith("error")
    assert v["tests"][f"{p}test_d[qwen4exp-roomy]"].startswith("running when the step ended")
    assert v["running_when_ended"] == [f"{p}test_d[qwen4exp-roomy]"]
    assert v["counts"] == {"passed": 1, "failed": 1, "errors": 2, "skipped": 1}
    t = s["tests"]
    assert t["per_step"]["test-prefill"] == v["counts"]
    assert (t["passed"], t["failed"], t["errors"], t["skipped"]) == (2, 2, 2, 1)
    assert f"{p}test_a[qwen4exp-pread-discrete]" in t["failures"]
    assert t["not_in_first_run"] == ["tests/prefill/test_trunk.py::test_graph"] and t["in_two_steps"] == {}
    assert "ended in tests/prefill/test_prefill.py::test_d[qwen4exp-roomy]" in r.stdout
