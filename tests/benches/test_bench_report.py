"""benches/report.py: what each bench's header and JSON say, against the facts fed in (a sysfs tree built here,
fio's own --version, the numbers given) and the page cache as mincore sees it."""
from __future__ import annotations

import json
import math
import mmap
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from gds_gather.io import measure
from gds_gather.benches import report
from gds_gather.config import Config


def test_short_num():
    assert [report.short_num(x) for x in (95_700, 6.8e6, 2.5e9, 1.234, -4_200, math.inf, math.nan)] == \
        ["95.7k", "6.8M", "2.5G", "1.23", "-4.2k", "", ""]


def test_ratio_line():
    assert report.ratio_line("a / b", 0, 5) == "  a / b: n/a"
    assert report.ratio_line("a / b", 5, None) == "  a / b: n/a"
    assert report.ratio_line("a / b", 9, 10, 0.9) == "  a / b = 0.90x  PASS (target >= 0.9)"
    assert report.ratio_line("a / b", 8, 10, 0.9, " (noisy)") == "  a / b = 0.80x  MISS (target >= 0.9) (noisy)"
    assert report.ratio_line("a / b", 30, 10) == "  a / b = 3.00x"


def _sysfs(root: Path, dev: int, target: str, *, partition=False, model=None, nested_model=None) -> Path:
    """/sys/dev/block/MAJ:MIN -> devices/<target> (a partition's parent is the disk), with the model files."""
    disk = root / "devices" / target
    node = disk / (disk.name + "p1") if partition else disk
    node.mkdir(parents=True)
    if partition:
        (node / "partition").write_text("1\n")
    if model:
        (disk / "device").mkdir()
        (disk / "device" / "model").write_text(model + "  \n")
    if nested_model:
        (disk / "device" / "device").mkdir(parents=True)
        (disk / "device" / "device" / "model").write_text(nested_model)
    link = root / "dev" / "block" / f"{os.major(dev)}:{os.minor(dev)}"
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(node)
    return root


@pytest.mark.parametrize("target, kw, want", [
    ("pci0000:00/nvme/nvme0n1", dict(partition=True, model="SAMSUNG MZQL23T8HCLS"),
     "nvme0n1 (nvme, SAMSUNG MZQL23T8HCLS)"),
    ("pci0000:00/virtio1/block/vda", {}, "vda (virtio)"),
    ("virtual/block/dm-0", {}, "dm-0 (device-mapper)"),
    ("virtual/block/md127", {}, "md127 (md raid)"),
    ("virtual/block/loop3", {}, "loop3 (loop)"),
    ("virtual/block/zram0", {}, "zram0 (zram)"),
    ("pci0000:00/ata1/sda", dict(partition=True, nested_model="WDC WD40"), "sda (scsi/sata, WDC WD40)"),
    ("platform/mmc/mmcblk0", {}, "mmcblk0"),
])
def test_block_device_from_sysfs(tmp_path, target, kw, want):
    f = tmp_path / "f"
    f.write_bytes(b"x")
    root = _sysfs(tmp_path / "sys", os.stat(f).st_dev, target, **kw)
    assert report.block_device(f, sysfs=root) == want


def test_block_device_here(tmp_path):
    assert report.block_device(tmp_path / "missing") == "?"
    dev = os.stat("/proc/self").st_dev
    assert report.block_device("/proc/self") == (f"no block device (device {os.major(dev)}:{os.minor(dev)}: tmpfs, "
                                                 "overlay or network)")
    src = shutil.which("findmnt") and subprocess.run(["findmnt", "-n", "-o", "SOURCE", "--target", str(tmp_path)],
                                                     capture_output=True, text=True).stdout.strip()
    if not src or not src.startswith("/dev/") or not Path(src).is_block_device():
        pytest.skip(f"{tmp_path} is not on a block device findmnt names ({src!r})")
    name = report.block_device(tmp_path).split(" ")[0]
    disk = Path(f"/sys/class/block/{Path(os.path.realpath(src)).name}")
    assert name in (disk.name, disk.resolve().parent.name)      # the disk, or the disk of the partition


def test_fio_version(monkeypatch):
    fio = shutil.which("fio")
    if fio:
        assert report.fio_version() == subprocess.run([fio, "--version"], capture_output=True,
                                                      text=True).stdout.strip()
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert report.fio_version() == "not installed"
    monkeypatch.setattr(shutil, "which", lambda name: "/nonexistent/fio")
    assert report.fio_version() == "?"


def test_go_cold(tmp_path, monkeypatch):
    f = tmp_path / "f.bin"
    f.write_bytes(np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes())
    monkeypatch.setattr(measure, "drop_caches", lambda: True)     # says it dropped; dropped nothing: mincore tells
    assert report.go_cold(f, drop=True).startswith("drop_caches (whole machine); NOT fully cold: 1.00 MiB still "
                                                   "cached")
    monkeypatch.setattr(measure, "drop_caches", lambda: False)
    assert report.go_cold(f, drop=True) == "drop_caches refused (not root): POSIX_FADV_DONTNEED on the file"
    assert measure.resident_bytes(f) == 0
    with open(f, "rb") as fh:                   # a live mapping's touched pages stay cached
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        page = mmap.PAGESIZE
        touched = bytes(mm[i] for i in range(0, 64 * page, page))
        how = report.go_cold(f)
        left = measure.resident_bytes(f)
        mm.close()
    assert len(touched) == 64 and left >= 64 * page
    assert how == (f"POSIX_FADV_DONTNEED on the file; NOT fully cold: {left / (1 << 20):.2f} MiB still cached "
                   "(pages of a live mapping stay, e.g. an open Table's metadata mapping of the file's head)")
    # over a span the mapping does not touch: cold
    assert report.go_cold(f, span=(512 << 10, 256 << 10)) == "POSIX_FADV_DONTNEED on the file"


@pytest.mark.parametrize("platform", ["discrete", "unified", "rocm", "cpu"])
def test_gpu_facts_on_a_forced_platform(platform):
    """No GPU here: what each forced platform's header says is what was found (no driver file, cupy's state,
    KvikIO's state on a discrete GPU), never a made-up GPU."""
    d = report.gpu_facts(Config(platform=platform))
    assert d["platform"] == platform and d["gpu"] == "none"
    if platform == "cpu":
        assert d["driver"] == "n/a" and d["gds"] == "n/a (no GPU)"
        return
    if not os.path.exists("/proc/driver/nvidia/version"):
        try:
            import cupy
            cupy.cuda.runtime.driverGetVersion()
        except Exception as e:
            assert d["driver"] == f"version unknown ({type(e).__name__})"
    if platform == "discrete":
        from gds_gather.backends import gds_state
        ok, real, why = gds_state()
        assert d["gds"] == ("real GPU-direct storage" if real else "compat mode" if ok else "unavailable") + f": {why}"
    else:
        assert d["gds"] == f"n/a on a {platform} platform"


def test_apply_cache_option():
    cfg, words = report.apply_cache_option(Config(cache_bytes=-1), "16M")
    assert cfg.cache_bytes == 16 << 20 and words == "row cache: budget 16,777,216 B (--cache)"
    cfg, words = report.apply_cache_option(Config(cache_bytes=-1), None)
    assert cfg.cache_bytes == -1 and words.startswith("row cache: budget auto (-1: the build's default")
    assert words.endswith(" (GDS_GATHER_CACHE_BYTES or the default)")


def test_write_result_json_and_a_missing_matplotlib(tmp_path, capsys):
    result = {"i": np.int64(7), "x": np.float32(0.5), "a": np.arange(3), "p": Path("/d/e"), "o": None,
              "s": complex(1, 2)}

    def plot(res, out):
        raise ImportError("No module named 'matplotlib'")
    a = SimpleNamespace(json_name=None, plot="", json=True)
    res = report.write_result("demo", result, a, tmp_path / "out", plot)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("plot: skipped, matplotlib is not installed (pip install 'gds-gather[plot]'): "
                      "No module named 'matplotlib'")
    assert out[1] == f"json: {tmp_path / 'out' / 'bench_demo.json'}" and "plot" not in res
    on_disk = json.loads((tmp_path / "out" / "bench_demo.json").read_text())
    assert on_disk == json.loads(out[2])
    assert on_disk == {"i": 7, "x": 0.5, "a": [0, 1, 2], "p": "/d/e", "o": None, "s": "(1+2j)",
                       "json_file": str(tmp_path / "out" / "bench_demo.json")}


def test_capped_runs_hold_again_and_restart_to_issue_37s_targets(capsys):
    """Under --memory-limit the again and restart passes are held to 1.5x the best of mmap and readahead; warm is
    held to the best of mmap and pread everywhere."""
    from gds_gather.benches.gather_report import print_ratios

    def run(x):
        return {"rows_per_s": x}
    med = {("direct", "again"): run(300.0), ("mmap", "again"): run(100.0), ("readahead", "again"): run(250.0),
           ("direct", "warm"): run(100.0), ("mmap", "warm"): run(60.0), ("pread", "warm"): run(110.0),
           ("direct", "restart"): run(400.0), ("mmap", "restart"): run(100.0), ("readahead", "restart"): run(200.0)}
    out = {"fio": {}}
    print_ratios(out, med, {"window": 4096}, SimpleNamespace(quick=False, targets=False, capped=512 << 20))
    r = out["ratios"]
    assert (r["again"]["vs"], r["again"]["target"]) == ("readahead", 1.5) and r["again"]["ratio"] == 1.2
    assert (r["restart"]["vs"], r["restart"]["target"]) == ("readahead", 1.5) and r["restart"]["ratio"] == 2.0
    assert (r["warm"]["vs"], r["warm"]["target"]) == ("pread", 1.0)
    text = capsys.readouterr().out
    assert "again: direct / best of mmap/readahead (readahead) = 1.20x  MISS (target >= 1.5)" in text
    print_ratios(out, med, {"window": 4096}, SimpleNamespace(quick=False, targets=False))     # no cap
    assert (out["ratios"]["again"]["vs"], out["ratios"]["again"]["target"]) == ("mmap", 0.8)
