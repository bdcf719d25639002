"""Measurement helpers shared by the benchmarks: cache state, page-cache residency, faults, machine facts."""
from __future__ import annotations

import ctypes
import json
import mmap
import os
import platform
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from .libc import libc


def drop_caches(control="/proc/sys/vm/drop_caches") -> bool:
    """Empty the WHOLE machine's page cache (echo 3 > /proc/sys/vm/drop_caches; root only); False when refused.
    Only ever called when a user asks for it (--drop-caches). Mapped pages of live mappings stay."""
    try:
        os.sync()
        with open(control, "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def evict_file(path) -> int:
    """Drop one file's clean pages from the page cache (fsync, then POSIX_FADV_DONTNEED; works without root).
    Returns the bytes of the file still cached afterwards (mincore): pages mapped by a live mapping stay."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return resident_bytes(path)


def resident_bytes(path, offset: int = 0, length: int | None = None) -> int:
    """Bytes of `path` now in the page cache (mincore over a fresh read-only mapping); with offset/length, of the
    pages overlapping that byte range only (e.g. a table's data, not the header a metadata mapping keeps)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    page = mmap.PAGESIZE
    vec = np.zeros((size + page - 1) // page, np.uint8)
    arr = np.frombuffer(mm, np.uint8)     # only to learn the mapping's address; nothing is read
    rc = libc().mincore(ctypes.c_void_p(arr.ctypes.data), ctypes.c_size_t(size), vec.ctypes.data_as(ctypes.c_void_p))
    del arr
    mm.close()
    end = size if length is None else min(size, offset + length)
    return int((vec[offset // page:(end + page - 1) // page] & 1).sum()) * page if rc == 0 else -1


PROC_IO_METHOD = ("/proc/self/io read_bytes: storage reads this process caused (its threads, io_uring workers, "
                  "readahead and page-fault reads)")


def counter_name(method: str | None, missing: str = "n/a") -> str:
    """A byte counter's short name, the part of its method text before ': ' (PROC_IO_METHOD, the device's)."""
    return (method or missing).split(": ")[0]


def proc_read_bytes(io="/proc/self/io") -> int | None:
    """read_bytes of /proc/self/io (every thread of this process, exited ones included), or None where the
    kernel has no task I/O accounting."""
    try:
        with open(io) as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def block_stat_path(path) -> Path | None:
    """/sys/dev/block/MAJ:MIN/stat of the block device (or partition) holding `path`; None on tmpfs, overlay,
    network filesystems or where sysfs is not readable."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    return stat if os.access(stat, os.R_OK) else None


def device_read_bytes(stat: Path | None) -> int | None:
    """Bytes the block device has delivered since boot: field 3 of its stat file (sectors read, in 512 B units).
    System-wide: every process's reads of that device count."""
    if stat is None:
        return None
    try:
        return int(stat.read_text().split()[2]) * 512
    except (OSError, ValueError, IndexError):
        return None


class ReadCounter:
    """Bytes the storage actually delivered between start() and stop(), by two named methods:
    delivered_bytes from /proc/self/io (this process only) and device_bytes from the block device's counter
    (system-wide, so other processes' reads of that device count too). None where a method is unavailable."""

    def __init__(self, path):
        self.stat = block_stat_path(path)
        name = self.stat.parent.resolve().name if self.stat is not None else None
        self.device_method = (f"{self.stat} ({name}) sectors read x 512: the whole device, every process"
                              if self.stat is not None else None)
        self.start()

    def start(self) -> "ReadCounter":
        self._p0, self._d0 = proc_read_bytes(), device_read_bytes(self.stat)
        return self

    def stop(self) -> dict:
        p1, d1 = proc_read_bytes(), device_read_bytes(self.stat)
        return {"delivered_bytes": None if p1 is None or self._p0 is None else p1 - self._p0,
                "device_bytes": None if d1 is None or self._d0 is None else d1 - self._d0,
                "delivered_method": PROC_IO_METHOD if p1 is not None else None,
                "device_method": self.device_method}


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


def machine_facts(path=None, cpuinfo="/proc/cpuinfo") -> dict:
    """The header every benchmark prints: CPU, cores, memory, kernel, Python, storage under `path`, GPU."""
    from ..platform import detect
    from .storage import filesystem, logical_block_size
    cpu = "?"
    try:
        with open(cpuinfo) as f:
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
