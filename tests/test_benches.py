"""Smoke tests: each bench runs at a tiny size on the CPU with real figures, its JSON and a PNG plot, so none rots.

The GPU paths (cpu-gpu, gpu-direct, the device destinations, the GPU prefill) run in bench/gpu_check.sh.
"""
from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess

import numpy as np
import pytest

from gds_gather import benches
from gds_gather.cli import main as cli_main

REPO = pathlib.Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


def plot_args(tmp_path, name):
    return ["--plot", str(tmp_path / f"{name}.png")] if HAVE_MPL else []


def check_plot(tmp_path, name, res):
    if not HAVE_MPL:
        pytest.skip("matplotlib is not installed (pip install -e '.[test]')")
    png = tmp_path / f"{name}.png"
    assert res["plot"] == str(png) and png.read_bytes()[:8] == PNG and png.stat().st_size > 10_000


def last_json(capsys) -> tuple[dict, str]:
    out = capsys.readouterr().out
    return json.loads(out.strip().splitlines()[-1]), out


def test_sizes_and_gdsio_line():
    assert [benches.parse_size(x) for x in ("4K", "64k", "1M", "16MiB", "8G", "512", "1.5K")] == \
        [4096, 65536, 1 << 20, 16 << 20, 8 << 30, 512, 1536]
    assert [benches.human_size(x) for x in (4096, 1 << 20, 8 << 30, 7680)] == ["4K", "1M", "8G", "7680B"]
    with pytest.raises(ValueError, match="not a size"):
        benches.parse_size("lots")
    c = {"pattern": "rand", "path": "cpu", "threads": 1, "io_size": 4096, "file_bytes": 8 << 30,
         "median": {"qd": 128, "bytes": 97000 * 4096 * 5, "gib_s": 0.37, "iops": 97000.4, "mean_lat_us": 1300.2,
                    "p99_lat_us": 2400.7, "ops": 485000, "seconds": 5.0}}
    assert benches.gdsio_line(c) == (
        "IoType: RANDREAD XferType: CPUONLY Threads: 1 IoDepth: 128 DataSetSize: 1940000/8388608(KiB) IOSize: 4(KiB) "
        "Throughput: 0.37 GiB/sec, IOPS: 97000, Avg_Latency: 1300 usecs, p99_Latency: 2401 usecs ops: 485000 "
        "total_time 5.0 secs")


def test_ring_latency_output(tmp_path):
    """Ring.read(lat_ns=...) fills one positive latency per extent and reads the same bytes as without it."""
    from gds_gather import uring
    from gds_gather.readers import Staging
    data = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    f = tmp_path / "d.bin"
    data.tofile(f)
    offs = np.arange(0, 1 << 20, 8192, dtype=np.int64)[::-1].copy()
    st = Staging()
    buf = st.ensure(offs.size * 4096)
    lat = np.zeros(offs.size, np.int64)
    import os
    fd = os.open(f, os.O_RDONLY)
    try:
        with uring.Ring(16) as ring:
            ring.read(fd, offs, np.full(offs.size, 4096), buf.ctypes.data + np.arange(offs.size) * 4096,
                      queue_depth=8, lat_ns=lat)
            assert (lat > 0).all()
            assert np.array_equal(buf[:offs.size * 4096].reshape(-1, 4096), data.reshape(-1, 4096)[offs // 4096])
            with pytest.raises(ValueError, match="lat_ns"):
                ring.read(fd, offs, np.full(offs.size, 4096), buf.ctypes.data + np.arange(offs.size) * 4096,
                          lat_ns=np.zeros(3, np.int64))
    finally:
        os.close(fd)
        st.close()


def test_storage_bench_tiny(tmp_path, capsys):
    res = benches.storage_main(["--size", "8M", "--dir", str(tmp_path), "--io-size", "4K,64K", "--seconds", "0.2",
                                "--repeat", "2", "--warmup", "0.05", "--threads", "2", "--qd", "16", "--json",
                                *plot_args(tmp_path, "storage")])
    line, out = last_json(capsys)
    assert line["bench"] == "storage" and len(line["results"]) == 2
    assert "IoType: RANDREAD XferType: CPUONLY Threads: 2 IoDepth: 16 " in out and "IOSize: 64(KiB)" in out
    for r in res["results"]:
        m = r["median"]
        assert r["path"] == "cpu" and len(r["runs"]) == 2 and m["ops"] > 0 and m["gib_s"] > 0 and m["iops"] > 0
        assert m["bytes"] == m["ops"] * r["io_size"] and 0 < m["mean_lat_us"] and 0 < m["p99_lat_us"]
        assert abs(m["gib_s"] * 2**30 - m["iops"] * r["io_size"]) < 1e-6 * m["gib_s"] * 2**30
    assert {"facts", "file", "file_bytes", "skipped", "json_file"} <= set(line)
    assert json.loads(pathlib.Path(res["json_file"]).read_text())["results"][0]["median"]["ops"] > 0
    if res["facts"]["platform"] == "cpu":          # the GPU transfer types say why they did not run
        assert {s["path"] for s in res["skipped"]} == {"gpu-direct", "cpu-gpu"} and "skipped: no usable GPU" in out
    check_plot(tmp_path, "storage", res)


def test_storage_bench_seq_cold_fixed_bytes(tmp_path, capsys):
    """Sequential reads of a fixed byte count, cold, through the command line."""
    assert cli_main(["bench", "storage", "--size", "4M", "--dir", str(tmp_path), "--io-size", "64K,8M",
                     "--bytes", "2M", "--repeat", "1", "--warmup", "0", "--pattern", "seq", "--cold",
                     "--cold-method", "evict", "--path", "cpu", "--json"]) == 0
    line, out = last_json(capsys)
    (r,) = line["results"]                                 # 8M > the 4M file: skipped, saying so
    assert "IoType: READ XferType: CPUONLY" in out and "larger than the file" in out
    assert r["median"]["ops"] == 32 and r["median"]["bytes"] == 2 << 20


def test_gather_bench_tiny(tmp_path, capsys):
    res = benches.gather_main(["--quick", "--rows", "20000", "--gemma-rows", "512", "--tokens", "512", "--ubatch",
                               "256", "--repeat", "1", "--fio-runtime", "1", "--cold-method", "evict", "--dir",
                               str(tmp_path), "--json", *plot_args(tmp_path, "gather")])
    line, out = last_json(capsys)
    assert line["bench"] == "gather" and [t["label"] for t in line["tables"]] == ["qwen4exp geometry",
                                                                                 "gemma4-e4b geometry"]
    for t, per_tok in zip(res["tables"], (16, 1)):
        assert t["ids"] == 512 * per_tok
        got = {(r["backend"], r["cache"]): r for r in t["runs"]}
        want = {(b, "cold") for b in ("direct", "pread", "mmap", "readahead")} | \
            {(b, "warm") for b in ("direct", "pread", "mmap", "readahead", "resident")}
        assert set(got) >= want
        for r in t["runs"]:
            assert r["rows_per_s"] > 0 and r["ids"] == t["ids"] and 0 < r["unique"] <= r["ids"]
            assert r["ns_per_gather"] * r["rows_per_s"] == pytest.approx(1e9)
            assert r["p99_ms"] >= r["p50_ms"] > 0 and r["how"]
        assert got[("direct", "cold")]["amplification"] >= 1.0 and got[("direct", "cold")]["page_cache_growth_MiB"] == 0
        assert got[("pread", "cold")]["amplification"] == pytest.approx(1.0)
    assert "ns/gather" in out and "ratios (cold):" in out and "direct / mmap" in out
    if res["facts"]["fio"] != "not installed":
        assert res["tables"][0]["fio"]["cold_4096"]["iops"] > 0 and "fio randread 4K O_DIRECT" in out
    check_plot(tmp_path, "gather", res)


def test_bench_io_wrapper_random_ids_tmpfs(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_io_smoke", REPO / "bench" / "bench_io.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.main(["--quick", "--rows", "20000", "--ids", "2000", "--batch", "500", "--repeat", "1", "--no-fio",
                    "--backends", "direct,mmap,resident", "--cold-method", "evict", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    (t,) = res["tables"]
    assert t["ids"] == 2000 and "2,000 uniform random row ids" in t["trace"]
    assert {(r["backend"], r["cache"]) for r in t["runs"]} == {("direct", "cold"), ("mmap", "cold"),
                                                               ("direct", "warm"), ("mmap", "warm"),
                                                               ("resident", "warm")}
    assert "direct / mmap" in out and "(target >= 3.0)" in out
    assert (tmp_path / "bench_io.json").exists()


def test_prefill_bench_interleaved(tmp_path, capsys, monkeypatch):
    from gds_gather import prefill
    from gds_gather.model import write_model
    model = write_model(tmp_path / "q.gguf", "qwen4exp", rows=20000, progress=False)
    order = []
    real = prefill.run_prefill

    def spy(*args, **kw):
        order.append(kw["backend"])
        return real(*args, **kw)

    monkeypatch.setattr(prefill, "run_prefill", spy)
    res = benches.prefill_main(["--model", str(model), "--tokens", "512", "--ubatch", "256", "--repeat", "2",
                                "--backends", "direct,mmap", "--cold-method", "evict", "--dir", str(tmp_path),
                                "--json", *plot_args(tmp_path, "prefill")])
    line, out = last_json(capsys)
    # one warm-up each, then A/B/A/B cold and A/B/A/B warm
    assert order == ["direct", "mmap"] * 5
    (m,) = line["models"]
    assert {(r["backend"], r["cache"]) for r in m["runs"]} == {(b, c) for b in ("direct", "mmap")
                                                              for c in ("cold", "warm")}
    for r in m["runs"]:
        assert 0 < r["tok_per_s_min"] <= r["tok_per_s_median"] <= r["tok_per_s_max"] and len(r["tok_per_s_all"]) == 2
        assert r["rows_per_s"] > 0 and r["ple_rows"] == 512 * 16
    if res["facts"]["platform"] == "cpu":
        assert line["trunk"] == "none" and "trunk none: the PLE fetch + dequant alone" in out
    check_plot(tmp_path, "prefill", res)


def test_wrappers_and_cli_share_the_code():
    for name in ("storage", "gather", "prefill"):
        spec = importlib.util.spec_from_file_location(f"bench_{name}_smoke", REPO / "bench" / f"bench_{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        assert mod.main is getattr(benches, f"{name}_main")
    r = subprocess.run(["bash", "-n", str(REPO / "bench" / "gpu_check.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_kernel_bench_runs_or_says_why(capsys):
    """bench/bench_kernels.py (GPU) must at least import and run here: it measures, or says why it cannot."""
    spec = importlib.util.spec_from_file_location("bench_kernels_smoke", REPO / "bench" / "bench_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.main(["--quick"])
    assert isinstance(res, dict)
    from gds_gather.platform import detect
    if detect().kind == "cpu":
        assert "skipped" in res and res["skipped"]
