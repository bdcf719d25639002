"""vLLM's OpenAI-compatible server with the plugin, driven over HTTP (benches/vllm_server.py), on vLLM's CPU engine
in its venv (GDS_GATHER_VLLM_PYTHON; without it these tests skip and say why). The oracle is the same server
configuration without the plugin: greedy completions and a chat answer, token for token.

One server process tree per configuration, on a free port, readiness polled with a deadline (READY_S), always
stopped. Each server costs 45-80 s to start on a 2-core machine (vLLM's imports and engine start), the requests
seconds: the module runs six servers (one process, tensor parallel 2 and pipeline parallel 2, each with and without
the plugin) and one that refuses to start, about 8 minutes in all.
"""
from __future__ import annotations

import os
import re
import subprocess

import pytest

from gds_gather.benches import vllm_server as vs
from gds_gather.benches.vllm_ab import prompts

VLLM_PY = os.environ.get("GDS_GATHER_VLLM_PYTHON")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not VLLM_PY, reason="GDS_GATHER_VLLM_PYTHON is not set: vLLM's CPU engine runs in "
                                 "its own venv (`.ci/run` builds it and sets the variable)")]
# the tiny checkpoint's PLE table: 65,536 x 2,048 (bf16 in vLLM: 256 MiB), large beside the workers' RSS noise (up to
# ~100 MB between two starts of the same server here; a 64 MiB table left the first pipeline stage's margin to chance)
VOCAB, N_LAYER, PER_LAYER = 65536, 4, 512
TABLE_BF16 = VOCAB * N_LAYER * PER_LAYER * 2
READY_S = 600                                 # a server start's deadline (about 45-70 s here)
PROMPTS = prompts(VOCAB, 3, 24)
CHAT = [{"role": "user", "content": "The per-layer embedding stays on disk."}]
# one unbound OpenMP thread per process: two cores serve two ranks
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny random Gemma 4 text checkpoint with a byte-level tokenizer and a chat template."""
    out = tmp_path_factory.mktemp("gemma4")
    p = subprocess.run([VLLM_PY, "-m", "gds_gather.benches.vllm_ab", "tiny", "gemma4", str(out), "--vocab",
                        str(VOCAB), "--per-layer", str(PER_LAYER), "--tokenizer"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return str(out)


def serve(model, tmp, plugin: bool, tp: int = 1, pp: int = 1, env=None, extra=()) -> dict:
    """One server: the RSS of its processes once it is ready, its greedy completions, chat answer and a streamed
    completion, its log."""
    tmp.mkdir(parents=True, exist_ok=True)
    srv = vs.Server(model, VLLM_PY, tp=tp, pp=pp, log=tmp / "server.log", extra=extra,
                    env={**ENV, "GDS_GATHER_VLLM": "1" if plugin else "0", "GDS_GATHER_CACHE_DIR": str(tmp / "cache"),
                         **(env or {})})
    with srv:
        srv.wait_ready(READY_S)
        out = {"processes": vs.processes(srv.proc.pid), "tokens": vs.complete(srv.port, model, PROMPTS, 12),
               "chat": vs.chat(srv.port, model, CHAT, 12),
               "stream": vs.stream(srv.port, model, PROMPTS[0], 12)["tokens"]}
    out["log"] = srv.log()
    return out


def rss(run: dict, role: str) -> int:
    return next(p["rss"] for p in run["processes"] if p["role"] == role)


def plugin_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "gds_gather: model.embed_tokens_per_layer from" in line]


@pytest.fixture(scope="module")
def one_process_off(model, tmp_path_factory):
    return serve(model, tmp_path_factory.mktemp("off"), plugin=False)


@pytest.mark.hot_rows
def test_server_with_the_plugin_equals_the_server_without(model, one_process_off, tmp_path):
    # hot rows on, and a shutdown that lets the worker exit on its own: it saves them
    off = one_process_off
    on = serve(model, tmp_path, plugin=True, env={"GDS_GATHER_HOT_ROWS": "1"}, extra=["--shutdown-timeout", "10"])
    assert on["tokens"] == off["tokens"] and [len(t) for t in off["tokens"]] == [12, 12, 12]
    assert on["chat"] == off["chat"] and len(off["chat"]["token_ids"]) == 12
    assert on["stream"] == on["tokens"][0]                    # streamed: the same greedy tokens
    # the log says where the table is, which backend reads it, the row cache's budget and the hot-row file
    (line,) = plugin_lines(on["log"])
    assert f"from {model}/model.safetensors (model.embed_tokens_per_layer.weight, F32)" in line
    assert f": {TABLE_BF16} bytes not allocated on this rank (tp=1, pp=1); host backend " in line
    assert re.search(r"row cache budget \d+ bytes in this process \((auto|set|off)", line)
    hot = re.search(r"; hot rows (\S+\.rows)$", line).group(1)
    assert hot.startswith(f"{tmp_path}/cache/hot/") and "(Worker pid=" in line
    assert os.path.getsize(hot) > 4096                        # written when the worker exited
    assert plugin_lines(off["log"]) == []
    # the worker holds the model: without the table it is smaller (by the table, less allocator noise)
    assert rss(off, "Worker") - rss(on, "Worker") > TABLE_BF16 // 2


def test_server_refuses_a_table_that_does_not_fit(model, tmp_path):
    """One ERROR line says why, the server exits non-zero, and its port never accepts a connection."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    torch = pytest.importorskip("torch")
    bad = tmp_path / "other.safetensors"
    safetensors_torch.save_file({"model.embed_tokens_per_layer.weight": torch.zeros(100, 8)}, bad)
    srv = vs.Server(model, VLLM_PY, log=tmp_path / "server.log",
                    env={**ENV, "GDS_GATHER_VLLM": "1", "GDS_GATHER_VLLM_TABLE": str(bad)})
    with srv, pytest.raises(vs.ServerExited) as e:
        srv.wait_ready(READY_S)
    assert e.value.rc != 0 and not e.value.port_opened
    errors = [line for line in e.value.log.splitlines() if " ERROR " in line and "gds_gather: " in line]
    assert len(errors) == 1, errors
    assert errors[0].endswith(f"gds_gather: {bad}: a table of 100 rows x 8 elements, but the model's per-layer "
                              f"embedding is [{VOCAB:,}, {N_LAYER * PER_LAYER}]; the server does not start")


def parallel_pair(model, tmp_path, workers: str, **parallel):
    """The server of `parallel` (tp= or pp=) without and with the plugin: (off, on, the plugin's log lines), once
    greedy tokens are equal and both workers (`workers` 0 and 1, e.g. Worker_TP) logged the table."""
    off = serve(model, tmp_path / "off", plugin=False, **parallel)
    on = serve(model, tmp_path / "on", plugin=True, **parallel)
    assert on["tokens"] == off["tokens"] and on["chat"] == off["chat"] and on["stream"] == on["tokens"][0]
    lines = plugin_lines(on["log"])
    assert sorted(re.search(rf"\(({workers}\d) pid=", line).group(1) for line in lines) == [f"{workers}0",
                                                                                           f"{workers}1"]
    return off, on, lines


def test_tensor_parallel_2(model, tmp_path):
    """Each rank reads whole rows from the table (no collective); greedy tokens equal vLLM's tensor parallel 2
    without the plugin (vLLM's own all-reduce order makes TP=2 differ from one process on this random model)."""
    off, on, lines = parallel_pair(model, tmp_path, "Worker_TP", tp=2)
    assert all(f": {TABLE_BF16 // 2} bytes not allocated on this rank (tp=2, pp=1)" in line for line in lines)
    # each rank's vocabulary shard (half the table) is not held; the plugin's own memory is ~10 MiB per process
    assert sum(rss(off, r) - rss(on, r) for r in ("Worker_TP0", "Worker_TP1")) > TABLE_BF16 // 2


def test_pipeline_parallel_2(model, tmp_path):
    """The first stage reads rows, the second opens the table and reads nothing; greedy tokens equal vLLM's
    pipeline parallel 2 without the plugin (vllm_server.PP_COMPILATION: the CPU engine needs its warm-up)."""
    off, on, lines = parallel_pair(model, tmp_path, "Worker_PP", pp=2)
    assert all(f": {TABLE_BF16} bytes not allocated on this rank (tp=1, pp=2)" in line for line in lines)
    # the first stage does not hold the table; vLLM allocates it on the second stage too but never writes it there,
    # so that stage's RSS does not change
    assert rss(off, "Worker_PP0") - rss(on, "Worker_PP0") > TABLE_BF16 // 2
