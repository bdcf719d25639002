"""bench gather --memory-limit (gds_gather/benches/memcap.py): the cgroup files against fake cgroup trees, and, where
this machine lets a process make a memory cgroup, real capped runs: one that completes with every pass's peak, one
whose bench process the OOM killer ends (the finished passes are still written, the exit status says so)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gds_gather.benches import memcap
from gds_gather.benches.gather_passes import child_pass
from gds_gather.config import Config


def fake_v1(root, limit="9223372036854771712"):
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text("4:memory:/job\n0::/\n")
    d = root / "sys/fs/cgroup/memory/job"
    d.mkdir(parents=True)
    (d / "memory.limit_in_bytes").write_text(limit)
    return d


def test_no_cgroup_is_refused_in_one_line(tmp_path):
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text("0::/\n")        # v2 listed, but no cgroup2 mount under root
    with pytest.raises(memcap.CapError, match="no memory cgroup to make a child of") as e:
        memcap.MemoryCap.make(64 << 20, root=tmp_path)
    assert "\n" not in str(e.value)


def test_v1_cap_files(tmp_path, monkeypatch):
    """mkdir under the own cgroup, the limit written, peak / reset / page cache / OOM kills read from its files."""
    parent = fake_v1(tmp_path)
    monkeypatch.setattr(memcap.os, "getpid", lambda: 4242)
    cap = memcap.MemoryCap.make(96 << 20, root=tmp_path)
    assert cap.kind == "v1" and cap.dir.parent == parent and cap.dir.name.startswith("gds-gather-bench-4242-")
    assert (cap.dir / "memory.limit_in_bytes").read_text() == str(96 << 20)
    assert (cap.dir / "memory.memsw.limit_in_bytes").read_text() == str(96 << 20)
    (cap.dir / "memory.max_usage_in_bytes").write_text("52428800\n")
    (cap.dir / "memory.stat").write_text("rss 1\ncache 10485760\nmapped_file 3\n")
    (cap.dir / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    assert cap.peak() == 50 << 20 and cap.cache() == 10 << 20 and cap.oom_kills() == 2
    monkeypatch.setenv(memcap.ENV, f"v1:{cap.dir}")
    pm = memcap.PassMemory()                        # reset before the pass: v1 writes 0
    assert pm.reset and (cap.dir / "memory.max_usage_in_bytes").read_text() == "0"
    (cap.dir / "memory.max_usage_in_bytes").write_text("1048576")
    assert pm.fields() == {"peak_MiB": 1.0, "peak_since": "pass", "cache_charged_MiB": 10.0}
    for f in list(cap.dir.iterdir()):
        f.unlink()
    cap.close()
    assert not cap.dir.exists()


def test_pass_log_survives_a_half_written_line(tmp_path, monkeypatch):
    log = tmp_path / "p.jsonl"
    monkeypatch.setenv(memcap.PASSLOG, str(log))
    memcap.log_pass("direct", "cold", None)
    memcap.log_pass("direct", "cold", {"rows_per_s": 5.0})
    with open(log, "a") as f:
        f.write('{"backend": "pread", "pa')                 # the killed process's last write
    got = memcap.read_log(log)
    assert [(r["backend"], r["state"]) for r in got] == [("direct", "started"), ("direct", "done")]
    assert got[1]["run"] == {"rows_per_s": 5.0}


def test_a_new_process_pass_that_dies_is_a_record(tmp_path, capsys):
    trace = tmp_path / "t.npz"
    r = child_pass(tmp_path / "missing.gguf", "direct", trace, Config(), tmp_path)
    assert r["backend"] == "direct" and r["died"].startswith("exit 1")
    assert "a new-process pass died" in capsys.readouterr().out


def _can_cap():
    try:
        cap = memcap.MemoryCap.make(64 << 20)
    except memcap.CapError as e:
        return str(e)
    cap.close()
    return None


@pytest.mark.slow
@pytest.mark.skipif(_can_cap() is not None, reason=f"no memory cgroup can be made here: {_can_cap()}")
def test_real_caps(tmp_path):
    base = [sys.executable, "-m", "gds_gather.cli", "bench", "gather", "--quick", "--tables", "qwen4exp",
            "--backends", "direct,pread,resident", "--no-fio", "--out", str(tmp_path), "--dir", str(tmp_path)]
    ok = subprocess.run(base + ["--memory-limit", "256M"], capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "memory cap: every pass completed" in ok.stdout and "memory: peak" in ok.stdout
    res = json.loads((tmp_path / "bench_gather.json").read_text())
    assert res["memory_limit"] == 256 << 20 and res["oom_kills"] == 0
    runs = [r for t in res["tables"] for r in t["runs"]]
    assert runs and all(0 < r["peak_MiB"] <= 256 for r in runs)
    dead = subprocess.run(base + ["--memory-limit", "40M"], capture_output=True, text=True, timeout=600)
    assert dead.returncode == 1 and "memory cap: the bench process died (killed by signal 9" in dead.stdout
    res = json.loads((tmp_path / "bench_gather.json").read_text())
    assert res["died"]["why"].startswith("killed by signal 9") and res["oom_kills"] >= 1


@pytest.mark.skipif(_can_cap() is not None, reason=f"no memory cgroup can be made here: {_can_cap()}")
def test_a_stopped_bench_leaves_no_cgroup_behind():
    """kill() ends every process in the cap, so close() removes it; terminate_exits turns a SIGTERM into SystemExit
    (the parent's cleanup runs) and restores the old handler."""
    import os
    import signal
    cap = memcap.MemoryCap.make(64 << 20)
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        cap.enter(p.pid)
        cap.kill()
        assert p.wait(timeout=10) == -signal.SIGKILL
    finally:
        p.kill()
        cap.close()
    assert not cap.dir.exists()
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e, memcap.terminate_exits():
        os.kill(os.getpid(), signal.SIGTERM)       # (the handler runs as soon as the call returns)
    assert e.value.code == 143 and signal.getsignal(signal.SIGTERM) is before
