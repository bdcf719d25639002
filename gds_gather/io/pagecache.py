"""Page-cache-aware reads for `direct`: rows whose pages the page cache already holds are taken from it (no I/O:
copied from a mapping of the file, or pread where rows are wide enough for none of the file's pages to enter this
process's RSS; see Residency.take), the rest are read O_DIRECT (which still adds nothing to the page cache).

Residency comes from mincore over a read-only mapping of the table's span. A mincore of a whole table costs as much
as a warm batch, so the map is refreshed only when older than max(interval, 50 x the last refresh's cost) (at most
2% of the time). Between refreshes the map can be wrong: a row believed cold is read O_DIRECT (correct); before
copying rows believed resident, 8 of their pages are checked, and any miss refreshes the map first (a bulk eviction
never turns the copy into one major fault per row; MADV_RANDOM keeps a lone evicted page's fault to that page).
Where the kernel has cachestat (Linux 6.5+), a due refresh first asks it how many of the span's pages are cached
(one syscall): none, or the same count as last time with nothing evicted, skips the mincore. mincore rather than
RWF_NOWAIT reads: a NOWAIT miss still reads the pages into the page cache (docs/decisions/page-cache-mincore.md has
the figures).

A span of more than Residency.MAP_MAX_PAGES pages (a 28.8 GB table: 7M) is never asked about whole: its mincore
and its cachestat cost 0.7-1 s each, more than a warm batch many times over. Such a span is "sampled": each batch
asks mincore about Residency.SAMPLE of its rows; none resident: the batch is read O_DIRECT; all: it is read from
the page cache (a row the sample missed that is not resident is then a buffered read: correct, counted as a
page-cache row); a mix: mincore of every row. Its page-cache rows are pread whatever their width (a new process's
first touch of a mapped page, ~3 us, costs more than a pread) and offered to the row cache (the reader's
`admit_page_cache`), where a repeat costs no system call.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import platform
import threading
import time

import logging

import numpy as np

from . import native
from ..errors import ReadError
from .libc import libc as _libc
from .storage import close_mapping

log = logging.getLogger(__name__)
PAGE = mmap.PAGESIZE
# cachestat(2): the same number on x86_64 and in the generic table (arm64, riscv); Linux 6.5+
SYS_CACHESTAT = 451 if platform.machine() in ("x86_64", "aarch64", "arm64", "riscv64") else None


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted",
                                               "nr_recently_evicted")]


def _mincore_trusted(path) -> bool:
    """Whether mincore tells the truth about this file's pages. Since Linux 5.0 it reports EVERY page of a file
    mapping resident unless the process owns the file, may write it, or has CAP_FOWNER (mm/mincore.c,
    can_do_mincore): a shared read-only model store owned by another user would then be "all resident" and every
    row a major fault through the mapping. Such files are read O_DIRECT throughout (no page-cache reads), with a
    log line; root is trusted (CAP_FOWNER), which a root process that dropped its capabilities defeats."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    if os.geteuid() == 0 or st.st_uid == os.geteuid() or os.access(path, os.W_OK, effective_ids=True):
        return True
    log.info("%s: not owned by this user nor writable: mincore would call every page resident, so page-cache "
             "reads are off for it (everything O_DIRECT)", path)
    return False


PREAD_MIN_ROW = 1024    # page-cache rows at least this wide are pread, narrower ones copied from the mapping
# ... by up to PREAD_THREADS native threads, one per PREAD_PER_THREAD runs of rows (a new process's first copy of
# page-cache pages is its page faults, which threads share: docs/decisions/page-cache-copy.md)
PREAD_THREADS, PREAD_PER_THREAD = 4, 64
# ... and the narrower ones by up to that many native threads too, one per COPY_PER_THREAD rows: a new mapping's copy
# is its page faults, which threads take in parallel (docs/decisions/page-cache-copy.md)
COPY_PER_THREAD = 4096


def _threads(n: int, per_thread: int) -> int:
    """Native threads for n pieces of work: one per `per_thread`, at least 1, at most PREAD_THREADS and the cores."""
    return max(1, min(PREAD_THREADS, os.cpu_count() or 1, n // per_thread))


class Residency:
    """Which pages of [data_offset, data_offset + n_bytes) of `path` are in the page cache (see module doc)."""

    # A batch whose rows touch at most span pages / EXACT_DIV pages asks mincore about its own rows (one native call,
    # one mincore per row) instead of building a map of the whole span, until those calls have cost as much as one
    # map refresh would (estimated at MINCORE_NS_PER_PAGE; then the map, as for wide batches): a new Table's first
    # batches skip the refresh, a long run pays at most twice the cheaper way (figures:
    # docs/decisions/page-cache-residency.md).
    EXACT_DIV = 64
    MINCORE_NS_PER_PAGE = 15.0     # a whole-span mincore's cost per page (docs/decisions/page-cache-residency.md)
    MAP_MAX_PAGES = 1 << 20        # 4 GiB: a wider span is sampled (module doc)
    SAMPLE = 64

    def __init__(self, path, data_offset: int, n_bytes: int, *, interval: float = 0.25, config=None):
        self.interval = interval
        self.trusted = _mincore_trusted(path)
        with open(path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if hasattr(mmap, "MADV_RANDOM"):
            self._mm.madvise(mmap.MADV_RANDOM)
        self.data_offset, self.n_bytes = int(data_offset), int(n_bytes)
        self._base = np.frombuffer(self._mm, np.uint8)
        self.table = self._base[self.data_offset:self.data_offset + self.n_bytes]
        self.page0 = self.data_offset // PAGE
        end = -(-(self.data_offset + self.n_bytes) // PAGE)
        self._lib = native.library(config)[0]     # None: no C compiler, the map for every batch
        self.pages = end - self.page0
        self.sampled = self._lib is not None and self.pages > self.MAP_MAX_PAGES
        self.vec = np.zeros(0 if self.sampled else self.pages, np.uint8)
        self._last = -float("inf")
        self.cost = 0.0
        self.any = False
        self.refreshes = 0
        self.skipped = 0                # due refreshes cachestat made unnecessary
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)) if SYS_CACHESTAT else -1
        self._rfd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))     # buffered reads of resident rows
        if hasattr(os, "posix_fadvise"):     # (a row the map wrongly calls resident: no readahead around it)
            os.posix_fadvise(self._rfd, 0, 0, os.POSIX_FADV_RANDOM)
        self.path = path
        self._range = _CachestatRange(self.page0 * PAGE, self.pages * PAGE)
        self._stat = _Cachestat()
        self._seen = None               # (nr_cache, nr_evicted) at the last refresh
        self._none_at = -float("inf")       # exact path: when cachestat last said (almost) nothing is cached
        self._none = False
        self.exact = 0                      # batches answered by per-row mincore
        self._exact_s = 0.0                 # their cost so far
        # a new reader learns the span's residency in the background where anything is cached, so a new process's
        # first batch on a warm file finds the map made; every use of the map (and close) waits for it first
        self._learning = None
        if self.trusted and not self.sampled and (self.cached() or (1 << 62, 0))[0] > self._few():
            self._learning = threading.Thread(target=self.refresh, name="gds-gather-residency", daemon=True)
            self._learning.start()

    def _learned(self) -> None:
        if self._learning is not None:
            self._learning.join()
            self._learning = None

    def cached(self):
        """(pages of the span in the page cache, pages of the file evicted so far) from cachestat, or None where
        the kernel lacks it (the fd is then closed and never asked again)."""
        if self._fd < 0:
            return None
        libc = _libc()
        r = libc.syscall(ctypes.c_long(SYS_CACHESTAT), ctypes.c_int(self._fd), ctypes.byref(self._range),
                         ctypes.byref(self._stat), ctypes.c_uint(0))
        if r != 0:
            os.close(self._fd)
            self._fd = -1
            return None
        return int(self._stat.nr_cache), int(self._stat.nr_evicted)

    def _update(self, force: bool = False) -> None:
        """A due refresh: skipped where cachestat shows (almost) nothing cached, or nothing changed since the last
        one. "Almost": at most `few` pages (1/64 of the span, at least 16 = the 64 KiB head a GGUF metadata mapping
        keeps cached after an eviction, at most 256 = 1 MiB); their rows are then read O_DIRECT (a few reads)
        instead of a mincore of the whole span."""
        now = self.cached()
        few = self._few()
        if now is not None and (now[0] <= few or (not force and now == self._seen)):
            if now[0] <= few:
                self.any = False
            self._seen = now
            self._last = time.perf_counter()
            self.skipped += 1
            return
        self.refresh()

    def _few(self) -> int:
        pages = self.pages
        return min(256, max(pages // 64, min(16, pages // 4)))

    def refresh(self) -> None:
        a = time.perf_counter()
        addr = self._base.ctypes.data + self.page0 * PAGE
        rc = _libc().mincore(ctypes.c_void_p(addr), ctypes.c_size_t(self.vec.shape[0] * PAGE),
                             self.vec.ctypes.data_as(ctypes.c_void_p))
        if rc:
            self.vec[:] = 0
        self.vec &= 1
        self.any = bool(self.vec.any())
        self._seen = self.cached()
        b = time.perf_counter()
        self.cost, self._last = b - a, b
        self.refreshes += 1

    def rows_resident(self, unique_rows: np.ndarray, row_bytes: int) -> np.ndarray | None:
        """Bool mask of the rows whose every page is resident, or None when no page of the table is (or when
        mincore cannot be trusted for this file: see _mincore_trusted)."""
        if not self.trusted:
            return None
        if self.sampled:
            return self._rows_sampled(unique_rows, row_bytes)
        self._learned()
        if self._per_row(unique_rows.shape[0], row_bytes):
            return self._rows_exact(unique_rows, row_bytes)
        if time.perf_counter() - self._last >= max(self.interval, 50 * self.cost):
            self._update()
        if not self.any:
            return None
        start = self.data_offset + unique_rows * row_bytes
        first = start // PAGE - self.page0
        last = (start + row_bytes - 1) // PAGE - self.page0
        ok = self._mask(first, last, row_bytes)
        if ok.any() and not self._still_resident(first[ok]):    # evicted since the last refresh: look again
            self._update(force=True)
            ok = self._mask(first, last, row_bytes) if self.any else np.zeros(first.shape[0], bool)
        return ok if ok.any() else None

    def _per_row(self, n_rows: int, row_bytes: int) -> bool:
        """Whether this batch asks mincore about its own rows (see EXACT_DIV): the native helper is there, the rows
        touch few pages, and the per-row calls so far cost less than one map refresh (measured, or estimated)."""
        pages = self.vec.shape[0]
        if self.refreshes and time.perf_counter() - self._last < self.interval:
            return False                            # a fresh map (e.g. learned in the background): use it
        refresh_s = self.cost if self.refreshes else pages * self.MINCORE_NS_PER_PAGE * 1e-9
        return (self._lib is not None and n_rows * (-(-row_bytes // PAGE) + 1) <= pages // self.EXACT_DIV
                and self._exact_s < refresh_s)

    def _rows_exact(self, unique_rows: np.ndarray, row_bytes: int) -> np.ndarray | None:
        """rows_resident for a few rows: mincore of each row's pages now (no map, nothing stale). cachestat, asked
        at most every `interval`, skips it while (almost) nothing of the span is cached (a cold file)."""
        now = time.perf_counter()
        if now - self._none_at >= self.interval:
            st = self.cached()
            self._none = st is not None and st[0] <= self._few()
            self._none_at = now
        if self._none:
            return None
        ok = self._ask(*self._row_pages(unique_rows, row_bytes))
        self.exact += 1
        self._exact_s += time.perf_counter() - now
        return ok if ok.any() else None

    def _rows_sampled(self, unique_rows: np.ndarray, row_bytes: int) -> np.ndarray | None:
        """rows_resident of a sampled span (module doc): SAMPLE rows spread over the batch first, then every row
        where the sample is mixed."""
        n = unique_rows.shape[0]
        pick = np.unique(np.linspace(0, n - 1, min(self.SAMPLE, n)).astype(np.int64)) if n else unique_rows[:0]
        ok = self._ask(*self._row_pages(unique_rows[pick], row_bytes))
        if not ok.any():
            return None
        if pick.shape[0] == n:
            return ok
        if ok.all():
            return np.ones(n, bool)
        self.exact += 1
        ok = self._ask(*self._row_pages(unique_rows, row_bytes))
        return ok if ok.any() else None

    def _row_pages(self, rows: np.ndarray, row_bytes: int) -> tuple[np.ndarray, np.ndarray]:
        """(first page in the file, pages touched) of each row."""
        start = self.data_offset + rows * row_bytes
        first = start // PAGE
        return first, (start + row_bytes - 1) // PAGE - first + 1

    def _ask(self, first: np.ndarray, count: np.ndarray) -> np.ndarray:
        """Whether pages [first[i], first[i] + count[i]) of the file are all resident, for each i: one native call."""
        return native.mincore_rows(self._lib, self._base.ctypes.data, first, count, PAGE, -(-len(self._mm) // PAGE))

    def _mask(self, first, last, row_bytes):
        ok = self.vec[first].astype(bool)
        span = -(-row_bytes // PAGE) + 1            # the most pages a row can touch
        for k in range(1, span):
            ok &= self.vec[np.minimum(first + k, last)].astype(bool)
        return ok

    def _still_resident(self, pages: np.ndarray, samples: int = 8) -> bool:
        """mincore of up to `samples` pages spread over those believed resident (one ctypes call each, so few of
        them): a bulk eviction since the last refresh (memory pressure, a benchmark going cold) shows up here, so
        the copy never turns into one major fault per row."""
        pick = pages[np.linspace(0, pages.shape[0] - 1, min(samples, pages.shape[0])).astype(np.int64)]
        if self._lib is not None:       # one native call, not a ctypes call per run
            return bool(self._ask(pick + self.page0, np.ones(pick.shape[0], np.int64)).all())
        one = np.zeros(1, np.uint8)
        mincore, base = _libc().mincore, self._base.ctypes.data + self.page0 * PAGE
        for p in sorted(set(pick.tolist())):     # (np.unique's first call imports numpy.ma: tens of ms)
            if mincore(ctypes.c_void_p(base + p * PAGE), ctypes.c_size_t(PAGE),
                       one.ctypes.data_as(ctypes.c_void_p)) == 0 and not one[0] & 1:
                return False
        return True

    def take(self, rows: np.ndarray, row_bytes: int, out: np.ndarray) -> None:
        """Read whole rows (resident pages: no I/O), sorted ids, into out, uint8 [len(rows), row_bytes] contiguous.

        Rows of PREAD_MIN_ROW bytes or more are pread (runs of adjacent rows as one read): a page touched through the
        mapping joins this process's RSS, and where the kernel maps large folios whole one row maps up to 2 MiB of
        the file. Narrower rows are copied out of the mapping, where pread's per-call cost dominates (see
        docs/decisions/page-cache-copy.md), by several threads for a large batch, as is everything where the native
        helpers are missing (by one). A sampled span's rows are pread whatever their width (module doc)."""
        if (row_bytes < PREAD_MIN_ROW and not self.sampled) or self._lib is None:
            threads = _threads(rows.shape[0], COPY_PER_THREAD)
            if self._lib is not None and threads > 1:
                native.copy_rows(self._lib, self.table, rows * row_bytes, out, threads=threads)
                return
            # mode="clip" (the rows are checked): with out= and "raise", numpy gathers into a temporary first
            np.take(self.table.reshape(-1, row_bytes), rows, axis=0, out=out, mode="clip")
            return
        from ..planner import row_runs
        offs, lens, dst = row_runs(rows, row_bytes, self.data_offset)
        idx, code = native.pread_pool(self._lib, self._rfd, offs, lens, lens, out, dst,
                                      threads=_threads(offs.shape[0], PREAD_PER_THREAD))
        if idx >= 0:
            raise ReadError(f"{self.path}: reading page-cache rows at offset {int(offs[idx])} failed: "
                            f"{os.strerror(code) if code > 0 else 'unexpected end of file'}")

    def close(self) -> None:
        self._learned()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._rfd >= 0:
            os.close(self._rfd)
            self._rfd = -1
        self.table = self._base = None
        close_mapping(self._mm)
        self._mm = None
