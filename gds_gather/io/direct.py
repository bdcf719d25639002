"""The engine: O_DIRECT aligned windows, all submitted by one thread through io_uring (the native thread pool where
io_uring is missing), into one reused staging buffer; rows are taken out of their windows by one vectorized gather.
`pread` (llama.cpp's on-direct: buffered exact rows from native threads) shares the submission.

A read is a generator of steps (readers.IN_FLIGHT, then readers.Part): `parts(plan)` hands the rows over as they
arrive, straight out of the staging, and yields control while the reads are in flight, so the caller's work
(copying cache hits, the cache's bookkeeping) overlaps the device's; `read(plan)` returns them as one array.
HOST_READERS names every host reader by backend.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from typing import Iterator

import numpy as np

from . import forksafe, memory
from . import native
from . import uring
from ..config import Config
from ..errors import ReadError
from ..planner import ReadPlan, row_runs, split_extents
from .readers import (IN_FLIGHT, InFlight, MmapReader, Part, ReadaheadReader, Reader, ResidentReader, Staging,
                      default_align, default_threads, pooled_staging, release_staging)

log = logging.getLogger(__name__)

MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")
PAGE_CACHE_QD = 1024    # buffered reads served from memory: the queue depth is only a batch size
RUN_CHUNK = 256 << 10   # exact-row reads: runs of adjacent rows are read as one extent, split at this size
# parts(plan) of at least SPLIT_MIN O_DIRECT windows hands over the rows of the windows complete once each
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
    merge_runs = True       # buffered exact-row reads: adjacent rows in one read (a few system calls instead of one
    #                         a row: docs/decisions/page-cache-copy.md)

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
        self.staging = pooled_staging() if direct and self.odirect else None
        if self.staging is None:
            self.staging = Staging()
        self.staging.on_grow = _grow_hook(self)
        if self.odirect and self.config.page_cache_reads:     # residency learned from now on, in the background
            from .pagecache import Residency
            self._pc = Residency(self.path, self.data_offset, self.n_bytes, config=self.config)

    def _registered(self, buf: np.ndarray) -> None:
        if self.ring is not None and not self.ring.register_buffer(buf):
            self.notices.append("registering the staging buffer failed (RLIMIT_MEMLOCK?): plain io_uring reads")

    def _submit(self, offsets, lengths, expect, dst: np.ndarray, dst_offsets, pause: bool,
                marks=()) -> Iterator[InFlight | uring.Complete]:
        """Read the extents into dst at dst_offsets, as a generator: IN_FLIGHT once while they are read (pause),
        uring.Complete at each mark (io_uring only)."""
        raise NotImplementedError

    def _window_bytes(self, offs: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """The bytes each O_DIRECT window [offs, offs + lens) holds (one past the end of the file stops there)."""
        return np.minimum(offs + lens, self.file_size) - offs

    def fetch(self, plan: ReadPlan) -> tuple[np.ndarray, np.ndarray]:
        """Read the plan's rows into staging; (staging, byte offset of each unique row in it).

        With O_DIRECT the rows stay inside their aligned windows (offsets = plan.row_staging); otherwise they are
        compact (offsets = u * row_bytes). A GPU kernel can read them right there.
        """
        with self._lock:
            self.staged = None
            self.check_file()
            return _run(self._fetch(plan, self._resident(plan) if self.odirect else None, pause=False))

    def _fetch(self, plan: ReadPlan, res, pause: bool):
        """fetch, after check_file, given the rows' page-cache residency (bool [U], or None), as a generator
        (IN_FLIGHT where pause) that returns (staging, offsets)."""
        if self.odirect:
            if res is not None and res.any():
                return (yield from self._fetch_mixed(plan, res, pause))
            staging = self.staging.ensure(plan.window_bytes)
            self.last_from_page_cache = None
            offs, lens = plan.win_offsets, plan.win_lengths
            got = self._window_bytes(offs, lens)
            yield from self._submit(offs, lens, got, staging, plan.win_staging, pause)
            self.staged = (offs, got, plan.win_staging)     # what rows_in_staging offers
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
        yield from self._submit(offs, lens, lens, staging, dst, pause)
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

    @property
    def admit_page_cache(self) -> bool:
        """Whether the row cache should keep the rows this reader copies from the page cache (see RowReader)."""
        return self._pc is not None and self._pc.sampled     # a sampled span's page-cache rows are preads

    def _fetch_mixed(self, plan: ReadPlan, res: np.ndarray, pause: bool):
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
        got = self._window_bytes(offs, lens)
        yield from self._submit(offs, lens, got, staging, wst, pause)
        self.staged = (offs, got, wst)
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

    def read(self, plan: ReadPlan) -> np.ndarray:
        """The plan's unique rows, uint8 [U, row_bytes], as one array of their own."""
        (part,) = self._steps(plan, overlap=False)
        return part.rows.array()

    def parts(self, plan: ReadPlan) -> Iterator[InFlight | Part]:
        """The plan's unique rows as they arrive: IN_FLIGHT once while the reads are in flight (io_uring: right
        after the first submission; the thread pools: before them; none when every row comes from the page cache),
        then Parts. With io_uring and at least SPLIT_MIN O_DIRECT windows, the rows of the windows complete at each
        fraction in HANDOVER come while the others are read. Holds this reader (its lock, its staging) until it
        ends or is closed."""
        return self._steps(plan, overlap=True)

    def _steps(self, plan: ReadPlan, overlap: bool) -> Iterator[InFlight | Part]:
        with self._lock:        # the rows are copied out before another thread's fetch can reuse the staging
            self.staged = None
            self.check_file()
            every = np.arange(plan.n_unique, dtype=np.int64)
            res = self._resident(plan) if self.odirect else None    # looked up once, for the copy or the fetch
            if res is not None and res.all():          # all resident: one copy, no staging, nothing in flight
                out = np.empty((plan.n_unique, plan.row_bytes), np.uint8)
                self._pc.take(plan.unique_rows, plan.row_bytes, out)
                self.bytes_read += out.nbytes
                self.rows_from_page_cache += plan.n_unique
                self.last_from_page_cache = res
                yield Part(every, native.RowsAt.of(out, self._native))
            elif overlap and self.odirect and self.ring is not None and res is None \
                    and plan.n_windows >= max(2, SPLIT_MIN):
                yield from self._handing_over(plan)
            else:
                staging, offsets = yield from self._fetch(plan, res, pause=overlap)
                if self.odirect:        # straight from the windows to where the rows go
                    yield Part(every, native.RowsAt(staging, offsets, plan.row_bytes, self._native))
                else:
                    out = staging[:plan.n_unique * plan.row_bytes].reshape(plan.n_unique, plan.row_bytes).copy()
                    yield Part(every, native.RowsAt.of(out, self._native))

    def _handing_over(self, plan: ReadPlan) -> Iterator[InFlight | Part]:
        """O_DIRECT windows in one submission; at each fraction HANDOVER of them complete, a Part of their rows
        while the others are read, then the rest (see SPLIT_MIN)."""
        rw, U, rb = plan.row_window, plan.n_unique, plan.row_bytes
        staging = self.staging.ensure(plan.window_bytes)
        offs, lens = plan.win_offsets, plan.win_lengths
        self.last_from_page_cache = None
        handed = np.zeros(U, bool)
        got = self._window_bytes(offs, lens)
        marks = [max(1, int(plan.n_windows * f)) for f in HANDOVER]
        with closing(self._submit(offs, lens, got, staging, plan.win_staging, True, marks)) as steps:
            for step in steps:
                if step is IN_FLIGHT:
                    yield step
                    continue
                pos = np.flatnonzero(step.extents[rw] & ~handed)
                handed[pos] = True
                yield Part(pos, native.RowsAt(staging, plan.row_staging[pos], rb, self._native))
        self.staged = (offs, got, plan.win_staging)
        self.bytes_read += int(got.sum())
        self.rows_from_device += U
        rest = np.flatnonzero(~handed)
        if rest.shape[0]:
            yield Part(rest, native.RowsAt(staging, plan.row_staging[rest], rb, self._native))

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
                    release_staging(self.staging, memory.limits(self.config.memory_root))
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
            # io_uring hands buffered tmpfs reads to kernel workers, slower than pread threads
            # (docs/decisions/queue-depth.md); from memory, threads calling pread are the fast path
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
        if self._pc is not None and self._pc.sampled:
            parts.append("page-cache residency sampled per batch (a span over 4 GiB: no map)")
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

    def _submit(self, offsets, lengths, expect, dst, dst_offsets, pause: bool, marks=()):
        if offsets.shape[0] == 0:
            return
        if self.ring is not None and self.ring.foreign:
            self._after_fork()
        if self.ring is not None:
            self.ring.inject = self.inject if callable(self.inject) else None
            addrs = np.uint64(dst.ctypes.data) + np.asarray(dst_offsets, np.int64).astype(np.uint64)
            qd = wide_qd(self.config, lengths) if self.odirect else self.ring.sq_entries
            with closing(self.ring.reads(self.fd, offsets, lengths, addrs, expect=expect, align=self.align,
                                         path=self.path, queue_depth=qd, pause=pause, marks=marks)) as steps:
                for step in steps:
                    yield IN_FLIGHT if step is uring.SUBMITTED else step
            return
        if pause:                       # blocking engines: the caller's work runs before the reads
            yield IN_FLIGHT
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


def _run(steps):
    """Run a generator of steps to its end (nobody acts on them); its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


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
