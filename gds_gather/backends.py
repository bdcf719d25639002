"""Every backend, whether it can run here and why not, and what `backend="auto"` picks."""
from __future__ import annotations

import importlib.util
import logging
from dataclasses import asdict, dataclass

from .config import Config
from .errors import BackendError
from .platform import Platform, detect
from .readers import HOST_READERS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backend:
    name: str
    available: bool
    reason: str
    kind: str           # "host": rows land in host memory; "device": rows land in GPU memory

    def as_dict(self) -> dict:
        return asdict(self)


_DESCRIPTIONS = {
    "direct": "O_DIRECT aligned windows, one batched submitter (io_uring; native thread pool without it)",
    "pread": "buffered exact-row preads from 2 x cores native threads (llama.cpp's --lazy-mode on-direct)",
    "mmap": "table mapped with MADV_RANDOM, rows gathered by page faults (llama.cpp's lazy mode)",
    "readahead": "mmap + MADV_RANDOM + one batched MADV_WILLNEED per batch (unsloth llama.cpp #137)",
    "resident": "whole table loaded into host RAM once (upper bound)",
}


def _direct_how() -> str:
    from . import uring
    ok, why = uring.probe()
    return "io_uring" if ok else f"native thread pool ({why})"


def _gds(platform: Platform) -> Backend:
    if platform.kind != "discrete":
        return Backend("gds", False, f"needs a discrete NVIDIA GPU; platform is {platform.kind} ({platform.reason})",
                       "device")
    if importlib.util.find_spec("kvikio") is None:
        return Backend("gds", False, "kvikio is not installed (pip install 'gds-gather[cuda13]')", "device")
    return Backend("gds", False, "the KvikIO/cuFile reader is not part of this version", "device")


def backends(config: Config | None = None) -> list[Backend]:
    """Every backend with `available` and the reason (probes the GPU lazily; never raises)."""
    cfg = config or Config.from_env()
    plat = detect(cfg.platform)
    out = [Backend(name, True, _DESCRIPTIONS[name] + (f"; here: {_direct_how()}" if name == "direct" else ""),
                   "host") for name in HOST_READERS]
    out.append(_gds(plat))
    return out


def resolve(backend: str, config: Config | None = None) -> tuple[str, str]:
    """(backend name, why) for a requested backend; 'auto' defers to GDS_GATHER_BACKEND, then detection."""
    cfg = config or Config.from_env()
    name = (backend or "auto").lower()
    if name == "auto" and cfg.backend != "auto":
        name, forced = cfg.backend, "forced by GDS_GATHER_BACKEND"
    else:
        forced = "requested"
    if name == "auto":
        plat = detect(cfg.platform)
        why = (f"platform {plat.kind} ({plat.reason}): direct reads into host memory "
               f"({_direct_how()})")
        return "direct", why
    table = {b.name: b for b in backends(cfg)}
    if name not in table:
        raise BackendError(f"unknown backend {name!r}; known: {', '.join(table)}")
    if not table[name].available:
        raise BackendError(f"backend {name!r} is not available here: {table[name].reason}")
    return name, forced
