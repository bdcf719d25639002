"""Models whose per-layer embedding is a float8 table (issue 36): transformers' from_pretrained, the main job
(prefill --hf) and the vLLM plugin, each against the model loaded by its own engine with the same table
dequantized (float8 value x scale in float32, here in numpy from the formats' bit layout: tests/formats/
test_fp8_tables.py's decoder), saved as a plain float32 checkpoint.

The float8 checkpoints are written here: a tiny random model's table quantized to E4M3 / E5M2 with UE8M0 scales per
32 elements (OCP MX: the power of two that brings the block's max |x| within the format's max), or unscaled.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from gds_gather.benches.tiny import add_noise, text_model  # noqa: E402
from gds_gather.cli import main  # noqa: E402
from gds_gather.integrations.transformers import from_pretrained  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "formats"))
from test_fp8_tables import decode  # noqa: E402

PLE = "model.embed_tokens_per_layer.weight"
VOCAB, N_LAYER, PER_LAYER = 384, 4, 16
MAX = {"F8_E4M3": 448.0, "F8_E5M2": 57344.0}
VLLM_PY = os.environ.get("GDS_GATHER_VLLM_PYTHON")


def lut(kind: str) -> np.ndarray:
    return np.array([decode(kind, b) for b in range(256)], np.float64)


def quantize(x: np.ndarray, kind: str, block: int | None) -> tuple[np.ndarray, np.ndarray | None]:
    """(float8 codes, UE8M0 scale codes or None): nearest finite code of x / 2^e per block."""
    v = lut(kind)
    finite = np.nonzero(np.isfinite(v))[0]
    order = finite[np.argsort(v[finite], kind="stable")]
    sv = v[order]
    scodes = None
    y = x.astype(np.float64)
    if block:
        amax = np.abs(y).reshape(y.shape[0], -1, block).max(axis=2)
        e = np.clip(np.ceil(np.log2(np.maximum(amax, 1e-30) / MAX[kind])), -127, 127).astype(np.int64)
        scodes = (e + 127).astype(np.uint8)
        y = y / np.repeat(np.ldexp(1.0, e), block, axis=1)
    i = np.clip(np.searchsorted(sv, y), 1, len(sv) - 1)
    pick = np.where(np.abs(sv[i - 1] - y) <= np.abs(sv[i] - y), i - 1, i)
    return order[pick].astype(np.uint8), scodes


def dequantized(codes: np.ndarray, kind: str, scodes, block) -> np.ndarray:
    val = lut(kind)[codes].astype(np.float32)
    if scodes is None:
        return val
    s = np.array([decode("F8_E8M0", int(b)) for b in range(256)], np.float32)[scodes]
    return val * np.repeat(s, block, axis=1)              # one float32 multiply, as the engines do


def fp8_pair(src: Path, dst: Path, oracle: Path, kind: str, block: int | None) -> None:
    """dst: src with its table as float8 (+ scales); oracle: src with the table those bytes mean, float32."""
    tensors = safetensors_torch.load_file(src / "model.safetensors")
    x = tensors[PLE].float().numpy()
    codes, scodes = quantize(x, kind, block)
    for d in (dst, oracle):
        shutil.copytree(src, d)
    fp8 = dict(tensors)
    fp8[PLE] = torch.from_numpy(codes).view(getattr(torch, {"F8_E4M3": "float8_e4m3fn",
                                                             "F8_E5M2": "float8_e5m2"}[kind]))
    if scodes is not None:
        fp8[PLE + "_scale"] = torch.from_numpy(scodes).view(torch.float8_e8m0fnu)
    safetensors_torch.save_file(fp8, dst / "model.safetensors", metadata={"format": "pt"})
    plain = dict(tensors)
    plain[PLE] = torch.from_numpy(dequantized(codes, kind, scodes, block))
    safetensors_torch.save_file(plain, oracle / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    cls, cfg = text_model("gemma4", vocab=VOCAB, n_layer=N_LAYER, per_layer=PER_LAYER)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gemma4-bf16")
    add_noise(cls(cfg).eval(), 1).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.mark.parametrize("kind,block", [("F8_E4M3", 32), ("F8_E5M2", 32), ("F8_E4M3", None)])
def test_from_pretrained_fp8_table_under_bf16_model(bf16_model, tmp_path, kind, block):
    """Logits and greedy tokens equal to transformers' own model with the dequantized table."""
    fp8, oracle = tmp_path / "fp8", tmp_path / "oracle"
    fp8_pair(bf16_model, fp8, oracle, kind, block)
    ref = transformers.AutoModelForCausalLM.from_pretrained(oracle, dtype=torch.bfloat16).eval()
    model = from_pretrained(fp8, dtype=torch.bfloat16)
    h = model.gds_gather
    assert h.table.qtype.name == kind and (h.table.scales is not None) == bool(block)
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = ref(ids).logits, model(ids).logits
    assert torch.equal(a, b)
    ga = ref.generate(ids[:1, :6], max_new_tokens=6, do_sample=False)
    assert torch.equal(ga, model.generate(ids[:1, :6], max_new_tokens=6, do_sample=False))
    assert h.rows_read > 0
    h.close()


def test_prefill_main_job_on_fp8_checkpoint(bf16_model, tmp_path, capsys):
    fp8, oracle = tmp_path / "fp8", tmp_path / "oracle"
    fp8_pair(bf16_model, fp8, oracle, "F8_E4M3", 32)
    assert main(["prefill", "--hf", str(fp8), "--tokens", "48", "--ubatch", "16", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["logits_equal"] and res["rows_read_per_run"] > 0
    assert main(["info", str(fp8)]) == 0
    out = capsys.readouterr().out
    assert "F8_E4M3" in out and "scales" in out and "one per 32 elements" in out
    # convert: no float8 in GGUF; BF16 on request, its error measured against the scaled values
    assert main(["convert", str(fp8), "-o", str(tmp_path / "t.gguf"), "-q"]) == 2
    assert "GGUF has no float8 type" in capsys.readouterr().err
    assert main(["convert", str(fp8), "-o", str(tmp_path / "t.gguf"), "--qtype", "BF16", "-q"]) == 0


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PY, reason="GDS_GATHER_VLLM_PYTHON is not set: vLLM's CPU engine runs in its own venv")
def test_vllm_plugin_fp8_table(tmp_path):
    """vLLM with the float8 table from GDS_GATHER_VLLM_TABLE: greedy tokens equal vLLM without the plugin on the
    model whose table is the dequantized one."""
    import subprocess
    from gds_gather.benches.vllm_ab import run_subprocess
    src = tmp_path / "tiny"
    p = subprocess.run([VLLM_PY, "-m", "gds_gather.benches.vllm_ab", "tiny", "gemma4", str(src), "--vocab", "65536"],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    fp8, oracle = tmp_path / "fp8", tmp_path / "oracle"
    fp8_pair(src, fp8, oracle, "F8_E4M3", 32)
    kw = dict(timeout=900, bench_prompt_len=64, bench_batch=4, decode_tokens=8)
    off = run_subprocess(str(oracle), False, VLLM_PY, **kw)
    on = run_subprocess(str(src), True, VLLM_PY, env={"GDS_GATHER_VLLM_TABLE": str(fp8)}, **kw)
    assert "F8_E4M3" in on["log"] and on["rows_read"] > 0
    assert on["tokens"] == off["tokens"]
