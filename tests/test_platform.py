"""Platform detection from injected device properties, the one gds-or-direct decision, and what `info` says."""
from __future__ import annotations

import importlib
import json
import subprocess
import sys

import numpy as np
import pytest

import gds_gather as gg
from gds_gather import platform as pf
from gds_gather.model.synth import write_model

# as the H200 reports them
H200 = {"name": b"NVIDIA H200", "integrated": 0, "pageableMemoryAccessUsesHostPageTables": 0}
GB10 = {"name": b"NVIDIA GB10", "integrated": 1, "pageableMemoryAccessUsesHostPageTables": 0}
GH200 = {"name": b"NVIDIA GH200 480GB", "integrated": 0, "pageableMemoryAccessUsesHostPageTables": 1}
MI300 = {"name": b"AMD Instinct MI300X", "integrated": 0}


@pytest.mark.parametrize("facts,kind,words", [
    ({"is_hip": False, "device_count": 1, "props": H200}, "discrete", "integrated=0 pageable"),
    ({"is_hip": False, "device_count": 1, "props": GB10}, "unified", "integrated=1"),
    ({"is_hip": False, "device_count": 2, "props": GH200}, "unified", "UsesHostPageTables=1"),
    ({"is_hip": True, "device_count": 8, "props": MI300}, "rocm", "is_hip is True"),
    ({"is_hip": False, "device_count": 0}, "cpu", "no GPU device"),
    ({"cupy_error": "ModuleNotFoundError: No module named 'cupy'"}, "cpu", "cupy is not importable"),
    ({"is_hip": False, "count_error": "CUDARuntimeError: cudaErrorInsufficientDriver"}, "cpu", "no usable GPU driver"),
    ({"is_hip": False, "device_count": 1, "props_error": "RuntimeError: x"}, "cpu", "attribute query failed"),
    ({"cupy_error": "ImportError: libcudart", "torch_hip": "6.2", "torch_devices": 1,
      "torch_device_name": "AMD Radeon PRO W7900"}, "rocm", "torch is a ROCm build"),
    ({"is_hip": False, "count_error": "CUDARuntimeError", "torch_hip": "6.2", "torch_devices": 0}, "cpu", "driver"),
])
def test_classify(facts, kind, words):
    p = pf.classify(facts)
    assert p.kind == kind and words in p.reason, p
    assert p.path == pf.PATHS[kind]
    if "props" in facts:
        assert p.device == facts["props"]["name"].decode()


def test_every_kind_states_its_path():
    assert set(pf.PATHS) == set(pf.KINDS)
    assert "eager" in pf.PATHS["rocm"] and "no gds" in pf.PATHS["rocm"]
    assert "still copied" in pf.PATHS["unified"] and "graph" in pf.PATHS["discrete"]


def test_probe_here_is_cpu_and_imports_no_torch():
    """This machine: cupy imports, no driver; detection must not import torch (it is a CPU wheel here)."""
    code = ("import sys, json; from gds_gather.platform import probe, classify; f = probe(); "
            "print(json.dumps({'kind': classify(f).kind, 'torch': 'torch' in sys.modules, 'hip': f.get('torch_hip')}))")
    out = json.loads(subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                                    check=True).stdout.strip().splitlines()[-1])
    if out["kind"] != "cpu":
        pytest.skip(f"this machine has a GPU ({out['kind']})")
    assert out == {"kind": "cpu", "torch": False, "hip": None}


def test_torch_hip_version_from_metadata(monkeypatch):
    from importlib import metadata
    monkeypatch.setattr(metadata, "version", lambda name: "2.5.1+rocm6.2")
    assert pf._torch_hip_version() == "6.2"
    monkeypatch.setattr(metadata, "version", lambda name: "2.13.0+cpu")
    assert pf._torch_hip_version() is None


def test_override_keeps_the_detected_reason():
    p = pf.detect("unified")
    assert p.kind == "unified" and p.overridden and "forced by configuration" in p.reason
    with pytest.raises(ValueError):
        pf.detect("tpu")


# ---- the one gds-or-direct decision ------------------------------------------------------------------------------
@pytest.fixture
def table(tmp_path):
    path = tmp_path / "m.gguf"
    write_model(path, "qwen4exp", rows=5000, qtype="IQ4_NL", seed=2, progress=False)
    with gg.open_table(path) as t:
        yield t


def _inject(monkeypatch, kind, gds):
    backends = importlib.import_module("gds_gather.backends")
    monkeypatch.setattr(backends, "detect", lambda override="auto": pf.Platform(
        kind if override == "auto" else override, f"{kind} (injected)", "GPU"))
    monkeypatch.setattr(backends, "gds_state", lambda: gds)
    return backends


@pytest.mark.parametrize("kind,gds,verdict,want", [
    ("discrete", (True, True, "real GDS (injected)"), True, ("gds", "gds")),
    ("discrete", (True, True, "real GDS (injected)"), False, ("direct", "copy")),
    ("discrete", (True, False, "compat (injected)"), True, ("direct", "copy")),
    ("discrete", (False, False, "kvikio missing (injected)"), None, ("direct", "copy")),
    ("unified", (True, True, "real GDS (injected)"), True, ("direct", "zero-copy")),
    ("rocm", (False, False, "n/a"), None, ("direct", "copy")),
])
def test_choose_device_times_only_where_real_gds_exists(monkeypatch, table, kind, gds, verdict, want):
    backends = _inject(monkeypatch, kind, gds)
    asked = []

    def timed():
        asked.append(1)
        return verdict, "512 rows: gds 1.00 ms, direct 2.00 ms (injected)"
    monkeypatch.setattr(table, "gds_faster", timed)
    name, mode, why = backends.choose_device(table, "auto")
    assert (name, mode) == want, why
    assert asked == ([1] if kind == "discrete" and gds[1] else [])      # timed only with real GDS
    if asked:
        assert "512 rows" in why and "measured faster" in why
    assert why


def test_choose_device_explicit_backends(monkeypatch, table):
    backends = _inject(monkeypatch, "discrete", (True, False, "compat (injected)"))
    assert backends.choose_device(table, "gds")[:2] == ("gds", "gds")
    assert backends.choose_device(table, "pread")[:2] == ("pread", "copy")
    with pytest.raises(gg.BackendError, match="unknown backend"):
        backends.choose_device(table, "nvme-magic")
    backends = _inject(monkeypatch, "rocm", (False, False, "n/a"))
    with pytest.raises(gg.BackendError, match="CUDA-only"):
        backends.choose_device(table, "gds")
    backends = _inject(monkeypatch, "cpu", (False, False, "n/a"))
    with pytest.raises(gg.BackendError, match="no usable GPU"):
        backends.choose_device(table, "auto")


def test_fetch_device_asks_the_same_decision(monkeypatch, table):
    """Table.fetch_device goes through choose_device (so GpuPrefill and the benches report the same choice)."""
    tbl = importlib.import_module("gds_gather.gpu.device_path")
    seen = []

    def fake_choose(t, backend, cfg, state=None):
        seen.append((t, backend))
        raise gg.BackendError("stop here (injected)")
    monkeypatch.setattr(tbl, "choose_device", fake_choose)
    plan = table.plan(np.arange(10))
    with pytest.raises(gg.BackendError, match="injected"):
        table.fetch_device(plan, "auto")
    assert seen == [(table, "auto")]
    pipeline = importlib.import_module("gds_gather.prefill.pipeline")
    assert pipeline.choose_device is importlib.import_module("gds_gather.backends").choose_device


def test_gds_reader_turns_a_library_load_failure_into_backend_error(monkeypatch, table):
    """An OSError from loading libkvikio (or any import failure) is a BackendError naming the cause."""
    import builtins
    real_import = builtins.__import__

    def fake_import(name, *a, **k):
        if name.startswith("kvikio"):
            raise OSError("libkvikio.so: cannot open shared object file")
        return real_import(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", fake_import)
    from gds_gather.gpu.device import GdsReader
    from gds_gather.gpu.cuda import CudaAccel
    with pytest.raises(gg.BackendError, match="OSError: libkvikio.so") as info:
        GdsReader(table.path, table.data_offset, table.n_bytes, config=table.config, file_id=table.file_id,
                  accel=CudaAccel())
    assert isinstance(info.value.__cause__, OSError)


def test_info_states_the_platform_choice(table):
    res = subprocess.run([sys.executable, "-P", "-m", "gds_gather.cli", "info", str(table.path), "--json"],
                         capture_output=True, text=True, check=True)
    d = json.loads(res.stdout.strip().splitlines()[-1])
    assert d["platform"]["kind"] in pf.KINDS and d["platform"]["reason"]
    assert d["platform"]["path"] == pf.PATHS[d["platform"]["kind"]]
    text = subprocess.run([sys.executable, "-P", "-m", "gds_gather.cli", "info", str(table.path)],
                          capture_output=True, text=True, check=True).stdout
    assert "GPU path" in text


def _kvikio_here(monkeypatch, *, real=False, compat=True, fail=None):
    """A KvikIO as this process would import it (sys.modules): its cuFile driver's answer and its compat
    preference, or `fail` raised by the driver query."""
    import importlib.machinery
    import types

    def get(key):
        if fail:
            raise fail
        assert key == "is_gds_available"
        return real
    kv = types.ModuleType("kvikio")
    kv.__spec__ = importlib.machinery.ModuleSpec("kvikio", None)
    kv.cufile_driver = types.SimpleNamespace(get=get)
    kv.defaults = types.SimpleNamespace(is_compat_mode_preferred=lambda: compat)
    monkeypatch.setitem(sys.modules, "kvikio", kv)
    monkeypatch.setitem(sys.modules, "kvikio.cufile_driver", kv.cufile_driver)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", kv.defaults)


@pytest.mark.parametrize("real,compat,fail,want", [
    (True, False, None, (True, True, "KvikIO/cuFile with real GPU-direct storage (nvidia-fs or P2PDMA)")),
    (True, True, None, (True, False, "KvikIO/cuFile in compat mode")),
    (False, False, None, (True, False, "KvikIO/cuFile in compat mode")),
    (False, False, RuntimeError("cuFile driver init failed"),
     (False, False, "kvikio failed to initialise (RuntimeError: cuFile driver init failed)")),
])
def test_gds_state_reads_kvikio_s_answer(monkeypatch, real, compat, fail, want):
    from gds_gather.backends import gds_state
    _kvikio_here(monkeypatch, real=real, compat=compat, fail=fail)
    ok, is_real, why = gds_state()
    assert (ok, is_real) == want[:2] and why.startswith(want[2])


def test_resolve_gds_follows_the_platform_and_kvikio(monkeypatch):
    from gds_gather.backends import BY_CONFIG, BY_NAME, resolve, resolve_device
    _kvikio_here(monkeypatch)
    assert resolve("gds", gg.Config(platform="discrete")) == ("gds", BY_NAME)
    with pytest.raises(gg.BackendError, match="backend 'gds' is not available here: needs a discrete NVIDIA GPU; "
                                              "platform is unified"):
        resolve("gds", gg.Config(platform="unified"))
    name, mode, why = resolve_device("auto", gg.Config(platform="discrete", backend="pread"))
    assert (name, mode) == ("pread", "copy") and "discrete" in why and why.startswith(BY_CONFIG)
