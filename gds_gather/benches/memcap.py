"""`bench gather --memory-limit SIZE`: the bench's passes in a memory cgroup of their own, each pass's peak memory
and the page cache charged to it, and a record of every pass that survives the one that does not.

The parent makes a child memory cgroup of its own (cgroup v1: memory.limit_in_bytes, v2: memory.max; no swap
beyond the limit where the files exist), and runs the bench itself as a child process inside it (ENV names the
cgroup to the child and to the child's own new-process passes, which start inside it). The parent stays outside:
when the kernel's OOM killer ends the child, the parent still has every finished pass (the child appends each to
the pass log, PASSLOG, as it finishes) and writes them with the pass that died. Where no cgroup can be made (no
memory controller, no permission) --memory-limit is refused with one line before anything runs.

Peaks: v1 memory.max_usage_in_bytes, v2 memory.peak, reset before each pass where the kernel allows it (v1 always;
v2 from Linux 6.12), else the peak since the cap was made (said so in the record).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import CapError
from ..io import memory

ENV = "GDS_GATHER_BENCH_CGROUP"
PASSLOG = "GDS_GATHER_BENCH_PASSLOG"
FILES = {"v1": {"limit": "memory.limit_in_bytes", "swap": "memory.memsw.limit_in_bytes",
                "peak": "memory.max_usage_in_bytes", "usage": "memory.usage_in_bytes", "events": "memory.oom_control",
                "cache": "cache"},
         "v2": {"limit": "memory.max", "swap": "memory.swap.max", "peak": "memory.peak", "usage": "memory.current",
                "events": "memory.events", "cache": "file"}}


@dataclass
class MemoryCap:
    """A memory cgroup: its kind ("v1" / "v2") and directory."""
    kind: str
    dir: Path

    @classmethod
    def make(cls, limit: int, root: Path = Path("/")) -> "MemoryCap":
        """A new child cgroup of this process's own, limited to `limit` bytes (CapError where that fails)."""
        found = memory.own_cgroup(root)
        if found is None:
            raise CapError("--memory-limit: this process has no memory cgroup to make a child of (no memory "
                           "controller mounted under /sys/fs/cgroup)")
        kind, parent = found
        d = parent / f"gds-gather-bench-{os.getpid()}-{time.monotonic_ns() % 10**6}"
        try:
            d.mkdir()
            if kind == "v2" and not (d / "memory.max").exists():
                raise CapError(f"--memory-limit: the memory controller is not enabled for children of {parent} "
                               f"(cgroup.subtree_control)")
            (d / FILES[kind]["limit"]).write_text(str(limit))
        except OSError as e:
            if d.is_dir():
                d.rmdir()
            raise CapError(f"--memory-limit: cannot make a memory cgroup under {parent}: "
                           f"{e.strerror or e}") from None
        cap = cls(kind, d)
        cap._write("swap", str(limit) if kind == "v1" else "0")    # no swap beyond the limit, where it can be set
        return cap

    @classmethod
    def from_env(cls) -> "MemoryCap | None":
        """The cap this process runs in (ENV, set by the parent bench), or None."""
        v = os.environ.get(ENV)
        if not v:
            return None
        kind, _, d = v.partition(":")
        return cls(kind, Path(d))

    def env(self) -> dict:
        return {ENV: f"{self.kind}:{self.dir}"}

    def enter(self, pid: int) -> None:
        (self.dir / "cgroup.procs").write_text(str(pid))

    def _read(self, key: str) -> str:
        try:
            return (self.dir / FILES[self.kind][key]).read_text()
        except OSError:
            return ""

    def _write(self, key: str, value: str) -> bool:
        try:
            (self.dir / FILES[self.kind][key]).write_text(value)
            return True
        except OSError:
            return False

    def reset_peak(self) -> bool:
        """Start a new peak (v1: write 0; v2: Linux 6.12's reset); False where the peak runs from the cap's start."""
        return self._write("peak", "0" if self.kind == "v1" else "reset")

    def peak(self) -> int | None:
        v = self._read("peak").strip()
        return int(v) if v.isdigit() else None

    def cache(self) -> int | None:
        """Page cache charged to the cgroup now (memory.stat's cache / file)."""
        return memory.stat_value(self.dir / "memory.stat", FILES[self.kind]["cache"])

    def oom_kills(self) -> int:
        for line in self._read("events").splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill" and v.strip().isdigit():
                return int(v)
        return 0

    def kill(self) -> None:
        """SIGKILL every process in the cgroup (the bench child and its passes: the parent is stopping early)."""
        try:
            pids = (self.dir / "cgroup.procs").read_text().split()
        except OSError:
            return
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

    def close(self) -> None:
        """Remove the cgroup (its processes have ended; a v1 cgroup with charged page cache still goes)."""
        for _ in range(50):
            try:
                self.dir.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


class PassMemory:
    """Around one pass in a capped process: the peak reset before, (peak, page cache charged) after."""

    def __init__(self):
        self.cap = MemoryCap.from_env()
        self.reset = self.cap.reset_peak() if self.cap else False

    def fields(self) -> dict:
        if self.cap is None:
            return {}
        mib = (lambda v: None if v is None else v / (1 << 20))     # noqa: E731
        return {"peak_MiB": mib(self.cap.peak()), "peak_since": "pass" if self.reset else "cap",
                "cache_charged_MiB": mib(self.cap.cache())}


def log_pass(backend: str, name: str, run: dict | None) -> None:
    """Append a pass to the pass log (PASSLOG) of a capped bench: run None when it starts, its figures when done."""
    path = os.environ.get(PASSLOG)
    if not path:
        return
    rec = {"backend": backend, "pass": name, "state": "started" if run is None else "done"}
    if run is not None:
        rec["run"] = run
    with open(path, "a") as f:
        f.write(json.dumps(rec, default=float) + "\n")


def read_log(path: Path) -> list[dict]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:          # a line the killed process left half written
            break
    return out


@contextlib.contextmanager
def terminate_exits():
    """SIGTERM raises SystemExit(143) in the main thread while inside (so a `kill` of the parent bench still runs its
    cleanup: the capped child killed, the cgroup removed); elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)
    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
