"""CPU tests of the GPU-code review's findings (issue 17), against stand-ins for cupy and the CUDA streams.

There is no GPU in CI: each test below shows one finding's behaviour where it can be shown without a device (which
stream each queued operation runs on, the order of synchronizations and unpins, what is registered). The same
findings on a real GPU are covered by `gpu`-marked tests in test_device_gpu.py.
"""
from __future__ import annotations

import ast
import importlib
import contextlib
import io
from pathlib import Path

import numpy as np


def _script(name: str) -> str:
    """A module-level string constant of tests/gpu/test_device_gpu.py (a subprocess script), without importing it."""
    tree = ast.parse((Path(__file__).parent / "test_device_gpu.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise KeyError(name)


# -- finding 2: the prefill fault script's "OK" line under numpy 2 ----------------------------------------------------
def test_fault_script_prints_plain_ints_for_the_flags():
    """numpy 2 prints list(np.int32 array) as [np.int32(0), ...]: the gpu test's "OK 6 [0, 0]" must still match."""
    line = next(ln for ln in _script("_INJECT").splitlines() if ln.strip().startswith('print("OK"'))

    class Pipe:
        class flags:
            host = np.zeros(2, np.int32)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(line.strip(), {"res": {"outputs": [0] * 6}, "pipe": Pipe})
    assert out.getvalue().strip() == "OK 6 [0, 0]"


# -- stand-ins for cupy, torch's CUDA streams and torch CUDA ids ------------------------------------------------------
import ctypes  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402

import pytest  # noqa: E402

import gds_gather as gg  # noqa: E402

TORCH_STREAM = 0x5150       # the handle of "torch's current stream" below
NULL = 0                    # cupy's default: the legacy null stream


class FakeCuda:
    """Enough of cupy for the destinations, devcache's launches and Table's device gather, on host memory. Every queued
    operation is logged with the stream it was queued on: ("h2d" | "set" | "asarray" | "kernel" | "sync", ptr)."""

    def __init__(self, *, from_external: bool = True, register_fails_at: int | None = None):
        self.log: list = []
        self.registered: dict[int, int] = {}     # address -> bytes, as hostRegister/hostUnregister leave it
        self.n_register = 0
        self.register_fails_at = register_fails_at
        fake = self

        class Stream:
            null = None

            def __init__(self, ptr=NULL):
                self.ptr = ptr

            def synchronize(self):
                fake.log.append(("sync", self.ptr))

            def __enter__(self):
                fake.current.append(self)
                return self

            def __exit__(self, *exc):
                fake.current.pop()

        if from_external:
            Stream.from_external = classmethod(lambda cls, obj: cls(obj.__cuda_stream__()[1]))

        class ExternalStream(Stream):
            pass

        class Device:
            def __init__(self, i=0):
                self.id = i

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                pass

            def synchronize(self):
                fake.log.append(("device-sync", None))

        def host_register(ptr, n, flags):
            fake.n_register += 1
            if fake.n_register == fake.register_fails_at:
                raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered (stand-in)")
            fake.registered[ptr] = n

        def host_unregister(ptr):
            if ptr not in fake.registered:
                raise RuntimeError("cudaErrorHostMemoryNotRegistered (stand-in)")
            del fake.registered[ptr]
            fake.log.append(("unregister", ptr))

        def memcpy_async(dst, src, n, kind, stream):
            ctypes.memmove(dst, src, n)
            fake.log.append(("h2d", stream))

        class PinnedMemory(bytearray):      # cudaHostAlloc'd (mapped: its device pointer is its address)
            @property
            def ptr(self):
                return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))

        def zeros(n, dtype=np.uint8):      # cupy.zeros: a memset queued on cupy's current stream
            fake.log.append(("memset", fake.current[-1].ptr))
            return DevArray(np.zeros(n, dtype), fake)

        self.current = [Stream(NULL)]
        rt = types.SimpleNamespace(hostRegister=host_register, hostUnregister=host_unregister,
                                   memcpyAsync=memcpy_async, memcpyHostToDevice=1, is_hip=False,
                                   pointerGetAttributes=lambda p: types.SimpleNamespace(devicePointer=p))
        self.cuda = types.SimpleNamespace(Stream=Stream, ExternalStream=ExternalStream, Device=Device, runtime=rt,
                                          get_current_stream=lambda: fake.current[-1],
                                          alloc_pinned_memory=lambda n: PinnedMemory(n))
        self.module = types.ModuleType("cupy")
        self.module.__dict__.update(
            cuda=self.cuda, uint8=np.uint8, int64=np.int64, int32=np.int32, ndarray=DevArray,
            empty=lambda n, dtype=np.uint8: DevArray(np.zeros(n, dtype), fake),
            zeros=zeros,
            asarray=self._asarray, asnumpy=self._asnumpy,
            from_dlpack=lambda x: DevArray(x.a, fake), arange=lambda *a: DevArray(np.arange(*a), fake))

    def _asnumpy(self, a, stream=None):
        """cupy.asnumpy: a blocking copy down on `stream` (the current one without)."""
        self.log.append(("sync", (stream or self.current[-1]).ptr))
        return np.asarray(a.a if isinstance(a, DevArray) else a)

    def _asarray(self, a):
        if isinstance(a, DevArray):
            return a
        self.log.append(("asarray", self.current[-1].ptr))
        return DevArray(np.array(a), self)

    def streams(self, *kinds) -> set:
        return {p for k, p in self.log if k in kinds}


class DevArray:
    """A 'device' array of FakeCuda: numpy memory, copies logged on the stream they were queued on."""

    def __init__(self, a, fake):
        self.a, self.fake = a, fake

    nbytes = property(lambda self: self.a.nbytes)
    shape = property(lambda self: self.a.shape)
    dtype = property(lambda self: self.a.dtype)
    data = property(lambda self: types.SimpleNamespace(ptr=self.a.ctypes.data))
    device = property(lambda self: types.SimpleNamespace(id=0))

    def _wrap(self, a):
        return DevArray(a, self.fake)

    def __getitem__(self, k):
        k = tuple(x.a if isinstance(x, DevArray) else x for x in k) if isinstance(k, tuple) else \
            (k.a if isinstance(k, DevArray) else k)
        return self._wrap(self.a[k])

    def __setitem__(self, k, v):
        self.a[k] = v.a if isinstance(v, DevArray) else v
        self.fake.log.append(("kernel", self.fake.current[-1].ptr))

    def __add__(self, o):
        return self._wrap(self.a + (o.a if isinstance(o, DevArray) else o))

    def view(self, dtype):
        return self._wrap(self.a.view(dtype))

    def reshape(self, *shape):
        return self._wrap(self.a.reshape(*shape))

    def set(self, arr, stream=None):
        self.a[...] = arr
        self.fake.log.append(("set", (stream or self.fake.current[-1]).ptr))

    def __dlpack__(self, **kw):
        return self.a.__dlpack__()

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


class TorchCudaIds:
    """Stands for a torch CUDA tensor of ids (arrays.kind reads the type's module and .device)."""
    __module__ = "torch.stand_in"

    def __init__(self, a):
        self.a = np.asarray(a)
        self.device = types.SimpleNamespace(type="cuda", index=0)


class TorchStream:
    """A torch.cuda.Stream stand-in: torch.cuda.current_stream() makes a new one per call, same handle."""

    def __init__(self, handle=TORCH_STREAM):
        self.cuda_stream = handle


@pytest.fixture
def fake_cuda(monkeypatch):
    """FakeCuda installed as `cupy`, torch's current stream = TORCH_STREAM, the kernel launch recorded (and
    computed with host_kernels.reference_gather, so the rows are checked against gguf's dequantizer)."""
    torch = pytest.importorskip("torch")
    from gds_gather.gpu import dequant as dequant_gpu
    from gds_gather.gpu import devcache, host_kernels
    fake = FakeCuda()
    monkeypatch.setitem(sys.modules, "cupy", fake.module)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: TorchStream())

    def gather_rows(staging, offs, inv, qtype, row_elems, *, dtype="float32", stream=None, **kw):
        torch_ids = hasattr(inv, "numpy")       # None: torch's current stream for torch ids, as the real one
        fake.log.append(("launch", dequant_gpu._stream_handle(stream, "torch" if torch_ids else "cupy", 0)))
        inv = inv.numpy() if torch_ids else np.asarray(inv.a)
        return host_kernels.reference_gather(staging.a, offs.a, inv, qtype, row_elems, dtype=dtype, **kw)
    monkeypatch.setattr(dequant_gpu, "gather_rows", gather_rows)
    monkeypatch.setattr(devcache, "_function", lambda device_id, name: CopyKernel(fake, name))
    from gds_gather.gpu import device      # the fake's device pointer of mapped memory is its host address
    monkeypatch.setattr(device, "device_view", lambda host: DevArray(host, fake))
    return fake


class CopyKernel:
    """kernels/copy.cu on host memory, logged on the stream it is launched on (cupy's current): gg_copy_words
    (ctl[0] 8-byte words src -> dst), gg_copy_rows (ctl[1] rows of row_bytes, pool + src[r] -> pool + dst[r])."""

    def __init__(self, fake, name):
        assert name in ("gg_copy_rows", "gg_copy_words"), name
        self.fake, self.name = fake, name

    def __call__(self, grid, block, args):
        if self.name == "gg_copy_words":
            src, dst, ctl = (int(a) for a in args)
            ctypes.memmove(dst, src, 8 * ctypes.c_int64.from_address(ctl).value)
            self.fake.log.append(("kernel", self.fake.current[-1].ptr))
            return
        pool, src, dst, ctl, rb = (int(a) for a in args)
        k = ctypes.c_int64.from_address(ctl + 8).value
        s = np.ctypeslib.as_array((ctypes.c_int64 * k).from_address(src))
        d = np.ctypeslib.as_array((ctypes.c_int64 * k).from_address(dst))
        for a, b in zip(s.tolist(), d.tolist()):
            ctypes.memmove(pool + b, pool + a, rb)
        self.fake.log.append(("kernel", self.fake.current[-1].ptr))


def _table(path, cache_bytes=0, platform="discrete"):
    return gg.open_table(path, config=gg.Config(platform=platform, cache_bytes=cache_bytes))


# -- finding 1: torch CUDA ids with stream=None: everything on torch's current stream ----------------------------------
@pytest.mark.parametrize("cache_bytes", [0, 1 << 20], ids=["no-cache", "device-cache"])
def test_torch_ids_queue_everything_on_torchs_current_stream(fake_cuda, small_table, cache_bytes):
    ids = np.random.default_rng(0).integers(0, 300, (40, 3))
    with _table(small_table, cache_bytes) as t:
        want = t.gather(ids)
        for _ in range(2):          # the second batch: device-cache hits and admissions
            got = t.gather(TorchCudaIds(ids))
            np.testing.assert_array_equal(np.asarray(got), want)
    queued = fake_cuda.streams("h2d", "set", "asarray", "kernel", "launch", "memset")
    assert queued == {TORCH_STREAM}, fake_cuda.log      # the destination's zeros too (issue 34): not stream 0
    assert ("launch", TORCH_STREAM) in fake_cuda.log and ("memset", TORCH_STREAM) in fake_cuda.log


def test_torch_ids_read_rows_on_torchs_current_stream(fake_cuda, small_table):
    ids = np.random.default_rng(1).integers(0, 300, (50, 2))
    with _table(small_table) as t:
        got = t.read_rows(TorchCudaIds(ids))
        np.testing.assert_array_equal(np.asarray(got), t.read_rows(ids))
    assert fake_cuda.streams("h2d", "set", "asarray", "kernel") == {TORCH_STREAM}, fake_cuda.log


# -- finding 7: one stream synchronization per device gather, one device choice per table ------------------------------
def test_one_sync_per_gather_on_torchs_current_stream(fake_cuda, small_table, monkeypatch):
    """torch.cuda.current_stream() is a new wrapper per call, same handle: the staging's previous consumer is on
    that same stream, so the destination's own wait is the only synchronization."""
    backends = importlib.import_module("gds_gather.backends")   # (gds_gather.backends is also a function)
    probes = []
    real = backends.gds_state
    monkeypatch.setattr(backends, "gds_state", lambda: probes.append(1) or real())
    ids = np.arange(30).reshape(10, 3)
    with _table(small_table) as t:
        t.gather(TorchCudaIds(ids))
        first = len(probes)         # the device choice, and resolving the destination's host backend: once per table
        t.gather(TorchCudaIds(ids))
        t.gather(TorchCudaIds(ids))
        assert [k for k, _ in fake_cuda.log].count("sync") == 3, fake_cuda.log
    assert first <= 2 and len(probes) == first     # kvikio import check + cuFile query: never per gather


def test_another_stream_is_waited_for(fake_cuda, small_table):
    """A gather on another stream first waits for the stream that last read the staging (then its own)."""
    ids = np.arange(30).reshape(10, 3)
    with _table(small_table) as t:
        t.gather(TorchCudaIds(ids))
        t.gather(TorchCudaIds(ids), stream=TorchStream(0x7777))
        syncs = [p for k, p in fake_cuda.log if k == "sync"]
        assert syncs == [TORCH_STREAM, TORCH_STREAM, 0x7777], fake_cuda.log


# -- finding 3: cupy 13 has no Stream.from_external ----------------------------------------------------------------
@pytest.mark.parametrize("from_external", [True, False], ids=["cupy14", "cupy13"])
def test_device_cache_copies_launch_on_the_given_stream_without_from_external(monkeypatch, from_external):
    from gds_gather.gpu import devcache
    fake = FakeCuda(from_external=from_external)
    monkeypatch.setitem(sys.modules, "cupy", fake.module)
    monkeypatch.setattr(devcache, "_function", lambda device_id, name: CopyKernel(fake, name))
    pool = np.zeros(64, np.uint8)
    pool[:8] = np.arange(1, 9)
    fresh = np.arange(100, 116, dtype=np.uint8)
    ctl = np.array([2, 1], np.int64)                # 2 words of fresh rows; 1 admitted row
    adm = np.array([16, 40], np.int64)              # pool[16:24] -> pool[40:48]
    devcache.copy_words(fresh.ctypes.data, pool.ctypes.data + 16, ctl.ctypes.data, 4, 0xabc, 0)
    devcache.copy_rows(pool.ctypes.data, adm.ctypes.data, adm.ctypes.data + 8, ctl.ctypes.data, 8, 4, 0xabc, 0)
    assert fake.log == [("kernel", 0xabc), ("kernel", 0xabc)]
    np.testing.assert_array_equal(pool[16:32], fresh)
    np.testing.assert_array_equal(pool[40:48], fresh[:8])


def test_only_arrays_wraps_foreign_streams():
    """Stream.from_external (cupy >= 14) and ExternalStream (cupy 13) are chosen in one place: arrays.cupy_stream."""
    root = Path(__file__).parents[2] / "gds_gather"
    users = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                   if p.name != "arrays.py" and ("from_external" in p.read_text() or "ExternalStream" in p.read_text()))
    assert users == []


# -- finding 5: pin / unpin pairing under a failing hostRegister; close continues -------------------------------------
def _open_fds(path) -> int:
    import os
    d = "/proc/self/fd"
    return sum(1 for f in os.listdir(d) if os.path.realpath(os.path.join(d, f)) == os.path.realpath(path))


def test_refused_register_is_never_unregistered(fake_cuda, small_table):
    """The zero-copy destination's first register of its reader's staging fails: the gather fails, nothing is
    page-locked, and close unregisters nothing (it raised "not registered" before, hiding the first error and
    skipping the other closes)."""
    fake_cuda.register_fails_at = 1
    t = _table(small_table, platform="unified")
    with pytest.raises(RuntimeError, match="AlreadyRegistered"):
        t.gather(TorchCudaIds(np.arange(3)), "direct")
    t.close()
    assert fake_cuda.registered == {}


def test_refused_register_after_regrowth_is_never_unregistered(fake_cuda):
    from gds_gather.gpu.device import pin_staging
    from gds_gather.io.readers import Staging
    st = Staging()
    st.ensure(4096)
    pin_staging(st, mapped=True)
    assert list(fake_cuda.registered.values()) == [st.buf.nbytes]
    fake_cuda.register_fails_at = 2
    with pytest.raises(RuntimeError, match="AlreadyRegistered"):
        st.ensure(st.buf.nbytes + 1)        # unregisters the old buffer, then registering the grown one fails
    assert fake_cuda.registered == {}
    st.close()                              # nothing registered: nothing to unregister
    fake_cuda.register_fails_at = None
    st.ensure(4096)
    pin_staging(st, mapped=False)
    st.close()
    assert fake_cuda.registered == {}


def test_close_runs_every_close_and_raises_the_first_error(fake_cuda, small_table, monkeypatch):
    before = _open_fds(small_table)
    t = _table(small_table, platform="unified")
    t.gather(TorchCudaIds(np.arange(3)), "direct")      # pinned, mapped O_DIRECT staging (closed first)
    t.gather(np.arange(3), "pread")                     # a host reader (closed after it)
    assert _open_fds(small_table) >= before + 2

    def refuse(ptr):
        raise RuntimeError("cudaErrorDevicesUnavailable (stand-in)")
    monkeypatch.setattr(fake_cuda.cuda.runtime, "hostUnregister", refuse)
    with pytest.raises(RuntimeError, match="DevicesUnavailable"):
        t.close()
    assert _open_fds(small_table) == before and t.closed    # the pread reader's fd was closed all the same


# -- finding 4: close waits for queued GPU work before unpinning the staging it reads ---------------------------------
@pytest.mark.parametrize("how", ["close", "finalizer"])
def test_close_waits_for_the_last_stream_before_unpinning(fake_cuda, small_table, how):
    import gc
    t = _table(small_table, platform="unified")
    t.gather(TorchCudaIds(np.arange(30).reshape(10, 3)), "direct", stream=TorchStream(0x7777))
    launch = fake_cuda.log.index(("launch", 0x7777))
    if how == "close":
        t.close()
    else:
        del t
        gc.collect()
    after = fake_cuda.log[launch + 1:]
    kinds = [k for k, _ in after]
    assert "unregister" in kinds and ("sync", 0x7777) in after, fake_cuda.log
    assert after.index(("sync", 0x7777)) < kinds.index("unregister")


# -- finding 6: KvikIO compat mode reads with O_DIRECT, and says so ------------------------------------------------
class FakeKvikioDefaults:
    """kvikio.defaults' set/get/is_compat_mode_preferred; `known`: the settings this KvikIO version has."""

    def __init__(self, compat: bool, known=("num_threads", "gds_threshold", "auto_direct_io_read")):
        self.compat, self.known, self.values = compat, set(known), {"auto_direct_io_read": False}

    def set(self, config):
        for k in config:
            if k not in self.known:
                raise KeyError(k)           # kvikio's _property_setters[name]
        self.values.update(config)

    def get(self, name):
        if name not in self.known:
            raise KeyError(name)
        return self.values[name]

    def is_compat_mode_preferred(self):
        return self.compat


def _kvikio(defaults, gds: bool):
    return types.SimpleNamespace(defaults=defaults, cufile_driver=types.SimpleNamespace(get=lambda k: gds))


@pytest.mark.parametrize("known,direct", [(("num_threads", "gds_threshold", "auto_direct_io_read"), True),
                                          (("num_threads", "gds_threshold"), False)], ids=["kvikio26", "kvikio25.8"])
def test_compat_mode_reads_bypass_the_page_cache_and_say_so(known, direct):
    from gds_gather.gpu.device import configure_kvikio
    d = FakeKvikioDefaults(compat=True, known=known)
    real, how = configure_kvikio(8, _kvikio(d, gds=False))
    assert not real and d.values["num_threads"] == 8 and d.values["gds_threshold"] == 0
    assert d.values["auto_direct_io_read"] is direct
    assert ("O_DIRECT" in how) is direct and ("BUFFERED" in how) is (not direct), how


def test_real_gds_leaves_the_posix_setting_alone():
    from gds_gather.gpu.device import configure_kvikio
    d = FakeKvikioDefaults(compat=False)
    assert configure_kvikio(4, _kvikio(d, gds=True)) == (True, "real GPU-direct storage")
    assert d.values["auto_direct_io_read"] is False


# -- finding 8: the flag publication is a real store barrier; a refused wait node falls back to eager -----------------
def test_native_publish_is_a_fenced_store(tmp_path):
    import shutil
    import subprocess
    from gds_gather.io import native
    lib, why = native.library(gg.Config(cache_dir=tmp_path))
    if lib is None:
        pytest.skip(why)
    flags = np.zeros(2, np.int32)
    native.publish_i32(lib, flags, 1, 7)
    assert flags.tolist() == [0, 7]
    with pytest.raises(IndexError):
        native.publish_i32(lib, flags, 2, 1)
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump to check the barrier instruction")
    so = next((tmp_path / "native").glob("libggnative-*.so"))
    asm = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(so)], capture_output=True, text=True).stdout
    body = asm.split("<gg_publish_i32>:", 1)[1].split("\n\n", 1)[0]
    assert any(b in body for b in ("mfence", "lock ", "dmb")), body    # a full fence before the flag store


def test_publisher_without_native_helpers(monkeypatch):
    from gds_gather.gpu import graph
    from gds_gather.io import native
    monkeypatch.setattr(native, "library", lambda config=None: (None, "no C compiler (stand-in)"))
    monkeypatch.setattr(graph.platform, "machine", lambda: "aarch64")
    with pytest.raises(gg.errors.BackendError, match="store-store barrier"):
        graph.publisher()
    monkeypatch.setattr(graph.platform, "machine", lambda: "x86_64")      # TSO: a plain store is ordered
    flags = np.zeros(2, np.int32)
    graph.publisher()(flags, 0, 1)
    assert flags.tolist() == [1, 0]


def test_refused_wait_during_capture_runs_eagerly(tmp_path):
    """The driver takes the eager probe's wait but refuses the captured node (HostAccel(refuse_waits="capture")):
    the real GpuPrefill falls back to eager steps, says why, and its rows equal the CPU pipeline's."""
    pytest.importorskip("torch")
    from gds_gather.gpu.host import HostAccel
    from gds_gather.model.synth import write_model
    from gds_gather.prefill.pipeline import CpuPrefill, GpuPrefill
    from gds_gather.prefill.run import RowMapper
    path = write_model(tmp_path / "m.gguf", "gemma4-e2b", qtype="Q8_0", rows=3000, progress=False)
    tok = np.random.default_rng(0).integers(1, 3000, 40)
    with gg.open_table(path, config=gg.Config(platform="discrete", accel="host", cache_bytes=0)) as t:
        p = GpuPrefill(t, RowMapper(t), backend="direct", ubatch=16, graph=True, dtype="float32", trunk="tiny",
                       accel=HostAccel(refuse_waits="capture"))
        try:
            res = p.run(tok, collect=True)
        finally:
            p.close()
        ref = CpuPrefill(t, RowMapper(t), backend="direct", ubatch=16, trunk="tiny").run(tok, collect=True)
    assert not res["graph"] and p.flags is None and "801" in res["graph_reason"], res["graph_reason"]
    assert len(res["outputs"]) == 3
    for (ple, _), (want, _) in zip(res["outputs"], ref["outputs"]):
        assert torch_equal(ple, want)
    p.release(1)            # eager: no flag to set


def torch_equal(a, b) -> bool:
    import torch
    return bool(torch.equal(a, b))


# -- finding 9: gpu_check's test steps each have a limit and a junit XML; the summary lists every step ----------------
_JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="{n}">{cases}
</testsuite></testsuites>"""


def _junit(path, cases):
    body = "".join(f'<testcase classname="tests.{f}" name="{n}" file="tests/{f}.py">{extra}</testcase>'
                   for f, n, extra in cases)
    path.write_text(_JUNIT.format(n=len(cases), cases=body))


def test_summary_lists_every_step_and_a_killed_one_without_junit(tmp_path):
    import json
    import subprocess
    import sys
    out, junit = tmp_path / "out", tmp_path / "junit"
    out.mkdir()
    junit.mkdir()
    steps = [("package", "ok", 1), ("gpu-selection", "ok", 9), ("test-kernels", "ok", 80),
             ("test-prefill", "timeout after 120 s", 130), ("test-other", "failed (exit 1)", 20),
             ("bench-kernels", "ok", 30)]
    (tmp_path / "steps.tsv").write_text("".join(f"{a}\t{b}\t{c}\n" for a, b, c in steps))
    (tmp_path / "missing.json").write_text('{"required": [], "optional": []}')
    _junit(junit / "test-kernels.xml", [("test_kernels_gpu", "a", ""), ("test_kernels_gpu", "b", "")])
    _junit(junit / "test-other.xml", [("test_hf", "c", '<failure message="x"/>'), ("test_trunk", "d", "<skipped/>")])
    (junit / "test-prefill.xml").write_text("<testsuites><testsuite")     # killed while writing
    (junit / "all.collected").write_text("9\n")
    script = Path(__file__).parents[2] / "bench" / "gpu_check_summary.py"
    r = subprocess.run([sys.executable, str(script), str(out), str(tmp_path / "steps.tsv"),
                        str(tmp_path / "missing.json"), "1", str(junit)], capture_output=True, text=True)
    assert r.returncode == 1, r.stderr
    s = json.loads((out / "summary.json").read_text())
    assert list(s["steps"]) == [a for a, _, _ in steps] and not s["ok"]
    assert s["steps"]["test-prefill"]["junit"] == "none: the step wrote no junit XML (timeout after 120 s)"
    assert s["steps"]["test-kernels"]["junit"] is True
    t = s["tests"]
    assert (t["passed"], t["failed"], t["skipped"], t["collected"]) == (2, 1, 1, 4)
    assert t["per_step"]["test-kernels"]["passed"] == 2 and t["per_step"]["test-other"]["failed"] == 1
    assert t["failures"] == ["tests.test_hf::c"]
    assert "in_no_step" not in t            # a step without junit: the count cannot be compared
    for name, _, _ in steps:
        assert name in r.stdout
    assert "junit: none" in r.stdout and (out / "gpu_tests.xml").is_file()


class OldKvikioDefaults:
    """kvikio.defaults before 25.02: num_threads_reset / gds_threshold_reset, no set/get."""

    def __init__(self):
        self.values = {}

    def num_threads_reset(self, n):
        self.values["num_threads"] = n

    def gds_threshold_reset(self, n):
        self.values["gds_threshold"] = n

    def is_compat_mode_preferred(self):
        return True


def test_old_kvikio_and_no_cufile_driver():
    """KvikIO < 25.02 gets its threads and threshold through the *_reset calls; a cuFile driver that cannot be
    asked means no GPU-direct DMA; without auto_direct_io_read the reads are said to be buffered."""
    from gds_gather.gpu.device import configure_kvikio
    d = OldKvikioDefaults()

    def no_driver(key):
        raise RuntimeError("cuFile driver not loaded")
    kv = types.SimpleNamespace(defaults=d, cufile_driver=types.SimpleNamespace(get=no_driver))
    real, how = configure_kvikio(6, kv)
    assert not real and d.values == {"num_threads": 6, "gds_threshold": 0}
    assert "BUFFERED POSIX reads" in how and "no GPU-direct DMA" in how


def test_gds_reader_on_the_host_accel(tmp_path, ggufs):
    """GdsReader through HostAccel's cuFile stand-in reads the plan's 4 KiB windows into device staging where each
    unique row is the file's row, and refuses a plan at another alignment; Table.fetch_device through the gds
    destination first waits for the stream's earlier work; a destination of an unknown mode is refused."""
    pytest.importorskip("torch")
    from gds_gather.gpu import destinations
    from gds_gather.gpu.device import GdsReader
    from gds_gather.errors import BackendError
    path, raw, _ = ggufs.table(tmp_path / "g.gguf", 200, seed=4)
    with gg.open_table(path, config=gg.Config(platform="discrete", accel="host", cache_bytes=0)) as t:
        a = t.accel
        plan = t.plan(np.array([150, 3, 3, 77]), align=t.gds_align)
        r = t.region.open(GdsReader, t.config, accel=a)
        try:
            dev = r.read_windows(plan)
            got = np.stack([np.asarray(dev)[o:o + t.row_bytes] for o in plan.row_staging.tolist()])
            np.testing.assert_array_equal(got, raw[plan.unique_rows])
            assert r.bytes_read == plan.window_bytes
            with pytest.raises(BackendError, match=r"gds: plan at 512-byte alignment; plan at Table.gds_align"):
                r.read_windows(t.plan(np.array([1]), align=512))
        finally:
            r.close()
        s = a.stream()
        earlier = []
        a.defer(s, lambda: earlier.append(True))              # the stream's earlier work on the staging
        dev, offs = t.fetch_device(plan, "gds", stream=s)
        assert earlier == [True]                             # waited for it before reading
        a.synchronize(s)                                     # (the offsets' copy is queued on s)
        got = np.stack([np.asarray(dev)[o:o + t.row_bytes] for o in np.asarray(offs).tolist()])
        np.testing.assert_array_equal(got, raw[plan.unique_rows])
        assert [d.name for d in t.readers()[1]] == ["gds"] and t.readers()[1][0].bytes_read > 0
        spec = destinations.Spec(t, a, "direct", 8, 1 << 16, slots=1)
        with pytest.raises(ValueError, match="bogus"):
            destinations.build(spec, "bogus")
