"""Which kind of machine this is (discrete GPU, unified memory, ROCm, CPU only), detected lazily and overridable.

Detection is two steps: probe() reads the facts (cupy's runtime: HIP build or not, device count, the device
properties; the installed torch's build) into a plain dict, and classify(facts) decides from that dict alone,
so every path is unit-tested with injected properties. Nothing here runs at import: cupy is imported only when
detect() is called, torch only where its installed build is ROCm and cupy cannot answer, and every failure is
a reason.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

KINDS = ("discrete", "unified", "rocm", "cpu")

# What each kind's GPU path does (gds-gather info, the prefill's log): the choice, and why.
PATHS = {
    "discrete": ("O_DIRECT reads into pinned host staging + one H2D copy per ubatch (gds instead where real "
                 "GPU-direct storage exists and measures faster); prefill: CUDA graph per (ubatch size, slot)"),
    "unified": ("O_DIRECT reads into GPU-mapped host staging the kernel reads in place (no row copy; tokens and "
                "indices are still copied); prefill: CUDA graph per (ubatch size, slot)"),
    "rocm": ("O_DIRECT reads into pinned host staging + one HIP copy; no gds (KvikIO/cuFile is CUDA-only); "
             "prefill: eager, no graph (the captured flag wait is a CUDA driver call)"),
    "cpu": "host readers, gguf's dequantizer and a torch CPU trunk; no GPU path",
}


@dataclass(frozen=True)
class Platform:
    kind: str          # discrete | unified | rocm | cpu
    reason: str        # why this kind (the detected attributes, or the override, or the missing piece)
    device: str = ""   # GPU name, if any
    overridden: bool = False

    @property
    def path(self) -> str:
        """What the GPU path does on this kind of machine, and why."""
        return PATHS[self.kind]


def _name(raw) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw or "")


def classify(facts: dict) -> Platform:
    """The platform from probed facts (see probe()); pure, so tests inject any machine.

    facts: ``cupy_error`` (str: cupy not importable), ``is_hip`` (cupy is a HIP build), ``count_error`` /
    ``device_count``, ``props`` (device 0's properties: ``name``, ``integrated``,
    ``pageableMemoryAccessUsesHostPageTables``), ``props_error``, ``torch_hip`` (the installed torch's HIP
    version, or None) and ``torch_devices`` (GPUs torch sees, where it was asked).
    """
    torch_hip = facts.get("torch_hip")
    if torch_hip and facts.get("torch_devices", 0) > 0 and not facts.get("is_hip"):
        return Platform("rocm", f"torch is a ROCm build (HIP {torch_hip}) and sees {facts['torch_devices']} GPU(s); "
                        "cupy is not a HIP build, so the GPU kernels need cupy-rocm-7-0",
                        _name(facts.get("torch_device_name")))
    if facts.get("cupy_error"):
        return Platform("cpu", f"cupy is not importable ({facts['cupy_error']})")
    if facts.get("count_error"):
        return Platform("cpu", f"no usable GPU driver ({facts['count_error']})")
    if not facts.get("device_count"):
        return Platform("cpu", "no GPU device")
    if facts.get("props_error"):
        return Platform("cpu", f"GPU attribute query failed ({facts['props_error']})")
    props = facts.get("props") or {}
    name = _name(props.get("name"))
    if facts.get("is_hip"):
        return Platform("rocm", "cupy.cuda.runtime.is_hip is True (a ROCm build of cupy)", name)
    integrated = int(props.get("integrated", 0) or 0)
    pageable = int(props.get("pageableMemoryAccessUsesHostPageTables", 0) or 0)
    attrs = f"integrated={integrated} pageableMemoryAccessUsesHostPageTables={pageable}"
    if integrated or pageable:
        return Platform("unified", attrs, name)
    return Platform("discrete", attrs, name)


def _torch_hip_version():
    """The installed torch's HIP version from its package metadata ('2.5.1+rocm6.2' -> '6.2'), without importing it."""
    try:
        from importlib import metadata
        v = metadata.version("torch")
    except Exception:
        return None
    return v.split("+rocm", 1)[1] if "+rocm" in v else None


def probe() -> dict:
    """The facts classify() needs, read from cupy (and from torch only where torch is a ROCm build)."""
    facts: dict = {"torch_hip": _torch_hip_version()}
    try:
        from cupy.cuda import runtime   # lazy: never at package import; a failing import is the reason
    except Exception as e:  # ImportError, or a broken CUDA install
        facts["cupy_error"] = f"{type(e).__name__}: {e}"
        runtime = None
    if runtime is not None:
        facts["is_hip"] = bool(getattr(runtime, "is_hip", False))
        try:
            facts["device_count"] = int(runtime.getDeviceCount())
        except Exception as e:
            facts["count_error"] = f"{type(e).__name__}: {e}"
        if facts.get("device_count"):
            try:
                props = dict(runtime.getDeviceProperties(0))
                if "pageableMemoryAccessUsesHostPageTables" not in props and not facts["is_hip"]:
                    props["pageableMemoryAccessUsesHostPageTables"] = int(runtime.deviceGetAttribute(
                        runtime.cudaDevAttrPageableMemoryAccessUsesHostPageTables, 0))
                facts["props"] = props
            except Exception as e:
                facts["props_error"] = f"{type(e).__name__}: {e}"
    if facts["torch_hip"] and not facts.get("is_hip"):
        try:
            import torch
            facts["torch_devices"] = int(torch.cuda.device_count())
            if facts["torch_devices"]:
                facts["torch_device_name"] = torch.cuda.get_device_name(0)
        except Exception as e:
            facts["torch_error"] = f"{type(e).__name__}: {e}"
    return facts


@functools.cache
def _probe() -> Platform:
    return classify(probe())


def detect(override: str = "auto") -> Platform:
    """The platform, or `override` (one of KINDS) when not 'auto' (GDS_GATHER_PLATFORM / --platform)."""
    if override and override != "auto":
        if override not in KINDS:
            raise ValueError(f"platform must be auto or one of {', '.join(KINDS)}, got {override!r}")
        base = _probe()
        return Platform(override, f"forced by configuration (detected: {base.kind}: {base.reason})",
                        base.device, overridden=True)
    return _probe()
