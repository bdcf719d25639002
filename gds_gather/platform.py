"""Which kind of machine this is (discrete GPU, unified memory, ROCm, CPU only), detected lazily and overridable.

Nothing here runs at import: cupy is imported only when detect() is called, and every failure is a reason.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

KINDS = ("discrete", "unified", "rocm", "cpu")


@dataclass(frozen=True)
class Platform:
    kind: str          # discrete | unified | rocm | cpu
    reason: str        # why this kind (the detected attributes, or the override, or the missing piece)
    device: str = ""   # GPU name, if any
    overridden: bool = False


@functools.cache
def _probe() -> Platform:
    try:
        import cupy  # noqa: F401  (lazy: never at package import; a failing import is the reason)
        from cupy.cuda import runtime
    except Exception as e:  # ImportError, or a broken CUDA install
        return Platform("cpu", f"cupy is not importable ({type(e).__name__}: {e})")
    try:
        n = runtime.getDeviceCount()
    except Exception as e:
        return Platform("cpu", f"no usable GPU driver ({type(e).__name__}: {e})")
    if n == 0:
        return Platform("cpu", "no GPU device")
    try:
        props = runtime.getDeviceProperties(0)
        name = props.get("name", b"")
        name = name.decode() if isinstance(name, bytes) else str(name)
        if runtime.is_hip:
            return Platform("rocm", "cupy.cuda.runtime.is_hip is True", name)
        integrated = int(props.get("integrated", 0))
        pageable = int(runtime.deviceGetAttribute(runtime.cudaDevAttrPageableMemoryAccessUsesHostPageTables, 0))
        if integrated or pageable:
            return Platform("unified", f"integrated={integrated} pageableMemoryAccessUsesHostPageTables={pageable}",
                            name)
        return Platform("discrete", "integrated=0 pageableMemoryAccessUsesHostPageTables=0", name)
    except Exception as e:
        return Platform("cpu", f"GPU attribute query failed ({type(e).__name__}: {e})")


def detect(override: str = "auto") -> Platform:
    """The platform, or `override` (one of KINDS) when not 'auto' (GDS_GATHER_PLATFORM / --platform)."""
    if override and override != "auto":
        if override not in KINDS:
            raise ValueError(f"platform must be auto or one of {', '.join(KINDS)}, got {override!r}")
        base = _probe()
        return Platform(override, f"forced by configuration (detected: {base.kind}: {base.reason})",
                        base.device, overridden=True)
    return _probe()
