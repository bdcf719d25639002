"""The gds-gather command end to end: info, make-model, prefill (the main job on the CPU path)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import gds_gather as gg
from gds_gather.cli import main


def run_cli(*args, env=None):
    r = subprocess.run([sys.executable, "-P", "-m", "gds_gather.cli", *args], capture_output=True, text=True, env=env,
                       timeout=300)
    return r.returncode, r.stdout, r.stderr


def test_make_model_and_info_acceptance(tmp_path):
    """The issue's acceptance line: a 2,000,000-row IQ4_NL qwen4exp model (about 180 MB), then info."""
    out = tmp_path / "x.gguf"
    assert main(["make-model", "qwen4exp", "--rows", "2000000", "-o", str(out), "-q"]) == 0
    assert 179e6 < out.stat().st_size < 181e6
    code, stdout, _ = run_cli("info", str(out), "--json")
    assert code == 0
    d = json.loads(stdout)
    assert (d["arch"], d["qtype"], d["n_rows"], d["row_elems"], d["row_bytes"]) == ("qwen4exp", "IQ4_NL",
                                                                                     2000000, 160, 90)
    assert {b["name"] for b in d["backends"]} >= {"mmap", "resident", "gds"}
    assert all(b["reason"] for b in d["backends"])
    code, stdout, _ = run_cli("info", str(out))
    assert code == 0 and "IQ4_NL" in stdout and "2,000,000 rows" in stdout and "gds" in stdout


def test_info_errors_exit_2(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_text("nope")
    code, _, err = run_cli("info", str(bad))
    assert code == 2 and "not a GGUF" in err
    code, _, err = run_cli("make-model", "llama9", "-o", str(tmp_path / "y.gguf"))
    assert code == 2 and "preset" in err


@pytest.mark.parametrize("preset, qtype, rows", [("gemma4-e4b", "Q5_K", 4096), ("qwen4exp", "Q8_0", 50000),
                                                 ("gemma3n-e2b", "Q4_0", 3000)])
def test_prefill_json(tmp_path, preset, qtype, rows):
    path = tmp_path / f"{preset}.gguf"
    assert main(["make-model", preset, "--qtype", qtype, "--rows", str(rows), "-o", str(path), "-q"]) == 0
    code, stdout, err = run_cli("prefill", str(path), "--tokens", "3000", "--ubatch", "1024", "--json",
                                "--trunk", "none")
    assert code == 0, err
    res = json.loads(stdout.strip().splitlines()[-1])
    per_tok = 16 if preset == "qwen4exp" else 1
    assert res["tokens"] == 3000 and res["ubatches"] == 3 and res["ple_rows"] == 3000 * per_tok
    assert 0 < res["unique_rows"] <= res["ple_rows"] and res["rows_per_s"] > 0 and res["qtype"] == qtype
    assert res["pipeline"] == "cpu" and res["graph"] is False and res["useful_bytes"] > 0
    rb = res["useful_bytes"] // res["unique_rows"]       # rows the row cache served are not read again
    assert res["bytes_read"] >= (res["unique_rows"] - res["rows_from_cache"]) * rb
    if preset != "qwen4exp":   # natural text repeats words: token rows dedup well
        assert res["unique_rows"] < 0.6 * res["ple_rows"]


def test_prefill_default_model_is_built_once(tmp_path):
    env = {**__import__("os").environ, "GDS_GATHER_CACHE_DIR": str(tmp_path / "cache")}
    code, stdout, err = run_cli("prefill", "--tokens", "4096", env=env)
    assert code == 0, err
    assert "tok/s" in stdout and "unique" in stdout and "rows/s" in stdout
    built = list((tmp_path / "cache").glob("*.gguf"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    code, stdout, err = run_cli("prefill", "--tokens", "100", "--json", env=env)
    assert code == 0 and built[0].stat().st_mtime_ns == mtime
    assert json.loads(stdout.splitlines()[-1])["tokens"] == 100


def test_prefill_rows_match_reference(tmp_path):
    """The CPU pipeline's rows for a prompt are exactly the table rows ple_rows names."""
    from gds_gather.model.qwen4exp import Qwen4expHParams, next_prev, ple_rows
    from gds_gather.model.synth import write_model
    from gds_gather.prefill.run import RowMapper
    path = write_model(tmp_path / "q.gguf", "qwen4exp", rows=20000, progress=False)
    with gg.open_table(path) as t:
        hp = Qwen4expHParams.from_reader(t.reader)
        mapper = RowMapper(t)
        toks = np.random.default_rng(0).integers(0, 1000, 300)
        got = np.concatenate([mapper(toks[:100]), mapper(toks[100:])])
        np.testing.assert_array_equal(got, ple_rows(toks, hp))
        assert next_prev(toks, None, hp.ngram_size).tolist() == toks[-2:].tolist()


def test_prompt_file_and_bad_prompt(tmp_path):
    from gds_gather.prefill.prompts import prompt_tokens, word_ids
    p = tmp_path / "prompt.txt"
    p.write_text("the cat sat on the mat . the cat")
    ids = prompt_tokens(1000, (500,), p)
    assert (ids.size == 9 and ids[0] == ids[4] == ids[7] and ids[1] == ids[8] and ids[2] != ids[3]
            and 500 not in ids and 0 not in ids)
    assert prompt_tokens(1000, (), p, n_tokens=25).size == 25
    assert np.array_equal(word_ids("a b a", 50), word_ids("a b a", 50))
    (tmp_path / "blank.txt").write_text("   \n")
    with pytest.raises(ValueError, match="no words"):
        prompt_tokens(1000, (), tmp_path / "blank.txt")


def test_prompt_reads_only_what_it_needs(tmp_path, monkeypatch):
    """--prompt streams the file: 1,000 tokens of a 1.6 MB file read about one 64 KiB chunk, with the ids of a full
    read; undecodable bytes become U+FFFD, a character split across chunks is decoded whole."""
    import gds_gather.prefill.prompts as text_mod
    from gds_gather.prefill.prompts import prompt_tokens, word_ids
    rng = np.random.default_rng(1)
    words = np.array(["the", "cat", "sat", "on", "a", "mat", "naïve", "café", "日本", ",", "."])
    full = " ".join(words[rng.integers(0, words.size, 400_000)]) + "\n"
    p = tmp_path / "big.txt"
    p.write_text(full, encoding="utf-8")
    assert p.stat().st_size > 1.5e6
    read = []
    real_open = text_mod.open_prompt

    class Counting:
        def __init__(self, f):
            self.f = f

        def read(self, n):
            b = self.f.read(n)
            read.append(len(b))
            return b

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(text_mod, "open_prompt", lambda path: Counting(real_open(path)))
    ids = prompt_tokens(1000, (), p, n_tokens=1000)
    assert np.array_equal(ids, word_ids(full, 1000)[:1000])
    assert sum(read) <= 2 * text_mod.CHUNK_BYTES, sum(read)
    read.clear()
    monkeypatch.setattr(text_mod, "CHUNK_BYTES", 3)       # splits the UTF-8 of ï, é, 日, 本
    small = tmp_path / "small.txt"
    small.write_bytes("naïve café 日本 ok ".encode() * 50 + b"bad \xe9\xff byte")
    want = word_ids("naïve café 日本 ok " * 50 + "bad \ufffd\ufffd byte", 1000)
    assert np.array_equal(prompt_tokens(1000, (), small), want)
    monkeypatch.setattr(text_mod, "MAX_PROMPT_BYTES", 100)   # the cap: only the first 100 bytes are the prompt
    head = small.read_bytes()[:100].decode("utf-8", errors="replace")
    assert np.array_equal(prompt_tokens(1000, (), small), word_ids(head, 1000))
