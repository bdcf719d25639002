"""The CLI's edges, in-process: --cache sizes, an OS error (not a missing file) as one line and exit 1 (raised
under -v), and main() called from a thread other than the main one (no SIGTERM handler to install there)."""
from __future__ import annotations

import signal
import threading

import pytest

from gds_gather.cli import build_parser, main


@pytest.mark.parametrize("text, want", [("auto", -1), ("AUTO", -1), ("0", 0), ("16M", 16 << 20), ("1.5K", 1536),
                                        ("2GB", 2 << 30), ("4096", 4096)])
def test_cache_sizes(text, want):
    assert build_parser().parse_args(["prefill", "--cache", text]).cache == want


@pytest.mark.parametrize("text, words", [("inf", "not a size: 'inf' (e.g. 256M, 0, auto)"),
                                         ("lots", "not a size: 'lots'"),
                                         ("-5", "argument --cache: a size must be >= 0, got '-5'")])
def test_bad_cache_sizes(text, words, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["prefill", "--cache", text])
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_os_error_is_one_line_and_exit_1(capsys, monkeypatch, tmp_path):
    """An OSError that is not a missing file (EINVAL from a read): one line, exit 1; -v raises it."""
    from gds_gather.formats import gguf_parse

    def einval(self, path, table=None):
        raise OSError(22, "Invalid argument")
    monkeypatch.setattr(gguf_parse.GGUFHeader, "__init__", einval)
    path = tmp_path / "t.gguf"
    path.write_bytes(b"GGUF")
    assert main(["info", str(path)]) == 1
    err = capsys.readouterr().err
    assert err == "gds-gather: error: OSError: [Errno 22] Invalid argument\n"
    with pytest.raises(OSError):
        main(["-v", "info", str(path)])


def test_a_proc_file_is_refused_by_name(capsys):
    """/proc/self/mem is "regular" with size 0 and refuses a seek to its end: refused as no GGUF, naming it."""
    assert main(["info", "/proc/self/mem"]) == 2
    assert capsys.readouterr().err == "gds-gather: error: /proc/self/mem: empty file, not a GGUF file\n"


def test_main_from_a_worker_thread(tmp_path, capsys):
    before = signal.getsignal(signal.SIGTERM)
    rc = []
    th = threading.Thread(target=lambda: rc.append(main(["make-model", "qwen4exp", "--rows", "64", "-q", "-o",
                                                         str(tmp_path / "m.gguf")])))
    th.start()
    th.join()
    assert rc == [0] and (tmp_path / "m.gguf").stat().st_size > 0
    assert signal.getsignal(signal.SIGTERM) is before
    assert main(["info", str(tmp_path / "m.gguf"), "--json"]) == 0
    assert '"n_rows": 64' in capsys.readouterr().out


def test_info_names_the_shard_holding_the_table(tmp_path, capsys):
    """A sharded checkpoint (index + two shards, built here): info prints the model directory, then the shard the
    table is in, and the table's geometry from that shard's header."""
    import json

    import numpy as np
    st = pytest.importorskip("safetensors.numpy")
    w = np.arange(10 * 8, dtype=np.float32).reshape(10, 8)
    st.save_file({"model.norm.weight": np.ones(4, np.float32)}, tmp_path / "model-00001-of-00002.safetensors")
    st.save_file({"model.embed_tokens_per_layer.weight": w}, tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.norm.weight": "model-00001-of-00002.safetensors",
        "model.embed_tokens_per_layer.weight": "model-00002-of-00002.safetensors"}}))
    assert main(["info", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == str(tmp_path)
    assert out[1] == f"  shard          {tmp_path / 'model-00002-of-00002.safetensors'}"
    assert "[8, 10] (ggml order)" in out[3] and "10 rows x 8 elements = 32 B/row" in out[4]
