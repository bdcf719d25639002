"""measure.py: the benches' counters and facts against what the kernel files say (read here, independently), and
each counter's "not available" answer (a file that is missing or malformed: None, never a made-up figure)."""
from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest

from gds_gather.io import measure


def test_drop_caches_writes_3_or_says_refused(tmp_path):
    ctl = tmp_path / "drop_caches"          # a stand-in for /proc/sys/vm/drop_caches (the real one is never written)
    assert measure.drop_caches(ctl) is True and ctl.read_text() == "3\n"
    assert measure.drop_caches(tmp_path / "no" / "such" / "file") is False


def test_resident_bytes_of_an_empty_file(tmp_path):
    (tmp_path / "e").write_bytes(b"")
    assert measure.resident_bytes(tmp_path / "e") == 0


def test_proc_read_bytes(tmp_path):
    here = measure.proc_read_bytes()
    if os.path.exists("/proc/self/io"):
        with open("/proc/self/io") as f:
            want = int(next(line for line in f if line.startswith("read_bytes:")).split()[1])
        assert here is not None and want - (1 << 20) <= here <= want      # read just before: at most a little less
    (tmp_path / "io").write_text("rchar: 5\nread_bytes: 123456\nwrite_bytes: 0\n")
    assert measure.proc_read_bytes(tmp_path / "io") == 123456
    (tmp_path / "bad").write_text("read_bytes: lots\n")
    assert measure.proc_read_bytes(tmp_path / "bad") is None
    assert measure.proc_read_bytes(tmp_path / "none") is None
    (tmp_path / "other").write_text("rchar: 5\n")
    assert measure.proc_read_bytes(tmp_path / "other") is None


def test_block_counters(tmp_path):
    assert measure.block_stat_path(tmp_path / "missing") is None
    assert measure.block_stat_path("/proc/self") is None                # procfs: no block device
    stat = tmp_path / "stat"
    stat.write_text("   100 0 2048 7 0 0 0 0 0 0 0\n")
    assert measure.device_read_bytes(stat) == 2048 * 512
    for bad in ("", "1 2 x"):
        stat.write_text(bad)
        assert measure.device_read_bytes(stat) is None
    assert measure.device_read_bytes(tmp_path / "gone") is None and measure.device_read_bytes(None) is None
    real = measure.block_stat_path(tmp_path)
    if real is None:
        pytest.skip(f"{tmp_path} is not on a block device")
    c = measure.ReadCounter(tmp_path)
    assert c.device_method.startswith(f"{real} (") and c.device_method.endswith("the whole device, every process")
    got = measure.device_read_bytes(real)
    want = int(real.read_text().split()[2]) * 512       # read after: the device may have delivered more since
    assert 0 <= want - got < (256 << 20)


def test_percentile_ms():
    assert measure.percentile_ms([], 99) == 0.0
    assert measure.percentile_ms([0.001, 0.002, 0.003], 50) == pytest.approx(2.0)


def test_machine_facts(tmp_path):
    (tmp_path / "f").write_bytes(b"x" * 8192)
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nmodel name\t: Test CPU @ 3.0GHz\nflags\t: fpu\n")
    f = measure.machine_facts(tmp_path / "f", cpuinfo=tmp_path / "cpuinfo")
    assert f["cpu"] == "Test CPU @ 3.0GHz" and f["cores"] == os.cpu_count() and f["file"] == str(tmp_path / "f")
    assert (f["file_GiB"] == 0.0 and f["logical_block"] >= 512
            and f["platform"] in ("discrete", "unified", "rocm", "cpu"))
    assert measure.machine_facts(cpuinfo=tmp_path / "none")["cpu"] == "?" and "file" not in measure.machine_facts()


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (apt-get install fio)")
def test_fio_randread(tmp_path):
    f = tmp_path / "d.bin"
    f.write_bytes(np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes())
    r = measure.fio_randread(f, bs="4k", iodepth=4, runtime=1, size="4M")
    version = subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()
    assert r["iops"] > 0 and r["bw_MiBps"] == pytest.approx(r["iops"] * 4 / 1024, rel=0.05)
    assert r["version"] == version
    assert f"--filename={f}" in r["cmd"] and "--size=4M" in r["cmd"] and "--readonly" in r["cmd"]
    bad = measure.fio_randread(tmp_path / "missing.bin", runtime=1)
    assert set(bad) == {"error", "cmd"} and bad["error"] and "missing.bin" in bad["cmd"]


def test_fio_randread_without_fio(monkeypatch, tmp_path):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert measure.fio_randread(tmp_path / "x") is None
