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
                                         ("-5", "the cache size must be >= 0, got '-5'")])
def test_bad_cache_sizes(text, words, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["prefill", "--cache", text])
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_os_error_is_one_line_and_exit_1(capsys):
    """/proc/self/mem opens but cannot be mapped (EINVAL): an OSError that is not a missing file."""
    assert main(["info", "/proc/self/mem"]) == 1
    err = capsys.readouterr().err
    assert err == "gds-gather: error: OSError: [Errno 22] Invalid argument\n"
    with pytest.raises(OSError):
        main(["-v", "info", "/proc/self/mem"])


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
