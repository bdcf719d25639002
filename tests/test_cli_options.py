"""The command line's options: every flag says what it does; -v and --platform work before or after the
subcommand; a bench's counts refuse 0 and negatives on the command line (one line, exit 2) before anything is
built, instead of taking 0 for "the default"."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import pytest

from gds_gather import benches, cli

# options hidden from --help on purpose (internal switches of the benches' own scripts and tests)
HIDDEN = {("bench", "gather", "--targets"), ("bench", "gather", "--json-name"), ("bench", "prefill", "--json-name"),
          ("bench", "storage", "--json-name")}


def _walk(parser, path=()):
    """(subcommand path, action) for every argument of the parser and of its subcommands, recursively."""
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from _walk(sub, path + (name,))
        else:
            yield path, a


def test_every_flag_of_every_subcommand_has_help():
    seen, missing, hidden = set(), [], set()
    for path, a in _walk(cli.build_parser()):
        name = (a.option_strings or [a.dest])[-1]
        seen.add(path)
        if a.help == argparse.SUPPRESS:
            hidden.add(path + (name,))
        elif not (a.help or "").strip():
            missing.append(" ".join(("gds-gather",) + path + (name,)))
    assert missing == []
    assert hidden == HIDDEN
    assert {("info",), ("make-model",), ("prefill",), ("convert",), ("bench", "gather"), ("bench", "storage"),
            ("bench", "prefill")} <= seen        # the walk reached the nested bench subcommands


def test_info_help_describes_its_flags():
    out = subprocess.run([sys.executable, "-P", "-m", "gds_gather.cli", "info", "--help"], capture_output=True,
                         text=True, timeout=60).stdout
    lines = {x.split()[0]: x for x in out.splitlines() if x.strip().startswith(("--tensor", "--json"))}
    assert set(lines) == {"--tensor", "--json"}
    assert all(len(x.split()) > 2 for x in lines.values()), lines     # a description after the flag


@pytest.mark.parametrize("argv, platform, verbose", [
    (["info", "m.gguf"], None, False),
    (["--platform", "unified", "info", "m.gguf"], "unified", False),
    (["info", "m.gguf", "--platform", "unified"], "unified", False),
    (["--platform", "rocm", "info", "m.gguf", "--platform", "unified"], "unified", False),   # after wins
    (["-v", "prefill"], None, True),
    (["prefill", "-v", "--platform", "cpu"], "cpu", True),
    (["bench", "gather", "--platform", "cpu", "-v"], "cpu", True),
    (["bench", "--platform", "cpu", "storage"], "cpu", False),
    (["--platform", "cpu", "make-model", "qwen4exp", "-o", "x.gguf"], "cpu", False),
    (["convert", "d", "-o", "x.gguf", "--platform", "discrete"], "discrete", False),
])
def test_global_options_before_or_after_the_subcommand(argv, platform, verbose):
    args = cli.build_parser().parse_args(argv)
    assert (args.platform, args.verbose) == (platform, verbose)


def test_platform_after_the_subcommand_reaches_the_command(small_table):
    """`info` reports the platform it ran with: the same, forced one for --platform before and after `info`."""
    def platform(*argv):
        r = subprocess.run([sys.executable, "-P", "-m", "gds_gather.cli", *argv], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["platform"]
    before = platform("--platform", "unified", "info", str(small_table), "--json")
    after = platform("info", str(small_table), "--json", "--platform", "unified")
    assert before == after and before["kind"] == "unified" and "forced by configuration" in before["reason"]


# (bench, flag): every integer option of the benches; each counts something, so 0 is no count
COUNTS = [("gather", f) for f in ("--repeat", "--rows", "--gemma-rows", "--tokens", "--ubatch", "--ids", "--batch",
                                  "--samples", "--qd", "--fio-runtime")] + \
         [("prefill", f) for f in ("--repeat", "--tokens", "--ubatch")] + \
         [("storage", f) for f in ("--repeat", "--threads", "--qd")]


@pytest.mark.parametrize("value", ["0", "-1"])
@pytest.mark.parametrize("bench, flag", COUNTS)
def test_a_bench_count_of_0_or_less_is_refused_in_one_line(bench, flag, value, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", bench, flag, value, "--out", str(tmp_path)])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and f"argument {flag}: must be in 1.." in err, err
    assert list(tmp_path.iterdir()) == []                       # nothing built, nothing written


def test_every_integer_bench_option_is_a_bounded_count():
    """No bench option is a bare int (where 0 would reach the bench and could be taken for the default)."""
    for name in benches.BENCHES:
        ints = sorted(a.option_strings[-1] for a in benches.build_parser(name)._actions
                      if getattr(a.type, "__name__", "") == "integer" or a.type is int)
        assert ints == sorted(f for b, f in COUNTS if b == name)
        assert not [a for a in benches.build_parser(name)._actions if a.type is int]


def test_repeat_0_without_quick_exits_before_building_the_tables(tmp_path):
    """The issue's case: `bench gather --repeat 0` without --quick would first build 4 GB of tables."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-P", "-m", "gds_gather.cli", "bench", "gather", "--repeat", "0", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == ["gds-gather bench gather: error: argument --repeat: must be in 1..2,147,483,647, "
                                     "got 0 (see gds-gather bench gather --help)"]
    assert list(tmp_path.iterdir()) == [] and time.perf_counter() - t0 < 30


@pytest.mark.parametrize("bench, field", [("gather", "repeat"), ("gather", "fio_runtime"), ("prefill", "repeat"),
                                          ("storage", "repeat")])
def test_a_count_of_0_given_in_code_is_refused_not_defaulted(bench, field, tmp_path, monkeypatch):
    """benches.run(name, args) with a 0 that bypassed argparse: a ValueError before anything is built."""
    monkeypatch.setenv("GDS_GATHER_CACHE_DIR", str(tmp_path / "cache"))
    args = benches.build_parser(bench).parse_args(["--out", str(tmp_path / "out")])
    setattr(args, field, 0)
    with pytest.raises(ValueError, match="must be >= 1"):
        benches.run(bench, args)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_a_missing_model_is_one_line(tmp_path, capsys):
    missing = tmp_path / "missing.gguf"
    assert cli.main(["info", str(missing)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [f"gds-gather: error: {missing}: no such file"]
