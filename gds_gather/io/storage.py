"""Facts about the storage under a file: logical block size (O_DIRECT alignment), filesystem, device; and closing
the mappings the readers and caches make of it."""
from __future__ import annotations

import os
from pathlib import Path

DEFAULT_BLOCK = 4096


def close_mapping(m) -> None:
    """Unmap an mmap.mmap (None is fine); where numpy views of it still exist the GC unmaps it when they die."""
    if m is not None:
        try:
            m.close()
        except BufferError:
            pass


def _sysfs_queue(dev: int) -> Path | None:
    base = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for q in (base / "queue", base.parent / "queue" if base.exists() else None, base / ".." / "queue"):
        if q is not None and (q / "logical_block_size").exists():
            return q
    return None


def logical_block_size(path) -> int:
    """The logical block size of the device holding `path` (O_DIRECT's alignment), or 4096 when unknown
    (tmpfs, overlay, network filesystems)."""
    try:
        q = _sysfs_queue(os.stat(path).st_dev)
        if q is not None:
            n = int((q / "logical_block_size").read_text())
            if n > 0 and n & (n - 1) == 0:
                return n
    except (OSError, ValueError):
        pass
    return DEFAULT_BLOCK


def filesystem(path) -> str:
    """The filesystem type of the mount holding `path` (from /proc/mounts), or '?'."""
    try:
        p = os.path.realpath(path)
        best, kind = "", "?"
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and (p == parts[1] or p.startswith(parts[1].rstrip("/") + "/")):
                    if len(parts[1]) >= len(best):
                        best, kind = parts[1], parts[2]
        return kind
    except OSError:
        return "?"
