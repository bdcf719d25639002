"""Array kinds (numpy, torch CPU, torch CUDA, cupy) and zero-copy conversion between them, imported lazily."""
from __future__ import annotations

from ..errors import BadDtypeError


def kind(x) -> str:
    """'numpy', 'torch' (CPU tensor), 'torch-cuda', 'cupy', or 'host-device' (host.HostAccel's device memory),
    without importing torch or cupy."""
    mod = type(x).__module__.split(".")[0]
    if mod == "cupy":
        return "cupy"
    if mod == "gds_gather" and type(x).__name__ == "HostArray":
        return "host-device"
    if mod == "torch":
        return "torch-cuda" if x.device.type != "cpu" else "torch"
    return "numpy"


def is_device(x) -> bool:
    return kind(x) in ("cupy", "torch-cuda", "host-device")


def to_cupy(x):
    """A cupy view of a cupy array or torch CUDA tensor (DLPack, no copy)."""
    import cupy
    return x if kind(x) == "cupy" else cupy.from_dlpack(x)


def like(arr, ref):
    """`arr` (cupy) as the kind of `ref`: a torch tensor for torch ids (DLPack, no copy), else cupy."""
    if kind(ref) == "torch-cuda":
        import torch
        return torch.from_dlpack(arr)
    return arr


def stream_ptr(stream) -> int:
    """The raw CUDA stream handle of None (cupy's current), a cupy Stream, a torch Stream, or an int."""
    if stream is None:
        import cupy
        return cupy.cuda.get_current_stream().ptr
    if isinstance(stream, int):
        return stream
    for attr in ("ptr", "cuda_stream"):        # cupy.cuda.Stream, torch.cuda.Stream
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    raise TypeError(f"not a CUDA stream: {stream!r}")


def launch_stream(stream, ids):
    """The stream a device gather of `ids` queues everything on: `stream`, or where None torch's current stream for
    torch CUDA ids (where torch queues their consumers; its side streams do not wait for cupy's null stream), else
    None (cupy's current)."""
    if stream is None and kind(ids) == "torch-cuda":
        import torch
        return torch.cuda.current_stream(ids.device)
    return stream


def cupy_stream(stream):
    """A cupy Stream object for `stream` (wrapping a foreign handle without owning it): Stream.from_external on
    cupy 14 (where ExternalStream is deprecated), ExternalStream on cupy 13 (which has no from_external)."""
    import cupy
    if stream is None:
        return cupy.cuda.get_current_stream()
    if isinstance(stream, cupy.cuda.Stream):
        return stream
    return cupy.cuda.ExternalStream(stream_ptr(stream)) if not hasattr(cupy.cuda.Stream, "from_external") \
        else cupy.cuda.Stream.from_external(StreamRef(stream_ptr(stream)))


def torch_stream(handle: int, device=None):
    """A torch stream object for a raw handle (torch.cuda.ExternalStream: wraps it without owning it)."""
    import torch
    return torch.cuda.ExternalStream(int(handle), device=device)


class StreamRef:
    """A raw stream handle speaking the CUDA stream protocol (for cupy.cuda.Stream.from_external)."""

    def __init__(self, handle: int):
        self.handle = int(handle)

    def __cuda_stream__(self):
        return (0, self.handle)


OUT_DTYPES = ("float32", "float16", "bfloat16")


def dtype_name(dtype) -> str:
    """'float32', 'float16' or 'bfloat16' from a numpy/torch dtype or a name; BadDtypeError (a GatherError and a
    TypeError) naming the accepted dtypes otherwise."""
    try:
        name = str(dtype).replace("torch.", "")
    except Exception:         # an object whose __str__ fails is no dtype either
        name = ""
    if name not in OUT_DTYPES:
        try:
            import numpy as np
            name = np.dtype(dtype).name
        except Exception:     # TypeError, ValueError, SyntaxError ("float3,2"), ...: not a dtype
            pass
    if name not in OUT_DTYPES:
        try:
            what = repr(dtype)
        except Exception:
            what = f"an object of type {type(dtype).__name__}"
        raise BadDtypeError(f"output dtype must be one of {', '.join(OUT_DTYPES)} (numpy, torch or by name), "
                            f"got {what[:80]}")
    return name
