"""benches/vllm_ab.py without vLLM: the tiny checkpoints, the prompts, the A/B medians and ratios, the
subprocess contract (arguments, environment, the JSON last line) and the command line. The engine itself
(`run`) runs in vLLM's venv: tests/integrations/test_vllm.py."""
from __future__ import annotations

import json
import os
import stat
import sys

import numpy as np
import pytest

from gds_gather.benches import vllm_ab
from gds_gather.benches.tiny import tiny


def test_prompts_are_seeded_and_in_range():
    a = vllm_ab.prompts(1000, 3, 7, seed=5)
    assert a == vllm_ab.prompts(1000, 3, 7, seed=5) and a != vllm_ab.prompts(1000, 3, 7, seed=6)
    assert len(a) == 3 and all(len(p) == 7 and all(1 <= t < 1000 for t in p) for p in a)   # never token 0
    assert len({tuple(p) for p in a}) == 3              # the prompts of one call differ


def _record(plugin, prefill, decode, params, rss, start=1.0, tokens=((1, 2), (3, 4))):
    return {"plugin": plugin, "prefill_tok_per_s": prefill, "decode_tok_per_s": decode, "parameter_bytes": params,
            "rss_bytes": rss, "engine_start_s": start, "tokens": [list(t) for t in tokens],
            "class": "Gemma4ForCausalLM", "bytes_not_allocated": 1000 if plugin else 0}


def test_ab_interleaves_and_takes_medians():
    # off: prefill 100, 300, 200 -> median 200; on: 150, 450, 300 -> 300; decode off 10, 30, 20; on 5, 15, 10
    feed = {False: iter([_record(False, 100, 10, 5000, 9 << 20), _record(False, 300, 30, 5000, 7 << 20),
                         _record(False, 200, 20, 5000, 8 << 20)]),
            True: iter([_record(True, 150, 5, 4000, 4 << 20), _record(True, 450, 15, 4000, 6 << 20),
                        _record(True, 300, 10, 4000, 5 << 20)])}
    order, lines = [], []

    def runner(model_dir, plugin, python, **kw):
        order.append(plugin)
        assert (model_dir, python, kw) == ("/m", "/py", {"bench_batch": 2})
        return feed[plugin].__next__()

    res = vllm_ab.ab("/m", 3, "/py", log=lines.append, runner=runner, bench_batch=2)
    assert order == [False, True] * 3
    assert res["off"] == {"prefill_tok_per_s": 200, "decode_tok_per_s": 20, "parameter_bytes": 5000,
                          "rss_bytes": 8 << 20, "engine_start_s": 1.0}
    assert res["on"]["prefill_tok_per_s"] == 300 and res["on"]["decode_tok_per_s"] == 10
    assert res["prefill_on_vs_off"] == pytest.approx(1.5) and res["decode_on_vs_off"] == pytest.approx(0.5)
    assert res["tokens_equal"] and res["bytes_not_allocated"] == 1000 and res["class"] == "Gemma4ForCausalLM"
    assert len(lines) == 7 and lines[1] == ("run 1 plugin on : prefill 150 tok/s, decode 5 tok/s, parameters "
                                            "4,000 B, rss 4 MiB")
    assert lines[-1] == ("Gemma4ForCausalLM: greedy tokens equal with and without; parameters 5,000 -> 4,000 B "
                         "(1,000 B not allocated); prefill 1.50x, decode 0.50x (plugin on vs off, medians of 3)")


def test_ab_says_when_tokens_differ():
    recs = iter([_record(False, 1, 1, 1, 1), _record(True, 1, 1, 1, 1, tokens=((1, 2), (3, 5)))])
    lines = []
    res = vllm_ab.ab("/m", 1, log=lines.append, runner=lambda *a, **k: next(recs))
    assert not res["tokens_equal"] and "greedy tokens DIFFER with and without" in lines[-1]


@pytest.fixture()
def fake_python(tmp_path):
    """An executable standing in for vLLM's python: it prints a log line, then its argv and two variables as the
    JSON last line (or fails when FAKE_FAIL is set)."""
    p = tmp_path / "python"
    p.write_text(f"#!{sys.executable}\n"
                 "import json, os, sys\n"
                 "print('INFO a vLLM log line')\n"
                 "if os.environ.get('FAKE_FAIL'):\n"
                 "    sys.stderr.write('engine exploded'); sys.exit(3)\n"
                 "print(json.dumps({'argv': sys.argv[1:], 'plugin': os.environ['GDS_GATHER_VLLM'],\n"
                 "                  'table': os.environ.get('GDS_GATHER_VLLM_TABLE')}))\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return str(p)


def test_run_subprocess_contract(fake_python, tmp_path):
    res = vllm_ab.run_subprocess(tmp_path / "ckpt", True, fake_python, env={"GDS_GATHER_VLLM_TABLE": "/t.gguf"},
                                 bench_prompt_len=64, decode_tokens=8)
    assert res["argv"] == ["-m", "gds_gather.benches.vllm_ab", "run", str(tmp_path / "ckpt"), "--json",
                           "--bench-prompt-len", "64", "--decode-tokens", "8"]
    assert res["plugin"] == "1" and res["table"] == "/t.gguf"
    assert res["log"] == "INFO a vLLM log line\n"          # the output before the JSON line, and stderr (empty)
    off = vllm_ab.run_subprocess(tmp_path / "ckpt", False, fake_python)
    assert off["plugin"] == "0" and off["table"] == os.environ.get("GDS_GATHER_VLLM_TABLE")


def test_run_subprocess_failure_says_what_failed(fake_python, tmp_path):
    with pytest.raises(RuntimeError, match=r"failed \(3\):\nINFO a vLLM log line\n\nengine exploded"):
        vllm_ab.run_subprocess(tmp_path, False, fake_python, env={"FAKE_FAIL": "1"})


def test_main_ab(monkeypatch, capsys):
    calls = []

    def fake(model_dir, plugin, python, **kw):
        calls.append((model_dir, plugin, kw))
        return _record(plugin, 200 if plugin else 100, 10, 10, 1 << 20)
    monkeypatch.setattr(vllm_ab, "run_subprocess", fake)
    assert vllm_ab.main(["ab", "/ckpt", "--json", "--repeat", "2", "--bench-batch", "3"]) == 0
    res = json.loads(capsys.readouterr().out)              # --json: the result alone, no log lines
    assert res["repeat"] == 2 and res["prefill_on_vs_off"] == 2.0 and res["model"] == "/ckpt"
    assert calls[0] == ("/ckpt", False, {"bench_prompt_len": 512, "bench_batch": 3, "decode_tokens": 64,
                                         "compiled": 0})
    assert [c[1] for c in calls] == [False, True, False, True]
    assert vllm_ab.main(["ab", "/ckpt", "--repeat", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("run 1 plugin off: prefill 100 tok/s") and "prefill 2.00x" in out[-1]


def test_main_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        vllm_ab.main(["tiny", "llama", "/x"])
    assert "invalid choice: 'llama'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        vllm_ab.main([])


def test_tiny_checkpoints(tmp_path, capsys):
    """The checkpoints the engine tests serve: the PLE table is [vocab, n_layer x per_layer];
    the same seed gives the same weights, another seed other ones."""
    pytest.importorskip("transformers")
    safetensors = pytest.importorskip("safetensors.numpy")
    assert vllm_ab.main(["tiny", "gemma4", str(tmp_path / "a"), "--vocab", "512"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "a")
    tiny("gemma4", tmp_path / "b", vocab=512)
    tiny("gemma4", tmp_path / "c", vocab=512, seed=1)
    w = {k: safetensors.load_file(tmp_path / k / "model.safetensors") for k in "abc"}
    ple = w["a"]["model.embed_tokens_per_layer.weight"]
    assert ple.shape == (512, 4 * 128) and ple.dtype == np.float32
    assert all(np.array_equal(w["a"][k], w["b"][k]) for k in w["a"])
    assert not np.array_equal(ple, w["c"]["model.embed_tokens_per_layer.weight"])
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma4ForCausalLM"] and cfg["vocab_size_per_layer_input"] == 512


def test_tiny_multimodal_and_bad_kinds(tmp_path):
    pytest.importorskip("transformers")
    tiny("gemma4", tmp_path / "mm", vocab=256, n_layer=2, per_layer=16, multimodal=True)
    cfg = json.loads((tmp_path / "mm" / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma4ForConditionalGeneration"] and cfg["vision_config"]["hidden_size"] == 32
    assert cfg["text_config"]["hidden_size_per_layer_input"] == 16
    with pytest.raises(ValueError, match="multimodal: gemma4 only"):
        tiny("gemma3n", tmp_path / "x", vocab=256, n_layer=2, multimodal=True)
    with pytest.raises(ValueError, match="kind is gemma4 or gemma3n, got 'llama'"):
        tiny("llama", tmp_path / "y")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def _served(plugin, start, ttft1, tps8, worker_rss, tokens=((1, 2),)):
    return {"plugin": plugin, "tp": 2, "pp": 1, "bench": {"requests": 4}, "start_s": start, "restart_s": start / 2,
            "tokens": [list(t) for t in tokens], "chat": {"text": "", "token_ids": [5]},
            "load": [{"concurrency": 1, "ttft_s": ttft1, "tok_per_s": 10.0},
                     {"concurrency": 8, "ttft_s": 2 * ttft1, "tok_per_s": tps8}],
            "processes": [{"role": "APIServer", "rss_loaded": 100}, {"role": "Worker_TP0", "rss_loaded": worker_rss}]}


def test_serve_ab_interleaves_and_takes_medians():
    feed = {False: iter([_served(False, 50, 0.1, 80, 1000), _served(False, 70, 0.3, 60, 1200),
                         _served(False, 60, 0.2, 70, 1100)]),
            True: iter([_served(True, 40, 0.2, 90, 900), _served(True, 44, 0.2, 95, 950),
                        _served(True, 42, 0.4, 85, 990)])}
    order, lines = [], []

    def runner(model_dir, plugin, python, **kw):
        order.append(plugin)
        assert kw == {"tp": 2}
        return next(feed[plugin])

    res = vllm_ab.serve_ab("/m", 3, "/py", log=lines.append, runner=runner, tp=2)
    assert order == [False, True] * 3 and res["tokens_equal"] and res["tp"] == 2
    assert res["off"] == {"start_s": 60, "restart_s": 30, "c1_ttft_s": 0.2, "c1_tok_per_s": 10.0, "c8_ttft_s": 0.4,
                          "c8_tok_per_s": 70, "rss_loaded APIServer": 100, "rss_loaded Worker_TP0": 1100,
                          "rss_loaded total": 1200}
    assert res["on"]["rss_loaded Worker_TP0"] == 950 and res["on"]["c8_tok_per_s"] == 90
    assert lines[-1] == "  rss_loaded total: 1,200.000 / 1,050.000" and "greedy tokens equal" in lines[-10]


def test_serve_ab_says_when_tokens_differ():
    recs = iter([_served(False, 1, 1, 1, 1), _served(True, 1, 1, 1, 1, tokens=((1, 3),))])
    lines = []
    res = vllm_ab.serve_ab("/m", 1, log=lines.append, runner=lambda *a, **k: next(recs))
    assert not res["tokens_equal"] and any("greedy tokens DIFFER" in line for line in lines)


def test_serve_subprocess_arguments(tmp_path):
    """`serve` in vLLM's python: flags as the CLI spells them (a list: its items; True: the flag alone)."""
    p = tmp_path / "serve_python"
    p.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps({{'argv': sys.argv[1:]}}))\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    res = vllm_ab.serve_subprocess("/ckpt", True, str(p), tp=2, concurrency=[1, 8], no_restart=True)
    assert res["argv"] == ["-m", "gds_gather.benches.vllm_ab", "serve", "/ckpt", "--json", "--plugin", "--tp", "2",
                           "--concurrency", "1", "8", "--no-restart"]
