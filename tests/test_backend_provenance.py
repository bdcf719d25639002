"""The log says why a prefill's backend was chosen: auto (and the reason auto gives), requested with --backend, or
set by Config.backend / GDS_GATHER_BACKEND; nothing calls a backend "requested" that nobody asked for."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

import gds_gather as gg
from gds_gather.model.synth import write_model
from gds_gather.prefill.run import run_prefill


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("m") / "q.gguf", "qwen4exp", rows=3000, progress=False)


def _backend_logs(caplog, model, cfg, **kw):
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="gds_gather"):
        res = run_prefill(model, cfg, n_tokens=64, ubatch=64, trunk="none", progress=False, log=None, **kw)
    return res, [r.getMessage() for r in caplog.records if "backend" in r.getMessage()]


@pytest.mark.parametrize("given, env, backend, words", [
    (None, "auto", "direct", "backend direct: auto, the host default: O_DIRECT reads into host memory"),
    ("pread", "auto", "pread", "backend pread: requested with --backend"),
    ("mmap", "pread", "mmap", "backend mmap: requested with --backend"),     # --backend beats the variable
    (None, "readahead", "readahead", "backend readahead: set by Config.backend / GDS_GATHER_BACKEND"),
])
def test_the_log_says_where_the_backend_came_from(model, caplog, given, env, backend, words):
    cfg = gg.Config.from_env({"GDS_GATHER_BACKEND": env, "GDS_GATHER_PLATFORM": "cpu"})
    res, logs = _backend_logs(caplog, model, cfg, backend=given)
    assert res["backend"] == backend
    assert [x for x in logs if x.startswith(words)], logs
    if given is None:
        assert not [x for x in logs if "requested" in x], logs


def test_minus_v_prefill_on_the_command_line(model):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GDS_GATHER_")}
    for argv in (["-v", "prefill"], ["prefill", "-v"]):
        r = subprocess.run([sys.executable, "-P", "-m", "gds_gather.cli", *argv, str(model), "--tokens", "64",
                            "--platform", "cpu"], capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0, r.stderr
        logs = [x for x in r.stderr.splitlines() if x.startswith("INFO") and "backend" in x]
        assert [x for x in logs if x.startswith("INFO gds_gather.prefill.run: backend direct: auto, the host default: "
                                                "O_DIRECT reads into host memory (")], logs
        assert not [x for x in logs if "requested" in x], logs
        assert "backend   direct: auto, the host default" in r.stdout
