"""Measurement helpers shared by the benchmarks: cache state, page-cache residency, faults, machine facts."""
from __future__ import annotations

import ctypes
import functools
import json
import mmap
import os
import platform
import resource
import shutil
import subprocess
import sys

import numpy as np


def drop_caches() -> bool:
    """Evict the page cache (needs root); False when not allowed. Mapped pages of live mappings stay."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def evict_file(path) -> None:
    """Drop one file's clean pages from the page cache (works without root)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@functools.cache
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def resident_bytes(path) -> int:
    """Bytes of `path` now in the page cache (mincore over a fresh read-only mapping)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    page = mmap.PAGESIZE
    vec = np.zeros((size + page - 1) // page, np.uint8)
    arr = np.frombuffer(mm, np.uint8)     # only to learn the mapping's address; nothing is read
    rc = _libc().mincore(ctypes.c_void_p(arr.ctypes.data), ctypes.c_size_t(size), vec.ctypes.data_as(ctypes.c_void_p))
    del arr
    mm.close()
    return int((vec & 1).sum()) * page if rc == 0 else -1


def major_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def percentile_ms(seconds, q) -> float:
    return float(np.percentile(np.asarray(seconds) * 1e3, q)) if len(seconds) else 0.0


def fio_randread(path, *, bs="4k", direct=True, engine="io_uring", iodepth=64, numjobs=1, runtime=5,
                 size=None) -> dict | None:
    """fio's random-read figure on the same file, or None when fio is absent or fails."""
    fio = shutil.which("fio")
    if not fio:
        return None
    cmd = [fio, "--name=gg", f"--filename={path}", "--rw=randread", f"--bs={bs}", f"--direct={int(direct)}",
           f"--ioengine={engine}", f"--iodepth={iodepth}", f"--numjobs={numjobs}", "--group_reporting",
           f"--runtime={runtime}", "--time_based", "--output-format=json", "--readonly"]
    if size:
        cmd.append(f"--size={size}")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        return {"error": r.stderr.strip()[:200], "cmd": " ".join(cmd)}
    job = json.loads(r.stdout)["jobs"][0]["read"]
    return {"iops": job["iops"], "bw_MiBps": job["bw"] / 1024, "cmd": " ".join(cmd),
            "version": json.loads(r.stdout).get("fio version", "")}


def machine_facts(path=None) -> dict:
    """The header every benchmark prints: CPU, cores, memory, kernel, Python, storage under `path`, GPU."""
    from .platform import detect
    from .storage import filesystem, logical_block_size
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "?")
    except OSError:
        pass
    facts = {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(),
             "python": sys.version.split()[0], "numpy": np.__version__,
             "mem_GiB": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}
    if path is not None:
        facts.update(file=str(path), filesystem=filesystem(path), logical_block=logical_block_size(path),
                     file_GiB=round(os.path.getsize(path) / 2**30, 2))
    plat = detect()
    facts.update(platform=plat.kind, gpu=plat.device or "none", platform_reason=plat.reason)
    return facts
