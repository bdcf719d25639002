"""The device of the GPU data path, by name: "cuda" (cuda.CudaAccel: the GPU) or "host" (host.HostAccel: the same
operations on the host, deferred streams; for tests and debugging). Both implement interface.Accel. Selection is
explicit (`get`, Config.accel); nothing falls back silently.
"""
from __future__ import annotations

from .cuda import CudaAccel
from .host import HostAccel
from .interface import Accel
from ..errors import BackendError

ACCELS = ("cuda", "host")


def get(name: str = "cuda") -> Accel:
    """The accelerator by name: "cuda" (the GPU) or "host" (everything on the host, deferred streams)."""
    if name == "cuda":
        return CudaAccel()
    if name == "host":
        return HostAccel()
    raise BackendError(f"unknown accelerator {name!r}; known: {', '.join(ACCELS)}")
