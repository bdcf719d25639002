"""Benchmarks users can run: storage bandwidth (gdsio-style), the gather microbenchmark, prefill A/B.

    gds-gather bench storage [--file F | --size 8G] [--io-size 4K,64K,1M,16M] [--threads N] [--qd N]
                             [--pattern rand|seq] [--path gpu-direct,cpu-gpu,cpu] [--cold] [--seconds S]
    gds-gather bench gather  [--tables qwen4exp,gemma4-e4b] [--backends ...] [--warm cache|tmpfs|none]
    gds-gather bench prefill [--model F] [--backends ...] [--tokens N] [--trunk none|tiny|real]

bench/bench_storage.py, bench_gather.py, bench_prefill.py (and bench_io.py, the gather bench on random ids) run the
same code. Every bench prints a header of machine facts (CPU, cores, GPU, driver, GPU-direct storage state,
filesystem, device), warms up, repeats each measurement (--repeat) and reports medians; --json ends the output with
one JSON line, a JSON file goes to --out, --plot FILE.png draws the backends side by side (matplotlib with the Agg
canvas: `pip install 'gds-gather[plot]'`), and --quick makes a small run. Importable: storage_main(argv),
gather_main(argv), prefill_main(argv) return the result dict.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np

from . import measure
from .config import Config

REPO = Path(__file__).resolve().parents[1]
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
HOST_BACKENDS = ("direct", "pread", "mmap", "readahead", "resident")


# ================================================================================================ shared helpers

def parse_size(s) -> int:
    """'4K' -> 4096, '1M', '8G', '512' (bytes); binary units, an optional 'iB'/'B' suffix."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(s), re.I)
    if not m:
        raise ValueError(f"not a size: {s!r} (examples: 4K, 64K, 1M, 8G)")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2).lower() or " "))


def human_size(n: int) -> str:
    """4096 -> '4K', 16 MiB -> '16M', 8 GiB -> '8G' (exact multiples), else bytes."""
    for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"


def _short(x: float) -> str:
    """Compact figure for plot labels: 95.7k, 6.8M, 1.23."""
    if not math.isfinite(x):
        return ""
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}"


def default_dir(cfg: Config) -> Path:
    """Where made files (test files, built tables) live: bench/out in a checkout, else the cache directory."""
    bench = REPO / "bench"
    if (bench / "bench_io.py").exists() and os.access(bench, os.W_OK):
        return bench / "out"
    return Path(cfg.cache_dir) / "bench"


def go_cold(path, method: str = "drop") -> str:
    """Empty the page cache (drop_caches as root) or evict just this file; returns what was done."""
    if method == "drop" and measure.drop_caches():
        return "drop_caches"
    measure.evict_file(path)
    return "POSIX_FADV_DONTNEED on the file"


def block_device(path) -> str:
    """The block device under `path`, e.g. 'nvme0n1 (nvme, SAMSUNG MZQL23T8HCLS)' or 'vda (virtio)'."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return "?"
    base = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not base.exists():
        return f"no block device (device {os.major(dev)}:{os.minor(dev)}: tmpfs, overlay or network)"
    real = base.resolve()
    if (real / "partition").exists():
        real = real.parent
    name, s = real.name, str(real)
    kind = ("nvme" if name.startswith("nvme") else "virtio" if "/virtio" in s else "device-mapper"
            if name.startswith("dm-") else "md raid" if name.startswith("md") else "loop" if name.startswith("loop")
            else "zram" if name.startswith("zram") else "scsi/sata" if name.startswith("sd") else "")
    model = ""
    for f in (real / "device" / "model", real / "device" / "device" / "model"):
        try:
            model = f.read_text().strip()
            break
        except OSError:
            pass
    what = ", ".join(x for x in (kind, model) if x)
    return f"{name} ({what})" if what else name


def fio_version() -> str:
    fio = shutil.which("fio")
    if not fio:
        return "not installed"
    try:
        return subprocess.run([fio, "--version"], capture_output=True, text=True, timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def gpu_facts(cfg: Config) -> dict:
    """GPU, driver and GPU-direct storage state (imports cupy/kvikio only where a GPU platform is detected)."""
    from .platform import detect
    plat = detect(cfg.platform)
    d = {"platform": plat.kind, "platform_reason": plat.reason, "gpu": plat.device or "none",
         "driver": "n/a", "gds": "n/a (no GPU)"}
    if plat.kind == "cpu":
        return d
    parts = []
    try:
        with open("/proc/driver/nvidia/version") as f:
            m = re.search(r"Kernel Module(?: for \S+)?\s+([\d.]+)", f.read())
            if m:
                parts.append(f"NVIDIA {m.group(1)}")
    except OSError:
        pass
    try:
        import cupy
        v = cupy.cuda.runtime.driverGetVersion()
        parts.append(f"{'HIP' if cupy.cuda.runtime.is_hip else 'CUDA'} {v // 1000}.{v % 1000 // 10}")
    except Exception as e:  # a broken driver is a fact too
        parts.append(f"version unknown ({type(e).__name__})")
    d["driver"] = ", ".join(parts)
    if plat.kind == "discrete":
        from .backends import gds_state
        ok, real, why = gds_state()
        d["gds"] = ("real GPU-direct storage" if real else "compat mode" if ok else "unavailable") + f": {why}"
    else:
        d["gds"] = f"n/a on a {plat.kind} platform"
    return d


def bench_facts(path, cfg: Config) -> dict:
    f = measure.machine_facts(path)
    f.update(gpu_facts(cfg))
    f.update(device=block_device(path), fio=fio_version())
    return f


def print_header(name: str, f: dict) -> None:
    print(f"# gds-gather bench {name}")
    print(f"# machine  {f['cpu']}, {f['cores']} cores, {f['mem_GiB']} GiB RAM, Linux {f['kernel']}, "
          f"Python {f['python']}, numpy {f['numpy']}")
    print(f"# gpu      {f['gpu']}; platform {f['platform']} ({f['platform_reason']}); driver {f['driver']}; "
          f"GDS {f['gds']}")
    print(f"# storage  {f['file']} ({f['file_GiB']} GiB): {f['filesystem']} on {f['device']}, "
          f"{f['logical_block']} B logical blocks")
    print(f"# tools    fio: {f['fio']}", flush=True)


def machine_title(f: dict) -> str:
    cpu = re.sub(r"\((R|TM)\)|\bCPU\b|\s@.*$", "", f.get("cpu", "?"))
    cpu = re.sub(r"\s+", " ", cpu).strip()
    gpu = f.get("gpu") if f.get("gpu") not in (None, "", "none") else "no GPU"
    return f"{cpu} ({f.get('cores')} cores), {gpu}; {f.get('filesystem', '?')} on {f.get('device', '?')}"


def _median_run(runs: list[dict], key: str) -> dict:
    """The run whose `key` is the median (the upper middle one for an even count), with every value listed."""
    best = dict(sorted(runs, key=lambda r: r[key])[len(runs) // 2])
    best[key + "_all"] = [r[key] for r in runs]
    return best


def _ratio(name: str, a, b, target=None) -> str:
    if not a or not b:
        return f"  {name}: n/a"
    x = a / b
    verdict = "" if target is None else ("  PASS" if x >= target else "  MISS") + f" (target >= {target})"
    return f"  {name} = {x:.2f}x{verdict}"


def _jsonable(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    return str(x)


def _finish(name: str, result: dict, a, out_dir: Path, plot) -> dict:
    """Write the JSON file, draw the plot, print the JSON line."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / (a.json_name or f"bench_{name}.json")
    if a.plot:
        try:
            plot(result, a.plot)
            result["plot"] = str(a.plot)
            print(f"plot: {a.plot}")
        except ImportError as e:
            print(f"plot: skipped, matplotlib is not installed (pip install 'gds-gather[plot]'): {e}")
    result["json_file"] = str(path)
    path.write_text(json.dumps(result, indent=1, default=_jsonable))
    print(f"json: {path}")
    if a.json:
        print(json.dumps(result, default=_jsonable))
    return result


# ------------------------------------------------------------------------------------------------ plotting

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def _figure(ncols: int, width: float = 6.4, height: float = 4.6):
    """A figure drawn on the Agg canvas directly (no pyplot, no GUI backend, no global state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width * ncols, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, axes


def _bars(ax, groups, series, values, *, lo=None, hi=None, log=False, ylabel="", label_fmt=_short):
    """Grouped bars: one group per entry of `groups`, one bar per series; values[s][i] (None = missing)."""
    x = np.arange(len(groups), dtype=float)
    width = 0.8 / max(len(series), 1)
    top, low = 0.0, math.inf
    for i, s in enumerate(series):
        pos = x - 0.4 + width * (i + 0.5)
        keep = [j for j, v in enumerate(values[s]) if v is not None and math.isfinite(v) and v > 0]
        if not keep:
            ax.bar([], [], width, label=s, color=COLORS[i % len(COLORS)])
            continue
        v = np.array([values[s][j] for j in keep], float)
        yerr = None
        if lo is not None and hi is not None:
            yerr = np.array([[values[s][j] - lo[s][j] for j in keep], [hi[s][j] - values[s][j] for j in keep]], float)
            top = max(top, float(np.max(v + yerr[1])))
            low = min(low, float(np.min(v - yerr[0])))
        ax.bar(pos[keep], v, width, label=s, color=COLORS[i % len(COLORS)], yerr=yerr,
               capsize=3 if yerr is not None else 0, error_kw={"elinewidth": 1})
        top, low = max(top, float(v.max())), min(low, float(v.min()))
        tips = v if yerr is None else v + yerr[1]
        for p, val, tip in zip(pos[keep], v, tips):
            ax.annotate(label_fmt(val), (p, tip), xytext=(0, 2), textcoords="offset points", ha="center",
                        va="bottom", fontsize=7, rotation=90 if len(series) * len(groups) > 12 else 0)
    ax.set_xticks(x)
    ax.set_xticklabels(groups)
    if ylabel:
        ax.set_ylabel(ylabel)
    if log and top > 0:
        ax.set_yscale("log")
        ax.set_ylim(low / 3 if 0 < low < math.inf else None, top * 6)
    elif top > 0:
        ax.set_ylim(0, top * 1.18)
    ax.grid(axis="y", alpha=0.3)


# ================================================================================================ storage

XFER = {"gpu-direct": "GPUD", "cpu-gpu": "CPU_GPU", "cpu": "CPUONLY"}
STORAGE_PATHS = ("gpu-direct", "cpu-gpu", "cpu")
BUF_MIN, BUF_MAX = 32 * MiB, 512 * MiB      # one thread's (half-)buffer: enough for the queue, bounded in memory
COMPAT_BANNER = "WARNING: cuFile runs in compat mode: GPU_DIRECT numbers measure POSIX reads + a copy"


def _storage_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--file", help="read this file (default: a file of --size random bytes, made once in --dir)")
    p.add_argument("--size", help="size of the made file (default 8G; --quick 256M)")
    p.add_argument("--io-size", help="comma list of I/O sizes (default 4K,64K,1M,16M; --quick 4K,1M)")
    p.add_argument("--threads", type=int, default=1,
                   help="cpu, cpu-gpu: threads, each with its own io_uring, fd and buffer; gpu-direct: KvikIO's "
                        "thread pool size (num_threads) behind one submitter (default 1)")
    p.add_argument("--qd", type=int, default=128,
                   help="I/Os in flight per thread (default 128; bounded by the buffer for large I/O sizes)")
    p.add_argument("--pattern", choices=("rand", "seq"), default="rand",
                   help="rand: uniform offsets aligned to the I/O size; seq: each thread walks its own region")
    p.add_argument("--path", default=",".join(STORAGE_PATHS),
                   help="comma list of transfer types, after gdsio: gpu-direct (cuFile into GPU memory), cpu-gpu "
                        "(O_DIRECT into a pinned bounce buffer + one H2D copy per batch), cpu (O_DIRECT into host "
                        "memory); default all three, the GPU ones are skipped (saying why) without a GPU")
    p.add_argument("--cold", action="store_true", help="empty the page cache before each timed run")
    p.add_argument("--seconds", type=float, help="length of each timed run (default 5; --quick 1)")
    p.add_argument("--bytes", help="read this many bytes per timed run instead of for --seconds (e.g. 4G)")
    p.add_argument("--warmup", type=float, help="seconds of untimed reads before each configuration "
                                                "(default 1; --quick 0.25)")


class _StorageWorker:
    """One thread's reads of `io` bytes at a time: O_DIRECT through its own io_uring (cpu, cpu-gpu) or KvikIO
    CuFile.pread into device memory (gpu-direct). Set up outside the timing; run() is the timed part."""

    def __init__(self, path: Path, xfer: str, io: int, qd: int, pattern: str, index: int, nthreads: int,
                 seed: int, threads: int):
        from .storage import logical_block_size
        self.path, self.xfer, self.io = path, xfer, io
        size = os.path.getsize(path)
        self.nblocks = size // io
        self.rng = np.random.default_rng([seed, index])
        self.pattern = pattern
        region = max(1, self.nblocks // nthreads)
        self.first, self.region, self.cursor = (index * region) % self.nblocks, region, 0
        self.slots = max(1, min(BUF_MAX, max(BUF_MIN, qd * io)) // io)
        self.qd = min(qd, self.slots)
        self.notes: list[str] = []
        self.fd, self.ring, self.staging, self.file, self.stream, self.dev = -1, None, None, None, None, None
        self.k = 0
        try:
            if xfer == "gpu-direct":
                self._setup_kvikio(threads)
            else:
                self._setup_uring(logical_block_size(path))
        except BaseException:
            self.close()
            raise

    # -- setup -----------------------------------------------------------------------------------------------
    def _setup_uring(self, blk: int) -> None:
        from . import uring
        from .readers import Staging
        self.align = blk
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        try:
            self.fd = os.open(self.path, flags | getattr(os, "O_DIRECT", 0))
            self.notes.append("O_DIRECT")
        except OSError as e:
            self.fd = os.open(self.path, flags)
            self.notes.append(f"buffered reads: O_DIRECT refused ({e.strerror})")
        ok, why = uring.probe()
        if not ok:
            raise RuntimeError(f"the storage bench needs io_uring: {why}")
        self.ring = uring.Ring(max(8, self.qd))
        self.ring.register_file(self.fd)
        halves = 2 if self.xfer == "cpu-gpu" else 1
        self.staging = Staging()
        if self.xfer == "cpu-gpu":
            import cupy as cp
            self.cp = cp
            self.staging.pin = lambda b: cp.cuda.runtime.hostRegister(b.ctypes.data, b.nbytes, 1)  # portable
            self.staging.unpin = lambda b: cp.cuda.runtime.hostUnregister(b.ctypes.data)
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.dev = cp.empty(self.slots * self.io, cp.uint8)
            self.events = [None, None]
            self.notes.append(f"pinned 2 x {human_size(self.slots * self.io)} bounce buffer, one H2D copy per batch")
        buf = self.staging.ensure(halves * self.slots * self.io)
        self.notes.append("registered buffer" if self.ring.register_buffer(buf) else "unregistered buffer")
        self.base = np.uint64(buf.ctypes.data)
        # a batch fills at most one (half-)buffer with cpu-gpu (each byte read is copied once); the cpu path
        # may wrap around its buffer (the data is not looked at), so its batches can be longer
        self.batch_max = self.slots if self.xfer == "cpu-gpu" else max(self.slots, min(65536, 8 * self.slots))
        self.lens = np.full(self.batch_max, self.io, np.int64)
        self.ramp = np.arange(self.batch_max, dtype=np.uint64) % np.uint64(self.slots) * np.uint64(self.io)

    def _setup_kvikio(self, threads: int) -> None:
        import cupy as cp
        import kvikio
        import kvikio.defaults
        self.cp = cp
        try:
            kvikio.defaults.set({"num_threads": threads, "gds_threshold": 0})
        except AttributeError:       # KvikIO < 25.02
            kvikio.defaults.num_threads_reset(threads)
            kvikio.defaults.gds_threshold_reset(0)
        self.file = kvikio.CuFile(str(self.path), "r")
        self.dev = cp.empty(self.slots * self.io, cp.uint8)
        self.views = [self.dev[s * self.io:(s + 1) * self.io] for s in range(self.slots)]
        self.batch_max = max(self.slots, min(65536, 8 * self.slots))
        self.notes.append(f"KvikIO CuFile.pread, {threads} KvikIO threads, gds_threshold 0, one Python submitter "
                          f"keeping {self.qd} reads in flight")

    # -- the timed part ----------------------------------------------------------------------------------------
    def offsets(self, n: int) -> np.ndarray:
        if self.pattern == "rand":
            return self.rng.integers(0, self.nblocks, n, dtype=np.int64) * self.io
        blk = (self.cursor + np.arange(n, dtype=np.int64)) % self.region + self.first
        self.cursor += n
        return (blk % self.nblocks) * self.io

    def _batch(self, n: int) -> np.ndarray:
        offs = self.offsets(n)
        lat = np.empty(n, np.int64)
        if self.xfer == "gpu-direct":
            return self._batch_kvikio(offs, lat)
        h = self.k % 2 if self.xfer == "cpu-gpu" else 0
        self.k += 1
        if self.xfer == "cpu-gpu" and self.events[h] is not None:
            self.events[h].synchronize()          # the copy out of this half is done
        base = self.base + np.uint64(h * self.slots * self.io)
        self.ring.read(self.fd, offs, self.lens[:n], base + self.ramp[:n], align=self.align, path=self.path,
                       queue_depth=self.qd, lat_ns=lat)
        if self.xfer == "cpu-gpu":
            cp = self.cp
            cp.cuda.runtime.memcpyAsync(self.dev.data.ptr, int(base), n * self.io, cp.cuda.runtime.memcpyHostToDevice,
                                        self.stream.ptr)
            ev = cp.cuda.Event(disable_timing=True)
            ev.record(self.stream)
            self.events[h] = ev
        return lat

    def _batch_kvikio(self, offs: np.ndarray, lat: np.ndarray) -> np.ndarray:
        from .errors import ReadError
        pending: deque = deque()

        def reap():
            j, t, fut = pending.popleft()
            got = fut.get()
            lat[j] = time.perf_counter_ns() - t
            if got != self.io:
                raise ReadError(f"{self.path}: cuFile read at offset {int(offs[j])} returned {got} of {self.io} bytes")

        for j, off in enumerate(offs.tolist()):
            if len(pending) >= self.qd:
                reap()
            view = self.views[self.k % self.slots]
            self.k += 1
            pending.append((j, time.perf_counter_ns(), self.file.pread(view, self.io, off)))
        while pending:
            reap()
        return lat

    def run(self, seconds: float | None, nbytes: int | None, barrier: threading.Barrier) -> None:
        self.error = None
        lats, ops = [], 0
        budget = nbytes // self.io if nbytes else math.inf
        target = 0.2 if not seconds else min(0.25, max(0.02, seconds / 10))   # seconds per batch
        n = min(self.batch_max, 4 * self.qd)
        try:
            barrier.wait()
            self.t0 = time.perf_counter()
            end = self.t0 + seconds if seconds else math.inf
            while ops < budget:
                a = time.perf_counter()
                if a >= end:
                    break
                k = int(min(n, budget - ops))
                lats.append(self._batch(k))
                ops += k
                dt = max(time.perf_counter() - a, 1e-6)
                n = int(min(self.batch_max, max(self.qd, n * target / dt)))
            if self.stream is not None:
                self.stream.synchronize()       # the last copies have landed
        except BaseException as e:             # re-raised by the main thread
            self.error = e
            barrier.abort()
        self.t1 = time.perf_counter()
        self.ops = ops
        self.lat = np.concatenate(lats) if lats else np.zeros(0, np.int64)

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        if self.staging is not None:
            self.staging.close()
            self.staging = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.file is not None:
            self.file.close()
            self.file = None
        self.dev = self.views = None


def storage_run(path: Path, xfer: str, io: int, *, threads: int = 1, qd: int = 128, pattern: str = "rand",
                seconds: float | None = 1.0, nbytes: int | None = None, seed: int = 0) -> dict:
    """One timed run of one configuration: GiB/s, IOPS, mean and p99 per-I/O latency."""
    nthreads = 1 if xfer == "gpu-direct" else threads
    workers = []
    try:
        for i in range(nthreads):
            workers.append(_StorageWorker(path, xfer, io, qd, pattern, i, nthreads, seed, threads))
        barrier = threading.Barrier(nthreads)
        ths = [threading.Thread(target=w.run, args=(seconds, nbytes and -(-nbytes // nthreads), barrier),
                                name=f"bench-storage-{i}") for i, w in enumerate(workers)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        for w in workers:
            if w.error is not None:
                raise w.error
        ops = sum(w.ops for w in workers)
        wall = max(w.t1 for w in workers) - min(w.t0 for w in workers)
        lat = np.concatenate([w.lat for w in workers])
        return {"gib_s": ops * io / wall / GiB, "iops": ops / wall, "ops": ops, "bytes": ops * io, "seconds": wall,
                "mean_lat_us": float(lat.mean()) / 1e3 if lat.size else 0.0,
                "p99_lat_us": float(np.percentile(lat, 99)) / 1e3 if lat.size else 0.0,
                "qd": workers[0].qd, "notes": workers[0].notes}
    finally:
        for w in workers:
            w.close()


def storage_file(directory: Path, size: int) -> Path:
    """A file of `size` random bytes in `directory`, made once (creation is never timed)."""
    path = Path(directory) / f"storage-{human_size(size)}.bin"
    if path.exists() and path.stat().st_size == size:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"making {path}: {size / GiB:.2f} GiB of random bytes (once, not timed)", flush=True)
    tmp = path.with_suffix(".tmp")
    rng = np.random.default_rng(0)
    chunk = 64 * MiB
    with open(tmp, "wb") as f:
        left = size
        while left:
            n = min(chunk, left)
            f.write(rng.integers(0, 2**63, -(-n // 8), dtype=np.uint64).view(np.uint8)[:n].tobytes())
            left -= n
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def _lat(us: float) -> str:
    return f"{us:.1f}" if us < 100 else f"{us:.0f}"


def gdsio_line(c: dict) -> str:
    m = c["median"]
    return (f"IoType: {'RANDREAD' if c['pattern'] == 'rand' else 'READ'} XferType: {XFER[c['path']]} "
            f"Threads: {c['threads']} IoDepth: {m['qd']} DataSetSize: {m['bytes'] // KiB}/{c['file_bytes'] // KiB}(KiB) "
            f"IOSize: {c['io_size'] // KiB}(KiB) Throughput: {m['gib_s']:.2f} GiB/sec, IOPS: {m['iops']:.0f}, "
            f"Avg_Latency: {_lat(m['mean_lat_us'])} usecs, p99_Latency: {_lat(m['p99_lat_us'])} usecs "
            f"ops: {m['ops']} total_time {m['seconds']:.1f} secs")


def run_storage(a, cfg: Config) -> dict:
    from .platform import detect
    q = a.quick
    size = parse_size(a.size or ("256M" if q else "8G"))
    io_sizes = [parse_size(x) for x in (a.io_size or ("4K,1M" if q else "4K,64K,1M,16M")).split(",") if x.strip()]
    seconds = a.seconds if a.seconds is not None else (1.0 if q else 5.0)
    nbytes = parse_size(a.bytes) if a.bytes else None
    repeat = a.repeat or (2 if q else 3)
    warmup = a.warmup if a.warmup is not None else (0.25 if q else 1.0)
    paths = [x.strip() for x in a.path.split(",") if x.strip()]
    for x in paths:
        if x not in STORAGE_PATHS:
            raise ValueError(f"--path must be a comma list of {', '.join(STORAGE_PATHS)}; got {x!r}")
    if a.threads < 1 or a.qd < 1 or repeat < 1:
        raise ValueError("--threads, --qd and --repeat must be >= 1")
    data_dir = Path(a.dir or a.out or default_dir(cfg))
    path = Path(a.file) if a.file else storage_file(data_dir, size)
    file_bytes = os.path.getsize(path)
    facts = bench_facts(path, cfg)
    print_header("storage", facts)
    plat = detect(cfg.platform)
    skipped = {}
    if plat.kind == "cpu":
        for x in ("gpu-direct", "cpu-gpu"):
            skipped[x] = f"no usable GPU (platform cpu: {plat.reason})"
    else:
        if plat.kind == "rocm":
            skipped["gpu-direct"] = "cuFile/KvikIO is NVIDIA only (platform rocm)"
        else:
            from .backends import gds_state
            ok, real, why = gds_state()
            if not ok:
                skipped["gpu-direct"] = why
            elif not real and "gpu-direct" in paths:
                print(COMPAT_BANNER)
                print(f"  ({why})")
    how = f"{seconds:g} s" if not nbytes else f"{human_size(nbytes)}"
    print(f"# {file_bytes / GiB:.2f} GiB file; {'random' if a.pattern == 'rand' else 'sequential'} reads; "
          f"threads {a.threads}; QD {a.qd}; {repeat} timed runs of {how} per configuration after {warmup:g} s of "
          f"warm-up, median shown; {'cold (page cache emptied before each run)' if a.cold else 'page cache as it is'}",
          flush=True)
    result = {"bench": "storage", "facts": facts, "file": str(path), "file_bytes": file_bytes, "pattern": a.pattern,
              "threads": a.threads, "qd": a.qd, "seconds": seconds, "bytes_per_run": nbytes, "repeat": repeat,
              "cold": a.cold, "results": [], "skipped": []}
    for x in paths:
        if x in skipped:
            print(f"XferType: {XFER[x]} ({x}): skipped: {skipped[x]}")
            result["skipped"].append({"path": x, "why": skipped[x]})
            continue
        for io in io_sizes:
            if io > file_bytes or io % facts["logical_block"]:
                why = (f"I/O size {io} is larger than the file" if io > file_bytes else
                       f"I/O size {io} is not a multiple of the {facts['logical_block']} B logical block")
                print(f"XferType: {XFER[x]} IOSize: {io // KiB}(KiB): skipped: {why}")
                result["skipped"].append({"path": x, "io_size": io, "why": why})
                continue
            kw = dict(threads=a.threads, qd=a.qd, pattern=a.pattern)
            if warmup > 0:
                storage_run(path, x, io, seconds=warmup, seed=99, **kw)
            runs = []
            for r in range(repeat):
                if a.cold:
                    go_cold(path, a.cold_method)
                runs.append(storage_run(path, x, io, seconds=None if nbytes else seconds, nbytes=nbytes, seed=r,
                                        **kw))
            c = {"path": x, "xfer": XFER[x], "io_size": io, "pattern": a.pattern, "threads": a.threads,
                 "file_bytes": file_bytes, "runs": runs, "median": _median_run(runs, "gib_s")}
            result["results"].append(c)
            each = " ".join(f"{r['gib_s']:.2f}" for r in runs)
            print(gdsio_line(c) + f"   [runs {each} GiB/s; {', '.join(runs[0]['notes'])}]", flush=True)
    return _finish("storage", result, a, Path(a.out or data_dir), _plot_storage)


def _plot_storage(res: dict, out) -> None:
    rows = res["results"]
    if not rows:
        raise ValueError("nothing was measured: no plot")
    sizes = sorted({r["io_size"] for r in rows})
    paths = [p for p in STORAGE_PATHS if any(r["path"] == p for r in rows)]
    groups = [human_size(s) for s in sizes]
    get = lambda p, s, k: next((r["median"][k] for r in rows if r["path"] == p and r["io_size"] == s), None)  # noqa: E731
    fig, (ax1, ax2) = _figure(2, 5.6, 4.4)
    names = {p: f"{XFER[p]} ({p})" for p in paths}
    _bars(ax1, groups, [names[p] for p in paths], {names[p]: [get(p, s, "gib_s") for s in sizes] for p in paths},
          ylabel="GiB/s (median)", label_fmt=lambda v: f"{v:.2f}")
    ax1.set_xlabel("I/O size")
    ax1.set_title(f"throughput, {'random' if res['pattern'] == 'rand' else 'sequential'} reads, "
                  f"{res['threads']} thread(s), QD up to {res['qd']}", fontsize=10)
    ax1.legend(fontsize=8)
    _bars(ax2, groups, [names[p] for p in paths], {names[p]: [get(p, s, "mean_lat_us") for s in sizes] for p in paths},
          lo={names[p]: [get(p, s, "mean_lat_us") for s in sizes] for p in paths},
          hi={names[p]: [get(p, s, "p99_lat_us") for s in sizes] for p in paths},
          log=True, ylabel="latency per I/O, us (bar: mean, whisker: p99)", label_fmt=lambda v: f"{v:.0f}")
    ax2.set_xlabel("I/O size")
    ax2.set_title("latency", fontsize=10)
    fig.suptitle(f"gds-gather bench storage: {res['file_bytes'] / GiB:.2f} GiB file\n{machine_title(res['facts'])}",
                 fontsize=10)
    fig.savefig(out)


# ================================================================================================ gather

def _gather_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--file", action="append", help="a GGUF with a PLE table (repeatable; default: build --tables)")
    p.add_argument("--tables", default="qwen4exp,gemma4-e4b",
                   help="tables to build and bench: qwen4exp (IQ4_NL, 90 B rows, 16 rows per token), gemma4-e4b "
                        "(Q5_K, 7,392 B rows, one per token); default both")
    p.add_argument("--rows", type=int, help="rows of the qwen4exp-geometry table (default 24,000,000 = 2.16 GB; "
                                            "--quick 200,000)")
    p.add_argument("--gemma-rows", type=int, help="rows of the gemma4-e4b table (default 262,144 = 1.94 GB, the "
                                                  "real one; --quick 4,096)")
    p.add_argument("--trace", choices=("text", "random"), default="text",
                   help="text: the row ids of a real English prompt, ubatch by ubatch (default); random: uniform "
                        "random ids (--ids, --batch)")
    p.add_argument("--prompt", help="text file for the trace (default: the Python documentation topics)")
    p.add_argument("--tokens", type=int, help="prompt tokens per pass (default 8192; --quick 2048)")
    p.add_argument("--ubatch", type=int, help="tokens per gather call (default 2048; --quick 1024)")
    p.add_argument("--ids", type=int, help="--trace random: ids per pass (default 100,000; --quick 5,000)")
    p.add_argument("--batch", type=int, help="--trace random: ids per gather call (default 16,384; --quick 1,000)")
    p.add_argument("--backends", help="comma list (default direct,pread,mmap,readahead,resident, and on a GPU the "
                                      "device destinations gpu:direct and gpu:gds)")
    p.add_argument("--warm", choices=("cache", "tmpfs", "none"), default="cache",
                   help="warm: cache = the same file after an untimed pass (page cache warm; O_DIRECT still reads "
                        "the drive); tmpfs = a copy of the table on --tmpfs; none")
    p.add_argument("--tmpfs", default="/dev/shm", help="where --warm tmpfs copies the table")
    p.add_argument("--no-cold", action="store_true")
    p.add_argument("--no-warm", action="store_true", help="same as --warm none")
    p.add_argument("--qd", type=int, default=128, help="queue depth of direct and of fio (default 128)")
    p.add_argument("--fio-runtime", type=int, help="seconds per fio run (default 5; --quick 1)")
    p.add_argument("--no-fio", action="store_true", help="skip fio")
    p.add_argument("--targets", action="store_true", help=argparse.SUPPRESS)


def _built_table(directory: Path, preset: str, rows: int) -> Path:
    from .model import write_model
    path = Path(directory) / f"{preset}-{rows}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"building {path} (once, not timed)", flush=True)
        write_model(path, preset, rows=rows, progress=True)
    return path


def _trace(t, a) -> tuple[list[np.ndarray], str]:
    if a.trace == "random":
        ids = np.random.default_rng(0).integers(0, t.n_rows, a.ids)
        return ([ids[k:k + a.batch] for k in range(0, ids.size, a.batch)],
                f"{a.ids:,} uniform random row ids in gathers of {a.batch:,}")
    from .prefill import RowMapper
    from .text import prompt_tokens
    mapper = RowMapper(t)
    tokenizer = getattr(mapper, "tokenizer", None)       # the model's own tokenizer, where the file carries one
    tokens = prompt_tokens(mapper.n_vocab, mapper.reserved, a.prompt, a.tokens,
                           **({"tokenizer": tokenizer} if tokenizer is not None else {}))
    trace = [mapper(tokens[k:k + a.ubatch]) for k in range(0, tokens.size, a.ubatch)]
    n = sum(x.size for x in trace)
    return trace, (f"{tokens.size:,} tokens of {'the default text (Python docs)' if a.prompt is None else a.prompt} -> "
                   f"{n:,} row ids ({mapper.rows_per_token} per token) in {len(trace)} gather call(s) of up to "
                   f"{min(a.ubatch, tokens.size):,} tokens")


def _bs_name(bs: int) -> str:
    return human_size(bs) if bs % 1024 == 0 else f"{bs} B"


def _bytes_read(t) -> int:
    return sum(getattr(r, "bytes_read", 0) for r in [*t._readers.values(), *t._sinks.values()])


def _fetch(t, b: str, plan, stream) -> None:
    if b.startswith("gpu:"):
        t.fetch_device(plan, b[4:], stream)
        stream.synchronize()
    else:
        t.read_plan(plan, b)


def _open_for(path, cfg, b: str, stream):
    """A fresh table whose reader for `b` is open (fd, ring, mapping; resident: loaded) outside the timing."""
    import gds_gather as gg
    t = gg.open_table(path, config=cfg)
    _fetch(t, b, t.plan(np.zeros(1, np.int64)), stream)
    return t


def _how(t, b: str) -> str:
    if b.startswith("gpu:"):
        return next(iter(t._sinks.values())).how
    return t._readers[b].how


def gather_pass(t, b: str, trace, stream=None) -> dict:
    """One timed pass over the trace; a gather is one row id (ns/gather = wall / row ids, as llama.cpp #137)."""
    path = t.path
    b0, res0, flt0 = _bytes_read(t), measure.resident_bytes(path), measure.major_faults()
    lat, useful, n_ids, uniq, wins = [], 0, 0, 0, 0
    t0 = time.perf_counter()
    for ids in trace:
        a = time.perf_counter()
        plan = t.plan(ids)
        _fetch(t, b, plan, stream)
        lat.append(time.perf_counter() - a)
        useful += plan.exact_bytes
        n_ids += plan.n_ids
        uniq += plan.n_unique
        wins += plan.n_windows
    wall = time.perf_counter() - t0
    read = _bytes_read(t) - b0
    return {"backend": b, "rows_per_s": n_ids / wall, "ns_per_gather": wall * 1e9 / n_ids, "seconds": wall,
            "ids": n_ids, "unique": uniq, "unique_rows_per_s": uniq / wall, "windows": wins,
            "bytes_read": read, "read_MiB_s": read / wall / MiB, "amplification": read / useful if useful else 0.0,
            "major_faults": measure.major_faults() - flt0,
            "page_cache_growth_MiB": (measure.resident_bytes(path) - res0) / MiB,
            "p50_ms": measure.percentile_ms(lat, 50), "p99_ms": measure.percentile_ms(lat, 99)}


def _gather_line(r: dict) -> str:
    return (f"  {r['backend']:<11} {r['cache']:<4} {r['ns_per_gather']:>9,.0f} ns/gather {r['rows_per_s']:>12,.0f} rows/s"
            f"  ampl {r['amplification']:6.1f}x  majflt {r['major_faults']:>7,}  cache +{r['page_cache_growth_MiB']:7.1f} MiB"
            f"  p50 {r['p50_ms']:7.2f} ms  p99 {r['p99_ms']:7.2f} ms   [{r['how']}]")


def _gpu_stream(backends):
    if not any(b.startswith("gpu:") for b in backends):
        return None
    import cupy
    return cupy.cuda.Stream(non_blocking=True)


def _gather_table(path: Path, label: str, a, cfg: Config, backends: list[str], facts_line) -> dict:
    import gds_gather as gg
    with gg.open_table(path, config=cfg) as t:
        trace, desc = _trace(t, a)
        data = t.path                       # the file holding the table (a shard of a split model)
        geo = dict(n_rows=t.n_rows, row_bytes=t.row_bytes, qtype=t.qtype.name, align=t.align, arch=t.arch,
                   table_bytes=t.n_bytes, window=t._typical_window())
    n_ids = sum(x.size for x in trace)
    print(f"\n## {label}: {path} ({geo['arch'] or '?'}, {geo['n_rows']:,} rows x {geo['row_bytes']:,} B "
          f"{geo['qtype']} = {geo['table_bytes'] / 1e9:.2f} GB; O_DIRECT alignment {geo['align']} B)")
    print(f"   trace: {desc}; {a.repeat} timed passes each, median shown; {facts_line(path)}", flush=True)
    out = {"label": label, "path": str(path), **geo, "trace": desc, "ids": n_ids, "runs": [], "fio": {}}
    stream = _gpu_stream(backends)
    cold_b = [b for b in backends if b != "resident"]
    med: dict = {}
    if not a.no_cold:
        how = go_cold(data, a.cold_method)
        print(f"cold ({how} before each pass; passes interleaved {'/'.join(cold_b)}; resident runs warm only: "
              f"its cold pass is a load of the whole table)", flush=True)
        runs: dict = {b: [] for b in cold_b}
        hows = {}
        for _ in range(a.repeat):
            for b in cold_b:
                with _open_for(path, cfg, b, stream) as t:
                    go_cold(data, a.cold_method)
                    runs[b].append(gather_pass(t, b, trace, stream))
                    hows[b] = _how(t, b)
        for b in cold_b:
            r = _median_run(runs[b], "rows_per_s")
            r.update(cache="cold", how=hows[b])
            med[(b, "cold")] = r
            out["runs"].append(r)
            print(_gather_line(r), flush=True)
        if not a.no_fio:
            for bs in sorted({4096, geo["window"]}):
                name = "4k" if bs == 4096 else f"{bs}"
                f = measure.fio_randread(data, bs=name, direct=True, iodepth=a.qd, runtime=a.fio_runtime)
                out["fio"][f"cold_{bs}"] = f
                if f and "iops" in f:
                    print(f"  fio randread {_bs_name(bs)} O_DIRECT io_uring "
                          f"QD {a.qd}: {f['iops']:,.0f} IOPS, {f['bw_MiBps']:,.0f} MiB/s   [{f['cmd']}]")
                else:
                    print(f"  fio {name}: {'not installed' if f is None else f.get('error')}")
        d = med.get(("direct", "cold"))
        print("ratios (cold):")
        for bs in sorted({4096, geo["window"]}):
            f = out["fio"].get(f"cold_{bs}") or {}
            if d and f.get("iops"):
                tgt = 0.9 if a.targets and bs == 4096 else None
                # direct submits one read per window: its reads/s is what compares with fio's IOPS
                reads = d["windows"] / d["seconds"]
                print(_ratio(f"direct rows/s / fio {_bs_name(bs)} IOPS", d["rows_per_s"], f["iops"], tgt)
                      + f";  direct's reads/s {reads:,.0f} = {reads / f['iops']:.2f}x, its MiB/s "
                        f"{d['read_MiB_s']:,.0f} = {d['read_MiB_s'] / f['bw_MiBps']:.2f}x fio's")
        for other, tgt in (("mmap", 3.0), ("pread", 1.3), ("readahead", None)):
            if (other, "cold") in med and d:
                print(_ratio(f"direct / {other}", d["rows_per_s"], med[(other, "cold")]["rows_per_s"],
                             tgt if a.targets else None))
        for dev in ("gpu:direct", "gpu:gds"):
            if (dev, "cold") in med and d:
                print(_ratio(f"{dev} / direct (host)", med[(dev, "cold")]["rows_per_s"], d["rows_per_s"]))
    warm = "none" if a.no_warm else a.warm
    if warm != "none":
        warm_path, copied = path, False
        if warm == "tmpfs":
            free = shutil.disk_usage(a.tmpfs).free
            if free < 2 * os.path.getsize(path):
                print(f"warm: skipped, {a.tmpfs} has {free / GiB:.1f} GiB free")
                warm_path = None
            else:
                warm_path = Path(a.tmpfs) / f"gds-gather-bench-{os.getpid()}.gguf"
                shutil.copyfile(path, warm_path)
                copied = True
        if warm_path is not None:
            try:
                out.update(_gather_warm(warm_path, warm, a, cfg, backends, trace, stream, med))
            finally:
                if copied:
                    warm_path.unlink(missing_ok=True)
    return out


def _gather_warm(path: Path, warm: str, a, cfg, backends, trace, stream, med) -> dict:
    from .storage import filesystem
    where = ("the same file after one untimed pass per backend (O_DIRECT reads still go to the drive)"
             if warm == "cache" else f"a copy on {a.tmpfs} ({filesystem(path)})")
    print(f"warm ({where}; passes interleaved)", flush=True)
    extra = {"runs_warm": [], "fio_warm": None}
    tables = {}
    direct_threads = 1        # io_uring: one submitting thread; the native pool (memory filesystems): its threads
    try:
        for b in backends:
            tables[b] = _open_for(path, cfg, b, stream)
            gather_pass(tables[b], b, trace, stream)              # warm-up
            r = getattr(tables[b], "_readers", {}).get("direct") if b == "direct" else None
            if r is not None and getattr(r, "ring", None) is None:
                direct_threads = r.threads
        runs: dict = {b: [] for b in backends}
        for _ in range(a.repeat):
            for b in backends:
                runs[b].append(gather_pass(tables[b], b, trace, stream))
        for b in backends:
            r = _median_run(runs[b], "rows_per_s")
            r.update(cache="warm", how=_how(tables[b], b))
            med[(b, "warm")] = r
            extra["runs_warm"].append(r)
            print(_gather_line(r), flush=True)
    finally:
        for t in tables.values():
            t.close()
    d = med.get(("direct", "warm"))
    jobs = direct_threads
    if warm == "tmpfs" and not a.no_fio:
        f = measure.fio_randread(path, bs="4k", direct=False, engine="psync", iodepth=1, numjobs=jobs,
                                 runtime=a.fio_runtime)
        extra["fio_warm"] = f
        if f and "iops" in f:
            print(f"  fio psync 4k, {jobs} job(s) (direct's thread count here): {f['iops']:,.0f} IOPS   "
                  f"[{f['cmd']}]")
    print("ratios (warm):")
    if extra["fio_warm"] and extra["fio_warm"].get("iops") and d:
        print(_ratio(f"direct / fio psync 4k {jobs} job(s)", d["rows_per_s"], extra["fio_warm"]["iops"],
                     0.7 if a.targets else None))
    for other in ("mmap", "pread", "resident"):
        if (other, "warm") in med and d:
            print(_ratio(f"direct / {other}", d["rows_per_s"], med[(other, "warm")]["rows_per_s"]))
    return extra


def _default_backends(cfg: Config) -> list[str]:
    """The host backends, and on a GPU the device destinations (gpu:gds where KvikIO is usable)."""
    from .platform import detect
    out = list(HOST_BACKENDS)
    plat = detect(cfg.platform)
    if plat.kind != "cpu":
        out.append("gpu:direct")
        if plat.kind == "discrete":
            from .backends import gds_state
            if gds_state()[0]:
                out.append("gpu:gds")
    return out


def run_gather(a, cfg: Config) -> dict:
    q = a.quick
    a.rows = a.rows or (200_000 if q else 24_000_000)
    a.gemma_rows = a.gemma_rows or (4096 if q else 262_144)
    a.tokens = a.tokens or (2048 if q else 8192)
    a.ubatch = a.ubatch or (1024 if q else 2048)
    a.ids = a.ids or (5000 if q else 100_000)
    a.batch = a.batch or (1000 if q else 16_384)
    a.repeat = a.repeat or (2 if q else 3)
    a.fio_runtime = a.fio_runtime or (1 if q else 5)
    if min(a.rows, a.gemma_rows, a.tokens, a.ubatch, a.ids, a.batch, a.repeat, a.qd) < 1:
        raise ValueError("sizes, --repeat and --qd must be >= 1")
    cfg = cfg.with_(queue_depth=a.qd)
    data_dir = Path(a.dir or a.out or default_dir(cfg))
    backends = [b.strip() for b in a.backends.split(",") if b.strip()] if a.backends else _default_backends(cfg)
    for b in backends:
        if b not in HOST_BACKENDS and b not in ("gpu:direct", "gpu:pread", "gpu:mmap", "gpu:readahead", "gpu:gds"):
            raise ValueError(f"unknown backend {b!r}; known: {', '.join(HOST_BACKENDS)}, gpu:direct, gpu:gds")
    tables: list[tuple[str, Path]] = []
    if a.file:
        tables = [(Path(f).name, Path(f)) for f in a.file]
    else:
        for name in [x.strip() for x in a.tables.split(",") if x.strip()]:
            if name == "qwen4exp":
                tables.append(("qwen4exp geometry", _built_table(data_dir, "qwen4exp", a.rows)))
            elif name == "gemma4-e4b":
                tables.append(("gemma4-e4b geometry", _built_table(data_dir, "gemma4-e4b", a.gemma_rows)))
            else:
                raise ValueError(f"--tables: qwen4exp and/or gemma4-e4b, got {name!r} (use --file for others)")
    facts = bench_facts(tables[0][1], cfg)
    print_header("gather", facts)
    print(f"# backends {', '.join(backends)}; QD {a.qd}; a gather = one row id (ns/gather = wall / row ids); "
          f"ampl = bytes read / bytes of the unique rows; majflt = major page faults of this process; cache = growth "
          f"of the file's page-cache residency; p50/p99 per gather call", flush=True)

    def facts_line(p):
        from .storage import filesystem
        return f"{filesystem(p)} on {block_device(p)}"

    result = {"bench": "gather", "facts": facts, "backends": backends, "trace": a.trace, "qd": a.qd,
              "repeat": a.repeat, "warm_mode": "none" if a.no_warm else a.warm, "tables": []}
    for label, path in tables:
        t = _gather_table(path, label, a, cfg, backends, facts_line)
        t["runs"] += t.pop("runs_warm", [])
        result["tables"].append(t)
    return _finish("gather", result, a, Path(a.out or data_dir), _plot_gather)


def _series(all_backends, runs):
    """(backends, caches, pick) of one panel: the measured backends in bench order, the caches present, and
    pick(backend, cache, key) -> that run's value or None."""
    backends = [b for b in all_backends if any(r["backend"] == b for r in runs)]
    caches = [c for c in ("cold", "warm") if any(r["cache"] == c for r in runs)]

    def pick(b, c, k):
        return next((r[k] for r in runs if r["backend"] == b and r["cache"] == c), None)
    return backends, caches, pick


def _plot_gather(res: dict, out) -> None:
    tabs = res["tables"]
    if not tabs:
        raise ValueError("nothing was measured: no plot")
    fig, axes = _figure(len(tabs), 6.6, 4.8)
    for ax, t in zip(axes, tabs):
        backends, caches, pick = _series(res["backends"], t["runs"])
        vals = {c: [pick(b, c, "rows_per_s") for b in backends] for c in caches}
        every = {c: [pick(b, c, "rows_per_s_all") or [0.0] for b in backends] for c in caches}
        _bars(ax, backends, caches, vals, lo={c: [min(x) for x in every[c]] for c in caches},
              hi={c: [max(x) for x in every[c]] for c in caches}, log=True,
              ylabel="rows gathered per second (median)")
        f = (t.get("fio") or {}).get("cold_4096") or {}
        if f.get("iops"):
            ax.axhline(f["iops"], color="k", ls="--", lw=1,
                       label=f"fio 4K randread O_DIRECT QD {res['qd']}: {_short(f['iops'])} IOPS")
        ax.set_title(f"{t['label']}: {t['n_rows']:,} rows x {t['row_bytes']:,} B {t['qtype']} "
                     f"({t['table_bytes'] / 1e9:.2f} GB)\n{_short(t['ids'])} row ids per pass "
                     f"({'text trace' if res['trace'] == 'text' else 'random ids'}); whiskers: min-max",
                     fontsize=9)
        ax.legend(fontsize=8, loc="upper left")
    warm = {"cache": "page cache warm", "tmpfs": "a tmpfs copy", "none": "not run"}[res["warm_mode"]]
    fig.suptitle(f"gds-gather bench gather, cold (page cache dropped) and warm ({warm})\n"
                 f"{machine_title(res['facts'])}", fontsize=10)
    fig.savefig(out)


# ================================================================================================ prefill

def _prefill_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", help="GGUF model (repeatable; default: the built-in qwen4exp model)")
    p.add_argument("--prompt", help="text file (default: the Python documentation topics)")
    p.add_argument("--tokens", type=int, help="prompt tokens (default 8192; --quick 2048)")
    p.add_argument("--ubatch", type=int, help="default 2048; --quick 1024")
    p.add_argument("--backends", help="comma list (default direct,pread,mmap,readahead,resident, and gds on a "
                                      "discrete GPU with KvikIO)")
    p.add_argument("--no-cold", action="store_true")
    p.add_argument("--no-warm", action="store_true")
    p.add_argument("--trunk", choices=("real", "tiny", "none"),
                   help="synthetic trunk (default: none on the CPU, i.e. the PLE fetch + dequant alone; real on a GPU)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--no-graph", action="store_true", help="GPU: run the steps eagerly (no CUDA graph)")
    p.add_argument("--targets", action="store_true",
                   help="the prefill issue's ratios: adds direct:nograph (GPU), fio's IOPS on the same file, and "
                        "direct cold vs min(resident, storage-bound tok/s) and vs mmap")


def run_prefill_bench(a, cfg: Config) -> dict:
    import gds_gather as gg
    from .platform import detect
    from .prefill import default_model, run_prefill
    q = a.quick
    a.tokens = a.tokens or (2048 if q else 8192)
    a.ubatch = a.ubatch or (1024 if q else 2048)
    a.repeat = a.repeat or (2 if q else 3)
    if min(a.tokens, a.ubatch, a.repeat) < 1:
        raise ValueError("--tokens, --ubatch and --repeat must be >= 1")
    plat = detect(cfg.platform)
    gpu = plat.kind != "cpu"
    trunk = a.trunk or ("real" if gpu else "none")
    if a.backends:
        backends = [b.strip() for b in a.backends.split(",") if b.strip()]
    else:
        backends = list(HOST_BACKENDS) + (["gds"] if "gpu:gds" in _default_backends(cfg) else [])
    if a.targets:
        backends = list(dict.fromkeys(["direct", "mmap", "resident"] + backends
                                      + (["direct:nograph"] if gpu and not a.no_graph else [])))
    models = [Path(m) for m in a.model] if a.model else [default_model(cfg, progress=True)]
    with gg.open_table(models[0], config=cfg) as t:
        facts = bench_facts(t.path, cfg)
    print_header("prefill", facts)
    pipeline = ("GPU pipeline (graph-captured fetch-dequant + trunk)" if gpu and not a.no_graph else
                "GPU pipeline, eager" if gpu else "CPU pipeline (no GPU here)")
    trunk_note = {"none": "none: the PLE fetch + dequant alone (the CPU default; --trunk tiny|real adds a synthetic "
                          "torch trunk)",
                  "tiny": "tiny synthetic torch trunk", "real": "synthetic trunk with the real shapes"}[trunk]
    print(f"# {pipeline}; trunk {trunk_note}; {a.tokens:,} tokens in ubatches of {a.ubatch:,}; backends interleaved "
          f"{'/'.join(backends)}; one warm-up run each, then {a.repeat} runs per backend cold (page cache emptied "
          f"before each run) and warm; tok/s min/median/max", flush=True)
    if "resident" in backends:
        print("# resident: each run opens the table afresh, so its time includes loading the whole table", flush=True)
    result = {"bench": "prefill", "facts": facts, "backends": backends, "trunk": trunk, "pipeline": pipeline,
              "tokens": a.tokens, "ubatch": a.ubatch, "repeat": a.repeat, "models": []}
    kw = dict(prompt=a.prompt, n_tokens=a.tokens, ubatch=a.ubatch, graph=not a.no_graph, cold=False, trunk=trunk,
              dtype=a.dtype, progress=False, log=None)
    for model in models:
        with gg.open_table(model, config=cfg) as t:
            table_path, desc = t.path, (f"{t.arch or '?'}, {t.qtype.name} table of {t.n_rows:,} rows x "
                                        f"{t.row_bytes:,} B")
        print(f"\n## {model} ({desc})", flush=True)
        def one(b):                             # "direct:nograph" is direct run eagerly (graph vs no-graph)
            name, _, mod = b.partition(":")
            return run_prefill(model, cfg, backend=name, **{**kw, "graph": kw["graph"] and mod != "nograph"})
        for b in backends:                      # warm-up: first-use costs (native build, kernels, graphs)
            one(b)
        m = {"model": str(model), "table": desc, "runs": []}
        series = [c for c in ("cold", "warm") if not getattr(a, f"no_{c}")]
        for cache in series:
            runs: dict = {b: [] for b in backends}
            for rep in range(a.repeat):
                for b in backends:
                    if cache == "cold":
                        go_cold(table_path, a.cold_method)
                    runs[b].append(one(b))
                print(f"    {cache} run {rep + 1}/{a.repeat}: "
                      + "  ".join(f"{b} {runs[b][-1]['tok_per_s']:,.0f}" for b in backends) + " tok/s", flush=True)
            for b in backends:
                tok = [r["tok_per_s"] for r in runs[b]]
                mid = _median_run(runs[b], "tok_per_s")
                s = {"backend": b, "cache": cache, "tok_per_s_min": min(tok), "tok_per_s_median": statistics.median(tok),
                     "tok_per_s_max": max(tok), "tok_per_s_all": tok, "rows_per_s": mid["rows_per_s"],
                     "read_amplification": mid["read_amplification"],
                     "page_cache_growth_MiB": mid["page_cache_growth_bytes"] / MiB, "ple_rows": mid["ple_rows"],
                     "unique_rows": mid["unique_rows"], "io_seconds": mid["io_seconds"], "how": mid["how"],
                     "pipeline": mid["pipeline"]}
                m["runs"].append(s)
                print(f"  {b:<10} {cache:<4} tok/s  min {s['tok_per_s_min']:>10,.0f}  median {s['tok_per_s_median']:>10,.0f}"
                      f"  max {s['tok_per_s_max']:>10,.0f}   PLE rows/s {s['rows_per_s']:>11,.0f}  "
                      f"ampl {s['read_amplification']:5.1f}x  cache +{s['page_cache_growth_MiB']:6.1f} MiB   "
                      f"[{s['how']}]", flush=True)
        get = {(r["backend"], r["cache"]): r["tok_per_s_median"] for r in m["runs"]}
        print("ratios (median tok/s):")
        for cache in series:
            for other in ("mmap", "pread", "resident"):
                if ("direct", cache) in get and (other, cache) in get and other != "direct":
                    print(_ratio(f"direct / {other} ({cache})", get[("direct", cache)], get[(other, cache)]))
        if a.targets and ("direct", "cold") in get:
            m["targets"] = _prefill_targets(table_path, get, m["runs"], a)
        result["models"].append(m)
    data_dir = Path(a.dir or a.out or default_dir(cfg))
    return _finish("prefill", result, a, Path(a.out or data_dir), _plot_prefill)


def _prefill_targets(path, get: dict, runs: list, a) -> dict:
    """The prefill issue's targets: cold direct >= 0.9 x min(resident, storage-bound), >= 3 x cold mmap."""
    from . import measure
    cold = next(r for r in runs if r["backend"] == "direct" and r["cache"] == "cold")
    rows_per_tok = cold["unique_rows"] / max(1, a.tokens)
    fio = measure.fio_randread(path, bs="4k", direct=True, iodepth=128, runtime=3 if a.quick else 5)
    iops = fio.get("iops") if fio else None
    bound = iops / rows_per_tok if iops else None
    resident = get.get(("resident", "warm")) or get.get(("resident", "cold"))
    d = get[("direct", "cold")]
    t = {"direct_cold_tok_s": d, "unique_rows_per_token": rows_per_tok, "fio_4k_iops": iops,
         "storage_bound_tok_s": bound, "resident_tok_s": resident}
    print("targets (prefill issue):")
    if iops:
        print(f"  storage-bound tok/s = fio 4K randread {iops:,.0f} IOPS / {rows_per_tok:.2f} unique rows per token "
              f"= {bound:,.0f}")
    limits = [x for x in (resident, bound) if x]
    if limits:
        print(_ratio("direct cold / min(resident, storage-bound)", d, min(limits), 0.9))
    if ("mmap", "cold") in get:
        print(_ratio("direct cold / mmap cold", d, get[("mmap", "cold")], 3.0))
    for cache in ("cold", "warm"):
        if ("direct:nograph", cache) in get:
            print(_ratio(f"graph / no-graph ({cache})", get[("direct", cache)], get[("direct:nograph", cache)]))
    return t


def _plot_prefill(res: dict, out) -> None:
    models = res["models"]
    if not models:
        raise ValueError("nothing was measured: no plot")
    fig, axes = _figure(len(models), 6.6, 4.6)
    for ax, m in zip(axes, models):
        backends, caches, pick = _series(res["backends"], m["runs"])
        _bars(ax, backends, caches, {c: [pick(b, c, "tok_per_s_median") for b in backends] for c in caches},
              lo={c: [pick(b, c, "tok_per_s_min") for b in backends] for c in caches},
              hi={c: [pick(b, c, "tok_per_s_max") for b in backends] for c in caches},
              log=True, ylabel="tokens per second (median; whiskers: min-max)")
        ax.set_title(f"{Path(m['model']).name}: {m['table']}", fontsize=9)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"gds-gather bench prefill: {res['pipeline']}, trunk {res['trunk']}, {res['tokens']:,} tokens, "
                 f"ubatch {res['ubatch']:,}\n{machine_title(res['facts'])}", fontsize=10)
    fig.savefig(out)


# ================================================================================================ entry points

BENCHES = {
    "storage": (_storage_args, run_storage,
                "storage-to-memory bandwidth after gdsio: GPU_DIRECT (cuFile), CPU_GPU (pinned bounce buffer + H2D "
                "copy), CPU only; GiB/s, IOPS, mean and p99 latency per I/O size"),
    "gather": (_gather_args, run_gather,
               "the gather microbenchmark: a real-text row-id trace on qwen4exp- and gemma4-e4b-geometry tables, "
               "every backend cold and warm, against fio on the same file"),
    "prefill": (_prefill_args, run_prefill_bench,
                "prefill A/B: backends interleaved, cold and warm, tok/s min/median/max"),
}


def add_arguments(name: str, p: argparse.ArgumentParser) -> None:
    """The options of bench `name` (shared by `gds-gather bench NAME` and bench/bench_NAME.py)."""
    BENCHES[name][0](p)
    p.add_argument("--repeat", type=int, help="timed repetitions per measurement, median shown "
                                              "(default 3; --quick 2)")
    p.add_argument("--cold-method", choices=("drop", "evict"), default="drop",
                   help="how to go cold: drop = the whole page cache (root; evict without root), evict = "
                        "POSIX_FADV_DONTNEED on the file only")
    p.add_argument("--quick", action="store_true", help="a small, short run (smoke test)")
    p.add_argument("--dir", help="where made files live (default bench/out in a checkout, else the cache dir)")
    p.add_argument("--out", help="where the JSON file goes (default --dir)")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    p.add_argument("--plot", metavar="FILE.png", help="draw the results (matplotlib)")
    p.add_argument("--json-name", help=argparse.SUPPRESS)


def build_parser(name: str, prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog or f"gds-gather bench {name}", description=BENCHES[name][2])
    add_arguments(name, p)
    return p


def run(name: str, args, cfg: Config | None = None) -> dict:
    return BENCHES[name][1](args, cfg or Config.from_env())


def main(name: str, argv=None, prog: str | None = None) -> dict:
    return run(name, build_parser(name, prog).parse_args(argv))


def storage_main(argv=None) -> dict:
    return main("storage", argv, "bench_storage.py")


def gather_main(argv=None) -> dict:
    return main("gather", argv, "bench_gather.py")


def prefill_main(argv=None) -> dict:
    return main("prefill", argv, "bench_prefill.py")
