"""The memory-derived budgets through the command: `info`'s memory line, and an explicit row cache budget too
large for the memory this process may use refused in one line (exit 2). The limits are read from a fake tree
(GDS_GATHER_MEMORY_ROOT), so the test runs on any machine."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gds_gather.cli import main

MiB = 1 << 20


def run_cli(*args, env=None):
    r = subprocess.run([sys.executable, "-P", "-m", "gds_gather.cli", *args], capture_output=True, text=True,
                       env={**os.environ, **(env or {})}, timeout=300)
    return r.returncode, r.stdout, r.stderr


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("m") / "m.gguf"       # 20,000 rows x 90 B: a 1.7 MiB table
    assert main(["make-model", "qwen4exp", "--rows", "20000", "-o", str(out), "-q"]) == 0
    return out


def cgroup_v2(tmp, limit: int, usage: int = 0):
    """A root with a cgroup v2 limit of `limit` bytes and 8 GiB MemAvailable."""
    (tmp / "proc/self").mkdir(parents=True)
    (tmp / "proc/self/cgroup").write_text("0::/job\n")
    (tmp / "proc/meminfo").write_text("MemAvailable: 8388608 kB\n")
    (tmp / "sys/fs/cgroup/job").mkdir(parents=True)
    (tmp / "sys/fs/cgroup/job/memory.max").write_text(f"{limit}\n")
    (tmp / "sys/fs/cgroup/job/memory.current").write_text(f"{usage}\n")
    return tmp


def test_info_says_the_memory_the_budget_and_whether_resident_fits(model, tmp_path):
    code, out, err = run_cli("info", str(model))
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("  memory "))
    assert "available" in line and "row cache budget" in line and "auto: 10% of the table" in line
    assert "resident fits" in line or "resident does not fit" in line
    env = {"GDS_GATHER_MEMORY_ROOT": str(cgroup_v2(tmp_path, 1 * MiB))}      # 1 MiB left: the table does not fit
    code, out, err = run_cli("info", str(model), env=env)
    assert code == 0, err
    assert "(cgroup v2 /job limit 1,048,576 B less 0 B used)" in out and "resident does not fit" in out
    code, out, err = run_cli("info", str(model), "--json", env=env)
    m = json.loads(out)["memory"]
    assert (m["available_bytes"], m["cgroup_limit_bytes"], m["resident_fits"]) == (MiB, MiB, False)
    assert m["cache_budget_reason"] == "auto: 1/8 of the memory available" and m["cache_budget_bytes"] == MiB // 8


def test_an_explicit_budget_too_large_for_the_limit_is_refused_in_one_line(model, tmp_path):
    env = {"GDS_GATHER_MEMORY_ROOT": str(cgroup_v2(tmp_path, 1 * MiB)), "GDS_GATHER_CACHE_DIR": str(tmp_path / "c")}
    code, out, err = run_cli("prefill", str(model), "--tokens", "64", "--cache", "2M", env=env)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gds-gather: error: row cache budget 2,097,152 B"), err
    assert "1,048,576 B this process may use (cgroup v2 /job limit" in lines[0]
    code, out, err = run_cli("prefill", str(model), "--tokens", "64", "--cache", "512K", env=env)   # fits
    assert code == 0, err
    assert "          budget set (GDS_GATHER_CACHE_BYTES or --cache)" in out.splitlines()
