"""Row types: the GGML types (facts and the CPU reference dequantizer taken from gguf, never hand-copied) and the
float8 element types safetensors checkpoints store, which GGUF has none of.

RowType holds both: every GGMLQuantizationType under its own name and id (they compare and hash equal), and
F8_E4M3 (OCP e4m3fn: bias 7, no infinities, S.1111.111 is NaN), F8_E5M2 (bias 15, IEEE-style infinities and NaNs)
and F8_E8M0 (UE8M0: 2**(e - 127), 0xFF is NaN; a scale type) under ids GGML does not use, which no GGUF file may
carry. A float8 row decodes element by element through a 256-entry float32 table built from the bits (fp8_lut):
the format's value exactly, -0 kept, NaN where NaN (sign kept, quiet).
"""
from __future__ import annotations

import enum
import functools

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from ..errors import RowWidthError, UnsupportedTypeError

Q = GGMLQuantizationType

FP8_IDS = {"F8_E4M3": 1000, "F8_E5M2": 1001, "F8_E8M0": 1002}     # outside GGML's ids (gguf_parse refuses them)
FP4_IDS = {"F4_E2M1": 1003}         # ModelOpt NVFP4's packed elements: two per byte, the first in the low nibble
RowType = enum.IntEnum("RowType", {**{t.name: t.value for t in Q}, **FP8_IDS, **FP4_IDS})
RowType.__doc__ = "A row table's element or block type: every GGML type, the float8 and the float4 types."
FP8_TYPES = tuple(RowType[n] for n in FP8_IDS)
FP4_TYPES = tuple(RowType[n] for n in FP4_IDS)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)     # E2M1's magnitudes by its 3 low bits (OCP MX; bit 3: the sign)

# The types a PLE table may have and gguf can dequantize (checked against the installed gguf at first use).
CANDIDATES = (
    Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
    Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ4_NL, Q.IQ4_XS,
    Q.TQ1_0, Q.TQ2_0, Q.MXFP4, Q.NVFP4,
)


def implemented(types, call) -> tuple[GGMLQuantizationType, ...]:
    """The types for which call(qt) does not raise NotImplementedError: what the installed gguf implements."""
    ok = []
    for qt in types:
        try:
            call(qt)
        except NotImplementedError:
            continue
        ok.append(qt)
    return tuple(ok)


@functools.cache
def supported_types() -> tuple[RowType, ...]:
    """Every candidate GGML type the installed gguf dequantizes (the types a GGUF table may have)."""
    return tuple(RowType(int(t)) for t in implemented(
        CANDIDATES, lambda qt: gq.dequantize(np.zeros((1, GGML_QUANT_SIZES[qt][1]), np.uint8), qt)))


def row_types() -> tuple[RowType, ...]:
    """Every type a table may have: supported_types() and the float8 / float4 types (safetensors tables)."""
    return supported_types() + FP8_TYPES + FP4_TYPES


def qtype_of(value) -> RowType:
    """A RowType from a RowType or GGMLQuantizationType, a name ('q4_0', 'IQ4_NL', 'f8_e4m3') or an id."""
    if isinstance(value, str):
        try:
            return RowType[value.strip().upper()]
        except KeyError:
            names = ", ".join(t.name for t in row_types())
            raise UnsupportedTypeError(f"unknown row type {value!r}; supported: {names}") from None
    try:
        return RowType(int(value))
    except (ValueError, TypeError):
        raise UnsupportedTypeError(f"unknown GGML type id {value!r}") from None


def check_supported(qtype) -> RowType:
    qt = qtype_of(qtype)
    if qt not in row_types():
        names = ", ".join(t.name for t in row_types())
        raise UnsupportedTypeError(f"type {qt.name} cannot be dequantized by gds_gather; supported: {names}")
    return qt


def is_fp8(qtype) -> bool:
    return int(qtype) in FP8_IDS.values()


def is_small_float(qtype) -> bool:
    """A float8 or packed float4 type: a safetensors table's, scaled by a tensor beside it (scales.py)."""
    return is_fp8(qtype) or int(qtype) in FP4_IDS.values()


def block_geometry(qtype) -> tuple[int, int]:
    """(elements per block, bytes per block): gguf.GGML_QUANT_SIZES; (1, 1) for a float8 type, (8, 4) for packed
    F4_E2M1 (the kernels decode 8 elements at a time)."""
    qt = qtype_of(qtype)
    if qt == RowType.F4_E2M1:
        return (8, 4)
    return (1, 1) if is_fp8(qt) else GGML_QUANT_SIZES[Q(int(qt))]


@functools.cache
def fp4_pair_lut() -> np.ndarray:
    """float32 [256, 2]: the two E2M1 values of each byte, the low nibble first."""
    nib = np.array([(-1.0 if n & 8 else 1.0) * E2M1[n & 7] for n in range(16)], np.float32)
    b = np.arange(256)
    return np.stack([nib[b & 15], nib[b >> 4]], axis=1)


@functools.cache
def fp8_lut(qtype) -> np.ndarray:
    """float32 [256]: the value of each byte of a float8 type, decoded from its bits (the module docstring)."""
    qt = qtype_of(qtype)
    b = np.arange(256)
    if qt == RowType.F8_E8M0:
        v = np.ldexp(1.0, b - 127)
        v[255] = np.nan
        return v.astype(np.float32)
    ebits, bias = {RowType.F8_E4M3: (4, 7), RowType.F8_E5M2: (5, 15)}[qt]
    mbits = 7 - ebits
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> mbits) & ((1 << ebits) - 1), b & ((1 << mbits) - 1)
    mag = np.where(e == 0, np.ldexp(m / 2**mbits, 1 - bias), np.ldexp(1 + m / 2**mbits, e - bias))
    top = e == (1 << ebits) - 1
    if qt == RowType.F8_E4M3:
        mag = np.where(top & (m == (1 << mbits) - 1), np.nan, mag)
    else:
        mag = np.where(top, np.where(m == 0, np.inf, np.nan), mag)
    return np.copysign(mag, sign).astype(np.float32)    # the sign bit of NaNs and zeros too


def row_bytes(qtype, row_elems: int, what: str = "row") -> int:
    """Bytes of one row of `row_elems` elements; raises RowWidthError if the width is not whole blocks."""
    block, size = block_geometry(qtype)
    if row_elems <= 0 or row_elems % block:
        raise RowWidthError(
            f"{what} width {row_elems} is not a positive multiple of the {qtype_of(qtype).name} block size {block}")
    return row_elems // block * size


def dequantize_rows(raw: np.ndarray, qtype, row_elems: int) -> np.ndarray:
    """Raw rows uint8 [n, row_bytes] -> float32 [n, row_elems]: exactly gguf.quants.dequantize, or the float8
    values (fp8_lut). A scaled table's scales are applied by its Table (scales.py), not here."""
    qt = check_supported(qtype)
    rb = row_bytes(qt, row_elems)
    if raw.dtype != np.uint8:   # readers hand over raw bytes; a float array here would be converted, not viewed
        raise TypeError(f"dequantize_rows takes raw uint8 rows, got {raw.dtype}")
    raw = np.ascontiguousarray(raw).reshape(-1, rb)
    if raw.shape[0] == 0:
        return np.empty((0, row_elems), np.float32)
    if is_fp8(qt):
        return fp8_lut(qt)[raw]
    if qt == RowType.F4_E2M1:
        return fp4_pair_lut()[raw].reshape(raw.shape[0], row_elems)
    out = gq.dequantize(raw, Q(int(qt)))
    return np.asarray(out, dtype=np.float32).reshape(-1, row_elems)
