"""Every backend, whether it can run here and why not, and what `backend="auto"` picks."""
from __future__ import annotations

import importlib.util
import logging
from dataclasses import asdict, dataclass

from .config import Config
from .errors import BackendError
from .platform import Platform, detect
from .io.direct import HOST_READERS

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
    from .io import uring
    ok, why = uring.probe()
    return "io_uring" if ok else f"native thread pool ({why})"


# where a backend choice came from, as resolve() and resolve_device() say it (a caller that knows more, e.g. that
# a user gave --backend, says that instead of BY_NAME)
BY_NAME = "named by the caller"
BY_CONFIG = "set by Config.backend / GDS_GATHER_BACKEND"

GDS_MIN_WINDOW = 64 << 10     # below this GPU-direct storage loses to O_DIRECT + pinned copy (KvikIO
#                               sends reads under its gds_threshold, 16 KiB, to POSIX for the same reason)


def gds_state() -> tuple[bool, bool, str]:
    """(kvikio usable, real GPU-direct storage, why). Imports kvikio: call only on a GPU platform."""
    if importlib.util.find_spec("kvikio") is None:
        return False, False, "kvikio is not installed (pip install 'gds-gather[cuda13]')"
    try:
        import kvikio.cufile_driver
        import kvikio.defaults
        real = bool(kvikio.cufile_driver.get("is_gds_available"))
        compat = kvikio.defaults.is_compat_mode_preferred()
    except Exception as e:
        return False, False, f"kvikio failed to initialise ({type(e).__name__}: {e})"
    if real and not compat:
        return True, True, "KvikIO/cuFile with real GPU-direct storage (nvidia-fs or P2PDMA)"
    return True, False, ("KvikIO/cuFile in compat mode: no GPU-direct DMA here (no nvidia-fs/P2PDMA, "
                         "or KvikIO prefers compat); reads go through a bounce buffer")


def _gds(platform: Platform) -> Backend:
    if platform.kind != "discrete":
        return Backend("gds", False, f"needs a discrete NVIDIA GPU; platform is {platform.kind}",
                       "device")
    ok, real, why = gds_state()
    return Backend("gds", ok, why, "device")


def backends(config: Config | None = None) -> list[Backend]:
    """Every backend with `available` and the reason (probes the GPU lazily; never raises)."""
    cfg = config or Config.from_env()
    plat = detect(cfg.platform)
    out = [Backend(name, True, _DESCRIPTIONS[name] + (f"; here: {_direct_how()}" if name == "direct" else ""),
                   "host") for name in HOST_READERS]
    out.append(_gds(plat))
    return out


def _requested(backend: str, cfg: Config) -> tuple[str, str]:
    """(name, source) of the backend asked for: `backend` lower-cased with source BY_NAME, except that "auto" (or
    none) defers to Config.backend (GDS_GATHER_BACKEND) where that names one, with source BY_CONFIG."""
    name = (backend or "auto").lower()
    if name == "auto" and cfg.backend != "auto":
        return cfg.backend, BY_CONFIG
    return name, BY_NAME


def resolve(backend: str, config: Config | None = None) -> tuple[str, str]:
    """(backend name, why) for a backend or 'auto'. why says where the choice came from: BY_NAME for a backend
    given by name (a user's request or a caller handing on its own choice: only the caller knows which), BY_CONFIG
    for 'auto' where Config.backend names one, else auto's choice and its reason."""
    cfg = config or Config.from_env()
    name, forced = _requested(backend, cfg)
    if name == "auto":      # a host read: no device probe (torch, cupy, kvikio stay unimported)
        return "direct", f"the host default: O_DIRECT reads into host memory ({_direct_how()})"
    if name in HOST_READERS:
        return name, forced
    table = {b.name: b for b in backends(cfg)}
    if name not in table:
        raise BackendError(f"unknown backend {name!r}; known: {', '.join(table)}")
    if not table[name].available:
        raise BackendError(f"backend {name!r} is not available here: {table[name].reason}")
    return name, forced


def choose_device(table, backend: str = "auto", config: Config | None = None, state=None) -> tuple[str, str, str]:
    """The one "gds or direct" decision for rows of `table` that must end in GPU memory: (backend, mode, why).

    Table.fetch_device, GpuPrefill and the benches all call this, so each reports the same choice and reason.
    Where real GPU-direct storage exists, auto times gds against direct + pinned copy on 512 rows of this table
    (once per table: Table.gds_faster) and picks the faster; elsewhere the platform decides (resolve_device).
    state: () -> gds_state()'s answer for the table's accelerator (default: KvikIO's).
    """
    cfg = config or table.config
    return resolve_device(backend, cfg, window_bytes=table.typical_window, gds_faster=table.gds_faster,
                          state=state)


def resolve_device(backend: str, config: Config | None = None, window_bytes: int = 4096,
                   gds_faster=None, state=None) -> tuple[str, str, str]:
    """(backend, destination mode, why) for rows that must end in GPU memory.

    mode: "copy" (pinned staging + one H2D copy), "zero-copy" (GPU-mapped host staging), or "gds".
    gds_faster: a callable () -> (bool, detail) that times gds against direct on this table; asked only where real
    GPU-direct storage exists. Without it, windows of at least GDS_MIN_WINDOW bytes go to gds. state: a callable
    giving (kvikio usable, real GPU-direct, why) (default gds_state). why starts with BY_NAME or BY_CONFIG where the
    backend was not auto's choice.
    """
    state = state or gds_state
    cfg = config or Config.from_env()
    plat = detect(cfg.platform)
    if plat.kind == "cpu":
        raise BackendError(f"GPU ids, but no usable GPU here: {plat.reason}")
    host_mode = "zero-copy" if plat.kind == "unified" else "copy"
    name, source = _requested(backend, cfg)
    if name == "gds":
        if plat.kind == "rocm":
            raise BackendError("backend 'gds' is not available on ROCm: KvikIO/cuFile is CUDA-only")
        ok, real, why = state()
        if not ok:
            raise BackendError(f"backend 'gds' is not available here: {why}")
        return "gds", "gds", f"{source}: {why}"
    if name != "auto":
        if name not in HOST_READERS:
            raise BackendError(f"unknown backend {name!r}; known: {', '.join([*HOST_READERS, 'gds'])}")
        return name, host_mode, f"{source}, into {host_mode} staging on a {plat.kind} platform"
    if plat.kind == "unified":
        return "direct", "zero-copy", f"unified memory ({plat.reason}): direct reads into GPU-mapped host memory"
    if plat.kind == "rocm":
        return "direct", "copy", "ROCm: direct reads into pinned host staging, then a HIP copy"
    ok, real, why = state()
    if real and gds_faster is not None:
        faster, detail = gds_faster()
        if faster:
            return "gds", "gds", f"{why}; gds measured faster for this table's windows ({detail})"
        reason = f"real GDS present, but direct measured faster for this table's windows ({detail})"
    elif real and window_bytes >= GDS_MIN_WINDOW:
        return "gds", "gds", f"{why}; windows of {window_bytes} B are large enough for GPU-direct reads"
    else:
        reason = (f"real GDS present, but windows of {window_bytes} B are below {GDS_MIN_WINDOW} B" if real else why)
    return "direct", "copy", f"discrete GPU: direct reads into pinned staging + one H2D copy ({reason})"
