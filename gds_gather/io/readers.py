"""Readers: execute a ReadPlan against a file and return the unique rows' raw bytes, uint8 [U, row_bytes].

`direct` is the engine: O_DIRECT aligned windows, all submitted by one thread through io_uring (native thread
pool where io_uring is missing), into one reused staging buffer; rows are taken out of their windows by one
vectorized gather. The others are faithful baselines: `pread` (llama.cpp's on-direct), `mmap` (llama.cpp's lazy
mode), `readahead` (lazy mode plus one batched MADV_WILLNEED), `resident` (the whole table in RAM).
Every reader is a context manager; `read(plan)` is the whole hot path and never loops over rows in Python.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from . import forksafe
from . import native
from . import uring
from ..config import Config
from ..errors import ReadError
from ..planner import ReadPlan, row_runs, split_extents, windows
from .storage import close_mapping

log = logging.getLogger(__name__)


MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")
PAGE_CACHE_QD = 1024    # buffered reads served from memory: the queue depth is only a batch size
RUN_CHUNK = 256 << 10   # exact-row reads: runs of adjacent rows are read as one extent, split at this size
# read(on_rows=...) of at least SPLIT_MIN O_DIRECT windows hands over the rows of the windows complete once each
# fraction HANDOVER of them is (copied out of staging, into the row cache) while the rest are read, in one
# submission: the copies overlap the device (docs/decisions/handover.md).
SPLIT_MIN = 64
HANDOVER = (0.5, 0.85)
# O_DIRECT staging made at open, so a first read does not pay the fault-in and io_uring registration of fresh memory
# (docs/decisions/staging-memory.md); larger batches still grow it in place.
STAGING_INITIAL = 6 << 20


def wide_qd(config: Config, lengths: np.ndarray) -> int:
    """O_DIRECT queue depth: queue_depth x the mean window in 4 KiB pages (rounded up), at most queue_depth_max.

    The rule: every window of a ubatch's misses goes out in one submission. Narrow rows (qwen4exp, 90 B) keep
    queue_depth (256); wide rows (gemma4-e4b, 7,392 B: 7.7 KiB windows at 512-B alignment, 2 pages) get 512, above
    the 140-440 windows of a 2,048-token ubatch: a QD below a batch's windows waits for refills, one beyond the
    device's tags neither helps nor hurts (docs/decisions/queue-depth.md)."""
    pages = -(-int(lengths.sum()) // max(1, lengths.shape[0]) // 4096) if lengths.shape[0] else 1
    return max(1, min(config.queue_depth_max, config.queue_depth * max(1, pages)))


# Default O_DIRECT window alignment of narrow rows: at least 4096 even where the device's logical block is 512
# (neighbours in touching blocks merge into fewer windows, which costs less than the bytes saved; docs/decisions/alignment-and-gaps.md).
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


class RowReader(Protocol):
    """What the chain (source.through, the destinations) asks of a reader: every reader
    declares each capability (Reader's defaults), none is probed."""
    name: str
    how: str
    tells_source: bool      # its rows_from_* counters say where rows came from (O_DIRECT readers do)
    overlaps_io: bool       # read(plan, during_io=, on_rows=) overlaps the caller's work with the reads
    staging: "Staging | None"   # the reused host buffer fetch(plan) reads into (None: read returns fresh arrays)
    odirect: bool           # fetch leaves rows inside aligned windows (plan.row_staging), not compact
    bytes_read: int
    rows_from_page_cache: int
    last_from_page_cache: "np.ndarray | None"     # set before a read's during_io runs

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
# costs far more than registering a faulted one with a new ring (docs/decisions/staging-memory.md). One buffer of at most
# POOL_MAX_BYTES is kept; release_staging_pool() frees it.
POOL_MAX_BYTES = 256 << 20
_POOL: list = []
_POOL_LOCK = threading.Lock()


def _pool_after_fork() -> None:
    # a forked child: another parent thread may have held the pool's lock at fork(); the child starts with no pool
    global _POOL_LOCK
    _POOL_LOCK = threading.Lock()
    _POOL.clear()


forksafe.on_child(_pool_after_fork)


def _pooled_staging():
    with _POOL_LOCK:
        return _POOL.pop() if _POOL else None


def _release_staging(st: "Staging") -> None:
    """A closed reader's staging: into the pool where it fits (not pinned for a GPU, not too large), else freed."""
    st.on_grow = None
    if st._map is not None and not st.pin and 0 < st.buf.nbytes <= POOL_MAX_BYTES:
        with _POOL_LOCK:
            if not _POOL:
                _POOL.append(st)
                return
    st.close()


def release_staging_pool() -> None:
    """Free the staging buffer kept for the next reader (see POOL_MAX_BYTES)."""
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


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _grow_hook(reader) -> callable:
    """Staging's on_grow calling reader._registered through a weak reference (no reader <-> staging cycle)."""
    ref = weakref.ref(reader)

    def on_grow(buf):
        r = ref()
        if r is not None:
            r._registered(buf)
    return on_grow


class _FdReader(Reader):
    """Shared machinery of the explicit-read engines: an fd, a staging buffer, and a way to submit.

    Thread-safe: one lock (it waits, it does not refuse) covers a whole read, from the submission to the copy of
    the rows out of the shared staging. Released on close() or when collected (weakref.finalize on the fd; the
    ring and the staging release themselves), with no reference cycle to wait for the cycle collector.
    """

    overlaps_io = True
    merge_runs = True       # buffered exact-row reads: adjacent rows in one read (200,000 contiguous 90 B rows on
    #                         tmpfs, 4 native threads: 74 ms row by row, 19 ms in runs)

    def __init__(self, *a, direct: bool, **kw):
        super().__init__(*a, **kw)
        self.fd = -1
        self.ring = None
        self.odirect = False
        self.align = 1
        self.notices: list[str] = []
        self.inject = None          # tests: fault injection (io_uring: callable(res, idx); threads: (index, errno))
        self._pc = None             # pagecache.Residency of an O_DIRECT reader with page-cache reads
        self.last_from_page_cache = None   # bool [U] of the last O_DIRECT fetch: rows copied from the page cache
        self.staged = None          # (file offsets, bytes, staging offsets) of the windows the last O_DIRECT read left
        #                             whole in staging; None after any other read (rows_in_staging)
        self.during_io = None       # read(plan, during_io=f): f() runs once while the reads are in flight
        self._native = native.library(self.config)[0]     # rows out of staging with no temporary (None: numpy copies)
        self._lock = threading.RLock()
        forksafe.track(self, "_lock")
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        from .storage import filesystem
        fs = filesystem(self.path)
        self.memory_fs = fs in MEMORY_FILESYSTEMS
        if direct and self.memory_fs:
            direct = False
            self.notices.append(f"{fs} is memory: buffered exact-row reads (O_DIRECT would only add copies)")
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(self.path, flags | os.O_DIRECT)
                self.odirect = True
                self.tells_source = True     # O_DIRECT: a row not copied from the page cache came from the device
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                    raise
                self.notices.append(f"O_DIRECT refused by the filesystem ({e.strerror}): buffered reads")
        if self.fd < 0:
            self.fd = os.open(self.path, flags)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        self._fd_fin = weakref.finalize(self, _close_fd, self.fd)
        self.staging = _pooled_staging() if direct and self.odirect else None
        if self.staging is None:
            self.staging = Staging()
        self.staging.on_grow = _grow_hook(self)
        if self.odirect and self.config.page_cache_reads:     # residency learned from now on, in the background
            from .pagecache import Residency
            self._pc = Residency(self.path, self.data_offset, self.n_bytes, config=self.config)

    def _registered(self, buf: np.ndarray) -> None:
        if self.ring is not None and not self.ring.register_buffer(buf):
            self.notices.append("registering the staging buffer failed (RLIMIT_MEMLOCK?): plain io_uring reads")

    def _submit(self, offsets, lengths, expect, dst: np.ndarray, dst_offsets, handover=None) -> None:
        raise NotImplementedError

    def _submit_windows(self, offs, lens, staging: np.ndarray, at, handover=None) -> np.ndarray:
        """Read the O_DIRECT windows [offs, offs + lens) into staging at byte offsets `at`; once they are all in,
        they are what rows_in_staging offers. Returns the bytes each window holds (one past the end of the file
        stops there)."""
        got = np.minimum(offs + lens, self.file_size) - offs
        self._submit(offs, lens, got, staging, at, handover)
        self.staged = (offs, got, at)
        return got

    def fetch(self, plan: ReadPlan) -> tuple[np.ndarray, np.ndarray]:
        """Read the plan's rows into staging; (staging, byte offset of each unique row in it).

        With O_DIRECT the rows stay inside their aligned windows (offsets = plan.row_staging); otherwise they are
        compact (offsets = u * row_bytes). A GPU kernel can read them right there.
        """
        with self._lock:
            self.staged = None
            self.check_file()
            return self._fetch_checked(plan, self._resident(plan) if self.odirect else None)

    def _fetch_checked(self, plan: ReadPlan, res) -> tuple[np.ndarray, np.ndarray]:
        """fetch, after check_file, given the rows' page-cache residency (bool [U], or None)."""
        if self.odirect:
            if res is not None and res.any():
                return self._fetch_mixed(plan, res)
            staging = self.staging.ensure(plan.window_bytes)
            self.last_from_page_cache = None
            got = self._submit_windows(plan.win_offsets, plan.win_lengths, staging, plan.win_staging)
            self.bytes_read += int(got.sum())
            self.rows_from_device += plan.n_unique
            return staging, plan.row_staging
        n = plan.n_unique * plan.row_bytes
        staging = self.staging.ensure(n)
        if self.merge_runs:     # adjacent rows: one extent per run (contiguous ids: one read, not one per row)
            offs, lens, dst = row_runs(plan.unique_rows, plan.row_bytes, plan.data_offset)
        else:                   # the pread baseline reads row by row, as llama.cpp does
            offs, lens = plan.row_offsets, np.full(plan.n_unique, plan.row_bytes, np.int64)
            dst = np.arange(plan.n_unique, dtype=np.int64) * plan.row_bytes
        if lens.shape[0] and int(lens.max()) > RUN_CHUNK:
            offs, lens, _, dst, _ = split_extents(offs, lens, lens, dst, RUN_CHUNK)
        self._submit(offs, lens, lens, staging, dst)
        self.bytes_read += n
        return staging, np.arange(plan.n_unique, dtype=np.int64) * plan.row_bytes

    def _resident(self, plan: ReadPlan):
        """Rows the page cache holds (bool [U]), or None (page-cache reads off, or nothing resident)."""
        return self.resident(plan.unique_rows, plan.row_bytes)

    def resident(self, rows: np.ndarray, row_bytes: int):
        """Which of these sorted rows the page cache holds, as this reader knows it (bool [k]), or None (no
        page-cache reads, or nothing resident): a prefetch leaves those to the read (a copy, not I/O)."""
        if self._pc is None:
            return None
        return self._pc.rows_resident(rows, row_bytes)

    def _fetch_mixed(self, plan: ReadPlan, res: np.ndarray):
        """Windows whose rows are all resident are copied from the page cache (after the O_DIRECT windows in
        staging, compact); the other windows are read O_DIRECT as planned."""
        rb, rw = plan.row_bytes, plan.row_window
        heads = np.flatnonzero(np.r_[True, rw[1:] != rw[:-1]])
        keep = ~np.logical_and.reduceat(res, heads)          # windows to read O_DIRECT
        pc = ~keep[rw]                                       # rows copied from the page cache
        offs, lens = plan.win_offsets[keep], plan.win_lengths[keep]
        wst = np.zeros_like(lens)
        if lens.shape[0]:
            np.cumsum(lens[:-1], out=wst[1:])
        wb = int(lens.sum())
        base = -(-wb // 64) * 64
        npc = int(pc.sum())
        staging = self.staging.ensure(base + npc * rb)
        self.last_from_page_cache = pc
        self._submit_windows(offs, lens, staging, wst)
        self._pc.take(plan.unique_rows[pc], rb, staging[base:base + npc * rb].reshape(npc, rb))
        out = np.empty(plan.n_unique, np.int64)
        d = ~pc
        remap = np.cumsum(keep) - 1
        out[d] = wst[remap[rw[d]]] + (plan.row_staging[d] - plan.win_staging[rw[d]])
        out[pc] = base + np.arange(npc, dtype=np.int64) * rb
        self.bytes_read += wb + npc * rb
        self.rows_from_page_cache += npc
        self.rows_from_device += plan.n_unique - npc
        return staging, out

    def rows_in_staging(self, rows: np.ndarray, row_bytes: int, take) -> int:
        """take(pos, at): those of the sorted table rows `rows` that the last O_DIRECT read's windows hold whole,
        at positions pos, as a native.RowsAt into staging, valid during the call (made under this reader's lock: no
        other read reuses the staging meanwhile); returns how many. The device delivered them with the rows that
        read asked for: taking them costs no request (prefetch.py's riders)."""
        with self._lock:
            if self.staged is None or not rows.shape[0] or not self.staged[0].shape[0]:
                return 0
            offs, got, at_staging = self.staged
            at = self.data_offset + rows * row_bytes
            w = np.maximum(np.searchsorted(offs, at, "right") - 1, 0)
            pos = np.flatnonzero((at >= offs[w]) & (at + row_bytes <= offs[w] + got[w]))
            if pos.shape[0]:
                w = w[pos]
                take(pos, native.RowsAt(self.staging.buf, at_staging[w] + (at[pos] - offs[w]), row_bytes,
                                        self._native))
            return int(pos.shape[0])

    def _run_during_io(self) -> None:
        fn, self.during_io = self.during_io, None
        if fn is not None:
            fn()

    def read(self, plan: ReadPlan, during_io=None, on_rows=None) -> np.ndarray | None:
        """The plan's unique rows, uint8 [U, row_bytes]. during_io: a callable run once while the reads are in
        flight (io_uring: right after the first submission; the thread pools: before them; not at all when every
        row comes from the page cache). on_rows(pos, rows): the rows are handed over in parts instead of
        returned (read returns None): rows = the unique rows at positions pos (int64, ascending) as a
        native.RowsAt, every row in exactly one part, valid during the call only (it may point into the reader's
        staging); with io_uring and at least SPLIT_MIN O_DIRECT windows, the rows of the windows complete at each
        fraction in HANDOVER come while the others are read."""
        with self._lock:        # the rows are copied out before another thread's fetch can reuse the staging
            self.during_io = during_io
            try:
                return self._read_locked(plan, on_rows)
            finally:
                self.during_io = None

    def _read_locked(self, plan: ReadPlan, on_rows=None) -> np.ndarray | None:
        self.staged = None
        self.check_file()
        res = self._resident(plan) if self.odirect else None    # looked up once, for the copy or the fetch
        if res is not None and res.all():          # all resident: one copy, no staging; no read: no during_io
            out = np.empty((plan.n_unique, plan.row_bytes), np.uint8)
            self._pc.take(plan.unique_rows, plan.row_bytes, out)
            self.bytes_read += out.nbytes
            self.rows_from_page_cache += plan.n_unique
            self.last_from_page_cache = res
        elif on_rows is not None and self.odirect and self.ring is not None and res is None \
                and plan.n_windows >= max(2, SPLIT_MIN):
            self._read_handing_over(plan, on_rows)
            return None
        else:
            staging, offsets = self._fetch_checked(plan, res)
            if on_rows is not None and self.odirect:      # straight from the windows to where the rows go
                on_rows(np.arange(plan.n_unique, dtype=np.int64),
                        native.RowsAt(staging, offsets, plan.row_bytes, self._native))
                return None
            if self.odirect:
                out = native.RowsAt(staging, offsets, plan.row_bytes, self._native).array()
            else:
                out = staging[:plan.n_unique * plan.row_bytes].reshape(plan.n_unique, plan.row_bytes).copy()
        if on_rows is None:
            return out
        on_rows(np.arange(plan.n_unique, dtype=np.int64), native.RowsAt.of(out, self._native))
        return None

    def _read_handing_over(self, plan: ReadPlan, on_rows) -> None:
        """O_DIRECT windows in one submission; at each fraction HANDOVER of them complete, their rows are copied
        out and handed to on_rows while the others are read, then the rest (see SPLIT_MIN)."""
        rw, U = plan.row_window, plan.n_unique
        staging = self.staging.ensure(plan.window_bytes)
        offs, lens = plan.win_offsets, plan.win_lengths
        self.last_from_page_cache = None
        handed = np.zeros(U, bool)

        def hand(pos: np.ndarray) -> None:
            handed[pos] = True
            on_rows(pos, native.RowsAt(staging, plan.row_staging[pos], plan.row_bytes, self._native))
        got = self._submit_windows(offs, lens, staging, plan.win_staging,
                                   handover=([max(1, int(plan.n_windows * f)) for f in HANDOVER],
                                             lambda done: hand(np.flatnonzero(done[rw] & ~handed))))
        self.bytes_read += int(got.sum())
        self.rows_from_device += U
        rest = np.flatnonzero(~handed)
        if rest.shape[0]:
            hand(rest)

    def close(self) -> None:
        with self._lock:
            broken = False
            if self.ring is not None:
                broken = self.ring.broken       # undrained: reads may still land in the staging, never reuse it
                self.ring.close()
                self.ring = None
            try:
                if broken:
                    self.staging.close()
                else:
                    _release_staging(self.staging)
            finally:                        # a staging that fails to close (unpin) still lets the fd go
                self.staging = Staging()    # (a second close must not pool the same buffer twice)
                self.staged = None
                if self._pc is not None:
                    self._pc.close()
                    self._pc = None
                if self.fd >= 0:
                    self._fd_fin()
                    self.fd = -1


class _Engines(_FdReader):
    """Submission through io_uring (preferred), the native thread pool, or Python threads (last resort)."""

    def __init__(self, *a, direct: bool, engine: str, threads: int, **kw):
        super().__init__(*a, direct=direct, **kw)
        self.align = self._block_size() if self.odirect else 1
        self.threads = threads
        self._lib = None
        parts = [("O_DIRECT aligned windows" if self.odirect else "buffered exact rows")]
        if engine == "auto" and self.memory_fs:
            # io_uring hands buffered tmpfs reads to kernel workers, slower than pread threads (docs/decisions/queue-depth.md);
            # from memory, threads calling pread are the fast path
            engine = "threads"
            self.notices.append("memory filesystem: native pread threads instead of io_uring")
        if engine in ("auto", "uring"):
            ok, why = uring.probe()
            if ok:
                self._ring_depth = max(8, min(4096, max(self.config.queue_depth, self.config.queue_depth_max)
                                              if self.odirect else max(self.config.queue_depth, PAGE_CACHE_QD)))
                self._open_ring()
                parts.append(f"io_uring QD {self.config.queue_depth} x pages per window, up to {self.ring.sq_entries}"
                             if self.odirect else f"io_uring QD {self.ring.sq_entries}")
            elif engine == "uring":
                raise ReadError(f"io_uring was requested but is not usable here: {why}")
            else:
                self.notices.append(f"{why}: native thread pool instead")
        if self.ring is None:
            self._lib, why = native.library(self.config)
            if self._lib is not None:
                parts.append(f"native thread pool of {threads}")
            else:
                self.notices.append(f"{why}: Python threads instead (slower: one Python call per read)")
                parts.append(f"Python thread pool of {threads}")
        self.how = ", ".join(parts + self.notices)
        for n in self.notices:   # a memory filesystem is expected; every other fallback is a warning
            (log.info if "memory" in n else log.warning)("%s: %s: %s", self.path.name, self.name, n)

    def _block_size(self) -> int:
        return default_align(self.config, self.path)

    def _open_ring(self) -> None:
        self.ring = uring.Ring(self._ring_depth)
        if not self.ring.register_file(self.fd) and not any("registering the file" in n for n in self.notices):
            self.notices.append("registering the file with io_uring failed: plain fds")
        if self.staging.buf.nbytes:         # a staging buffer from the pool: register it with this ring
            self._registered(self.staging.buf)

    def _after_fork(self) -> None:
        """In a child that inherited this reader through fork(): the ring's mappings are the parent's, so the child
        gets a ring of its own (the staging is a private mapping: the child's copy is its own)."""
        old, self.ring = self.ring, None
        old.close()             # foreign: closes this process's copies only, never touches the parent's reads
        self._open_ring()
        if self.staging.buf.nbytes:
            self._registered(self.staging.buf)

    def _submit(self, offsets, lengths, expect, dst, dst_offsets, handover=None) -> None:
        if offsets.shape[0] == 0:
            return
        if self.ring is not None and self.ring.foreign:
            self._after_fork()
        if self.ring is not None:
            self.ring.inject = self.inject if callable(self.inject) else None
            addrs = np.uint64(dst.ctypes.data) + np.asarray(dst_offsets, np.int64).astype(np.uint64)
            fn, self.during_io = self.during_io, None
            self.ring.read(self.fd, offsets, lengths, addrs, expect=expect, align=self.align, path=self.path,
                           queue_depth=wide_qd(self.config, lengths) if self.odirect else self.ring.sq_entries,
                           between=fn, handover=handover)
            return
        self._run_during_io()           # blocking engines: nothing to overlap with
        if self._lib is not None:
            inj = self.inject if isinstance(self.inject, tuple) else (-1, 0)
            idx, code = native.pread_pool(self._lib, self.fd, offsets, lengths, expect, dst, dst_offsets,
                                          align=self.align, threads=self.threads, inject=inj)
            if idx >= 0:
                off = int(offsets[idx])
                if code == -1:
                    raise ReadError(f"{self.path}: unexpected end of file reading at offset {off}: "
                                    "was the file truncated?")
                raise ReadError(code, f"{self.path}: read at offset {off} failed: {os.strerror(code)}")
            return
        _python_pool(self.fd, self.path, offsets, lengths, expect, dst, dst_offsets, self.align, self.threads)


def _python_pool(fd, path, offsets, lengths, expect, dst, dst_offsets, align, threads) -> None:
    """Last resort without io_uring or a C compiler: threads calling os.preadv, one extent per call."""
    mv = memoryview(dst)

    def one(i):
        o, n, e, d = int(offsets[i]), int(lengths[i]), int(expect[i]), int(dst_offsets[i])
        got = 0
        while got < e:
            try:
                r = os.preadv(fd, [mv[d + got:d + n]], o + got)
            except InterruptedError:
                continue
            except OSError as err:
                raise ReadError(err.errno, f"{path}: read at offset {o + got} failed: {err.strerror}") from None
            if r == 0:
                raise ReadError(f"{path}: unexpected end of file at offset {o + got}: was the file truncated?")
            start, got = got, got + r
            if got < e:
                got -= got % align
                if got <= start:    # the file ends inside this aligned block: re-reading it would loop forever
                    raise ReadError(f"{path}: unexpected end of file at offset {o + start + r}: "
                                    "was the file truncated?")
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, range(offsets.shape[0])))


class DirectReader(_Engines):
    """The engine: O_DIRECT aligned windows at high queue depth from one batched submitter."""

    name = "direct"

    def __init__(self, *a, **kw):
        cfg = kw.get("config") or Config.from_env()
        super().__init__(*a, direct=True, engine=cfg.engine, threads=default_threads(cfg), **kw)
        if self.odirect:        # staging faulted in (and registered with the ring) at open, not in the first read
            self.staging.ensure(STAGING_INITIAL)


class PreadReader(_Engines):
    """llama.cpp's on-direct: buffered exact-row preads from 2 x cores native threads (FADV_RANDOM fd)."""

    name = "pread"
    merge_runs = False

    def __init__(self, *a, **kw):
        cfg = kw.get("config") or Config.from_env()
        super().__init__(*a, direct=False, engine="threads", threads=default_threads(cfg), **kw)


HOST_READERS = {cls.name: cls for cls in (DirectReader, PreadReader, MmapReader, ReadaheadReader, ResidentReader)}
