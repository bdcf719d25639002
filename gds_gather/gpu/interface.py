"""The interface of the device primitives the GPU data path is built from (`Accel`): allocate, pin and map host
memory, queue copies and kernels on a stream, events, graph capture, waits and writes of host flags, cuFile reads.

Two implementations: cuda.CudaAccel (the GPU: torch / cupy / kvikio glue) and host.HostAccel (the same operations
on the host with real values and deferred streams, so the whole device path runs in CI). accel.get picks one by
name.
"""
from __future__ import annotations

import numpy as np


class Accel:
    """What the device data path needs from a device. Arrays: `empty` and `device_array` give device memory (cupy /
    HostArray), `pinned_array` page-locked numpy arrays (no torch: Table's device path runs with cupy alone), `zeros`
    and `pinned` torch tensors on the device / in page-locked host memory (the prefill's tokens and indices);
    streams are this accel's (any stream object the CUDA side accepts: None, an int handle, a cupy or torch
    stream)."""

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
    def gather(self, staging, offsets, inverse, qtype, row_elems, *, dtype, stream, out=None, scale=None,
               layout="flat", n_layer=None, block_scales=None):
        """dequant.gather_rows queued on `stream`: the same arguments and checks; block_scales (dequant.BlockScales
        or its 4- or 5-tuple, arrays of this accel) for a block-scaled float8 or E2M1 table."""
        raise NotImplementedError
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
