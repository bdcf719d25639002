"""The GPU implementation of the device primitives (interface.Accel): glue to torch, cupy and kvikio, every method
the one call it names (the pieces that are more than one call are device.py's). torch, cupy and kvikio are imported
lazily, on first use.
"""
from __future__ import annotations

import numpy as np

from . import arrays
from .graph import HostFlags
from .interface import Accel
from ..errors import BackendError


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

    def gather(self, staging, offsets, inverse, qtype, row_elems, *, dtype, stream, block_scales=None, **kw):
        from . import dequant
        return dequant.gather_rows(staging, offsets, inverse, qtype, row_elems, dtype=dtype, stream=stream,
                                   block_scales=block_scales, **kw)     # kw: out, scale, layout, n_layer

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
        from . import dequant
        dequant.warmup(qtypes, dtypes=(dtype,), index_dtypes=("int32",))

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
        return StreamFlags(n)

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


class StreamFlags(HostFlags):
    """graph.HostFlags whose waits and writes take a stream object (graph.HostFlags takes raw handles)."""

    def wait(self, stream, i, value=1):
        super().wait(arrays.stream_ptr(stream), i, value)

    def write(self, stream, i, value):
        super().write(arrays.stream_ptr(stream), i, value)

    def probe(self, stream):
        super().probe(arrays.stream_ptr(stream))
