"""Readers: execute a ReadPlan against a file and return the unique rows' raw bytes, uint8 [U, row_bytes].

This module holds what every reader is (the RowReader protocol, the Reader base class, the Region a reader opens,
the steps a read yields: IN_FLIGHT and Part), the reused O_DIRECT staging buffer, and the faithful baselines:
`mmap` (llama.cpp's lazy mode), `readahead` (lazy mode plus one batched MADV_WILLNEED), `resident` (the whole
table in RAM). The engine (`direct`, and the `pread` baseline that shares its submission) is direct.py.
Every reader is a context manager; `read(plan)` is the whole hot path and never loops over rows in Python.
"""
from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

import numpy as np

from . import forksafe, memory
from . import native
from ..config import Config
from ..errors import ReadError
from ..planner import ReadPlan, windows
from .native import RowsAt
from .storage import close_mapping

# (neighbours in touching blocks merge into fewer windows, which costs less than the bytes saved;
# docs/decisions/alignment-and-gaps.md).
MIN_ALIGN = 4096
# KvikIO uses GPU-direct storage only for page-aligned reads ("all reads should be at an offset that is a multiple
# of 4096 bytes", kvikio's docs); default_align may window wide rows at the device's 512-B logical block, so plans
# read by device.GdsReader use max(GDS_ALIGN, the table's alignment) (Table.gds_align)
GDS_ALIGN = 4096


def default_align(config: Config, path, row_bytes: int = 0) -> int:
    """GDS_GATHER_ALIGN; else for rows of at least MIN_ALIGN bytes the device's logical block size, for narrower
    rows max(MIN_ALIGN, the logical block size).

    Wide rows: every row needs a window of its own either way (two rows share a block only where their ids are
    adjacent), so a coarser alignment only adds bytes: a 7,392 B gemma4-e4b row is an 8 or 12 KiB window at 4096
    (11.2 KiB mean on the default text), 7.5 or 8 KiB at 512 (7.7 KiB), the same 2,400 requests per 16-batch cold
    pass (figures: docs/decisions/alignment-and-gaps.md)."""
    from .storage import logical_block_size
    if config.align:
        return config.align
    lbs = logical_block_size(path)
    return lbs if row_bytes >= MIN_ALIGN else max(MIN_ALIGN, lbs)


def default_threads(config: Config) -> int:
    return config.threads or 2 * (os.cpu_count() or 1)



class InFlight:
    """The step a read yields once its reads are in flight (io_uring: right after the first submission; the thread
    pools: just before their blocking reads): the caller's CPU work done now overlaps the device's. A read with
    nothing to wait for (every row in the page cache) yields none."""

    def __repr__(self) -> str:
        return "IN_FLIGHT"


IN_FLIGHT = InFlight()


@dataclass(frozen=True)
class Part:
    """Rows a read delivers: the unique rows at `positions` (int64, ascending, into the plan's unique rows) as a
    native.RowsAt, valid until the read's next step (it may point into the reader's staging). Every row of a read
    comes in exactly one part."""
    positions: np.ndarray
    rows: RowsAt


def parts_of(reader, plan: ReadPlan) -> Iterator[InFlight | Part]:
    """The steps of a read of `plan`: reader.parts(plan) where the reader overlaps its reads with the caller's
    work, else one Part of every row once read(plan) returns. Close it (contextlib.closing) when leaving early."""
    return reader.parts(plan) if reader.overlaps_io else _whole(reader, plan)


def _whole(reader, plan: ReadPlan) -> Iterator[Part]:
    yield Part(np.arange(plan.n_unique, dtype=np.int64), RowsAt.of(reader.read(plan)))


class RowReader(Protocol):
    """What the chain (source.through, the destinations) asks of a reader: every reader
    declares each capability (Reader's defaults), none is probed."""
    name: str
    how: str
    tells_source: bool      # its rows_from_* counters say where rows came from (O_DIRECT readers do)
    overlaps_io: bool       # parts(plan) yields IN_FLIGHT while its reads are in flight (parts_of)
    staging: "Staging | None"   # the reused host buffer fetch(plan) reads into (None: read returns fresh arrays)
    odirect: bool           # fetch leaves rows inside aligned windows (plan.row_staging), not compact
    bytes_read: int
    rows_from_page_cache: int
    last_from_page_cache: "np.ndarray | None"     # set before a read yields IN_FLIGHT
    admit_page_cache: bool  # the row cache keeps its page-cache rows too (each cost it a system call: pagecache.py)

    def check_file(self) -> None: ...
    def read(self, plan: ReadPlan) -> np.ndarray: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class Region:
    """Where a table's rows lie: the file, its identity when the table was opened (device, inode, size, mtime),
    and the byte range of the rows. Every reader of a table is opened from it."""
    path: Path
    data_offset: int
    n_bytes: int
    file_id: tuple

    def open(self, reader_class, config: Config, **kw):
        """A reader of this region (a HOST_READERS class, device.GdsReader, ...)."""
        return reader_class(self.path, self.data_offset, self.n_bytes, config=config, file_id=self.file_id, **kw)


def check_file(path: Path, file_id: tuple) -> None:
    """Raise ReadError if the file at `path` is no longer the one `file_id` (device, inode, size, mtime) names."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ReadError(f"{path}: the file was removed after it was opened") from None
    now = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if now != file_id:
        what = ("replaced (another inode)" if now[:2] != file_id[:2] else
                f"resized from {file_id[2]} to {now[2]} bytes" if now[2] != file_id[2] else
                "modified (mtime changed)")
        raise ReadError(f"{path}: the file was {what} since it was opened; reopen the table")


class Reader:
    name = "?"
    tells_source = False     # see RowReader
    overlaps_io = False
    staging = None
    odirect = False
    last_from_page_cache = None
    admit_page_cache = False

    def __init__(self, path: Path, data_offset: int, n_bytes: int, *, config: Config | None = None,
                 file_id: tuple | None = None):
        self.path = Path(path)
        self.data_offset = int(data_offset)
        self.n_bytes = int(n_bytes)
        self.config = config or Config.from_env()
        if file_id is None:
            st = os.stat(self.path)
            file_id = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        self.file_id = file_id
        self.file_size = self.file_id[2]
        self.how = ""            # how this reader runs here (engine, fallbacks), for logs and bench headers
        self.bytes_read = 0      # bytes requested from the file so far (for read amplification)
        self.rows_from_page_cache = 0   # direct: rows copied from pages the page cache held (see pagecache.py)
        self.rows_from_device = 0       # direct: rows read O_DIRECT

    def resident(self, rows: np.ndarray, row_bytes: int):
        """Rows the page cache holds as far as this reader knows (bool [k]); None: it does not tell."""
        return None

    def check_file(self) -> None:
        """Raise ReadError if the file was truncated, rewritten or replaced since the table was opened."""
        check_file(self.path, self.file_id)

    def read(self, plan: ReadPlan) -> np.ndarray:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Staging:
    """A page-aligned host buffer reused across batches (O_DIRECT needs aligned destinations).

    It grows in place inside one reserved address range (MAP_NORESERVE: no memory until a page is touched), to
    1.25x the size asked rounded up to 2 MiB, so a larger batch keeps the pages already touched and the address;
    only a batch beyond the reservation (4x the size asked, at least RESERVE_MIN) maps a new range. A first batch
    at a new size so pays once for faulting in its new pages and nothing for the old ones (the old buffer was
    replaced by a fresh one of the next power of two, every page faulted in again and re-registered).
    Hooks: on_grow(buf) after each growth (io_uring buffer registration), and `pin(buf)` / `unpin(buf)` set by a
    destination to page-lock (and GPU-map) the buffer (see device.py).
    """

    RESERVE_MIN = 1 << 30
    GRAIN = 2 << 20

    def __init__(self, on_grow=None):
        self._map = None
        self.buf = np.zeros(0, np.uint8)
        self.on_grow = on_grow
        self.pin = self.unpin = None
        self.grows = 0

    def ensure(self, nbytes: int) -> np.ndarray:
        if nbytes > self.buf.nbytes:
            size = -(-(int(nbytes) + int(nbytes) // 4) // self.GRAIN) * self.GRAIN
            if self._map is None or size > len(self._map):
                self.close()
                self._map = _reserve(size, max(self.RESERVE_MIN, 4 * size))
            elif self.unpin and self.buf.nbytes:
                self.unpin(self.buf)
            self.buf = np.frombuffer(self._map, np.uint8, size)
            self.grows += 1
            if self.on_grow:
                self.on_grow(self.buf)
            if self.pin:
                self.pin(self.buf)
        return self.buf

    def close(self) -> None:
        try:
            if self.unpin and self.buf.nbytes:
                self.unpin(self.buf)
        finally:                            # a refused unregister still frees the mapping
            self.buf = np.zeros(0, np.uint8)
            close_mapping(self._map)
            self._map = None


# O_DIRECT staging buffers of closed readers, reused by the next reader this process opens: faulting in a fresh one
# costs far more than registering a faulted one with a new ring (docs/decisions/staging-memory.md). One buffer of at
# most pool_max_bytes() is kept; release_staging_pool() frees it.
POOL_MAX_BYTES = 256 << 20
POOL_MEMORY_SHARE = 8          # and at most 1/8 of the memory this process may still use (as the row cache's budget)
_POOL: list = []
_POOL_LOCK = threading.Lock()


def _pool_after_fork() -> None:
    # a forked child: another parent thread may have held the pool's lock at fork(); the child starts with no pool
    global _POOL_LOCK
    _POOL_LOCK = threading.Lock()
    _POOL.clear()


forksafe.on_child(_pool_after_fork)


def pooled_staging():
    with _POOL_LOCK:
        return _POOL.pop() if _POOL else None


def pool_max_bytes(limits: memory.Limits) -> int:
    """The largest staging buffer kept for the next reader: POOL_MAX_BYTES, less where memory binds."""
    avail = memory.available(limits)
    return POOL_MAX_BYTES if avail is None else min(POOL_MAX_BYTES, avail // POOL_MEMORY_SHARE)


def release_staging(st: "Staging", limits: memory.Limits | None = None) -> None:
    """A closed reader's staging: into the pool where it fits (not pinned for a GPU, not larger than
    pool_max_bytes(limits); default limits: this process's), else freed."""
    st.on_grow = None
    limits = memory.limits() if limits is None else limits
    if st._map is not None and not st.pin and 0 < st.buf.nbytes <= pool_max_bytes(limits):
        with _POOL_LOCK:
            if not _POOL:
                _POOL.append(st)
                return
    st.close()


def release_staging_pool() -> None:
    """Free the staging buffer kept for the next reader (see pool_max_bytes)."""
    with _POOL_LOCK:
        while _POOL:
            _POOL.pop().close()


def _reserve(size: int, reserve: int) -> mmap.mmap:
    """A private anonymous mapping of `reserve` bytes that commits no memory until touched; `size` bytes where the
    kernel refuses that (strict overcommit accounting)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
    try:
        return mmap.mmap(-1, reserve, flags=flags)
    except OSError:
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


class MmapReader(Reader):
    """llama.cpp's lazy mode: the table mapped with MADV_RANDOM, rows gathered by page faults (numpy fancy index)."""

    name = "mmap"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._mm = None
        self._view = None
        self.how = "mmap + MADV_RANDOM, one page fault per missing row"

    def _map(self) -> np.ndarray:
        if self._mm is None:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            if hasattr(mmap, "MADV_RANDOM"):
                self._mm.madvise(mmap.MADV_RANDOM)
            self._view = np.frombuffer(self._mm, np.uint8, count=self.n_bytes, offset=self.data_offset)
        return self._view

    def read(self, plan: ReadPlan) -> np.ndarray:
        self.check_file()     # a truncated mapping would SIGBUS instead of raising
        view = self._map()
        self.bytes_read += plan.n_unique * plan.row_bytes
        return view.reshape(-1, plan.row_bytes)[plan.unique_rows]

    def close(self) -> None:
        self._view = None
        close_mapping(self._mm)
        self._mm = None


class ReadaheadReader(MmapReader):
    """MADV_RANDOM plus one batched MADV_WILLNEED over the merged pages of the batch, then the gather."""

    name = "readahead"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._lib, why = native.library(self.config)
        self.how = "mmap + MADV_RANDOM + batched MADV_WILLNEED (" + ("native" if self._lib else why) + ")"

    def read(self, plan: ReadPlan) -> np.ndarray:
        self.check_file()
        view = self._map()
        page = mmap.PAGESIZE
        # page ranges relative to the mapping base (madvise needs page-aligned addresses from the base)
        offs, lens, _ = windows(plan.row_offsets, plan.row_bytes, page)
        if self._lib is not None:
            base = view.ctypes.data - self.data_offset
            rc = native.madvise_ranges(self._lib, base, offs, lens, mmap.MADV_WILLNEED)
            if rc:
                raise ReadError(rc, f"{self.path}: madvise(MADV_WILLNEED) failed: {os.strerror(rc)}")
        else:
            for o, n in zip(offs.tolist(), lens.tolist()):
                self._mm.madvise(mmap.MADV_WILLNEED, o, min(n, self._mm.size() - o))
        self.bytes_read += int(lens.sum())
        return view.reshape(-1, plan.row_bytes)[plan.unique_rows]


class ResidentReader(Reader):
    """The whole table loaded into host RAM once (the upper bound a resident table gives)."""

    name = "resident"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._data = None
        self.how = "whole table in host RAM"

    def read(self, plan: ReadPlan) -> np.ndarray:
        if self._data is None:
            self.check_file()
            data = np.empty(self.n_bytes, np.uint8)
            with open(self.path, "rb", buffering=0) as f:
                f.seek(self.data_offset)
                got = 0
                while got < self.n_bytes:
                    n = f.readinto(memoryview(data)[got:])
                    if not n:
                        raise ReadError(f"{self.path}: unexpected end of file at offset "
                                        f"{self.data_offset + got} while loading the table")
                    got += n
            self._data = data
            self.bytes_read += self.n_bytes
        return self._data.reshape(-1, plan.row_bytes)[plan.unique_rows]

    def close(self) -> None:
        self._data = None


