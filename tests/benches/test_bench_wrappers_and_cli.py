"""Smoke tests: each bench runs at a tiny size on the CPU with real figures, its JSON and a PNG plot, so none rots;
plus the honest-numbers contract: a real median, bytes delivered beside bytes requested, no system-wide page-cache
drop unless asked, outputs in --out or the cache directory (never the checkout).

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
from gds_gather.io import measure
from gds_gather.cli import main as cli_main

REPO = pathlib.Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


pytestmark = pytest.mark.usefixtures("bench_sandbox")


def on_block_device(path) -> bool:
    return measure.block_stat_path(path) is not None and measure.proc_read_bytes() is not None


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
    from gds_gather.io import uring
    from gds_gather.io.readers import Staging
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
        assert m["bytes"] == pytest.approx(m["ops"] * r["io_size"]) and 0 < m["mean_lat_us"] and 0 < m["p99_lat_us"]
        assert abs(m["gib_s"] * 2**30 - m["iops"] * r["io_size"]) < 1e-6 * m["gib_s"] * 2**30
        # the median of two runs is the mean of both, not the larger one
        assert m["gib_s"] == pytest.approx(sum(x["gib_s"] for x in r["runs"]) / 2)
        for x in r["runs"]:
            assert "bytes_delivered" in x and "bytes_device" in x
            if x["bytes_delivered"] is not None:
                assert x["bytes_delivered"] >= 0
    assert {"facts", "file", "file_bytes", "skipped", "json_file"} <= set(line)
    # no --out: the JSON goes to the cache directory's bench/, made files to --dir
    assert pathlib.Path(res["json_file"]) == tmp_path / "cache" / "bench" / "bench_storage.json"
    assert json.loads(pathlib.Path(res["json_file"]).read_text())["results"][0]["median"]["ops"] > 0
    assert "# bytes    delivered = " in out and "/proc/self/io read_bytes" in out
    if res["facts"]["platform"] == "cpu":          # the GPU transfer types say why they did not run
        assert {s["path"] for s in res["skipped"]} == {"gpu-direct", "cpu-gpu"} and "skipped: no usable GPU" in out
    check_plot(tmp_path, "storage", res)


def test_storage_bench_seq_cold_fixed_bytes(tmp_path, capsys):
    """Sequential reads of a fixed byte count, cold (the file evicted, not the machine's cache), through the CLI;
    O_DIRECT on a disk file: the storage delivered at least the bytes requested."""
    assert cli_main(["bench", "storage", "--size", "4M", "--out", str(tmp_path / "o"), "--io-size", "64K,8M",
                     "--bytes", "2M", "--repeat", "1", "--warmup", "0", "--pattern", "seq", "--cold",
                     "--path", "cpu", "--json"]) == 0
    line, out = last_json(capsys)
    (r,) = line["results"]                                 # 8M > the 4M file: skipped, saying so
    assert "IoType: READ XferType: CPUONLY" in out and "larger than the file" in out
    assert r["median"]["ops"] == 32 and r["median"]["bytes"] == 2 << 20
    assert "cold = the bench's own files evicted" in out
    assert (tmp_path / "o" / "storage-4M.bin").exists() and (tmp_path / "o" / "bench_storage.json").exists()
    assert not (tmp_path / "cache" / "bench").exists()
    if on_block_device(tmp_path) and "O_DIRECT" in r["runs"][0]["notes"]:
        assert r["median"]["bytes_delivered"] >= 2 << 20


def test_gather_bench_tiny(tmp_path, capsys):
    res = benches.gather_main(["--quick", "--rows", "20000", "--gemma-rows", "512", "--tokens", "512", "--ubatch",
                               "256", "--repeat", "1", "--fio-runtime", "1", "--out", str(tmp_path), "--json",
                               *plot_args(tmp_path, "gather")])
    line, out = last_json(capsys)
    assert line["bench"] == "gather" and [t["label"] for t in line["tables"]] == ["qwen4exp geometry",
                                                                                 "gemma4-e4b geometry"]
    assert line["passes"] == ["cold", "again", "warm", "newproc", "restart"] and line["drop_caches"] is False
    for t, per_tok in zip(res["tables"], (16, 1)):
        assert t["ids"] == 512 * per_tok
        got = {(r["backend"], r["cache"]): r for r in t["runs"]}
        want = {(b, p) for b in ("direct", "pread", "mmap", "readahead")
                for p in ("cold", "again", "warm", "newproc", "restart")} | {("resident", "again"),
                                                                              ("resident", "warm")}
        assert set(got) == want
        for r in t["runs"]:
            assert r["rows_per_s"] > 0 and r["ids"] == t["ids"] and 0 < r["unique"] <= r["ids"]
            assert r["ns_per_gather"] * r["rows_per_s"] == pytest.approx(1e9)
            assert r["p99_ms"] >= r["p50_ms"] > 0 and r["how"]
            assert r["useful_bytes"] > 0 and r["bytes_requested"] >= 0
            for k in ("bytes_delivered", "bytes_device"):
                assert k in r and (r[k] is None or r[k] >= 0)
        dc = got[("direct", "cold")]
        assert dc["page_cache_growth_MiB"] == 0                    # O_DIRECT adds nothing to the page cache
        # rows the device had to deliver: all unique rows, or (with the row cache) those neither cache held
        rc = dc["row_cache"]
        from_device = dc["unique"] if rc is None else rc["rows_from_device"]
        if rc is not None:
            assert rc["rows_from_cache"] + rc["rows_from_page_cache"] + rc["rows_from_device"] \
                == dc["unique"] + rc["rows_prefetched"]       # (read ahead: a device row, then a cache hit)
            assert got[("direct", "again")]["row_cache"]["rows_from_cache"] > 0       # the trace repeats rows
        else:
            assert dc["ampl_requested"] >= 1.0
        # the eviction worked (mincore): at most the open Table's metadata mapping of the file's head stays
        assert dc["cold_left_MiB"] <= 0.0625 and ("still cached" in dc["cold_how"]) == (dc["cold_left_MiB"] > 0)
        assert got[("pread", "cold")]["ampl_requested"] == pytest.approx(1.0)
        if on_block_device(t["path"]):
            # O_DIRECT from the disk: the device delivered at least the bytes of the rows it had to deliver, and
            # what direct requested of the device (rows copied from the page cache count as requested, not delivered)
            row_bytes = dc["useful_bytes"] / dc["unique"]
            from_pc = 0 if rc is None else rc["rows_from_page_cache"] * row_bytes   # copied, not delivered
            assert dc["bytes_delivered"] >= from_device * row_bytes
            assert dc["bytes_delivered"] >= dc["bytes_requested"] - from_pc
            assert dc["ampl_delivered"] == pytest.approx(dc["bytes_delivered"] / dc["useful_bytes"])
            # pread's exact-row requests cost whole pages: delivered is what it really cost, not 1.0x
            assert got[("pread", "cold")]["bytes_delivered"] > got[("pread", "cold")]["useful_bytes"]
        # the warm pass ran on a page cache that holds the trace (an untimed buffered pass put it there)
        assert got[("direct", "warm")]["page_cache_before_MiB"] > 0
        assert set(t["ratios"]) == {"cold", "again", "warm", "newproc", "restart"}
        # the new processes: engine start-up timed apart; the restart after direct's cold pass found its hot rows,
        # the new process on a warm box had none (the files were removed) and read the page cache instead
        assert got[("direct", "restart")]["hot_rows_loaded"] > 0 and got[("direct", "newproc")]["hot_rows_loaded"] == 0
        # ... and found the native helpers built, as a user's new process does (no compiler run before the pass)
        assert not any(got[(b, p)]["native_built"] for b in ("direct", "pread", "readahead")
                       for p in ("newproc", "restart"))
        assert got[("direct", "newproc")]["row_cache"]["rows_from_page_cache"] > 0
        assert got[("direct", "restart")]["row_cache"]["rows_from_cache"] > 0
        assert t["ratios"]["cold"]["target"] is None and t["ratios"]["again"]["vs"] == "mmap"   # --quick: no targets
    assert "ns/gather" in out and "ratios (median rows/s):" in out and "(target >=" not in out
    assert "so no PASS/MISS verdicts" in out and "PASS (target" not in out and "MISS (target" not in out
    long = [x for x in out.splitlines() if len(x) > 120 and not x.startswith("{")]
    assert not long, long
    assert "cold: direct / best of pread/mmap/readahead" in out
    assert "same table again" in out and "new table, warm page cache" in out
    if res["facts"]["fio"] != "not installed":
        assert res["tables"][0]["fio"]["cold_4096"]["iops"] > 0 and "fio randread 4K O_DIRECT" in out
    # outputs in --out: the JSON, the built tables; nothing in the cache directory
    assert (tmp_path / "bench_gather.json").exists() and (tmp_path / "qwen4exp-20000.gguf").exists()
    assert not (tmp_path / "cache" / "bench").exists()
    check_plot(tmp_path, "gather", res)


def test_bench_io_wrapper_random_ids_tmpfs(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_io_smoke", REPO / "bench" / "bench_io.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.main(["--quick", "--rows", "20000", "--ids", "2000", "--batch", "500", "--repeat", "1", "--no-fio",
                    "--backends", "direct,mmap,resident", "--no-again", "--cache", "0", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    (t,) = res["tables"]
    assert t["ids"] == 2000 and "2,000 uniform random row ids" in t["trace"]
    assert {(r["backend"], r["cache"]) for r in t["runs"]} == {("direct", "cold"), ("mmap", "cold"),
                                                               ("direct", "warm"), ("mmap", "warm"),
                                                               ("resident", "warm")}
    assert "cold: direct / mmap = " in out and "(target >=" not in out     # --quick: no verdicts
    assert "# row cache: budget 0 B (--cache)" in out           # --cache 0 -> Config(cache_bytes=0): no row cache
    for r in t["runs"]:
        assert r["row_cache"] is None or r["row_cache"].get("rows_from_cache", 0) == 0
    # --dir holds made files; the JSON goes to the cache directory (no --out)
    assert (tmp_path / "cache" / "bench" / "bench_io.json").exists() and not (tmp_path / "bench_io.json").exists()


def test_prefill_bench_interleaved(tmp_path, capsys, monkeypatch):
    from gds_gather.prefill import run as prefill
    from gds_gather.model.synth import write_model
    model = write_model(tmp_path / "q.gguf", "qwen4exp", rows=20000, progress=False)
    order = []
    real = prefill.run_prefill

    def spy(*args, **kw):
        order.append(kw["backend"])
        return real(*args, **kw)

    monkeypatch.setattr(prefill, "run_prefill", spy)
    res = benches.prefill_main(["--model", str(model), "--tokens", "512", "--ubatch", "256", "--repeat", "2",
                                "--backends", "direct,mmap,resident", "--out", str(tmp_path),
                                "--json", *plot_args(tmp_path, "prefill")])
    line, out = last_json(capsys)
    # one warm-up each, then A/B/C/A/B/C cold and A/B/C/A/B/C warm; then direct with the row cache carried: one
    # untimed run filling it, two timed
    assert order == ["direct", "mmap", "resident"] * 5 + ["direct"] * 3
    (m,) = line["models"]
    assert {(r["backend"], r["cache"]) for r in m["runs"]} == {(b, c) for b in ("direct", "mmap", "resident")
                                                              for c in ("cold", "warm")} | {("direct", "carried")}
    cold = next(r for r in m["runs"] if r["backend"] == "direct" and r["cache"] == "cold")
    carried = next(r for r in m["runs"] if r["cache"] == "carried")
    assert cold["row_cache"]["rows_from_cache"] < carried["row_cache"]["rows_from_cache"]   # cold starts empty
    for r in m["runs"]:
        assert 0 < r["tok_per_s_min"] <= r["tok_per_s_median"] <= r["tok_per_s_max"] and len(r["tok_per_s_all"]) == 2
        assert r["tok_per_s_median"] == pytest.approx(sum(r["tok_per_s_all"]) / 2)     # a real median of two
        assert r["rows_per_s"] > 0 and r["ple_rows"] == 512 * 16
        assert r["bytes_delivered"] is None or r["bytes_delivered"] >= 0
        if r["backend"] == "resident":      # loaded before the clock: the timed run reads nothing
            assert r["bytes_requested"] == 0
            if r["bytes_delivered"] is not None:
                assert r["bytes_delivered"] == 0
    assert "direct cold (row cache empty at the start) / resident (in memory before the clock)" in out
    assert "direct cold, row cache carried from the previous prompt of this process / resident" in out
    assert (tmp_path / "bench_prefill.json").exists()
    if res["facts"]["platform"] == "cpu":
        assert line["trunk"] == "none" and "trunk none: the PLE fetch + dequant alone" in out
    check_plot(tmp_path, "prefill", res)


def test_package_layout():
    """benches is a package of one module per bench plus shared report/plot modules; the CLI builds from it."""
    import importlib
    for mod in ("storage", "gather", "prefill", "report", "plot"):
        assert importlib.import_module(f"gds_gather.benches.{mod}")
    assert pathlib.Path(benches.__file__).name == "__init__.py"
    assert not (REPO / "gds_gather" / "benches.py").exists()
    assert set(benches.BENCHES) == {"storage", "gather", "prefill"}
    for name in benches.BENCHES:
        h = benches.build_parser(name).format_help()
        assert "--drop-caches" in h and "WHOLE machine" in h.replace("\n", " ") and "--out" in h
    from gds_gather.cli import build_parser
    assert build_parser().parse_args(["bench", "gather", "--quick", "--cache", "1M"]).cache == "1M"


def test_real_median():
    assert benches.median([3.0, 1.0, 2.0]) == 2.0
    assert benches.median([1.0, 4.0]) == 2.5                    # the mean of the middle two, not the max
    assert benches.median([1, 2, 3, 10]) == 2.5
    runs = [{"rows_per_s": 100.0, "ids": 5, "ops": 3, "how": "a", "rc": {"hits": 1}},
            {"rows_per_s": 300.0, "ids": 5, "ops": 4, "how": "b", "rc": {"hits": 3}}]
    m = benches.median_run(runs, "rows_per_s")
    assert m["rows_per_s"] == 200.0 and m["rows_per_s_all"] == [100.0, 300.0] and m["n_runs"] == 2
    assert m["ids"] == 5 and isinstance(m["ids"], int) and m["ops"] == 3.5 and m["how"] == "a"
    assert m["rc"] == {"hits": 2}
    assert benches.median_run(runs[:1] * 3, "rows_per_s")["rows_per_s"] == 100.0


def test_drop_caches_only_when_asked(tmp_path, capsys, monkeypatch):
    """--drop-caches calls measure.drop_caches (here refused, as without root) and says so; the default evicts the
    file only (the autouse fixture fails any other call)."""
    calls = []
    monkeypatch.setattr(measure, "drop_caches", lambda: calls.append(1) or False)
    res = benches.storage_main(["--size", "1M", "--dir", str(tmp_path), "--io-size", "64K", "--bytes", "256K",
                                "--repeat", "2", "--warmup", "0", "--path", "cpu", "--cold", "--drop-caches"])
    out = capsys.readouterr().out
    assert len(calls) == 2                                  # once before each cold run, as asked
    assert "echo 3 > /proc/sys/vm/drop_caches" in out and res["results"][0]["median"]["ops"] == 4
    f = tmp_path / "f.bin"
    f.write_bytes(b"x" * 65536)
    f.read_bytes()
    assert "refused (not root)" in benches.go_cold(f, drop=True) and len(calls) == 3
    assert benches.go_cold(f) == "POSIX_FADV_DONTNEED on the file" and measure.resident_bytes(f) == 0


def test_delivered_bytes_counter(tmp_path):
    """ReadCounter: an O_DIRECT read of a cold disk file is counted (>= the bytes read); nothing read, ~nothing."""
    import mmap
    import os
    f = tmp_path / "d.bin"
    f.write_bytes(np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes())
    assert measure.evict_file(f) == 0
    c = measure.ReadCounter(f)
    assert c.stop()["delivered_bytes"] in (0, None)
    if not on_block_device(f):
        pytest.skip("no block device or no /proc/self/io under tmp_path")
    buf = mmap.mmap(-1, 1 << 16)
    fd = os.open(f, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    try:
        c.start()
        for off in range(0, 1 << 20, 1 << 16):
            assert os.preadv(fd, [buf], off) == 1 << 16
        got = c.stop()
    except OSError as e:
        pytest.skip(f"O_DIRECT refused here: {e}")
    finally:
        os.close(fd)
    assert got["delivered_bytes"] >= 1 << 20 and "/proc/self/io" in got["delivered_method"]
    assert got["device_bytes"] >= 1 << 20 and "whole device" in got["device_method"]


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
