"""GGML type facts and the CPU reference dequantizer, all taken from gguf (never hand-copied)."""
from __future__ import annotations

import functools

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from ..errors import RowWidthError, UnsupportedTypeError

Q = GGMLQuantizationType

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
def supported_types() -> tuple[GGMLQuantizationType, ...]:
    """Every candidate type the installed gguf dequantizes."""
    return implemented(CANDIDATES, lambda qt: gq.dequantize(np.zeros((1, GGML_QUANT_SIZES[qt][1]), np.uint8), qt))


def qtype_of(value) -> GGMLQuantizationType:
    """A GGMLQuantizationType from an enum member, its name ('q4_0', 'IQ4_NL') or its id."""
    if isinstance(value, GGMLQuantizationType):
        return value
    if isinstance(value, str):
        try:
            return GGMLQuantizationType[value.strip().upper()]
        except KeyError:
            names = ", ".join(t.name for t in supported_types())
            raise UnsupportedTypeError(f"unknown GGML type {value!r}; supported: {names}") from None
    try:
        return GGMLQuantizationType(int(value))
    except (ValueError, TypeError):
        raise UnsupportedTypeError(f"unknown GGML type id {value!r}") from None


def check_supported(qtype) -> GGMLQuantizationType:
    qt = qtype_of(qtype)
    if qt not in supported_types():
        names = ", ".join(t.name for t in supported_types())
        raise UnsupportedTypeError(f"type {qt.name} cannot be dequantized by gds_gather; supported: {names}")
    return qt


def block_geometry(qtype) -> tuple[int, int]:
    """(elements per block, bytes per block) from gguf.GGML_QUANT_SIZES."""
    return GGML_QUANT_SIZES[qtype_of(qtype)]


def row_bytes(qtype, row_elems: int, what: str = "row") -> int:
    """Bytes of one row of `row_elems` elements; raises RowWidthError if the width is not whole blocks."""
    block, size = block_geometry(qtype)
    if row_elems <= 0 or row_elems % block:
        raise RowWidthError(
            f"{what} width {row_elems} is not a positive multiple of the {qtype_of(qtype).name} block size {block}")
    return row_elems // block * size


def dequantize_rows(raw: np.ndarray, qtype, row_elems: int) -> np.ndarray:
    """Raw rows uint8 [n, row_bytes] -> float32 [n, row_elems], exactly gguf.quants.dequantize."""
    qt = check_supported(qtype)
    rb = row_bytes(qt, row_elems)
    if raw.dtype != np.uint8:   # readers hand over raw bytes; a float array here would be converted, not viewed
        raise TypeError(f"dequantize_rows takes raw uint8 rows, got {raw.dtype}")
    raw = np.ascontiguousarray(raw).reshape(-1, rb)
    if raw.shape[0] == 0:
        return np.empty((0, row_elems), np.float32)
    out = gq.dequantize(raw, qt)
    return np.asarray(out, dtype=np.float32).reshape(-1, row_elems)
