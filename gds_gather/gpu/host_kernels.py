"""The dequant kernels run on the host: the very same CUDA C++ (the per-type dequantizers and the gather's
per-item routine, ``kernels/host_check.cu``) compiled by the host's C++ compiler into a small shared library
loaded with ctypes, and the numpy oracle they are checked against (gguf.quants.dequantize, the float8 and E2M1
values of quants.dequantize_rows, block scales applied as numpy float32 products: value * (scale * smul)). This is
how the kernels
are checked bit for bit on machines without a GPU, and what host.HostAccel runs as its gather.

Exactness: no contraction and no fast math (g++ ``-ffp-contract=off``; x86-64 float math is SSE, with no excess
precision), so the host build computes what the device does (dequant.py's contract).
"""
from __future__ import annotations

import ctypes
import functools
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as gq

from . import arrays, kernel_sources, tables
from .dequant import INDEX_CTYPES, OUT_DTYPES, as_block_scales, geometry, output_shape, scale_geometry
from ..errors import BackendError, RowWidthError, UnsupportedTypeError
from ..formats import quants
from ..io import cbuild

Q = GGMLQuantizationType

HOST_SOURCE = "host_check.cu"
HOST_CXX_FLAGS = ("-std=c++17", "-O2", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared")


# ---- the host build -------------------------------------------------------------------------------------------
def host_compiler() -> list[str] | None:
    """The compile command of the host build (compiler and options, no files), or None without a compiler."""
    for cxx in ("g++", "c++", "clang++"):
        path = shutil.which(cxx)
        if path:
            return [path, "-x", "c++", *HOST_CXX_FLAGS]
    nvcc = shutil.which("nvcc")
    if nvcc:   # nvcc's host path: the .cu is compiled for the host (the kernels too, which is harmless)
        return [nvcc, "-std=c++17", "-O2", "--fmad=false", "-Xcompiler", "-fPIC,-ffp-contract=off", "-shared",
                "-x", "cu"]
    return None


def host_compiler_available() -> bool:
    return host_compiler() is not None


def cache_dir() -> Path:
    """Where host builds are kept: gds_gather-<uid> in the temp folder."""
    return Path(tempfile.gettempdir()) / f"gds_gather-{os.getuid() if hasattr(os, 'getuid') else 'u'}"


@functools.cache
def host_library(soft_mul: bool = False) -> ctypes.CDLL:
    """The host build of the kernels (kernels/host_check.cu), compiled once and cached by content hash.

    soft_mul=True builds gg_mul the way HIP devices run it (hardware multiply only where every value is normal,
    the integer IEEE multiply otherwise), so the ROCm path is checked bit for bit here too.
    """
    cmd = host_compiler()
    if cmd is None:
        raise BackendError("building the host check of the CUDA kernels needs a C++ compiler (g++, clang++) or nvcc")
    files = {n: kernel_sources.source(n) for n in (*tables.KERNEL_SOURCES, HOST_SOURCE)}
    flags = [*cmd[1:], *(f"-D{k}={v}" for k, v in tables.defines().items())] + (["-DGG_SOFT_MUL=1"] if soft_mul
                                                                                 else [])
    try:
        lib = cbuild.build_shared(cmd[:1], files, HOST_SOURCE, flags, cache_dir(), "gg_host_", digits=20)
    except cbuild.CompileError as e:
        raise BackendError(f"host build of the kernels failed ({cmd[0]}):\n{e.output[-4000:]}") from None
    dll = ctypes.CDLL(str(lib))
    c_p, i64, i32 = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int
    dll.gg_geometry.argtypes = [i32, ctypes.POINTER(i32), ctypes.POINTER(i32)]
    dll.gg_host_dequant.argtypes = [i32, c_p, i64, c_p, c_p]
    dll.gg_host_gather.argtypes = [i32, i32, i32, c_p, c_p, c_p, c_p, c_p, i64, i32, i32, ctypes.c_float, i32]
    dll.gg_host_gather_scaled.argtypes = [i32, i32, i32, i32, c_p, c_p, c_p, c_p, c_p, i64, i32, i32,
                                          ctypes.c_float, i32, c_p, c_p, i32, ctypes.c_float]
    for f in (dll.gg_geometry, dll.gg_host_dequant, dll.gg_host_gather, dll.gg_host_gather_scaled):
        f.restype = i32
    dll.gg_host_mul.argtypes = [c_p, c_p, c_p, i64]
    dll.gg_host_mul.restype = None
    return dll


def host_mul(a: np.ndarray, b: np.ndarray, soft_mul: bool = False) -> np.ndarray:
    """The kernels' gg_mul over float32 arrays, run on the host (soft_mul: as HIP devices compute it)."""
    a, b = np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} and {b.shape}")
    out = np.empty_like(a)
    host_library(soft_mul).gg_host_mul(_ptr(a), _ptr(b), _ptr(out), a.size)
    return out


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def host_geometry(qtype) -> tuple[int, int]:
    """(elements, bytes) per block as the CUDA source defines them (tests compare with gguf)."""
    qk, ts = ctypes.c_int(), ctypes.c_int()
    if host_library().gg_geometry(int(quants.qtype_of(qtype)), ctypes.byref(qk), ctypes.byref(ts)):
        raise UnsupportedTypeError(f"{quants.qtype_of(qtype).name} is not in the CUDA source")
    return qk.value, ts.value


def host_dequantize(blocks: np.ndarray, qtype, soft_mul: bool = False) -> np.ndarray:
    """The CUDA block dequantizers run on the host: uint8 [..., k * type_size] -> float32 [..., k * block_size].

    Same shape convention as gguf.quants.dequantize, and (by construction and test) the same bits.
    """
    qt = quants.check_supported(qtype)
    block, size = quants.block_geometry(qt)
    raw = np.ascontiguousarray(blocks)
    if raw.dtype != np.uint8:
        raise TypeError(f"host_dequantize takes uint8 blocks, got {raw.dtype}")
    if raw.ndim == 0 or raw.shape[-1] % size:
        raise RowWidthError(f"{qt.name}: last dimension ({raw.shape}) is not a multiple of {size} bytes")
    n_blocks = raw.size // size
    out = np.empty(raw.shape[:-1] + (raw.shape[-1] // size * block,), np.float32)
    if n_blocks:
        rc = host_library(soft_mul).gg_host_dequant(int(qt), _ptr(raw), n_blocks, _ptr(tables.table_blob()), _ptr(out))
        if rc:
            raise UnsupportedTypeError(f"{qt.name} is not in the CUDA source")
    return out


def _check_host_args(staging, row_offsets, inverse, rb: int):
    staging = np.ascontiguousarray(staging)
    offs = np.ascontiguousarray(row_offsets)
    inv = np.ascontiguousarray(inverse)
    if staging.dtype != np.uint8:
        raise TypeError(f"staging must be uint8, got {staging.dtype}")
    if offs.dtype != np.int64 or offs.ndim != 1:
        raise TypeError(f"row_offsets must be a 1-D int64 array, got {offs.dtype} {offs.shape}")
    if inv.dtype.name not in INDEX_CTYPES:
        raise TypeError(f"inverse must be int32 or int64, got {inv.dtype}")
    if offs.size and (offs.min() < 0 or offs.max() + rb > staging.size):
        raise IndexError(f"row_offsets reach outside the {staging.size}-byte staging buffer")
    if inv.size and (inv.min() < 0 or inv.max() >= offs.size):
        raise IndexError(f"inverse values must lie in [0, {offs.size})")
    return staging, offs, inv


def _check_host_scales(block_scales, qt, row_elems: int, n_unique: int):
    """(sstaging, soffsets, scale type, sblock, smul), the arrays checked numpy arrays: soffsets one per unique row,
    every scale row inside sstaging."""
    st, sblock, srb, smul = scale_geometry(qt, block_scales, row_elems)
    bs = as_block_scales(block_scales)
    sst, soffs = np.ascontiguousarray(bs.sstaging), np.ascontiguousarray(bs.soffsets)
    if sst.dtype != np.uint8:
        raise TypeError(f"block_scales.sstaging must be uint8, got {sst.dtype}")
    if soffs.dtype != np.int64 or soffs.shape != (n_unique,):
        raise TypeError(f"block_scales.soffsets must be int64 [{n_unique}] (one per unique row), got "
                        f"{soffs.dtype} {soffs.shape}")
    if soffs.size and (soffs.min() < 0 or soffs.max() + srb > sst.size):
        raise IndexError(f"block_scales.soffsets reach outside the {sst.size}-byte scale staging buffer")
    return sst, soffs, st, sblock, smul


def host_gather(staging, row_offsets, inverse, qtype, row_elems, *, dtype="float32", scale=None, layout="flat",
                n_layer=None, block_scales=None, soft_mul: bool = False) -> np.ndarray:
    """gather_rows' kernel body run on the host over numpy arrays (bounds-checked), for tests and debugging;
    with block_scales (numpy arrays), gg_gather_scaled's.

    Returns float32 / float16 numpy arrays, or uint16 holding bfloat16 bits.
    """
    qt, rb, seg = geometry(qtype, row_elems, layout, n_layer)
    row_elems = int(row_elems)
    staging, offs, inv = _check_host_args(staging, row_offsets, inverse, rb)
    scaled = None if block_scales is None else _check_host_scales(block_scales, qt, row_elems, offs.size)
    name = arrays.dtype_name(dtype)
    n = inv.size
    out = np.empty(output_shape(inv.shape, qt, row_elems, layout, n_layer),
                   {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[name])
    if n:
        lib = host_library(soft_mul)
        args = (OUT_DTYPES[name], int(inv.dtype == np.int64), _ptr(staging), _ptr(offs), _ptr(inv), _ptr(out),
                _ptr(tables.table_blob()), n, row_elems, seg, 1.0 if scale is None else float(np.float32(scale)),
                int(scale is not None))
        if scaled is None:
            rc = lib.gg_host_gather(int(qt), *args)
        else:
            sst, soffs, st, sblock, smul = scaled
            rc = lib.gg_host_gather_scaled(int(qt), int(st), *args, _ptr(sst), _ptr(soffs), sblock, smul)
        if rc:
            raise UnsupportedTypeError(f"{qt.name} is not in the CUDA source")
    return out


# ---- the numpy oracle ---------------------------------------------------------------------------------------------
def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest even: gguf's BF16 quantizer (= torch .to(bfloat16))."""
    x = np.ascontiguousarray(x, np.float32)
    return gq.quantize(x, Q.BF16).view(np.uint16).reshape(x.shape)


def _rows(staging: np.ndarray, offs: np.ndarray, nbytes: int) -> np.ndarray:
    return staging[offs[:, None] + np.arange(nbytes)] if offs.size else np.zeros((0, nbytes), np.uint8)


def reference_gather(staging, row_offsets, inverse, qtype, row_elems, *, dtype="float32", scale=None,
                     layout="flat", n_layer=None, block_scales=None) -> np.ndarray:
    """What gather_rows must produce, from quants.dequantize_rows (gguf.quants.dequantize; float8 and E2M1 from
    their bits) and numpy (numpy arrays in, numpy out); block scales: value * (scale * smul) in float32, before
    `scale`."""
    qt, rb, seg = geometry(qtype, row_elems, layout, n_layer)
    row_elems = int(row_elems)
    staging, offs, inv = _check_host_args(staging, row_offsets, inverse, rb)
    f32 = quants.dequantize_rows(_rows(staging, offs, rb), qt, row_elems)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):    # inf, subnormal and NaN products are values
        if block_scales is not None:
            sst, soffs, st, sblock, smul = _check_host_scales(block_scales, qt, row_elems, offs.size)
            n_sc = -(-row_elems // sblock)
            s = quants.dequantize_rows(_rows(sst, soffs, n_sc * quants.block_geometry(st)[1]), st, n_sc)
            s = s * np.float32(smul)
            f32 = f32 * s[:, np.arange(row_elems) // sblock]
        if scale is not None:
            f32 = f32 * np.float32(scale)
    f32 = f32[inv.ravel()]
    name = arrays.dtype_name(dtype)
    if name == "float16":
        with np.errstate(over="ignore"):
            res = f32.astype(np.float16)
    elif name == "bfloat16":
        res = bf16_bits(f32)
    else:
        res = f32
    if layout == "flat":
        return res.reshape(inv.shape + (row_elems,))
    return np.ascontiguousarray(res.reshape(inv.size, row_elems // seg, seg).transpose(1, 0, 2))
