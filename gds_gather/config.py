"""All configuration in one frozen dataclass, read from the environment only by Config.from_env()."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Mapping

ENV_PREFIX = "GDS_GATHER_"


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gds-gather"


@dataclass(frozen=True)
class Config:
    backend: str = "auto"       # GDS_GATHER_BACKEND: force a backend (see gds_gather.backends())
    platform: str = "auto"      # GDS_GATHER_PLATFORM: auto | discrete | unified | rocm | cpu (override detection)
    align: int = 0              # GDS_GATHER_ALIGN: O_DIRECT window alignment; 0 = the file's logical block size
    max_gap: int = 0            # GDS_GATHER_MAX_GAP: merge windows separated by at most this many aligned blocks
    threads: int = 0            # GDS_GATHER_THREADS: reader threads; 0 = 2 x cores
    queue_depth: int = 128      # GDS_GATHER_QUEUE_DEPTH: reads in flight for the batched engines
    engine: str = "auto"        # GDS_GATHER_ENGINE: how `direct` submits: auto | uring | threads
    cache_dir: Path = _default_cache_dir()   # GDS_GATHER_CACHE_DIR: where the built-in default model is kept

    def __post_init__(self) -> None:
        if self.align and (self.align < 0 or self.align & (self.align - 1)):
            raise ValueError(f"align must be 0 or a power of two, got {self.align}")
        if self.engine not in ("auto", "uring", "threads"):
            raise ValueError(f"engine must be auto, uring or threads, got {self.engine!r}")
        for name in ("max_gap", "threads", "queue_depth"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> "Config":
        """Read every GDS_GATHER_* variable once; explicit keyword overrides win."""
        env = os.environ if env is None else env
        kw: dict = {}
        for f in fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is None or raw == "":
                continue
            if f.name == "cache_dir":
                kw[f.name] = Path(raw)
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
