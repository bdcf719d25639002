"""bench storage: storage-to-memory bandwidth after gdsio (GPU_DIRECT, CPU_GPU, CPUONLY), one line per configuration."""
from __future__ import annotations

import argparse
import math
import os
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np

from ..gpu import accel as accel_mod
from ..io import measure
from ..config import Config
from .plot import bars, figure
from .report import (COUNT, GiB, KiB, MiB, bench_facts, cold_method, data_dir, go_cold, machine_title, median_run,
                     out_dir, print_header, write_result)
from ..units import fit, human_size, parse_size

XFER = {"gpu-direct": "GPUD", "cpu-gpu": "CPU_GPU", "cpu": "CPUONLY"}
STORAGE_PATHS = ("gpu-direct", "cpu-gpu", "cpu")
BUF_MIN, BUF_MAX = 32 * MiB, 512 * MiB      # one thread's (half-)buffer: enough for the queue, bounded in memory
COMPAT_BANNER = "WARNING: cuFile runs in compat mode: GPU_DIRECT numbers measure POSIX reads + a copy"


def _storage_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--file", help="read this file (default: a file of --size random bytes, made once in --dir)")
    p.add_argument("--size", help="size of the made file (default 8G; --quick 256M)")
    p.add_argument("--io-size", help="comma list of I/O sizes (default 4K,64K,1M,16M; --quick 4K,1M)")
    p.add_argument("--threads", type=COUNT, default=1,
                   help="cpu, cpu-gpu: threads, each with its own io_uring, fd and buffer; gpu-direct: KvikIO's "
                        "thread pool size (num_threads) behind one submitter (default 1)")
    p.add_argument("--qd", type=COUNT, default=128,
                   help="I/Os in flight per thread (default 128; bounded by the buffer for large I/O sizes)")
    p.add_argument("--pattern", choices=("rand", "seq"), default="rand",
                   help="rand: uniform offsets aligned to the I/O size; seq: each thread walks its own region")
    p.add_argument("--path", default=",".join(STORAGE_PATHS),
                   help="comma list of transfer types, after gdsio: gpu-direct (cuFile into GPU memory), cpu-gpu "
                        "(O_DIRECT into a pinned bounce buffer + one H2D copy per batch), cpu (O_DIRECT into host "
                        "memory); default all three, the GPU ones are skipped (saying why) without a GPU")
    p.add_argument("--cold", action="store_true", help="evict the file from the page cache before each timed run "
                                                         "(--drop-caches: the whole machine's page cache)")
    p.add_argument("--seconds", type=float, help="length of each timed run (default 5; --quick 1)")
    p.add_argument("--bytes", help="read this many bytes per timed run instead of for --seconds (e.g. 4G)")
    p.add_argument("--warmup", type=float, help="seconds of untimed reads before each configuration "
                                                "(default 1; --quick 0.25)")


class StorageWorker:
    """One thread's reads of `io` bytes at a time: O_DIRECT through its own io_uring (cpu, cpu-gpu) or KvikIO
    CuFile.pread into device memory (gpu-direct), through `accel` (accel.get(Config.accel); default the GPU).
    Set up outside the timing; run() is the timed part."""

    def __init__(self, path: Path, xfer: str, io: int, qd: int, pattern: str, index: int, nthreads: int,
                 seed: int, threads: int, accel=None):
        from ..io.storage import logical_block_size
        self.path, self.xfer, self.io = path, xfer, io
        self.accel = accel
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
        from ..io import uring
        from ..io.readers import Staging
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
            acc = self._accel()
            acc.pin(self.staging, mapped=False)         # page-locked (portable) from its first ensure on
            self.stream = acc.stream()
            self.dev = acc.empty(self.slots * self.io)
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

    def _accel(self):
        if self.accel is None:
            self.accel = accel_mod.get("cuda")
        return self.accel

    def _setup_kvikio(self, threads: int) -> None:
        acc = self._accel()
        self.file, how, _ = acc.cufile(self.path, threads)
        self.dev = acc.empty(self.slots * self.io)
        self.views = [self.dev[s * self.io:(s + 1) * self.io] for s in range(self.slots)]
        self.batch_max = max(self.slots, min(65536, 8 * self.slots))
        self.notes.append(f"{how}; gds_threshold 0, one Python submitter keeping {self.qd} reads in flight")

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
            half = self.staging.buf[h * self.slots * self.io:(h + 1) * self.slots * self.io]
            self.accel.h2d(self.dev, half, n * self.io, self.stream)
            ev = self.accel.event()
            ev.record(self.stream)
            self.events[h] = ev
        return lat

    def _batch_kvikio(self, offs: np.ndarray, lat: np.ndarray) -> np.ndarray:
        from ..errors import ReadError
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
                self.accel.synchronize(self.stream)     # the last copies have landed
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
                seconds: float | None = 1.0, nbytes: int | None = None, seed: int = 0, accel=None) -> dict:
    """One timed run of one configuration: GiB/s, IOPS, mean and p99 per-I/O latency. `accel`: the device of the
    GPU transfers (default the GPU)."""
    nthreads = 1 if xfer == "gpu-direct" else threads
    workers = []
    try:
        for i in range(nthreads):
            workers.append(StorageWorker(path, xfer, io, qd, pattern, i, nthreads, seed, threads, accel))
        barrier = threading.Barrier(nthreads)
        io_count = measure.ReadCounter(path)
        ths = [threading.Thread(target=w.run, args=(seconds, nbytes and -(-nbytes // nthreads), barrier),
                                name=f"bench-storage-{i}") for i, w in enumerate(workers)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        for w in workers:
            if w.error is not None:
                raise w.error
        got = io_count.stop()
        ops = sum(w.ops for w in workers)
        wall = max(w.t1 for w in workers) - min(w.t0 for w in workers)
        lat = np.concatenate([w.lat for w in workers])
        return {"gib_s": ops * io / wall / GiB, "iops": ops / wall, "ops": ops, "bytes": ops * io, "seconds": wall,
                "bytes_delivered": got["delivered_bytes"], "bytes_device": got["device_bytes"],
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


def _mib(x) -> str:
    return "n/a" if x is None else f"{x / MiB:,.1f}"


def _lat(us: float) -> str:
    return f"{us:.1f}" if us < 100 else f"{us:.0f}"


def gdsio_line(c: dict) -> str:
    m = c["median"]
    return (f"IoType: {'RANDREAD' if c['pattern'] == 'rand' else 'READ'} XferType: {XFER[c['path']]} "
            f"Threads: {c['threads']} IoDepth: {m['qd']:.0f} "
            f"DataSetSize: {m['bytes'] // KiB:.0f}/{c['file_bytes'] // KiB}(KiB) "
            f"IOSize: {c['io_size'] // KiB}(KiB) Throughput: {m['gib_s']:.2f} GiB/sec, IOPS: {m['iops']:.0f}, "
            f"Avg_Latency: {_lat(m['mean_lat_us'])} usecs, p99_Latency: {_lat(m['p99_lat_us'])} usecs "
            f"ops: {m['ops']:.0f} total_time {m['seconds']:.1f} secs")


def run_storage(a, cfg: Config) -> dict:
    from ..platform import detect
    q = a.quick
    size = parse_size(a.size or ("256M" if q else "8G"))
    io_sizes = [parse_size(x) for x in (a.io_size or ("4K,1M" if q else "4K,64K,1M,16M")).split(",") if x.strip()]
    seconds = a.seconds if a.seconds is not None else (1.0 if q else 5.0)
    nbytes = parse_size(a.bytes) if a.bytes else None
    repeat = (2 if q else 3) if a.repeat is None else a.repeat
    warmup = a.warmup if a.warmup is not None else (0.25 if q else 1.0)
    paths = [x.strip() for x in a.path.split(",") if x.strip()]
    for x in paths:
        if x not in STORAGE_PATHS:
            raise ValueError(f"--path must be a comma list of {', '.join(STORAGE_PATHS)}; got {x!r}")
    if a.threads < 1 or a.qd < 1 or repeat < 1:
        raise ValueError("--threads, --qd and --repeat must be >= 1")
    path = Path(a.file) if a.file else storage_file(data_dir(a, cfg), size)
    file_bytes = os.path.getsize(path)
    facts = bench_facts(path, cfg)
    print_header("storage", facts, [cold_method(a) if a.cold else ""], quick=a.quick)
    plat = detect(cfg.platform)
    acc = accel_mod.get(cfg.accel)
    skipped = {}
    if plat.kind == "cpu":
        for x in ("gpu-direct", "cpu-gpu"):
            skipped[x] = "no usable GPU (platform cpu, see the header)"
    else:
        if plat.kind == "rocm":
            skipped["gpu-direct"] = "cuFile/KvikIO is NVIDIA only (platform rocm)"
        else:
            ok, real, why = acc.gds_state()
            if not ok:
                skipped["gpu-direct"] = why
            elif "gpu-direct" in paths:
                f, reads, real = acc.cufile(path, a.threads)     # (configures KvikIO's defaults for the runs)
                f.close()
                if not real:
                    print(COMPAT_BANNER)
                    print(f"  ({why})")
                print(f"# gpu-direct reads: {reads}")
                facts["kvikio_reads"] = reads
    how = f"{seconds:g} s" if not nbytes else f"{human_size(nbytes)}"
    print(fit(f"# {file_bytes / GiB:.2f} GiB file; {'random' if a.pattern == 'rand' else 'sequential'} reads; "
              f"threads {a.threads}; QD {a.qd}; {repeat} timed runs of {how} per configuration after {warmup:g} s of "
              f"warm-up, median shown; "
              f"{'cold (page cache emptied before each run)' if a.cold else 'page cache as it is'}", "#   "),
          flush=True)
    result = {"bench": "storage", "facts": facts, "file": str(path), "file_bytes": file_bytes, "pattern": a.pattern,
              "threads": a.threads, "qd": a.qd, "seconds": seconds, "bytes_per_run": nbytes, "repeat": repeat,
              "cold": a.cold, "results": [], "skipped": []}
    for x in paths:
        if x in skipped:
            print(fit(f"XferType: {XFER[x]} ({x}): skipped: {skipped[x]}"))
            result["skipped"].append({"path": x, "why": skipped[x]})
            continue
        for io in io_sizes:
            if io > file_bytes or io % facts["logical_block"]:
                why = (f"I/O size {io} is larger than the file" if io > file_bytes else
                       f"I/O size {io} is not a multiple of the {facts['logical_block']} B logical block")
                print(f"XferType: {XFER[x]} IOSize: {io // KiB}(KiB): skipped: {why}")
                result["skipped"].append({"path": x, "io_size": io, "why": why})
                continue
            kw = dict(threads=a.threads, qd=a.qd, pattern=a.pattern, accel=acc)
            if warmup > 0:
                storage_run(path, x, io, seconds=warmup, seed=99, **kw)
            runs = []
            for r in range(repeat):
                if a.cold:
                    go_cold(path, a.drop_caches)
                runs.append(storage_run(path, x, io, seconds=None if nbytes else seconds, nbytes=nbytes, seed=r,
                                        **kw))
            c = {"path": x, "xfer": XFER[x], "io_size": io, "pattern": a.pattern, "threads": a.threads,
                 "file_bytes": file_bytes, "runs": runs, "median": median_run(runs, "gib_s")}
            result["results"].append(c)
            each = " ".join(f"{r['gib_s']:.2f}" for r in runs)
            m = c["median"]
            print(gdsio_line(c), flush=True)      # gdsio's own line, verbatim: tools that parse gdsio's output read it
            print(fit(f"    delivered: {_mib(m['bytes_delivered'])} MiB, device: {_mib(m['bytes_device'])} MiB   "
                      f"[runs {each} GiB/s; {', '.join(runs[0]['notes'])}]", "      "), flush=True)
    return write_result("storage", result, a, out_dir(a, cfg), _plot_storage)


def _plot_storage(res: dict, out) -> None:
    rows = res["results"]
    if not rows:
        raise ValueError("nothing was measured: no plot")
    sizes = sorted({r["io_size"] for r in rows})
    paths = [p for p in STORAGE_PATHS if any(r["path"] == p for r in rows)]
    groups = [human_size(s) for s in sizes]

    def get(p, s, k):
        return next((r["median"][k] for r in rows if r["path"] == p and r["io_size"] == s), None)

    fig, (ax1, ax2) = figure(2, 5.6, 4.4)
    names = {p: f"{XFER[p]} ({p})" for p in paths}
    bars(ax1, groups, [names[p] for p in paths], {names[p]: [get(p, s, "gib_s") for s in sizes] for p in paths},
         ylabel="GiB/s (median)", label_fmt=lambda v: f"{v:.2f}")
    ax1.set_xlabel("I/O size")
    ax1.set_title(f"throughput, {'random' if res['pattern'] == 'rand' else 'sequential'} reads, "
                  f"{res['threads']} thread(s), QD up to {res['qd']}", fontsize=10)
    ax1.legend(fontsize=8)
    bars(ax2, groups, [names[p] for p in paths], {names[p]: [get(p, s, "mean_lat_us") for s in sizes] for p in paths},
         lo={names[p]: [get(p, s, "mean_lat_us") for s in sizes] for p in paths},
         hi={names[p]: [get(p, s, "p99_lat_us") for s in sizes] for p in paths},
         log=True, ylabel="latency per I/O, us (bar: mean, whisker: p99)", label_fmt=lambda v: f"{v:.0f}")
    ax2.set_xlabel("I/O size")
    ax2.set_title("latency", fontsize=10)
    fig.suptitle(f"gds-gather bench storage: {res['file_bytes'] / GiB:.2f} GiB file\n{machine_title(res['facts'])}",
                 fontsize=10)
    fig.savefig(out)


