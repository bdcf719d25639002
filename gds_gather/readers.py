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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from . import native, uring
from .config import Config
from .errors import ReadError
from .planner import ReadPlan, windows

log = logging.getLogger(__name__)


MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")
PAGE_CACHE_QD = 1024    # buffered reads served from memory: the queue depth is only a batch size


def default_threads(config: Config) -> int:
    return config.threads or 2 * (os.cpu_count() or 1)


class Reader:
    name = "?"

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

    def check_file(self) -> None:
        """Raise ReadError if the file was truncated, rewritten or replaced since the table was opened."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise ReadError(f"{self.path}: the file was removed after it was opened") from None
        now = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if now != self.file_id:
            what = ("replaced (another inode)" if now[:2] != self.file_id[:2] else
                    f"resized from {self.file_id[2]} to {now[2]} bytes" if now[2] != self.file_id[2] else
                    "modified (mtime changed)")
            raise ReadError(f"{self.path}: the file was {what} since it was opened; reopen the table")

    def read(self, plan: ReadPlan) -> np.ndarray:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Staging:
    """A page-aligned host buffer reused across batches (O_DIRECT needs aligned destinations); grows by doubling.

    Hooks: on_grow(buf) after each (re)allocation (io_uring buffer registration), and `pin(buf)` /
    `unpin(buf)` set by a GPU sink to page-lock the buffer for the GPU (see device.py).
    """

    def __init__(self, on_grow=None):
        self._map = None
        self.buf = np.zeros(0, np.uint8)
        self.on_grow = on_grow
        self.pin = self.unpin = None

    def ensure(self, nbytes: int) -> np.ndarray:
        if nbytes > self.buf.nbytes:
            size = max(1 << 20, 1 << (int(nbytes) - 1).bit_length())
            self.close()
            self._map = mmap.mmap(-1, size)
            self.buf = np.frombuffer(self._map, np.uint8)
            if self.on_grow:
                self.on_grow(self.buf)
            if self.pin:
                self.pin(self.buf)
        return self.buf

    def close(self) -> None:
        if self.unpin and self.buf.nbytes:
            self.unpin(self.buf)
        self.buf = np.zeros(0, np.uint8)
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:   # a caller still holds a view: the GC unmaps it
                pass
            self._map = None


def rows_from_windows(staging: np.ndarray, plan: ReadPlan) -> np.ndarray:
    """The unique rows out of window staging, as one vectorized gather (no per-row Python)."""
    view = np.lib.stride_tricks.sliding_window_view(staging[:plan.window_bytes], plan.row_bytes)
    return view[plan.row_staging]


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
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass
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


class _FdReader(Reader):
    """Shared machinery of the explicit-read engines: an fd, a staging buffer, and a way to submit."""

    def __init__(self, *a, direct: bool, **kw):
        super().__init__(*a, **kw)
        self.fd = -1
        self.ring = None
        self.odirect = False
        self.align = 1
        self.notices: list[str] = []
        self.inject = None          # tests: fault injection (io_uring: callable(res, idx); threads: (index, errno))
        self._lock = threading.Lock()
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
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                    raise
                self.notices.append(f"O_DIRECT refused by the filesystem ({e.strerror}): buffered reads")
        if self.fd < 0:
            self.fd = os.open(self.path, flags)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        self.staging = Staging(on_grow=self._registered)

    def _registered(self, buf: np.ndarray) -> None:
        if self.ring is not None and not self.ring.register_buffer(buf):
            self.notices.append("registering the staging buffer failed (RLIMIT_MEMLOCK?): plain io_uring reads")

    def _submit(self, offsets, lengths, expect, dst: np.ndarray, dst_offsets) -> None:
        raise NotImplementedError

    def fetch(self, plan: ReadPlan) -> tuple[np.ndarray, np.ndarray]:
        """Read the plan's rows into staging; (staging, byte offset of each unique row in it).

        With O_DIRECT the rows stay inside their aligned windows (offsets = plan.row_staging); otherwise they are
        compact (offsets = u * row_bytes). A GPU kernel can read them right there.
        """
        if not self._lock.acquire(blocking=False):
            raise ReadError(f"{self.path}: this reader is already reading in another thread; "
                            "use one reader (one Table) per thread")
        try:
            self.check_file()
            if self.odirect:
                end = np.minimum(plan.win_offsets + plan.win_lengths, self.file_size)
                staging = self.staging.ensure(plan.window_bytes)
                self._submit(plan.win_offsets, plan.win_lengths, end - plan.win_offsets, staging, plan.win_staging)
                self.bytes_read += plan.window_bytes
                return staging, plan.row_staging
            n = plan.n_unique * plan.row_bytes
            staging = self.staging.ensure(n)
            lens = np.full(plan.n_unique, plan.row_bytes, np.int64)
            dst = np.arange(plan.n_unique, dtype=np.int64) * plan.row_bytes
            self._submit(plan.row_offsets, lens, lens, staging, dst)
            self.bytes_read += n
            return staging, dst
        finally:
            self._lock.release()

    def read(self, plan: ReadPlan) -> np.ndarray:
        staging, offsets = self.fetch(plan)
        if self.odirect:
            return rows_from_windows(staging, plan)
        return staging[:plan.n_unique * plan.row_bytes].reshape(plan.n_unique, plan.row_bytes).copy()

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        self.staging.close()
        if self.fd >= 0:
            os.close(self.fd)
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
            # io_uring hands buffered tmpfs reads to kernel workers (measured: 0.6x a single pread thread);
            # from memory, threads calling pread are the fast path
            engine = "threads"
            self.notices.append("memory filesystem: native pread threads instead of io_uring")
        if engine in ("auto", "uring"):
            ok, why = uring.probe()
            if ok:
                self.ring = uring.Ring(max(8, min(4096, self.config.queue_depth if self.odirect else
                                                  max(self.config.queue_depth, PAGE_CACHE_QD))))
                if not self.ring.register_file(self.fd):
                    self.notices.append("registering the file with io_uring failed: plain fds")
                parts.append(f"io_uring QD {self.ring.sq_entries}")
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
        from .storage import logical_block_size
        return self.config.align or logical_block_size(self.path)

    def _submit(self, offsets, lengths, expect, dst, dst_offsets) -> None:
        if offsets.shape[0] == 0:
            return
        if self.ring is not None:
            self.ring.inject = self.inject if callable(self.inject) else None
            addrs = np.uint64(dst.ctypes.data) + np.asarray(dst_offsets, np.int64).astype(np.uint64)
            self.ring.read(self.fd, offsets, lengths, addrs, expect=expect, align=self.align, path=self.path,
                           queue_depth=self.config.queue_depth if self.odirect else self.ring.sq_entries)
            return
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
            got += r
            if got < e:
                got -= got % align
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, range(offsets.shape[0])))


class DirectReader(_Engines):
    """The engine: O_DIRECT aligned windows at high queue depth from one batched submitter."""

    name = "direct"

    def __init__(self, *a, **kw):
        cfg = kw.get("config") or Config.from_env()
        super().__init__(*a, direct=True, engine=cfg.engine, threads=default_threads(cfg), **kw)


class PreadReader(_Engines):
    """llama.cpp's on-direct: buffered exact-row preads from 2 x cores native threads (FADV_RANDOM fd)."""

    name = "pread"

    def __init__(self, *a, **kw):
        cfg = kw.get("config") or Config.from_env()
        super().__init__(*a, direct=False, engine="threads", threads=default_threads(cfg), **kw)


HOST_READERS = {cls.name: cls for cls in (DirectReader, PreadReader, MmapReader, ReadaheadReader, ResidentReader)}
