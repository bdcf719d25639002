"""Hot rows kept across processes: the row cache's rows, written to the cache directory when a Table closes and at
exit, and read back by the next process's first use of the same table, so a restart after `direct` (which leaves
the page cache empty) starts with the rows its last run read instead of reading them all from the device again.

One file per table (its path, data offset and row size name it), validated before any row is served: the table
file's identity (device, inode, size, mtime) and the table's geometry must match the header, the body must match
its CRC-32, every id must lie in the table, and a sample of the rows must equal the table's bytes read now. Anything
else is ignored with a warning. Files are written beside their final name and renamed over it, so concurrent
writers leave one valid file. With page-cache reads off (GDS_GATHER_PAGE_CACHE_READS=0) the file's pages are
dropped from the page cache after writing and reading it, keeping O_DIRECT's promise.
"""
from __future__ import annotations

import hashlib
import logging
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..io.safe_write import atomic_output, check_free_space

log = logging.getLogger(__name__)

MAGIC = b"GGHOTRW1"
VERSION = 1
_HEADER = struct.Struct("<8sIIQQQQQQqI4x")     # magic version row_bytes n data_offset n_rows dev ino size mtime crc
HEADER_BYTES = 4096                              # the body starts page-aligned
SAMPLE = 8                                       # rows compared with the table's bytes at load


@dataclass(frozen=True)
class Target:
    """What names and validates a table's hot-row file (kept by its cache: it may outlive the Table)."""
    path: Path
    data_offset: int
    row_bytes: int
    n_rows: int
    file_id: tuple
    config: object

    @classmethod
    def of(cls, table) -> "Target":
        return cls(Path(table.path), table.data_offset, table.row_bytes, table.n_rows, tuple(table.file_id),
                   table.config)


def directory(cache_dir) -> Path:
    """Where the hot-row files of a cache directory live (one <digest>.rows per table)."""
    return Path(cache_dir) / "hot"


def path_for(table) -> Path:
    """Where the hot rows of this table live: <cache_dir>/hot/<digest of path, data offset, row size>.rows."""
    key = f"{os.path.realpath(table.path)}\0{table.data_offset}\0{table.row_bytes}".encode()
    return directory(table.config.cache_dir) / (hashlib.sha256(key).hexdigest()[:24] + ".rows")


def _identity(table) -> tuple:
    dev, ino, size, mtime = table.file_id
    return table.row_bytes, table.data_offset, table.n_rows, dev, ino, size, mtime


def save(table, ids: np.ndarray, freq: np.ndarray, rows: np.ndarray) -> Path | None:
    """Write the rows (ids int64 [n], freq uint8 [n], rows uint8 [n, row_bytes]) for `table`; None when skipped."""
    path = path_for(table)
    ids = np.ascontiguousarray(ids, np.int64)
    freq = np.ascontiguousarray(freq, np.uint8)
    rows = np.ascontiguousarray(rows, np.uint8)
    crc = zlib.crc32(rows, zlib.crc32(freq, zlib.crc32(ids)))
    rb, off, n_rows, dev, ino, size, mtime = _identity(table)
    head = _HEADER.pack(MAGIC, VERSION, rb, ids.shape[0], off, n_rows, dev, ino, size, mtime, crc)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        check_free_space(path, HEADER_BYTES + ids.nbytes + freq.nbytes + rows.nbytes)
        with atomic_output(path) as tmp:
            with open(tmp, "wb") as f:
                f.write(head.ljust(HEADER_BYTES, b"\0"))
                f.write(ids.data)
                f.write(freq.data)
                f.write(rows.data)
                f.flush()
                if not table.config.page_cache_reads:
                    os.fsync(f.fileno())
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError as e:        # a full disk or a read-only cache directory: the next process starts cold
        log.warning("hot rows of %s not saved: %s", table.path, e)
        return None
    return path


def load(table, capacity: int):
    """(ids, freq, rows) saved for this table, at most `capacity` of the hottest, or None (no file, or one that
    does not fit the table: then a warning, and the file is left for the next writer to replace)."""
    path = path_for(table)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("hot rows %s not read: %s", path, e)
        return None
    with f:
        why, got = _read(f, table, capacity)
        if not table.config.page_cache_reads:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    if why:
        log.warning("hot rows %s ignored: %s", path, why)
        return None
    return got


def _read(f, table, capacity: int):
    head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES:
        return "truncated header", None
    magic, version, rb, n, off, n_rows, dev, ino, size, mtime, crc = _HEADER.unpack_from(head)
    if magic != MAGIC or version != VERSION:
        return "not a hot-row file of this version", None
    if (rb, off, n_rows, dev, ino, size, mtime) != _identity(table):
        return "written for another version of the table (the file changed, or was replaced)", None
    if n > table.n_rows or (HEADER_BYTES + n * (9 + rb)) != os.fstat(f.fileno()).st_size:
        return "its size does not match its header (truncated or corrupt)", None
    ids = np.fromfile(f, np.int64, n)
    freq = np.fromfile(f, np.uint8, n)
    rows = np.fromfile(f, np.uint8, n * rb).reshape(n, rb)
    if ids.shape[0] != n or rows.shape[0] != n or zlib.crc32(rows, zlib.crc32(freq, zlib.crc32(ids))) != crc:
        return "its CRC does not match (corrupt)", None
    if n and (ids.min() < 0 or ids.max() >= table.n_rows or (np.diff(np.sort(ids)) == 0).any()):
        return "row ids outside the table or repeated", None
    if not _sample_matches(table, ids, rows):
        return "its rows differ from the table's (the table changed in place)", None
    if n > capacity:                         # a smaller budget now: keep the hottest
        keep = np.sort(np.argsort(-freq.astype(np.int16), kind="stable")[:capacity])
        ids, freq, rows = ids[keep], freq[keep], rows[keep]
    return None, (ids, freq, rows)


def _sample_matches(table, ids: np.ndarray, rows: np.ndarray) -> bool:
    """SAMPLE rows, spread over the file, compared with the table's bytes read now (pread, a few reads)."""
    if not ids.shape[0]:
        return True
    pick = sorted(set(np.linspace(0, ids.shape[0] - 1, min(SAMPLE, ids.shape[0])).astype(np.int64).tolist()))
    fd = os.open(table.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        for i in pick:
            want = os.pread(fd, table.row_bytes, table.data_offset + int(ids[i]) * table.row_bytes)
            if want != rows[i].tobytes():
                return False
    finally:
        os.close(fd)
    return True
