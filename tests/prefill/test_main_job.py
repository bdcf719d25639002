"""The main job as a user runs it: `gds-gather prefill` on every table `open_table` opens, in a new process, with
its output checked line by line (the README quotes these lines; test_readme_output checks the quotes)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from gds_gather import TableLayoutError, open_table
from gds_gather.benches.tiny import add_noise, text_model
from gds_gather.integrations.convert import convert
from gds_gather.prefill.run import run_prefill

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB, N_LAYER, PER_LAYER = 512, 4, 16
README = Path(__file__).resolve().parents[2] / "README.md"
JSON_FIELDS = ("ple_seconds", "trunk_seconds", "ple_share", "trunk")


def run_cli(*args):
    r = subprocess.run([sys.executable, "-P", "-m", "gds_gather.cli", *args], capture_output=True, text=True,
                       timeout=300)
    return r.returncode, r.stdout, r.stderr


def _save(path: Path, kind: str, dtype, **save_kw) -> Path:
    """A tiny random Gemma 4 / Gemma 3n text model; every parameter gets noise so the rows are distinct."""
    cls, cfg = text_model(kind, vocab=VOCAB, n_layer=N_LAYER, per_layer=PER_LAYER, hidden=32, head_dim=16)
    torch.manual_seed(0)
    add_noise(cls(cfg)).to(dtype).save_pretrained(path, **save_kw)
    return path


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """{name: path}: every kind of table the main job must run on."""
    d = tmp_path_factory.mktemp("tables")
    g4 = _save(d / "gemma4", "gemma4", torch.bfloat16)
    sharded = _save(d / "sharded", "gemma4", torch.float32, max_shard_size="100KB")
    g3n = _save(d / "gemma3n", "gemma3n", torch.float32)
    out = {"hf-dir": g4, "hf-file": g4 / "model.safetensors", "hf-sharded": sharded, "gemma3n-dir": g3n,
           "convert": d / "ple.gguf", "convert-q8": d / "ple-q8.gguf"}
    assert (sharded / "model.safetensors.index.json").exists()
    convert(g4, out["convert"], progress=False)
    convert(g3n, out["convert-q8"], qtype="Q8_0", progress=False)
    return out


def _checkpoint_rows(path: Path) -> torch.Tensor:
    """The per-layer embedding weight as float32, read with safetensors (the oracle for the rows)."""
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    for f in files:
        w = safetensors_torch.load_file(str(f))
        for k, v in w.items():
            if k.endswith("embed_tokens_per_layer.weight"):
                return v.float()
    raise AssertionError("no per-layer embedding in the checkpoint")


@pytest.mark.parametrize("kind", ["hf-dir", "hf-file", "hf-sharded", "gemma3n-dir", "convert", "convert-q8"])
def test_prefill_runs_on_every_table(tables, kind):
    """A new process, as a user runs it: exit 0, stdout is the JSON line alone, the human lines are on stderr,
    each within 120 columns, and the time split is there."""
    code, out, err = run_cli("prefill", str(tables[kind]), "--tokens", "300", "--ubatch", "128", "--json",
                             "--trunk", "tiny")
    assert code == 0, err
    (line,) = out.splitlines()
    res = json.loads(line)
    assert all(k in res for k in JSON_FIELDS)
    assert res["tokens"] == 300 and res["ple_rows"] == 300 and res["ubatches"] == 3
    assert res["ple_seconds"] > 0 and res["trunk_seconds"] > 0
    assert res["ple_seconds"] + res["trunk_seconds"] == pytest.approx(res["seconds"])
    assert res["trunk"].startswith("synthetic tiny") and "random weights" in res["trunk"]
    human = [x for x in err.splitlines() if x.strip()]
    assert any(x.startswith("result ") for x in human) and any("PLE rows/s" in x for x in human)
    assert all(len(x) <= 120 for x in human), max(human, key=len)


@pytest.mark.parametrize("kind", ["hf-dir", "hf-sharded", "convert"])
def test_prefill_rows_and_per_layer_inputs_are_the_checkpoints(tables, kind):
    """The rows the prefill gathers are the checkpoint's (read with safetensors), and its per-layer inputs are the
    trunk's own math on them: the [n_layer, T, 16] layout scaled by sqrt(16), from the table's metadata."""
    src = tables["hf-sharded" if kind == "hf-sharded" else "hf-dir"]
    weight = _checkpoint_rows(src)
    tokens = np.random.default_rng(1).integers(0, VOCAB, 200)
    rows = run_prefill(tables[kind], tokens_override=tokens, ubatch=64, trunk="none", collect=True, progress=False,
                       log=None)["outputs"]
    got = torch.cat([r for r, _ in rows])
    assert torch.equal(got, weight[torch.from_numpy(tokens)])
    res = run_prefill(tables[kind], tokens_override=tokens, ubatch=64, trunk="tiny", collect=True, progress=False,
                      log=None)
    from gds_gather.prefill.pipeline import CpuPrefill
    from gds_gather.prefill.run import RowMapper
    with open_table(tables[kind]) as t:
        mapper = RowMapper(t)
        assert (mapper.n_layer, mapper.per_layer, mapper.row_scale) == (N_LAYER, PER_LAYER, 4.0)
        trunk = CpuPrefill(t, mapper, trunk="tiny").trunk
    for k, (ple, _) in enumerate(res["outputs"]):
        tk = torch.from_numpy(tokens[k * 64:(k + 1) * 64])
        with torch.no_grad():
            want = trunk.ple_inputs(weight[tk], trunk.embed(tk), rows_prescaled=False)
        assert ple.shape == (N_LAYER, tk.numel(), PER_LAYER)
        assert torch.allclose(ple, want, rtol=1e-6, atol=1e-6)


def _gguf_without_layout(path: Path, metadata: dict) -> Path:
    w = GGUFWriter(str(path), "gemma4")
    for k, v in metadata.items():
        w.add_uint32(k, v)
    w.add_tensor("per_layer_token_embd.weight", np.ones((64, 96), np.float32), raw_dtype=GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("metadata, words", [({}, "gemma4.block_count"),
                                             ({"gemma4.block_count": 5}, "no per-layer layout"),
                                             ({"gemma4.block_count": 2, "gemma4.embedding_length_per_layer_input": 32},
                                              "2 layers x 32")])
def test_a_table_without_a_layout_is_one_line(tmp_path, metadata, words):
    path = _gguf_without_layout(tmp_path / "x.gguf", metadata)
    with open_table(path) as t:
        from gds_gather.prefill.family import per_layer_layout
        with pytest.raises(TableLayoutError):
            per_layer_layout(t)
    code, out, err = run_cli("prefill", str(path), "--tokens", "10")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and words in err
    assert "Traceback" not in err


def test_byte_figures_agree(tmp_path):
    """One figure per line and no contradiction: amplification is delivered over the bytes of the rows read from
    the device, rows add up, and a request total above the table's size comes with the reason."""
    path = tmp_path / "q.gguf"
    code, _, err = run_cli("make-model", "qwen4exp", "--rows", "20000", "-o", str(path), "-q")
    assert code == 0, err
    code, out, err = run_cli("prefill", str(path), "--tokens", "2048", "--ubatch", "512", "--cold", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["rows_from_cache"] + res["rows_from_page_cache"] + res["rows_from_device"] \
        == res["unique_rows"] + res["rows_prefetched"]        # (read ahead: a device row, then a cache hit)
    assert res["bytes_from_device_rows"] == res["rows_from_device"] * 90
    if res["bytes_delivered"] is not None and res["rows_from_device"]:
        assert res["read_amplification"] == pytest.approx(res["bytes_delivered"] / res["bytes_from_device_rows"])
    lines = {x.split()[0]: x for x in err.splitlines() if x.strip() and not x.startswith(" ")}
    assert f"{res['bytes_requested']:,} B" in lines["requested"] and f"{res['bytes_needed']:,} B" in lines["needed"]
    assert (res["bytes_requested"] > res["table_bytes"]) == ("exceeds the" in err)
    assert "+-" not in err


def test_quick_benches_give_no_verdicts_and_fit(tables, tmp_path, capsys):
    """bench prefill on a transformers checkpoint (it runs on every table prefill does), --quick."""
    from gds_gather import benches
    benches.prefill_main(["--quick", "--model", str(tables["hf-dir"]), "--tokens", "256", "--ubatch", "128",
                          "--repeat", "1", "--backends", "direct,mmap,resident", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "so no PASS/MISS verdicts" in out
    assert "PASS (target" not in out and "MISS (target" not in out and "resident =" in out
    assert out.count("direct cold (row cache empty at the start) / resident") == 1
    assert "direct / resident" not in out         # the cold ratio to resident is printed once
    assert all(len(x) <= 120 for x in out.splitlines()), max(out.splitlines(), key=len)


def test_help_lists_every_command():
    from gds_gather.cli import build_parser
    sub = next(a for a in build_parser()._actions if a.dest == "cmd")
    code, out, _ = run_cli("--help")
    assert code == 0
    (description,) = [x for x in out.splitlines() if x.startswith("The `gds-gather` command")]
    assert all(name in description for name in sub.choices), description


def test_readme_output(tmp_path):
    """Every line the README quotes from the set-up command `gds-gather prefill` appears in a real run's output,
    with only its figures, paths and bracketed details changed (the lines that depend on the run: notes and
    machine facts, are skipped)."""
    text = README.read_text()
    block = re.search(r"<!-- prefill output -->\n```\n(.*?)```", text, re.S)
    assert block, "the README's quoted prefill output block is missing"
    env = {**os.environ, "GDS_GATHER_CACHE_DIR": str(tmp_path), "GDS_GATHER_HOT_ROWS": "1"}   # a user's default
    r = subprocess.run([sys.executable, "-P", "-m", "gds_gather.cli", "prefill", "--tokens", "2048"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    real = [_shape(x) for x in r.stdout.splitlines()]
    # the quoted run found every row in the page cache; where the kernel evicted some of the model it had just
    # written (memory pressure: seen in full-suite runs), the amplification line has its other wording, and the
    # rows read from the device are admitted to the row cache, so the hot-row line says it changed
    device = re.search(r"^sources .*?([\d,]+) from the device$", r.stdout, re.M)
    assert device, r.stdout
    skip = ("amplif.", "hot rows") if int(device.group(1).replace(",", "")) else ()
    quoted = [x for x in block.group(1).splitlines()
              if x.strip() and not x.startswith((" ", "note", "model", "prompt", "platform", "backend") + skip)]
    assert len(quoted) >= 10
    at = 0
    for line in quoted:                 # each quoted line, in the README's order
        assert _shape(line) in real[at:], line
        at = real.index(_shape(line), at) + 1


def _shape(line: str) -> str:
    """A line with its numbers, paths and bracketed details blanked: what stays is the labels and the wording."""
    line = re.sub(r"\[.*?\]|/\S+", "_", line)
    return re.sub(r"[+-]?\d[\d,.]*(?:x|%)?", "N", line).rstrip()
