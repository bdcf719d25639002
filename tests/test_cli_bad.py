"""Every bad command line gives ONE clear line on stderr naming the flag or the user's path, a non-zero exit, no
traceback, nothing left behind and nothing replaced, quickly and in bounded memory (issue 11).

Each case runs main() in-process (wall time and Python/numpy peak memory measured with tracemalloc); a subset also
runs `python -m gds_gather.cli` in a subprocess, the way a user meets it. Everything happens in tmp_path: the
special files (a FIFO, a symlink to a file) are made there, never at real device paths.
"""
from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from gds_gather import cli
from gds_gather.platform import Platform
from gds_gather.errors import OutputPathError
from gds_gather.io.safe_write import _umask, atomic_output, check_free_space, free_bytes

WALL_S = 5.0            # per in-process case (each takes well under a second alone; the machine is shared)
PEAK_BYTES = 64 << 20   # Python + numpy allocations per case (the old --tokens 10**9 took 7.9 GB)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from gds_gather.model.synth import write_model
    return write_model(tmp_path_factory.mktemp("model") / "m.gguf", "qwen4exp", rows=3000, progress=False)


def _setup(d: Path) -> None:
    """The files a user might point at by mistake: a directory, a FIFO, a symlink to a file, a blank prompt."""
    (d / "dir").mkdir()
    os.mkfifo(d / "fifo")
    (d / "target.gguf").write_bytes(b"precious")
    os.symlink(d / "target.gguf", d / "link.gguf")
    (d / "blank.txt").write_text("  \n\t\n")


def _snapshot(d: Path) -> dict:
    """name -> (file type, link target or content hash): what must be the same after a refused command."""
    out = {}
    for p in sorted(d.rglob("*")):
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            extra = os.readlink(p)
        elif stat.S_ISREG(st.st_mode):
            extra = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            extra = None
        out[str(p.relative_to(d))] = (stat.S_IFMT(st.st_mode), extra)
    return out


M = "{model}"
# (id, argv, environment, what the one line must contain)
CASES = [
    ("tokens-huge", ["prefill", M, "--tokens", "99999999999999"], {}, "--tokens"),
    ("tokens-1e9", ["prefill", M, "--tokens", str(10**9)], {}, "--tokens"),
    ("tokens-0", ["prefill", M, "--tokens", "0"], {}, "--tokens"),
    ("tokens-text", ["prefill", M, "--tokens", "many"], {}, "--tokens"),
    ("prompt-dir", ["prefill", M, "--prompt", "dir"], {}, "dir is a directory"),
    ("prompt-missing", ["prefill", M, "--prompt", "nope.txt"], {}, "nope.txt: no such file"),
    ("prompt-fifo", ["prefill", M, "--prompt", "fifo"], {}, "fifo is a FIFO"),
    ("prompt-blank", ["prefill", M, "--prompt", "blank.txt", "--trunk", "none"], {}, "blank.txt holds no words"),
    ("model-fifo", ["prefill", "fifo"], {}, "fifo is a FIFO"),
    ("info-fifo", ["info", "fifo"], {}, "fifo is a FIFO"),
    ("model-missing", ["prefill", "nope.gguf", "--tokens", "10"], {}, "nope.gguf"),
    ("out-dir", ["make-model", "qwen4exp", "--rows", "100", "-o", "dir"], {}, "dir is a directory"),
    ("out-missing-dir", ["make-model", "qwen4exp", "--rows", "100", "-o", "nodir/x.gguf"], {},
     "nodir/x.gguf: the directory nodir does not exist"),
    ("out-symlink", ["make-model", "qwen4exp", "--rows", "100", "-o", "link.gguf"], {}, "link.gguf is a symbolic link"),
    ("out-fifo", ["make-model", "qwen4exp", "--rows", "100", "-o", "fifo"], {}, "fifo is a FIFO"),
    # 2**31 rows of 7,350 B: 15.8 TB, checked against the free space before a byte is written
    ("rows-vs-disk", ["make-model", "gemma4-e2b", "--rows", str(2**31), "-o", "big.gguf"], {}, "big.gguf: needs"),
    ("rows-unaddressable", ["make-model", "qwen4exp", "--rows", str(2**31 + 1), "-o", "x.gguf"], {}, "--rows"),
    ("rows-0", ["make-model", "qwen4exp", "--rows", "0", "-o", "x.gguf"], {}, "--rows"),
    ("seed-negative", ["make-model", "qwen4exp", "--rows", "100", "--seed", "-1", "-o", "x.gguf"], {}, "--seed"),
    ("cache-inf", ["prefill", M, "--cache", "inf"], {}, "--cache"),
    ("ubatch-0", ["prefill", M, "--ubatch", "0"], {}, "--ubatch"),
    ("ubatch-negative", ["prefill", M, "--ubatch", "-4"], {}, "--ubatch"),
    ("queue-depth-0", ["prefill", M], {"GDS_GATHER_QUEUE_DEPTH": "0"}, "GDS_GATHER_QUEUE_DEPTH"),
    ("queue-depth-huge", ["prefill", M], {"GDS_GATHER_QUEUE_DEPTH": "100000"}, "GDS_GATHER_QUEUE_DEPTH"),
    ("threads-huge", ["prefill", M], {"GDS_GATHER_THREADS": "5000"}, "GDS_GATHER_THREADS"),
    ("threads-negative", ["info", M], {"GDS_GATHER_THREADS": "-1"}, "GDS_GATHER_THREADS"),
    ("align-odd", ["info", M], {"GDS_GATHER_ALIGN": "3000"}, "GDS_GATHER_ALIGN"),
    ("platform-env", ["info", M], {"GDS_GATHER_PLATFORM": "quantum"}, "GDS_GATHER_PLATFORM"),
    ("platform-discrete", ["--platform", "discrete", "prefill", M, "--tokens", "10"], {}, "--platform"),
    ("platform-unified", ["--platform", "unified", "prefill", M, "--tokens", "10"], {}, "--platform"),
    ("platform-rocm", ["--platform", "rocm", "prefill", M, "--tokens", "10"], {}, "--platform"),
    ("platform-no-torch", ["--platform", "discrete", "prefill", M, "--tokens", "10"], {"_gpu": "1"}, "needs torch"),
]
# run through the real entry point too (no monkeypatching possible there: no platform cases)
SUBPROCESS = {"tokens-huge", "prompt-dir", "prompt-missing", "out-dir", "out-missing-dir", "out-symlink",
              "out-fifo", "rows-vs-disk", "seed-negative", "queue-depth-0"}


def _argv(argv, model):
    return [str(model) if a == M else a for a in argv]


@pytest.mark.parametrize("name, argv, env, want", CASES, ids=[c[0] for c in CASES])
def test_bad_command_line(name, argv, env, want, model, tmp_path, monkeypatch, capsys):
    _setup(tmp_path)
    before = _snapshot(tmp_path)
    monkeypatch.chdir(tmp_path)
    for k in ("GDS_GATHER_QUEUE_DEPTH", "GDS_GATHER_THREADS", "GDS_GATHER_ALIGN", "GDS_GATHER_PLATFORM"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("GDS_GATHER_CACHE_DIR", str(tmp_path / "cache"))
    gpu = env.pop("_gpu", None) if env else None
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if gpu:     # a machine with a GPU but without torch
        import importlib.util
        real = importlib.util.find_spec
        monkeypatch.setattr(cli, "detect", lambda override="auto": Platform("discrete", "test: a GPU", "GPU"))
        monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "torch" else real(n, *a))
    else:       # never a GPU, whatever the machine has: the refusal is what is tested
        monkeypatch.setattr(cli, "detect", lambda override="auto": Platform("cpu", "test: no GPU"))
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        code = cli.main(_argv(argv, model))
    except SystemExit as e:      # argparse
        code = e.code
    took = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert code not in (0, None), (name, code, out, err)
    assert len(lines) == 1, err
    assert "Traceback" not in err and "Errno" not in err and ".tmp" not in err
    assert want in lines[0], lines[0]
    assert lines[0].startswith("gds-gather")
    assert _snapshot(tmp_path) == before, f"{name} changed {tmp_path}"
    assert took < WALL_S, f"{name}: {took:.2f} s"
    assert peak < PEAK_BYTES, f"{name}: {peak / 2**20:.0f} MiB"


@pytest.mark.parametrize("name, argv, env, want", [c for c in CASES if c[0] in SUBPROCESS],
                         ids=[c[0] for c in CASES if c[0] in SUBPROCESS])
def test_bad_command_line_subprocess(name, argv, env, want, model, tmp_path):
    _setup(tmp_path)
    before = _snapshot(tmp_path)
    e = {k: v for k, v in os.environ.items() if not k.startswith("GDS_GATHER_")}
    e.update(env, GDS_GATHER_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-P", "-m", "gds_gather.cli", *_argv(argv, model)], cwd=tmp_path, env=e,
                       capture_output=True, text=True, timeout=60)
    lines = r.stderr.splitlines()
    assert r.returncode != 0 and len(lines) == 1 and want in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert _snapshot(tmp_path) == before


def test_sigterm_mid_write_leaves_nothing(tmp_path):
    """kill / timeout during make-model: the temporary file beside the target is removed."""
    if free_bytes(tmp_path / "m.gguf") < 4e9:
        pytest.skip("needs 4 GB free for a table that is still being written when killed")
    (tmp_path / "m.gguf").write_bytes(b"old")
    p = subprocess.Popen([sys.executable, "-P", "-m", "gds_gather.cli", "make-model", "qwen4exp", "--rows", "20000000",
                          "-o", "m.gguf", "-q"], cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(n.endswith(".tmp") for n in os.listdir(tmp_path)):
        time.sleep(0.05)
    assert any(n.endswith(".tmp") for n in os.listdir(tmp_path)), "no temporary file appeared"
    p.terminate()
    _, err = p.communicate(timeout=60)
    assert p.returncode != 0 and err.strip() == "gds-gather: interrupted"
    assert os.listdir(tmp_path) == ["m.gguf"] and (tmp_path / "m.gguf").read_bytes() == b"old"


# ---- atomic_output itself ----------------------------------------------------------------------------------------
def test_atomic_output_replaces_a_regular_file(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    os.chmod(target, 0o600)
    with atomic_output(target) as tmp:
        assert tmp.parent == tmp_path and tmp.exists() and tmp != target
        tmp.write_bytes(b"new")
        assert target.read_bytes() == b"old"          # nothing visible until the end
    assert target.read_bytes() == b"new" and os.listdir(tmp_path) == ["out.bin"]
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~_umask()      # as open() makes it, not mkstemp's 0600


def test_atomic_output_removes_the_temporary_file_on_error(tmp_path):
    target = tmp_path / "out.bin"
    for exc in (RuntimeError, KeyboardInterrupt):
        with pytest.raises(exc):
            with atomic_output(target) as tmp:
                tmp.write_bytes(b"half")
                raise exc()
    assert os.listdir(tmp_path) == []


def test_atomic_output_unique_temporaries(tmp_path):
    target = tmp_path / "out.bin"
    with atomic_output(target) as a, atomic_output(target) as b:
        assert a != b
        a.write_bytes(b"a")
        b.write_bytes(b"b")
    assert target.read_bytes() == b"a" and os.listdir(tmp_path) == ["out.bin"]   # the outer one renames last


@pytest.mark.parametrize("kind", ["symlink", "dangling-symlink", "fifo", "dir", "appears-while-writing"])
def test_atomic_output_refuses_non_regular_targets(tmp_path, kind):
    target = tmp_path / "t"
    keep = tmp_path / "keep"
    keep.write_bytes(b"keep")
    if kind == "symlink":
        os.symlink(keep, target)
    elif kind == "dangling-symlink":
        os.symlink(tmp_path / "nowhere", target)
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind == "dir":
        target.mkdir()
    before = _snapshot(tmp_path)
    with pytest.raises(OutputPathError, match=str(target)):
        with atomic_output(target) as tmp:
            tmp.write_bytes(b"x")
            if kind == "appears-while-writing":
                os.mkfifo(target)
                before = _snapshot(tmp_path)
                before.pop(tmp.name)
    assert _snapshot(tmp_path) == before and keep.read_bytes() == b"keep"


def test_check_free_space(tmp_path):
    check_free_space(tmp_path / "x", 1)
    with pytest.raises(OutputPathError, match="needs"):
        check_free_space(tmp_path / "x", 1 << 62)
