"""All configuration in one frozen dataclass, read from the environment only by Config.from_env()."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Mapping

ENV_PREFIX = "GDS_GATHER_"
_MAX_ALIGN = 1 << 20            # O_DIRECT alignment above 1 MiB is no device's block size
# bounds of the integer settings: queue depth is an io_uring's entries (1..4096); 0 threads = 2 x cores
_INT_RANGES = {"max_gap": (0, 1 << 40), "max_window": (0, 1 << 40), "threads": (0, 1024), "queue_depth": (1, 4096)}
_INT_RANGES.update(cache_bytes=(-1, 1 << 50), page_cache_reads=(0, 1), hot_rows=(0, 1), queue_depth_max=(1, 4096),
                   vllm=(0, 1), prefetch=(0, 1))


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gds-gather"


@dataclass(frozen=True)
class Config:
    backend: str = "auto"       # GDS_GATHER_BACKEND: force a backend (see gds_gather.backends())
    platform: str = "auto"      # GDS_GATHER_PLATFORM: auto | discrete | unified | rocm | cpu (override detection)
    accel: str = "cuda"         # GDS_GATHER_ACCEL: the device of the GPU path: cuda | host (accel.HostAccel: the
    #                             whole device path run on the host, for tests and debugging)
    align: int = 0              # GDS_GATHER_ALIGN: O_DIRECT window alignment; 0 = max(4096, logical block size)
    max_gap: int = 0            # GDS_GATHER_MAX_GAP: merge windows separated by at most this many unread BYTES
    max_window: int = 1 << 20   # GDS_GATHER_MAX_WINDOW: cap on one O_DIRECT window's bytes (0: none); exceeded only
    #                             where no cut fits (one row larger, or rows sharing aligned blocks across the cut)
    max_waste: float = 16.0     # GDS_GATHER_MAX_WASTE: bridge a gap only if it is <= this many bytes per useful
    #                             byte of the row the merge brings in (caps what merging adds to the amplification)
    threads: int = 0            # GDS_GATHER_THREADS: reader threads; 0 = 2 x cores
    queue_depth: int = 256      # GDS_GATHER_QUEUE_DEPTH: reads in flight for the batched engines (256: half the
    #                             io_uring_enter calls of 128 on many small windows; docs/decisions/queue-depth.md)
    engine: str = "auto"        # GDS_GATHER_ENGINE: how `direct` submits: auto | uring | threads
    cache_dir: Path = _default_cache_dir()   # GDS_GATHER_CACHE_DIR: where the built-in default model is kept
    cache_bytes: int = -1       # GDS_GATHER_CACHE_BYTES: row cache budget (rows + index), shared by the Tables of one
    #                             file; -1 = auto: 10% of the table, at most 256 MiB and 1/8 of the
    #                             memory available (io/memory.py); 0 = no cache (see rowcache.py)
    page_cache_reads: int = 1   # GDS_GATHER_PAGE_CACHE_READS: direct copies rows the page cache holds (mincore) and
    #                             reads only the rest O_DIRECT; 0 = everything O_DIRECT
    hot_rows: int = 1           # GDS_GATHER_HOT_ROWS: the row cache's rows saved in cache_dir/hot when a Table closes
    #                             and at exit, read by the next process (hotrows.py); 0 = off
    queue_depth_max: int = 512  # GDS_GATHER_QUEUE_DEPTH_MAX: wide rows: QD = queue_depth x (window / 4 KiB), up to this
    vllm: int = 0               # GDS_GATHER_VLLM: 1 = the vLLM plugin serves Gemma 4 / 3n PLE rows from disk
    vllm_table: Path | None = None   # GDS_GATHER_VLLM_TABLE: the plugin's table file (default: the checkpoint)
    prefetch: int = 1           # GDS_GATHER_PREFETCH: 1 = Table.prefetch(ids) reads the next batch ahead (prefetch.py);
    #                             0 = it does nothing
    memory_root: Path | None = None  # GDS_GATHER_MEMORY_ROOT: read the memory limits (cgroup, /proc/meminfo) under
    #                             this directory instead of / (tests: a fake tree; io/memory.py)

    def __post_init__(self) -> None:
        # every message names the variable (and the field, for Config(...) callers)
        def bad(name: str, want: str, got) -> ValueError:
            return ValueError(f"{ENV_PREFIX + name.upper()} ({name}) must be {want}, got {got!r}")
        if self.align and (self.align < 0 or self.align & (self.align - 1) or self.align > _MAX_ALIGN):
            raise bad("align", f"0 or a power of two up to {_MAX_ALIGN}", self.align)
        if self.engine not in ("auto", "uring", "threads"):
            raise bad("engine", "auto, uring or threads", self.engine)
        if self.accel not in ("cuda", "host"):
            raise bad("accel", "cuda or host", self.accel)
        if self.platform not in ("auto", "discrete", "unified", "rocm", "cpu"):
            raise bad("platform", "auto, discrete, unified, rocm or cpu", self.platform)
        if isinstance(self.max_waste, bool) or not isinstance(self.max_waste, (int, float)) \
                or not self.max_waste >= 0:
            raise bad("max_waste", "a number >= 0", self.max_waste)
        for name, (lo, hi) in _INT_RANGES.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise bad(name, f"an integer in {lo}..{hi}", v)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> "Config":
        """Read every GDS_GATHER_* variable once; explicit keyword overrides win."""
        env = os.environ if env is None else env
        kw: dict = {}
        for f in fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is None or raw == "":
                continue
            if f.name in ("cache_dir", "vllm_table", "memory_root"):     # paths keep their case
                kw[f.name] = Path(raw)
            elif f.type in ("float", float):
                try:
                    kw[f.name] = float(raw)
                except ValueError:
                    raise ValueError(f"{ENV_PREFIX + f.name.upper()}={raw!r} is not a number") from None
            elif f.type in ("int", int):
                try:
                    kw[f.name] = int(raw, 0)
                except ValueError:
                    raise ValueError(f"{ENV_PREFIX + f.name.upper()}={raw!r} is not an integer") from None
            else:
                kw[f.name] = raw.strip().lower()
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)

    def with_(self, **changes) -> "Config":
        return replace(self, **{k: v for k, v in changes.items() if v is not None})
