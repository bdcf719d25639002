"""The device primitives the GPU data path is built from, behind one interface with two implementations.

`CudaAccel` is the glue to torch / cupy / kvikio (allocate, pin and map host memory, queue copies and kernels on
a stream, events, graph capture, waits and writes of host flags, cuFile reads). `HostAccel` runs the same
operations on the host with real values, so the caches, staging, slot reuse, capacity checks, the schedule and
every destination run in CI: device memory is host memory, the kernels are the CUDA sources compiled for the host
(dequant_gpu.host_gather; gguf's dequantizer without a C++ compiler), cuFile is a pread of the file.

HostAccel's streams are deferred: an operation queued on a stream is a closure that runs only when that stream is
synchronized, an event recorded on it is waited for, or a graph replay is run; a closure queued while its stream
runs runs at once (the ops of a step run in order inside the step). So an ordering bug that a GPU may or may not
show (staging read before it is written, a slot reused before its step ran, work queued on the wrong stream) gives
wrong rows or an error on the host, every time. CUDA's legacy stream (cupy's current stream and torch's default
one, which the prefill's and callers' non-blocking streams never wait for) is HostAccel's `null` stream, deferred
like the others: `device_array` queues its zeros on its stream as cupy's memset does, so a buffer zeroed on the
legacy stream and used on another without ordering is wiped when the legacy stream runs, after its first use. A
wait on a flag the host has not set is an error (a GPU would hang). Selection is explicit (`get("cuda" | "host")`,
Config.accel); nothing falls back silently.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import time
from collections import deque

import numpy as np

from . import arrays
from ..errors import BackendError, ReadError, StreamOrderError, WaitValueRefused

ACCELS = ("cuda", "host")
__all__ = ["ACCELS", "Accel", "CudaAccel", "HostAccel", "HostArray", "StreamOrderError", "get"]


def get(name: str = "cuda") -> "Accel":
    """The accelerator by name: "cuda" (the GPU) or "host" (everything on the host, deferred streams)."""
    if name == "cuda":
        return CudaAccel()
    if name == "host":
        return HostAccel()
    raise BackendError(f"unknown accelerator {name!r}; known: {', '.join(ACCELS)}")


class Accel:
    """What the device data path needs from a device. Arrays: `empty` and `device_array` give device memory (cupy /
    HostArray), `pinned_array` page-locked numpy arrays (no torch: Table's device path runs with cupy alone), `zeros`
    and `pinned` torch tensors on the device / in page-locked host memory (the prefill's tokens and indices); streams are this accel's (any stream
    object the CUDA side accepts: None, an int handle, a cupy or torch stream)."""

    name = "?"
    device = None           # the torch device of `zeros` tensors (and of the trunk)

    # memory
    def empty(self, nbytes: int): raise NotImplementedError
    def grow(self, old, nbytes: int, keep: int, device_id: int = 0): raise NotImplementedError  # old[:keep] kept
    def device_array(self, n: int, dtype, stream=None): raise NotImplementedError   # zeros queued on `stream`
    def pinned_array(self, n: int, dtype): raise NotImplementedError       # page-locked numpy array, zeros
    def zeros(self, n: int, dtype): raise NotImplementedError              # torch tensors (the prefill's trunk)
    def pinned(self, n: int, dtype): raise NotImplementedError
    def mapped(self, nbytes: int): raise NotImplementedError  # (host uint8 view, device pointer, owner)
    def pin(self, staging, mapped: bool) -> None: raise NotImplementedError
    def device_view(self, host: np.ndarray): raise NotImplementedError
    def ptr(self, a) -> int: raise NotImplementedError
    def dev_id(self) -> int: return 0                    # the current device (cupy's: Table's device path)
    def prefill_device(self) -> int: return 0            # the current device of torch (the prefill's)

    # queued work
    def h2d(self, dst, src: np.ndarray, nbytes: int, stream, dst_offset: int = 0): raise NotImplementedError
    def upload(self, dst, src: np.ndarray, stream): raise NotImplementedError
    def copy(self, dst, src, stream): raise NotImplementedError   # torch tensors, queued (non_blocking)
    def gather(self, staging, offsets, inverse, qtype, row_elems, *, dtype, stream, **kw): raise NotImplementedError
    def copy_words(self, src_ptr, dst_ptr, ctl_ptr, max_words, stream, device_id=0): raise NotImplementedError
    def copy_rows(self, pool_ptr, src_ptr, dst_ptr, ctl_ptr, row_bytes, max_rows, stream, device_id=0):
        raise NotImplementedError
    def take_rows(self, staging, offsets, inverse, row_bytes, shape, stream): raise NotImplementedError
    def defer(self, stream, fn): raise NotImplementedError     # fn in stream order (CUDA: now, on that stream)
    def order(self, stream, after=None): raise NotImplementedError  # stream's later work after `after`'s so far
    def to_host(self, ids, stream) -> np.ndarray: raise NotImplementedError  # copied down on stream, host waits
    def ids_like(self, host: np.ndarray, like, stream): raise NotImplementedError  # host ints up, of `like`'s kind
    def warmup(self, qtypes, dtype) -> None: pass

    # streams, events, graphs, flags, cuFile
    def stream(self): raise NotImplementedError
    def current(self, stream=None): raise NotImplementedError     # a stream object for `stream` (None: current)
    def key(self, stream): raise NotImplementedError     # what identifies a stream (CUDA: its raw handle)
    def using(self, stream): raise NotImplementedError            # context: `stream` is the current one
    def synchronize(self, stream) -> None: raise NotImplementedError
    def query(self, stream) -> bool: raise NotImplementedError
    def event(self, timing: bool = False, external: bool = False): raise NotImplementedError
    def capture(self, stream, fn): raise NotImplementedError      # (graph, outputs); graph.replay() queues fn
    def flags(self, n: int = 2): raise NotImplementedError
    def gds_state(self) -> tuple[bool, bool, str]: raise NotImplementedError
    def cufile(self, path, threads: int): raise NotImplementedError    # (file with pread(dst, n, off).get(), how, real)


# ---- the GPU ---------------------------------------------------------------------------------------------------

class CudaAccel(Accel):
    """torch / cupy / kvikio. Glue only: every method is the one call it names."""

    name = "cuda"

    @property
    def device(self):
        import torch
        return torch.device("cuda")

    @staticmethod
    def _cp():
        import cupy
        return cupy

    def empty(self, nbytes):
        cp = self._cp()
        return cp.empty(int(nbytes), cp.uint8)

    def grow(self, old, nbytes, keep, device_id=0):
        cp = self._cp()
        with cp.cuda.Device(device_id):
            new = cp.empty(nbytes, cp.uint8)
            if old is not None and keep:
                new[:keep] = old[:keep]
                cp.cuda.Device().synchronize()
        return new

    def device_array(self, n, dtype, stream=None):
        cp = self._cp()
        with arrays.cupy_stream(stream):        # cupy.zeros memsets on cupy's current stream: the caller's
            return cp.zeros(int(n), dtype)

    def pinned_array(self, n, dtype):
        dt = np.dtype(dtype)
        a = np.frombuffer(self._cp().cuda.alloc_pinned_memory(max(1, int(n)) * dt.itemsize), dt, int(n))
        a[:] = 0
        return a

    def zeros(self, n, dtype):
        import torch
        return torch.zeros(n, dtype=dtype, device=self.device)

    def pinned(self, n, dtype):
        import torch
        return torch.zeros(n, dtype=dtype, pin_memory=True)

    def mapped(self, nbytes):
        cp = self._cp()
        mem = cp.cuda.alloc_pinned_memory(nbytes)        # cudaHostAlloc: portable, mapped (UVA)
        return (np.frombuffer(mem, np.uint8, nbytes), int(cp.cuda.runtime.pointerGetAttributes(mem.ptr).devicePointer),
                mem)

    def pin(self, staging, mapped):
        from .device import pin_staging
        pin_staging(staging, mapped)

    def device_view(self, host):
        from .device import device_view
        return device_view(host)

    def ptr(self, a):
        return int(a.data_ptr()) if arrays.kind(a) == "torch-cuda" else int(a.data.ptr)

    def dev_id(self):
        return int(self._cp().cuda.Device().id)

    def prefill_device(self):
        import torch
        return int(torch.cuda.current_device())

    def h2d(self, dst, src, nbytes, stream, dst_offset=0):
        cp = self._cp()
        cp.cuda.runtime.memcpyAsync(dst.data.ptr + dst_offset, src.ctypes.data, nbytes,
                                    cp.cuda.runtime.memcpyHostToDevice, arrays.cupy_stream(stream).ptr)

    def upload(self, dst, src, stream):
        dst.set(src, stream=arrays.cupy_stream(stream))

    def copy(self, dst, src, stream):
        dst.copy_(src, non_blocking=True)       # (on torch's current stream: the step runs under using(stream))

    def gather(self, staging, offsets, inverse, qtype, row_elems, *, dtype, stream, **kw):
        from . import dequant as dequant_gpu
        return dequant_gpu.gather_rows(staging, offsets, inverse, qtype, row_elems, dtype=dtype, stream=stream, **kw)

    def copy_words(self, src_ptr, dst_ptr, ctl_ptr, max_words, stream, device_id=0):
        from . import devcache
        devcache.copy_words(src_ptr, dst_ptr, ctl_ptr, max_words, arrays.stream_ptr(stream), device_id)

    def copy_rows(self, pool_ptr, src_ptr, dst_ptr, ctl_ptr, row_bytes, max_rows, stream, device_id=0):
        from . import devcache
        devcache.copy_rows(pool_ptr, src_ptr, dst_ptr, ctl_ptr, row_bytes, max_rows, arrays.stream_ptr(stream),
                           device_id)

    def take_rows(self, staging, offsets, inverse, row_bytes, shape, stream):
        cp = self._cp()
        with arrays.cupy_stream(stream):
            rows = staging[offsets[:, None] + cp.arange(row_bytes)]
            return rows[cp.asarray(inverse)].reshape(shape + (row_bytes,))

    def defer(self, stream, fn):
        return fn()

    def order(self, stream, after=None):
        import torch
        stream.wait_stream(torch.cuda.current_stream() if after is None else after)    # (torch streams)

    def to_host(self, ids, stream):
        return self._cp().asnumpy(arrays.to_cupy(ids), stream=arrays.cupy_stream(stream))   # (blocking)

    def ids_like(self, host, like, stream):
        with arrays.cupy_stream(stream):
            return arrays.like(self._cp().asarray(host), like)

    def warmup(self, qtypes, dtype):
        from . import dequant as dequant_gpu
        dequant_gpu.warmup(qtypes, dtypes=(dtype,), index_dtypes=("int32",))

    def stream(self):
        try:
            import torch
        except ImportError:         # bench storage with cupy + kvikio only (the prefill needs torch anyway)
            return self._cp().cuda.Stream(non_blocking=True)
        return torch.cuda.Stream()

    def current(self, stream=None):
        return arrays.cupy_stream(stream)

    def key(self, stream):
        return arrays.stream_ptr(stream)    # by handle: torch makes a new wrapper per current_stream() call

    def using(self, stream):
        if isinstance(stream, self._cp().cuda.Stream):      # a cupy stream is its own context
            return stream
        import torch
        return torch.cuda.stream(stream)

    def synchronize(self, stream):
        (arrays.cupy_stream(stream) if stream is None or isinstance(stream, int) else stream).synchronize()

    def query(self, stream):
        return stream.query()

    def event(self, timing=False, external=False):
        try:
            import torch
        except ImportError:         # (as stream())
            return self._cp().cuda.Event(disable_timing=not timing)
        return torch.cuda.Event(enable_timing=timing, **({"external": True} if external else {}))

    def capture(self, stream, fn):
        import torch
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            out = fn()
        return g, out

    def flags(self, n=2):
        from .graph import HostFlags

        class Flags(HostFlags):     # waits and writes on a stream object (graph.HostFlags takes raw handles)
            def wait(self, stream, i, value=1):
                super().wait(arrays.stream_ptr(stream), i, value)

            def write(self, stream, i, value):
                super().write(arrays.stream_ptr(stream), i, value)

            def probe(self, stream):
                super().probe(arrays.stream_ptr(stream))
        return Flags(n)

    def gds_state(self):
        from ..backends import gds_state
        return gds_state()

    def cufile(self, path, threads):
        try:
            import kvikio
            import kvikio.defaults
        except Exception as e:   # ImportError, or OSError/RuntimeError from loading libkvikio / libcufile / libcuda
            raise BackendError(f"gds needs a loadable kvikio (pip install 'gds-gather[cuda13]'): "
                               f"{type(e).__name__}: {e}") from e
        from .device import configure_kvikio
        real, reads = configure_kvikio(threads)
        return kvikio.CuFile(str(path), "r"), f"KvikIO CuFile, {threads} threads, {reads}", real


# ---- the host, with deferred streams -----------------------------------------------------------------------------

class HostArray(np.ndarray):
    """HostAccel's device memory: a numpy array of its own type, so `arrays.kind` tells it from host arrays
    (ids of this type take Table's device path on a HostAccel table)."""


def _dev(a: np.ndarray) -> HostArray:
    return np.asarray(a).view(HostArray)


def _np(a) -> np.ndarray:
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
        buf = _np(dst)
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
        d = _np(dst).reshape(-1).view(np.uint8)      # bytes, as cudaMemcpyAsync copies them

        def copy():
            d[dst_offset:dst_offset + nbytes] = src.reshape(-1).view(np.uint8)[:nbytes]
        self.current(stream).enqueue(copy)

    def upload(self, dst, src, stream):
        d, s = _np(dst), np.array(src)          # pageable source: copied at the call, as cudaMemcpyAsync does

        def copy():
            d[...] = s
        self.current(stream).enqueue(copy)

    def copy(self, dst, src, stream):
        def copy():
            dst.copy_(src)
        self.current(stream).enqueue(copy)

    def gather(self, staging, offsets, inverse, qtype, row_elems, *, dtype, stream, out=None, scale=None,
               layout="flat", n_layer=None):
        from . import dequant as dq
        g = dq.check_launch(staging, offsets, inverse, qtype, row_elems, dtype=dtype, layout=layout, n_layer=n_layer,
                            host=True)
        if out is None:
            out = (self.torch.empty(g.shape, dtype=getattr(self.torch, g.name)) if g.kind == "torch" else
                   _dev(np.empty(g.shape, np.uint16 if g.name == "bfloat16" else g.name)))
        dq.check_out(out, g, host=True)
        o = _np(out)
        kw = dict(dtype=g.name, scale=scale, layout=layout, n_layer=n_layer)

        def kernel():
            run = dq.host_gather if dq.host_compiler_available() else dq.reference_gather
            o[...] = run(_np(staging), _np(offsets), _np(inverse), qtype, row_elems, **kw).view(o.dtype)
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
            st, of = _np(staging), _np(offsets)
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
        return np.array(_np(ids))

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
