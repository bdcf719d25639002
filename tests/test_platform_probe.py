"""platform.probe() against the runtimes it reads: cupy's (a stand-in module with a given machine's answers, so
every branch runs without a GPU) and a ROCm torch's; then classify() on what probe() read, end to end."""
from __future__ import annotations

import sys
import types

import pytest

from gds_gather import platform as pf


class Runtime:
    """cupy.cuda.runtime as a machine answers it: device count, device 0's properties, one attribute."""
    cudaDevAttrPageableMemoryAccessUsesHostPageTables = 100

    def __init__(self, count=1, props=None, is_hip=False, count_error=None, props_error=None, attr=0):
        self.count, self.props, self.is_hip = count, props or {}, is_hip
        self.count_error, self.props_error, self.attr = count_error, props_error, attr
        self.attr_asked = []

    def getDeviceCount(self):
        if self.count_error:
            raise self.count_error
        return self.count

    def getDeviceProperties(self, dev):
        assert dev == 0
        if self.props_error:
            raise self.props_error
        return dict(self.props)

    def deviceGetAttribute(self, attr, dev):
        self.attr_asked.append((attr, dev))
        return self.attr


@pytest.fixture()
def cupy_runtime(monkeypatch):
    """Install a stand-in `cupy.cuda.runtime` (and no ROCm torch) for the test."""
    monkeypatch.setattr(pf, "_torch_hip_version", lambda: None)

    def install(rt):
        cuda = types.ModuleType("cupy.cuda")
        cuda.runtime = rt
        cupy = types.ModuleType("cupy")
        cupy.cuda = cuda
        monkeypatch.setitem(sys.modules, "cupy", cupy)
        monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
        return rt
    return install


def test_discrete_gpu(cupy_runtime):
    rt = cupy_runtime(Runtime(props={"name": b"NVIDIA H100 PCIe", "integrated": 0}, attr=0))
    f = pf.probe()
    # the attribute is not in the properties dict: asked for once, of device 0
    assert rt.attr_asked == [(100, 0)]
    assert f == {"torch_hip": None, "is_hip": False, "device_count": 1,
                 "props": {"name": b"NVIDIA H100 PCIe", "integrated": 0, "pageableMemoryAccessUsesHostPageTables": 0}}
    p = pf.classify(f)
    assert (p.kind, p.device) == ("discrete", "NVIDIA H100 PCIe")
    assert p.reason == "integrated=0 pageableMemoryAccessUsesHostPageTables=0"


def test_unified_by_the_attribute(cupy_runtime):
    rt = cupy_runtime(Runtime(props={"name": "NVIDIA GB10", "integrated": 0}, attr=1))
    p = pf.classify(pf.probe())
    assert (p.kind, p.device) == ("unified", "NVIDIA GB10") and "pageableMemoryAccessUsesHostPageTables=1" in p.reason
    assert rt.attr_asked


def test_properties_that_carry_the_attribute_are_not_asked_again(cupy_runtime):
    rt = cupy_runtime(Runtime(props={"name": "Jetson", "integrated": 1, "pageableMemoryAccessUsesHostPageTables": 0}))
    f = pf.probe()
    assert rt.attr_asked == [] and f["props"]["integrated"] == 1
    assert pf.classify(f).kind == "unified"


def test_hip_build_of_cupy(cupy_runtime):
    rt = cupy_runtime(Runtime(props={"name": "AMD Instinct MI300X"}, is_hip=True))
    f = pf.probe()
    assert f["is_hip"] and rt.attr_asked == []            # HIP has no such attribute: not asked
    p = pf.classify(f)
    assert (p.kind, p.device) == ("rocm", "AMD Instinct MI300X") and "is_hip is True" in p.reason


@pytest.mark.parametrize("rt, key, kind_reason", [
    (Runtime(count_error=RuntimeError("cudaErrorNoDevice")), "count_error",
     "no usable GPU driver (RuntimeError: cudaErrorNoDevice)"),
    (Runtime(count=0), None, "no GPU device"),
    (Runtime(props_error=OSError("query refused")), "props_error",
     "GPU attribute query failed (OSError: query refused)"),
])
def test_failures_are_reasons(cupy_runtime, rt, key, kind_reason):
    cupy_runtime(rt)
    f = pf.probe()
    if key:
        assert f[key] == kind_reason.split("(", 1)[1].rstrip(")")
    assert "props" not in f
    p = pf.classify(f)
    assert (p.kind, p.reason) == ("cpu", kind_reason)


def test_rocm_torch_when_cupy_is_not_hip(cupy_runtime, monkeypatch):
    """A ROCm torch next to a cupy without devices: torch is asked how many GPUs it sees, and their name."""
    torch = pytest.importorskip("torch")
    cupy_runtime(Runtime(count=0))
    monkeypatch.setattr(pf, "_torch_hip_version", lambda: "6.2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"AMD Radeon {i}")
    f = pf.probe()
    assert (f["torch_hip"], f["torch_devices"], f["torch_device_name"]) == ("6.2", 2, "AMD Radeon 0")
    p = pf.classify(f)
    assert (p.kind, p.device) == ("rocm", "AMD Radeon 0") and "HIP 6.2" in p.reason and "sees 2 GPU(s)" in p.reason
    monkeypatch.setattr(torch.cuda, "device_count", lambda: (_ for _ in ()).throw(RuntimeError("hip init failed")))
    f = pf.probe()
    assert f["torch_error"] == "RuntimeError: hip init failed" and pf.classify(f).kind == "cpu"


def test_torch_version_unreadable(monkeypatch):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)
    monkeypatch.setattr(metadata, "version", missing)
    assert pf._torch_hip_version() is None
