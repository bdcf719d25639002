"""Only tests marked `gpu` are skipped without a GPU: a CPU test in tests/gpu/ (whose folder name makes "gpu" a
keyword of every test in it) runs."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_cpu_test_in_the_gpu_folder_runs():
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/gpu/test_schedule.py::test_stand_in_blocks_like_the_gpu"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]
