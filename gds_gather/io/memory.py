"""The memory this process may still use: its memory cgroup's limit less its usage (cgroup v2, else v1), the
cgroup's inactive file pages not counted as used (the page cache the kernel reclaims first: a table just written or
read buffered is charged to the cgroup that touched it), and the kernel's MemAvailable, whichever is less.

Budgets (the row cache's, the kept staging buffer's) are sized against this, not the machine's RAM: a process in a
512 MiB cgroup on a 16 GiB host is killed at 512 MiB. Read from a few small files under a root directory ("/" by
default; tests point it at a fake tree), once per process and root (`limits`; `refresh` reads again), so a budget
derived from it stays the same for the process's life (the row caches are keyed by their budget).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from . import forksafe

V1_NO_LIMIT = 1 << 60      # cgroup v1 says "no limit" with a page-rounded LONG_MAX; any value this large is none


@dataclass(frozen=True)
class Limits:
    """What was read; None where there was nothing to read (no memory cgroup, no limit, no /proc/meminfo)."""
    cgroup_limit: int | None        # bytes: the binding limit of this cgroup and its ancestors
    cgroup_usage: int | None        # bytes charged to the cgroup whose limit binds
    cgroup_source: str | None       # e.g. "cgroup v2 /user.slice/x" (the cgroup whose limit binds)
    mem_available: int | None       # /proc/meminfo MemAvailable, bytes
    meminfo_source: str | None = None
    cgroup_inactive_file: int | None = None    # bytes of that usage in inactive file pages (memory.stat)


def available(limits: Limits) -> int | None:
    """The bytes this process may still use: min(MemAvailable, cgroup limit - (usage - inactive file pages)); None
    when neither is known."""
    terms = [t for t in (cgroup_headroom(limits), limits.mem_available) if t is not None]
    return min(terms) if terms else None


def cgroup_headroom(limits: Limits) -> int | None:
    if limits.cgroup_limit is None:
        return None
    return max(limits.cgroup_limit - _working_set(limits.cgroup_usage, limits.cgroup_inactive_file), 0)


def _working_set(usage: int | None, inactive_file: int | None) -> int:
    return max((usage or 0) - (inactive_file or 0), 0)


def source(limits: Limits) -> str:
    """Where available() came from, in words: the cgroup whose limit binds, else MemAvailable."""
    head = cgroup_headroom(limits)
    if head is not None and (limits.mem_available is None or head <= limits.mem_available):
        used = f"{limits.cgroup_source} limit {limits.cgroup_limit:,} B less {limits.cgroup_usage or 0:,} B used"
        return used + (f" ({limits.cgroup_inactive_file:,} B of it inactive page cache, not counted)"
                       if limits.cgroup_inactive_file else "")
    if limits.mem_available is not None:
        return "MemAvailable" + ("" if limits.cgroup_limit is None else f" (below the {limits.cgroup_source} limit)")
    return "unknown (no memory cgroup limit, no /proc/meminfo)"


_CACHED: dict = {}
_LOCK = threading.Lock()


def _after_fork() -> None:
    # a forked child: another parent thread may have held the lock at fork(); the kept Limits stay true
    global _LOCK
    _LOCK = threading.Lock()


forksafe.on_child(_after_fork)


def limits(root=None) -> Limits:
    """This process's Limits under `root` (None: "/"), read on first use and kept (refresh() forgets them)."""
    key = str(root or "/")
    with _LOCK:
        got = _CACHED.get(key)
        if got is None:
            got = _CACHED[key] = read(Path(key))
        return got


def refresh() -> None:
    """Forget the kept Limits: the next limits() reads the files again (tests, a process moved between cgroups)."""
    with _LOCK:
        _CACHED.clear()


def _own_paths(root: Path) -> tuple[str | None, str | None]:
    """(v1 memory cgroup path, v2 cgroup path) of this process from root/proc/self/cgroup (None where absent)."""
    v1_path = v2_path = None
    for line in _text(root / "proc/self/cgroup").splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "memory" in controllers.split(","):
            v1_path = path
        elif hid == "0" and controllers == "":
            v2_path = path
    return v1_path, v2_path


def own_cgroup(root: Path = Path("/")) -> tuple[str, Path] | None:
    """("v1" or "v2", the directory of this process's memory cgroup), or None without one (a v1 memory hierarchy
    controls memory where it is mounted; a path missing under the mount reads as the mount's root, as in _walk)."""
    v1_path, v2_path = _own_paths(root)
    for kind, path, mount in (("v1", v1_path, root / "sys/fs/cgroup/memory"), ("v2", v2_path, root / "sys/fs/cgroup")):
        if path is None or not mount.is_dir() or (kind == "v2" and not (mount / "cgroup.controllers").exists()):
            continue
        d = mount.joinpath(*[p for p in path.strip("/").split("/") if p])
        return kind, d if d.is_dir() else mount
    return None


def read(root: Path) -> Limits:
    """Read the limits now from root/proc/self/cgroup, root/sys/fs/cgroup/... and root/proc/meminfo."""
    v1_path, v2_path = _own_paths(root)
    limit = usage = where = inactive = None
    if v1_path is not None:         # a v1 memory hierarchy controls memory (a controller binds to one hierarchy)
        limit, usage, where, inactive = _walk(root / "sys/fs/cgroup/memory", v1_path, "memory.limit_in_bytes",
                                              "memory.usage_in_bytes", "cgroup v1", "total_inactive_file")
    elif v2_path is not None:
        limit, usage, where, inactive = _walk(root / "sys/fs/cgroup", v2_path, "memory.max", "memory.current",
                                              "cgroup v2", "inactive_file")
    avail = None
    meminfo = root / "proc/meminfo"
    for line in _text(meminfo).splitlines():
        if line.startswith("MemAvailable:"):
            avail = int(line.split()[1]) * 1024
            break
    return Limits(limit, usage, where, avail, str(meminfo) if avail is not None else None, inactive)


def _walk(mount: Path, path: str, limit_file: str, usage_file: str, kind: str, inactive_key: str):
    """The cgroup at `path` and its ancestors up to the mount: (limit, usage, where, inactive file bytes) of the one
    with the least headroom (limit - usage + inactive file pages, from memory.stat's `inactive_key`: hierarchical
    in both versions). A path missing under the mount (a container that mounts its own cgroup as the root) reads
    the mount's root."""
    parts = [p for p in path.strip("/").split("/") if p]
    if not (mount.joinpath(*parts)).is_dir():
        parts = []
    best, head = (None, None, None, None), None
    for n in range(len(parts), -1, -1):
        d = mount.joinpath(*parts[:n])
        limit = _number(d / limit_file)
        if limit is None or limit >= V1_NO_LIMIT:
            continue
        usage, inactive = _number(d / usage_file), stat_value(d / "memory.stat", inactive_key)
        room = limit - _working_set(usage, inactive)
        if head is None or room < head:
            best, head = (limit, usage, f"{kind} /{'/'.join(parts[:n])}", inactive), room
    return best


def stat_value(path: Path, key: str) -> int | None:
    """The value of `key` in a cgroup's memory.stat file (bytes), or None (no file, no such key)."""
    for line in _text(path).splitlines():
        k, _, v = line.partition(" ")
        if k == key:
            try:
                return int(v)
            except ValueError:
                return None
    return None


def _number(path: Path) -> int | None:
    text = _text(path).strip()
    try:
        return int(text) if text and text != "max" else None
    except ValueError:
        return None


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return ""
