"""Build (once, cached by source hash: io/cbuild.py) and load the small native helper library native.c through ctypes.

Needs a C compiler (cc/gcc/clang) at first use; without one, callers fall back to pure-Python paths and say so.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
from importlib import resources
from pathlib import Path

import numpy as np

from . import cbuild
from ..config import Config

log = logging.getLogger(__name__)

built: list[str] = []       # the libraries this process compiled (a start-up that ran the compiler; benches report it)


def compiler() -> str | None:
    """The C compiler that builds the helpers: $CC, else cc, gcc or clang on PATH; None if there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


NATIVE_FLAGS = ("-O2", "-shared", "-fPIC", "-pthread")


def build(cache_dir) -> tuple[Path | None, str]:
    """(the library file under cache_dir/native, built now if it is not there; or None, why)."""
    sources = {"native.c": resources.files(__package__).joinpath("native.c").read_bytes()}
    folder = Path(cache_dir) / "native"
    so = cbuild.library_path(folder, "libggnative-", sources, NATIVE_FLAGS)
    if so.exists():
        return so, ""
    cc = compiler()
    if not cc:
        return None, "no C compiler (cc) to build the native helpers"
    try:
        so = cbuild.build_shared([cc], sources, "native.c", NATIVE_FLAGS, folder, "libggnative-")
    except cbuild.CompileError as e:
        return None, f"building the native helpers failed: {e.output.strip()[:300]}"
    built.append(str(so))
    return so, ""


@functools.cache
def _load(cache_dir: str) -> tuple[ctypes.CDLL | None, str]:
    so, why = build(cache_dir)
    if so is None:
        return None, why
    lib = ctypes.CDLL(str(so))
    # arrays go as addresses (ndarray.ctypes.data): ndarray.ctypes.data_as costs several microseconds a call
    lib.gg_pread_pool.restype = ctypes.c_int64
    lib.gg_pread_pool.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 5 + [ctypes.c_int64,
                                  ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_int,
                                  ctypes.POINTER(ctypes.c_int)]
    lib.gg_madvise_ranges.restype = ctypes.c_int
    lib.gg_madvise_ranges.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int]
    lib.gg_publish_i32.restype = None
    lib.gg_publish_i32.argtypes = [ctypes.c_void_p, ctypes.c_int32]
    lib.gg_copy_rows.restype = None
    lib.gg_copy_rows.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    lib.gg_hash_get.restype = None
    lib.gg_hash_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                                ctypes.c_int64, ctypes.c_void_p]
    lib.gg_hash_insert.restype = ctypes.c_int64
    lib.gg_hash_insert.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                                   ctypes.c_void_p, ctypes.c_int64]
    lib.gg_sketch_add.restype = None
    lib.gg_sketch_add.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.c_int64]
    lib.gg_sketch_min.restype = None
    lib.gg_sketch_min.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.c_int64, ctypes.c_void_p]
    lib.gg_mincore_rows.restype = None
    lib.gg_mincore_rows.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_void_p]
    return lib, f"native helpers {so.name}"


def library(config: Config | None = None) -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library or None, why)."""
    cfg = config or Config.from_env()
    try:
        return _load(str(cfg.cache_dir))
    except OSError as e:
        return None, f"loading the native helpers failed: {e}"


def pread_pool(lib, fd: int, offsets, lengths, expect, dst: np.ndarray, dst_offsets, *, align: int = 1,
               threads: int, inject: tuple[int, int] = (-1, 0)) -> tuple[int, int]:
    """Read every extent with `threads` native threads; returns (failed index or -1, errno or -1 for EOF)."""
    off = np.ascontiguousarray(offsets, np.int64)
    ln = np.ascontiguousarray(lengths, np.int64)
    ex = np.ascontiguousarray(expect, np.int64)
    do = np.ascontiguousarray(dst_offsets, np.int64)
    code = ctypes.c_int(0)
    idx = lib.gg_pread_pool(fd, off.ctypes.data, ln.ctypes.data, ex.ctypes.data, dst.ctypes.data, do.ctypes.data,
                            off.shape[0], align, threads, inject[0], inject[1], ctypes.byref(code))
    return int(idx), int(code.value)


def madvise_ranges(lib, base_addr: int, offsets, lengths, advice: int) -> int:
    off = np.ascontiguousarray(offsets, np.int64)
    ln = np.ascontiguousarray(lengths, np.int64)
    return lib.gg_madvise_ranges(base_addr, off.ctypes.data, ln.ctypes.data, off.shape[0], advice)


def publish_i32(lib, flags: np.ndarray, i: int, value: int) -> None:
    """flags[i] = value (int32) as a release store after a full fence (native.c: gg_publish_i32)."""
    if flags.dtype != np.int32 or not 0 <= i < flags.shape[0]:
        raise IndexError(f"publish_i32: flag {i} of an {flags.dtype} array of {flags.shape[0]}")
    lib.gg_publish_i32(flags.ctypes.data + 4 * int(i), int(value))


def mincore_rows(lib, base_addr: int, first_page, n_pages, page: int, map_pages: int) -> np.ndarray:
    """bool [n]: every page of [first_page[i], first_page[i] + n_pages[i]) of the mapping at base_addr (map_pages
    long) resident. IndexError for a range outside the mapping (mincore would describe another mapping there)."""
    f = np.ascontiguousarray(first_page, np.int64)
    c = np.ascontiguousarray(n_pages, np.int64)
    if f.shape[0] and (int(f.min()) < 0 or int(c.min()) < 1 or int((f + c).max()) > map_pages):
        raise IndexError("mincore_rows: a page range lies outside the mapping")
    out = np.zeros(f.shape[0], np.uint8)
    lib.gg_mincore_rows(base_addr, f.ctypes.data, c.ctypes.data, f.shape[0], page, out.ctypes.data)
    return out.view(bool)


def copy_rows(lib, src: np.ndarray, src_offsets, dst: np.ndarray, dst_rows=None, threads: int = 1) -> None:
    """dst[dst_rows[i]] = the row_bytes (dst.shape[1]) bytes at byte src_offsets[i] of src, for every i; dst_rows
    None: rows 0, 1, ... of dst. src: contiguous uint8; dst: C-contiguous uint8 [m, row_bytes].

    Native (lib): one memcpy per row and no temporary, by `threads` native threads (taking chunks of rows in
    turn); without it numpy's gather then scatter, whose temporary is fresh memory (its first touch costs several
    times the copy: docs/decisions/handover.md)."""
    so = np.ascontiguousarray(src_offsets, np.int64)
    n, rb = so.shape[0], dst.shape[1]
    do = np.arange(n, dtype=np.int64) if dst_rows is None else np.ascontiguousarray(dst_rows, np.int64)
    if not n:
        return
    if src.dtype != np.uint8 or dst.dtype != np.uint8 or not src.flags.c_contiguous or not dst.flags.c_contiguous \
            or do.shape[0] != n:
        raise ValueError("copy_rows: contiguous uint8 buffers and one destination row per source offset")
    if int(so.min()) < 0 or int(so.max()) + rb > src.size or int(do.min()) < 0 or int(do.max()) >= dst.shape[0]:
        raise IndexError("copy_rows: a row lies outside its buffer")
    if lib is None:
        view = np.lib.stride_tricks.sliding_window_view(src.reshape(-1)[:int(so.max()) + rb], rb)
        dst[do] = view[so]      # (not np.take: on this overlapping view it would copy the whole view first)
        return
    do = do * rb
    lib.gg_copy_rows(src.ctypes.data, so.ctypes.data, dst.ctypes.data, do.ctypes.data, n, rb, int(threads))


class RowsAt:
    """Rows of row_bytes at byte offsets of one buffer: what a read hands over (a reader's staging: its windows, the
    rows inside them), copied straight to where they go (the result, the row cache) by copy_rows, never gathered
    into an array of their own first. Valid while the buffer is: a reader's until it yields its next part."""

    __slots__ = ("buf", "offsets", "row_bytes", "lib", "_whole")

    def __init__(self, buf: np.ndarray, offsets: np.ndarray, row_bytes: int, lib=None, whole=None):
        self.buf, self.offsets, self.row_bytes, self.lib = buf, offsets, int(row_bytes), lib
        self._whole = whole

    @classmethod
    def of(cls, rows: np.ndarray, lib=None) -> "RowsAt":
        """The rows of an array uint8 [k, row_bytes] (array() gives that array back)."""
        rows = np.ascontiguousarray(rows)
        return cls(rows.reshape(-1), np.arange(rows.shape[0], dtype=np.int64) * rows.shape[1], rows.shape[1], lib,
                   rows)

    def __len__(self) -> int:
        return self.offsets.shape[0]

    def take(self, idx) -> "RowsAt":
        return RowsAt(self.buf, self.offsets[idx], self.row_bytes, self.lib)

    def copy_to(self, dst: np.ndarray, dst_rows=None) -> None:
        """dst[dst_rows[i]] = row i (dst_rows None: rows 0, 1, ... of dst)."""
        copy_rows(self.lib, self.buf, self.offsets, dst, dst_rows)

    def array(self) -> np.ndarray:
        """The rows as an array of their own, uint8 [k, row_bytes] (the array they were made of, if any)."""
        if self._whole is not None:
            return self._whole
        out = np.empty((len(self), self.row_bytes), np.uint8)
        self.copy_to(out)
        return out
