"""The lookup tables the dequant kernels read, built from gguf.quants (never hand-copied: the C++ holds none of
their values), and the translation unit the kernels compile as: the tables' offsets as defines, then the sources.

Both the GPU build (dequant.py, through nvrtc.py) and the host build (host_kernels.py) take the tables and the
defines from here, so the two read the same bytes at the same offsets.
"""
from __future__ import annotations

import functools

import numpy as np
from gguf import quants as gq

from . import kernel_sources

KERNEL_SOURCES = ("dequant.cuh", "float8.cuh", "gather.cu")     # in include order


def _small_ints(cls, dtype) -> np.ndarray:
    """A gguf grid (float32 values that are small integers) as exact integers, [rows, cols]."""
    cls.init_grid()
    g = np.asarray(cls.grid, np.float32).reshape(cls.grid_shape)
    out = g.astype(dtype)
    if not np.array_equal(out.astype(np.float32), g):
        raise AssertionError(f"gguf {cls.__name__} grid does not fit {np.dtype(dtype).name}")
    return np.ascontiguousarray(out)


@functools.cache
def _grids() -> tuple[tuple[str, np.ndarray], ...]:
    iq1s = _small_ints(gq.IQ1_S, np.int8)
    if not np.array_equal(_small_ints(gq.IQ1_M, np.int8), iq1s):
        raise AssertionError("gguf IQ1_M and IQ1_S grids differ; the kernels share one iq1s grid")
    return (
        ("IQ2XXS", _small_ints(gq.IQ2_XXS, np.uint8)),     # [256, 8]  values 8, 25, 43
        ("IQ2XS", _small_ints(gq.IQ2_XS, np.uint8)),       # [512, 8]
        ("IQ2S", _small_ints(gq.IQ2_S, np.uint8)),         # [1024, 8]
        ("IQ3XXS", _small_ints(gq.IQ3_XXS, np.uint8)),     # [256, 4]  4..62
        ("IQ3S", _small_ints(gq.IQ3_S, np.uint8)),         # [512, 4]  1..15
        ("IQ1S", iq1s),                                    # [2048, 8] -1, 0, 1
        ("KSIGNS", np.frombuffer(gq.IQ2_XXS.ksigns, np.uint8).copy()),      # [128]
        ("KV_IQ4NL", np.array(gq.IQ4_NL.kvalues, np.int8)),                 # [16]
        ("KV_MXFP4", np.array(gq.MXFP4.kvalues, np.int8)),
        ("KV_NVFP4", np.array(gq.NVFP4.kvalues, np.int8)),
        ("IQ1S_DELTA", np.array([gq.IQ1_S.delta], np.float32)),
        ("IQ1M_DELTA", np.array([gq.IQ1_M.delta], np.float32)),
    )


def grids() -> dict[str, np.ndarray]:
    """Every lookup table the kernels use, built from gguf.quants: name -> array (copies).

    IQ grids are the gguf grids as exact small integers (uint8, or int8 for IQ1), ``KSIGNS`` is
    ``IQ2_XXS.ksigns``, ``KV_*`` the int8 kvalues, ``IQ1*_DELTA`` gguf's float32 deltas.
    """
    return {name: arr.copy() for name, arr in _grids()}


@functools.cache
def _blob() -> tuple[np.ndarray, tuple[tuple[str, int], ...]]:
    parts, offsets, at = [], [], 0
    for name, arr in _grids():
        raw = np.ascontiguousarray(arr).view(np.uint8).ravel()
        offsets.append((name, at))
        parts.append(raw)
        pad = -(at + raw.size) % 16
        parts.append(np.zeros(pad, np.uint8))
        at += raw.size + pad
    blob = np.concatenate(parts)
    blob.setflags(write=False)
    return blob, tuple(offsets)


def table_blob() -> np.ndarray:
    """All tables in one read-only uint8 array (each at a 16-byte aligned offset), as the kernels read them."""
    return _blob()[0]


def defines() -> dict[str, int]:
    """The C preprocessor defines the sources need: GG_OFF_<NAME> = byte offset of each table in table_blob()."""
    return {f"GG_OFF_{name}": off for name, off in _blob()[1]}


@functools.cache
def source() -> str:
    """The complete NVRTC translation unit: defines, then KERNEL_SOURCES in order (each one's include guard is
    defined by the time a later one would include it)."""
    head = "".join(f"#define {k} {v}\n" for k, v in defines().items())
    body = "".join(kernel_sources.source(n).replace("#pragma once\n", "") + "\n" for n in KERNEL_SOURCES)
    return head + body
