"""vllm_plugin's pieces one at a time: the swap of vLLM's VocabParallelEmbedding while a model is built (the PLE
prefix gets a PerLayerEmbedding reading the table, every other prefix vLLM's own class, the module restored even
when the build fails), where the table comes from (a Hub snapshot of the safetensors alone), the switch, and, in
vLLM's venv (GDS_GATHER_VLLM_PYTHON), the compilation settings the text-only class needs."""
from __future__ import annotations

import os
import subprocess
import textwrap
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from gds_gather.integrations import vllm as vllm_plugin  # noqa: E402

VLLM_PY = os.environ.get("GDS_GATHER_VLLM_PYTHON")


@pytest.fixture()
def table_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("GDS_GATHER_VLLM_TABLE", raising=False)
    w = torch.randn(300, 32, generator=torch.Generator().manual_seed(1))
    safetensors_torch.save_file({"model.embed_tokens_per_layer.weight": w}, tmp_path / "model.safetensors")
    return tmp_path, w


def _config(model, additional=None):
    return SimpleNamespace(model_config=SimpleNamespace(model=str(model), revision="main"),
                           load_config=SimpleNamespace(download_dir="/dl"), additional_config=additional,
                           parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))


def test_ple_prefix_built_from_disk_others_by_vllm(table_dir):
    path, w = table_dir
    built = []

    def real(num, dim, *args, prefix="", **kw):
        built.append((num, dim, args, prefix, kw))
        return "vllm's module"
    module = SimpleNamespace(VocabParallelEmbedding=real)
    cfg = _config(path, additional={})
    with vllm_plugin._ple_on_disk(module, cfg, top_level=False):
        assert module.VocabParallelEmbedding(300, 64, "org", prefix="model.embed_tokens", x=1) == "vllm's module"
        m = module.VocabParallelEmbedding(300, 32, prefix="model.language_model.embed_tokens_per_layer")
    assert built == [(300, 64, ("org",), "model.embed_tokens", {"x": 1})]
    assert module.VocabParallelEmbedding is real
    assert isinstance(m, vllm_plugin.PerLayerEmbedding) and m.prefix == "model.language_model.embed_tokens_per_layer"
    assert cfg.additional_config == {"gds_gather_ple": "disk"}          # a factor of vLLM's compile-cache key
    ids = torch.tensor([299, 0, 7])
    assert torch.equal(m(ids), w[ids])
    with pytest.raises(RuntimeError, match="build failed"):
        with vllm_plugin._ple_on_disk(module, _config(path), top_level=False):
            raise RuntimeError("build failed")
    assert module.VocabParallelEmbedding is real


def test_table_from_a_hub_snapshot(table_dir, monkeypatch):
    """A model name that is not a directory: the table is in the Hub snapshot vLLM loads, downloaded as the
    safetensors files and their index only (never the whole repository)."""
    hub = pytest.importorskip("huggingface_hub")
    path, _ = table_dir
    asked = []

    def snapshot_download(repo, **kw):
        asked.append((repo, kw))
        return str(path)
    monkeypatch.setattr(hub, "snapshot_download", snapshot_download)
    from gds_gather.config import Config
    assert vllm_plugin.table_source(_config("google/gemma-4-E2B-it"), Config()) == path
    assert asked == [("google/gemma-4-E2B-it", {"revision": "main", "cache_dir": "/dl",
                                                "allow_patterns": ["*.safetensors", "*.safetensors.index.json"]})]
    assert vllm_plugin.table_source(_config("google/gemma-4-E2B-it"), Config(vllm_table=path / "t.gguf")) == \
        path / "t.gguf" and len(asked) == 1


def test_off_unless_switched_on(monkeypatch):
    monkeypatch.delenv("GDS_GATHER_VLLM", raising=False)
    assert vllm_plugin.register() is None                   # no vLLM import: it is not installed in this venv
    with pytest.raises(AttributeError, match="has no attribute 'LlamaForCausalLM'"):
        vllm_plugin.LlamaForCausalLM


SPLIT = textwrap.dedent("""
    import json
    from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode
    from types import SimpleNamespace
    from gds_gather.integrations import vllm as vllm_plugin
    from gds_gather.errors import ModelMismatchError
    out = {}
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.PIECEWISE,
                           splitting_ops=["vllm::unified_attention"])
    vllm_plugin._split_at_lookup(SimpleNamespace(compilation_config=cc))
    vllm_plugin._split_at_lookup(SimpleNamespace(compilation_config=cc))      # added once
    out["split"] = cc.splitting_ops
    try:
        vllm_plugin._split_at_lookup(SimpleNamespace(compilation_config=CompilationConfig(
            mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.FULL, splitting_ops=[])))
    except ModelMismatchError as e:
        out["full"] = str(e)
    cls = vllm_plugin.Gemma4ForCausalLM
    from vllm.model_executor.models.gemma4 import Gemma4ForCausalLM as base
    out["class"] = [cls.__name__, cls.__module__, cls.__mro__[1] is base, vllm_plugin.Gemma4ForCausalLM is cls]
    print(json.dumps(out))
""")


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PY, reason="GDS_GATHER_VLLM_PYTHON is not set (vLLM runs in its own venv)")
def test_compilation_settings_in_vllm():
    import json
    p = subprocess.run([VLLM_PY, "-c", SPLIT], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["split"] == ["vllm::unified_attention", "gds_gather::ple_rows"]
    assert out["full"].startswith("the per-layer embedding on disk cannot run inside a full CUDA graph "
                                  "(cudagraph_mode=FULL) of the text-only class: pass compilation_config="
                                  "{'cudagraph_mode': 'PIECEWISE'}")
    assert out["class"] == ["Gemma4ForCausalLM", "gds_gather.integrations.vllm", True, True]
