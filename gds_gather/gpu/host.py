"""The device on the host (HostAccel, interface.Accel's second implementation): the same operations with real
values, so the caches, staging, slot reuse, capacity checks, the schedule and every destination run in CI. Device
memory is host memory (HostArray), the kernels are the CUDA sources compiled for the host (host_kernels.host_gather;
gguf's dequantizer without a C++ compiler), cuFile is a pread of the file.

HostAccel's streams are deferred: an operation queued on a stream is a closure that runs only when that stream is
synchronized, an event recorded on it is waited for, or a graph replay is run; a closure queued while its stream
runs runs at once (the ops of a step run in order inside the step). So an ordering bug that a GPU may or may not
show (staging read before it is written, a slot reused before its step ran, work queued on the wrong stream) gives
wrong rows or an error on the host, every time. CUDA's legacy stream (cupy's current stream and torch's default
one, which the prefill's and callers' non-blocking streams never wait for) is HostAccel's `null` stream, deferred
like the others: `device_array` queues its zeros on its stream as cupy's memset does, so a buffer zeroed on the
legacy stream and used on another without ordering is wiped when the legacy stream runs, after its first use. A
wait on a flag the host has not set is an error (a GPU would hang).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import time
from collections import deque

import numpy as np

from . import arrays
from .interface import Accel
from ..errors import BackendError, ReadError, StreamOrderError, WaitValueRefused


class HostArray(np.ndarray):
    """HostAccel's device memory: a numpy array of its own type, so `arrays.kind` tells it from host arrays
    (ids of this type take Table's device path on a HostAccel table)."""


def _dev(a: np.ndarray) -> HostArray:
    return np.asarray(a).view(HostArray)


def numpy_view(a) -> np.ndarray:
    """A numpy view of a HostAccel array or a torch CPU tensor (bfloat16 as its uint16 bits), no copy."""
    if arrays.kind(a) == "torch":
        import torch
        return a.view(torch.int16).numpy().view(np.uint16) if a.dtype == torch.bfloat16 else a.numpy()
    return np.asarray(a).view(np.ndarray)


class HostStream:
    """A queue of closures, run in order at a synchronize, an event wait or a replay's run."""

    def __init__(self, accel: "HostAccel", name: str):
        self.accel, self.name, self.q, self.running = accel, name, deque(), False

    def enqueue(self, fn) -> None:
        if self.running:
            fn()
        else:
            self.q.append(fn)

    def run(self, until=None) -> None:
        if self.running:
            return
        self.running = True
        try:
            while self.q:
                fn = self.q.popleft()
                fn()
                if until is not None and until.done:
                    return
        finally:
            self.running = False

    def synchronize(self) -> None:
        self.accel.syncs += 1
        self.run()

    def query(self) -> bool:
        return not self.q

    def __repr__(self):
        return f"<HostStream {self.name}: {len(self.q)} queued>"


class HostEvent:
    def __init__(self, accel):
        self.accel, self.stream, self.done, self.t = accel, None, True, 0.0

    def record(self, stream=None) -> None:
        s = self.accel.current(stream)
        self.stream, self.done = s, False

        def mark():
            self.done, self.t = True, time.perf_counter()
        s.enqueue(mark)

    def synchronize(self) -> None:
        self.accel.syncs += 1
        if not self.done:
            self.stream.run(until=self)

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: "HostEvent") -> float:
        if not (self.done and end.done):
            raise RuntimeError("event not recorded or not yet run")
        return (end.t - self.t) * 1e3


class HostFlags:
    """graph.HostFlags on the host: the host sets flags, queued waits check them when they run."""

    def __init__(self, accel, n: int = 2, refuse: bool = False):
        self.accel, self.host, self.refuse = accel, np.zeros(n, np.int32), refuse

    def wait(self, stream, i: int, value: int = 1) -> None:
        if self.refuse:
            raise WaitValueRefused("cuStreamWaitValue32 failed with CUresult 801 (HostAccel refuse_waits)")

        def check():
            if self.host[i] != value:
                raise StreamOrderError(f"a queued wait on host flag {i} == {value} ran with the flag at "
                                       f"{int(self.host[i])}: on a GPU this step would wait forever")
        self.accel.current(stream).enqueue(check)

    def write(self, stream, i: int, value: int) -> None:
        def store():
            self.host[i] = value
        self.accel.current(stream).enqueue(store)

    def set(self, i: int, value: int = 1) -> None:
        self.host[i] = value

    def probe(self, stream) -> None:
        if self.refuse:
            raise WaitValueRefused("cuStreamWaitValue32 failed with CUresult 801 (HostAccel refuse_waits)")


class HostGraph:
    """A captured step on the host: replay queues the step closure on the capture stream."""

    def __init__(self, accel, stream, fn, out):
        self.accel, self.stream, self.fn, self.out = accel, stream, fn, out

    def replay(self) -> None:
        def run():
            self.out[:] = list(self.fn())
        self.accel.current(self.stream).enqueue(run)
        self.accel.replays += 1


class HostFile:
    """cuFile on the host: pread of the file into HostAccel device memory, synchronous (cuFile is not
    stream-ordered either)."""

    def __init__(self, path):
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))

    def pread(self, dst, n: int, off: int):
        buf = numpy_view(dst)
        got = os.preadv(self.fd, [memoryview(buf)[:n]], off) if n else 0
        return _Done(got)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _Done:
    def __init__(self, v):
        self.v = v

    def get(self):
        return self.v


class HostAccel(Accel):
    """The device on the host (see the module docstring). `syncs` counts synchronizations (stream and event
    waits), `replays` graph replays; refuse_waits=True makes the flag waits refused (as a driver without stream
    memory operations does; "capture": only inside a graph capture, as a driver that takes them eagerly but
    refuses the captured node); gds=False makes cuFile unavailable."""

    name = "host"

    def __init__(self, *, refuse_waits: bool | str = False, gds: bool = True):
        import torch
        self.torch = torch
        self.device = torch.device("cpu")
        self.null = HostStream(self, "null")
        self._current = [self.null]
        self.syncs = self.replays = 0
        self.refuse_waits, self.has_gds = refuse_waits, gds
        self.pinned_ranges: dict = {}

    def empty(self, nbytes):
        return _dev(np.zeros(int(nbytes), np.uint8))

    def grow(self, old, nbytes, keep, device_id=0):
        new = self.empty(nbytes)
        if old is not None and keep:
            new[:keep] = old[:keep]
        return new

    def device_array(self, n, dtype, stream=None):
        a = _dev(np.zeros(int(n), dtype))

        def memset():       # as cupy's memsetAsync: in `stream`'s order, whatever was written there before
            a[...] = 0
        self.current(stream).enqueue(memset)
        return a

    def pinned_array(self, n, dtype):
        return np.zeros(int(n), dtype)

    def zeros(self, n, dtype):
        return self.torch.zeros(n, dtype=dtype)

    def pinned(self, n, dtype):
        return self.torch.zeros(n, dtype=dtype)

    def mapped(self, nbytes):
        a = np.zeros(nbytes, np.uint8)
        return a, a.ctypes.data, a

    def pin(self, staging, mapped):
        ranges = self.pinned_ranges

        def pin(buf):
            ranges[buf.ctypes.data] = buf.nbytes

        def unpin(buf):
            ranges.pop(buf.ctypes.data, None)
        if staging.buf.nbytes:
            pin(staging.buf)
        staging.pin, staging.unpin = pin, unpin

    def device_view(self, host):
        return _dev(host)

    def ptr(self, a):
        return int(a.data_ptr()) if arrays.kind(a) == "torch" else int(np.asarray(a).ctypes.data)

    def h2d(self, dst, src, nbytes, stream, dst_offset=0):
        d = numpy_view(dst).reshape(-1).view(np.uint8)      # bytes, as cudaMemcpyAsync copies them

        def copy():
            d[dst_offset:dst_offset + nbytes] = src.reshape(-1).view(np.uint8)[:nbytes]
        self.current(stream).enqueue(copy)

    def upload(self, dst, src, stream):
        d, s = numpy_view(dst), np.array(src)          # pageable source: copied at the call, as cudaMemcpyAsync does

        def copy():
            d[...] = s
        self.current(stream).enqueue(copy)

    def copy(self, dst, src, stream):
        def copy():
            dst.copy_(src)
        self.current(stream).enqueue(copy)

    def gather(self, staging, offsets, inverse, qtype, row_elems, *, dtype, stream, out=None, scale=None,
               layout="flat", n_layer=None, block_scales=None):
        from . import dequant as dq, host_kernels as hk
        g = dq.check_launch(staging, offsets, inverse, qtype, row_elems, dtype=dtype, layout=layout, n_layer=n_layer,
                            block_scales=block_scales, host=True)
        if out is None:
            out = (self.torch.empty(g.shape, dtype=getattr(self.torch, g.name)) if g.kind == "torch" else
                   _dev(np.empty(g.shape, np.uint16 if g.name == "bfloat16" else g.name)))
        dq.check_out(out, g, host=True)
        o = numpy_view(out)
        kw = dict(dtype=g.name, scale=scale, layout=layout, n_layer=n_layer)
        bs = None if block_scales is None else dq.as_block_scales(block_scales)

        def kernel():
            run = hk.host_gather if hk.host_compiler_available() else hk.reference_gather
            st, of, inv = numpy_view(staging), numpy_view(offsets), numpy_view(inverse)
            scales = None if bs is None else dq.BlockScales(numpy_view(bs.sstaging), numpy_view(bs.soffsets),
                                                            bs.stype, bs.sblock, bs.smul)
            o[...] = run(st, of, inv, qtype, row_elems, block_scales=scales, **kw).view(o.dtype)
        self.current(stream).enqueue(kernel)
        return out

    def copy_words(self, src_ptr, dst_ptr, ctl_ptr, max_words, stream, device_id=0):
        def kernel():      # kernels/copy.cu's gg_copy_words: ctl[0] 8-byte words src -> dst
            w = ctypes.c_int64.from_address(ctl_ptr).value
            if not 0 <= w <= max_words:
                raise StreamOrderError(f"gg_copy_words: {w} words, the launch covers {max_words}")
            ctypes.memmove(dst_ptr, src_ptr, 8 * w)
        self.current(stream).enqueue(kernel)

    def copy_rows(self, pool_ptr, src_ptr, dst_ptr, ctl_ptr, row_bytes, max_rows, stream, device_id=0):
        def kernel():      # gg_copy_rows: ctl[1] rows of the pool, src[r] -> dst[r] (every source read first)
            k = ctypes.c_int64.from_address(ctl_ptr + 8).value
            if not 0 <= k <= max_rows:
                raise StreamOrderError(f"gg_copy_rows: {k} rows, the launch covers {max_rows}")
            if not k:
                return
            s = np.ctypeslib.as_array((ctypes.c_int64 * k).from_address(src_ptr))
            d = np.ctypeslib.as_array((ctypes.c_int64 * k).from_address(dst_ptr))
            hi = int(max(s.max(), d.max())) + row_bytes
            pool = np.ctypeslib.as_array((ctypes.c_uint8 * hi).from_address(pool_ptr))
            idx = np.arange(row_bytes)
            pool[d[:, None] + idx] = pool[s[:, None] + idx]
        self.current(stream).enqueue(kernel)

    def take_rows(self, staging, offsets, inverse, row_bytes, shape, stream):
        out = _dev(np.empty(tuple(shape) + (row_bytes,), np.uint8))
        inv = np.array(inverse)

        def kernel():
            st, of = numpy_view(staging), numpy_view(offsets)
            out.reshape(-1, row_bytes)[...] = st[of[inv.reshape(-1)][:, None] + np.arange(row_bytes)]
        self.current(stream).enqueue(kernel)
        return out

    def defer(self, stream, fn):
        self.current(stream).enqueue(fn)

    def order(self, stream, after=None):
        mark = self.event()
        mark.record(after)

        def wait():         # as cudaStreamWaitEvent: `after`'s work up to the mark runs first (no host sync counted)
            if not mark.done:
                mark.stream.run(until=mark)
        self.current(stream).enqueue(wait)

    def to_host(self, ids, stream):
        self.current(stream).synchronize()       # a blocking copy down on `stream`: its earlier work has run
        return np.array(numpy_view(ids))

    def ids_like(self, host, like, stream):
        a = np.array(host)
        return self.torch.from_numpy(a) if arrays.kind(like) == "torch" else _dev(a)

    def stream(self):
        return HostStream(self, f"stream-{id(self) % 997}-{len(self._current)}")

    def current(self, stream=None):
        if stream is None:
            return self._current[-1]
        if not isinstance(stream, HostStream):
            raise TypeError(f"not a HostAccel stream: {stream!r}")
        return stream

    def key(self, stream):
        return self.current(stream)

    @contextlib.contextmanager
    def using(self, stream):
        self._current.append(self.current(stream))
        try:
            yield
        finally:
            self._current.pop()

    def synchronize(self, stream):
        self.current(stream).synchronize()

    def query(self, stream):
        return self.current(stream).query()

    def event(self, timing=False, external=False):
        return HostEvent(self)

    def capture(self, stream, fn):
        """The step is not run here (its queued ops would run); a refused flag wait is raised now, as the driver
        refuses it during a real capture."""
        if self.refuse_waits:
            raise WaitValueRefused("cuStreamWaitValue32 failed with CUresult 801 (HostAccel refuse_waits)")
        out: list = []
        return HostGraph(self, stream, fn, out), out

    def flags(self, n=2):
        return HostFlags(self, n, refuse=self.refuse_waits is True)

    def gds_state(self):
        if not self.has_gds:
            return False, False, "HostAccel(gds=False): no cuFile stand-in"
        return True, False, "HostAccel: cuFile stand-in (pread into host device memory)"

    def cufile(self, path, threads):
        if not self.has_gds:
            raise BackendError("gds: HostAccel(gds=False) has no cuFile stand-in")
        try:
            return HostFile(path), f"host cuFile stand-in (pread), {threads} threads", False
        except OSError as e:
            raise ReadError(f"{path}: {e}") from None
