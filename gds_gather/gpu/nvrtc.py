"""Kernel modules: CUDA C++ compiled at run time by CuPy's RawModule (NVRTC; hiprtc on cupy's ROCm build), one
module per source, name expressions and device, made once per process (CuPy also caches the binary on disk).

The options keep the kernels' arithmetic exact (dequant.py's contract): no FMA contraction and denormals kept.
CuPy appends -ftz=true after NVRTC's options (cupy/cuda/compiler.py) and the last -ftz wins; hiprtc takes clang
options and cupy appends -fcuda-flush-denormals-to-zero; the kernels depend on neither (gg_mul in dequant.cuh
keeps the products that can meet subnormals exact on both).

cupy is imported lazily; nothing here imports it at module import time.
"""
from __future__ import annotations

import functools

from ..errors import BackendError

NVRTC_OPTIONS = ("-std=c++17", "--fmad=false", "--ftz=false")
HIPRTC_OPTIONS = ("-std=c++17", "-ffp-contract=off")


def cupy():
    """The cupy module, or BackendError saying how to install it."""
    try:
        import cupy
    except ImportError as e:
        raise BackendError("the GPU gather needs cupy (pip install 'gds-gather[cuda13]' or '[cuda12]')") from e
    return cupy


def options() -> tuple[str, ...]:
    """The compile options for this cupy build (NVRTC, or hiprtc on ROCm)."""
    return HIPRTC_OPTIONS if getattr(cupy().cuda.runtime, "is_hip", False) else NVRTC_OPTIONS


@functools.cache
def module(code: str, name_expressions: tuple[str, ...] | None = None, device_id: int | None = None):
    """The cupy.RawModule of `code` (with `name_expressions`, the template instances to compile), made once per
    (code, name expressions, device): on `device_id`, or on the current device when None."""
    cp = cupy()
    kw = {} if name_expressions is None else {"name_expressions": tuple(name_expressions)}
    if device_id is None:
        return cp.RawModule(code=code, options=options(), **kw)
    with cp.cuda.Device(device_id):
        return cp.RawModule(code=code, options=options(), **kw)
