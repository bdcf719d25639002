"""GPU destinations of the I/O engine: pinned staging + H2D copy, zero-copy mapped staging, KvikIO/cuFile.

All bit-exact against the file's bytes. Run on a GPU machine; skipped (and listed) elsewhere.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import gds_gather as gg

pytestmark = pytest.mark.gpu


@pytest.fixture
def table_and_rows(tmp_path, ggufs):
    rows = ggufs.rows(Q.Q8_0, 5000, 160, seed=3)          # 170-byte rows: many straddle 4 KiB blocks
    return ggufs.write(tmp_path / "t.gguf", rows, Q.Q8_0), rows


def _ids(n_rows):
    rng = np.random.default_rng(0)
    return np.concatenate([rng.integers(0, n_rows, 3000), [0, n_rows - 1, 0]]).reshape(-1, 3)


@pytest.mark.parametrize("platform", ["discrete", "unified"])
@pytest.mark.parametrize("backend", ["auto", "direct", "pread", "mmap", "resident"])
def test_read_rows_into_gpu_exact(table_and_rows, platform, backend):
    import cupy as cp
    path, rows = table_and_rows
    ids = _ids(rows.shape[0])
    with gg.open_table(path, config=gg.Config(platform=platform)) as t:
        got = t.read_rows(cp.asarray(ids), backend)
        assert isinstance(got, cp.ndarray) and got.shape == ids.shape + (t.row_bytes,)
        np.testing.assert_array_equal(cp.asnumpy(got), rows[ids])
        dest = t.readers()[1][0]
        want = ("zero-copy" if platform == "unified" and backend in ("auto", "direct", "pread") else
                "resident" if backend == "resident" else "copy")
        assert dest.name == want, (dest.name, dest.how)


def test_torch_ids_and_stream(table_and_rows):
    torch = pytest.importorskip("torch")
    path, rows = table_and_rows
    ids = _ids(rows.shape[0])
    s = torch.cuda.Stream()
    with gg.open_table(path) as t:
        got = t.read_rows(torch.as_tensor(ids, device="cuda"), stream=s)
        s.synchronize()
        assert isinstance(got, torch.Tensor) and got.is_cuda
        np.testing.assert_array_equal(got.cpu().numpy(), rows[ids])


def test_gds_backend_exact(table_and_rows):
    pytest.importorskip("kvikio")
    import cupy as cp
    path, rows = table_and_rows
    ids = _ids(rows.shape[0])
    with gg.open_table(path) as t:
        got = t.read_rows(cp.asarray(ids), "gds")
        np.testing.assert_array_equal(cp.asnumpy(got), rows[ids])
        assert "KvikIO" in t.readers()[1][0].how


def test_staging_reuse_waits_for_the_stream(table_and_rows):
    """Two fetches in a row: the second must not overwrite rows the first batch's consumer still reads."""
    import cupy as cp
    path, rows = table_and_rows
    with gg.open_table(path, config=gg.Config(platform="unified")) as t:
        a = t.read_rows(cp.arange(0, 100), "direct")
        b = t.read_rows(cp.arange(100, 200), "direct")
        np.testing.assert_array_equal(cp.asnumpy(a), rows[:100])
        np.testing.assert_array_equal(cp.asnumpy(b), rows[100:200])


@pytest.mark.parametrize("platform,cache", [("discrete", 0), ("discrete", 1 << 20), ("unified", 0)])
def test_a_batch_beyond_the_slot_rebuilds_the_destination(table_and_rows, platform, cache):
    """Table's device destination starts with a slot for the first batch and is rebuilt twice as large for one
    that does not fit (issue 17: the prefill's destinations, one slot): rows exact before and after, on a GPU."""
    import cupy as cp
    path, rows = table_and_rows
    with gg.open_table(path, config=gg.Config(platform=platform, cache_bytes=cache)) as t:
        for ids in (np.arange(0, 40, 2), np.random.default_rng(2).permutation(5000)[:3000], np.arange(0, 40, 2)):
            got = t.read_rows(cp.asarray(ids), "direct")
            np.testing.assert_array_equal(cp.asnumpy(got), rows[ids])
        (d,) = t.readers()[1]
        assert d.N >= 3000 and (d.cache is not None) == bool(cache and platform == "discrete")


def test_auto_reports_the_choice(table_and_rows):
    from gds_gather.backends import resolve_device
    name, mode, why = resolve_device("auto", gg.Config())
    assert name in ("direct", "gds") and why
    name, mode, why = resolve_device("auto", gg.Config(platform="unified"))
    assert (name, mode) == ("direct", "zero-copy")


from gds_gather.formats.quants import supported_types  # noqa: E402

TYPES = supported_types()


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_table_gather_every_type_cupy_and_torch(tmp_path, ggufs, qtype):
    """Issue 4: every type through t.gather with cupy ids and with torch ids, f32/f16/bf16, exact."""
    import cupy as cp
    torch = pytest.importorskip("torch")
    n_rows, width = 97, ggufs.width(qtype)
    path = ggufs.write(tmp_path / f"{qtype.name}.gguf", ggufs.rows(qtype, n_rows, width, seed=int(qtype)), qtype)
    ref = ggufs.reference(path)
    ids = np.random.default_rng(int(qtype)).integers(0, n_rows, (60, 3))
    with gg.open_table(path) as t:
        got = t.gather(cp.asarray(ids))
        assert isinstance(got, cp.ndarray) and got.dtype == np.float32
        np.testing.assert_array_equal(cp.asnumpy(got), ref[ids])
        tids = torch.as_tensor(ids, device="cuda")
        np.testing.assert_array_equal(t.gather(tids, dtype=torch.float16).cpu().numpy(),
                                      ref[ids].astype(np.float16))
        bf = t.gather(tids, dtype=torch.bfloat16)
        assert bf.dtype == torch.bfloat16
        assert torch.equal(bf.cpu(), torch.from_numpy(ref[ids]).to(torch.bfloat16))


# ---- the prefill's failure paths on a real GPU (issue 12) -------------------------------------------------------
_INJECT = r"""
import sys, time
import numpy as np
import gds_gather as gg
from gds_gather.errors import ReadError
from gds_gather.prefill.pipeline import GpuPrefill
from gds_gather.prefill.run import RowMapper
from gds_gather.gpu.schedule import StagingCapacityError
path, backend, platform, graph = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
cfg = gg.Config(platform=platform)
with gg.open_table(path, config=cfg) as t:
    mapper = RowMapper(t)
    tokens = np.random.default_rng(0).integers(1, min(mapper.n_vocab, t.n_rows), 256 * 6)
    pipe = GpuPrefill(t, mapper, backend=backend, ubatch=256, graph=graph, dtype="float32", trunk="tiny",
                      config=cfg)
    orig, calls = pipe._stage, [0]
    def stage(tok, s):
        calls[0] += 1
        if calls[0] == 3:
            orig(tok[: tok.size // 2], s)      # half the reads landed, then the disk fails
            raise ReadError("injected: I/O error at offset 4096")
        return orig(tok, s)
    pipe._stage = stage
    t0 = time.perf_counter()
    try:
        pipe.run(tokens)
        print("NO ERROR")
    except ReadError as e:
        print("ERR", f"{time.perf_counter() - t0:.3f}", " | ".join(getattr(e, "__notes__", [])), flush=True)
    pipe._stage = orig                          # the GPU is usable again: a whole run completes
    res = pipe.run(tokens, collect=True)
    print("OK", len(res["outputs"]), pipe.flags.host.tolist() if pipe.flags is not None else [0, 0], flush=True)
    ref = GpuPrefill(t, mapper, backend="resident", ubatch=256, graph=False, dtype="float32", trunk="tiny",
                     config=cfg)               # the oracle: the whole table in device memory, eager, no I/O
    try:
        want = ref.run(tokens, collect=True)["outputs"]
    finally:
        ref.close()
    err = max(float((x - x0).abs().max()) for o, o0 in zip(res["outputs"], want) for x, x0 in zip(o, o0))
    print("VALUES", "SAME" if len(want) == len(res["outputs"]) == 6 and err <= 1e-4 else "DIFFER", err, flush=True)
    if pipe.dest.capacity[0] is not None:       # a plan larger than the captured staging is refused
        pipe.dest.capacity = [1, 1]
        try:
            pipe.run(tokens)
            print("NOT REFUSED")
        except StagingCapacityError as e:
            print("REFUSED", str(e)[:60])
        pipe.dest.capacity = [None, None]
        print("AGAIN", pipe.run(tokens)["ubatches"], flush=True)
    pipe.close()
print("DONE", flush=True)
"""


@pytest.mark.parametrize("backend,platform,graph", [("direct", "discrete", True), ("direct", "unified", True),
                                                    ("gds", "discrete", True), ("direct", "discrete", False)])
def test_read_error_mid_prefill_returns_promptly(tmp_path, backend, platform, graph):
    """A ReadError in ubatch 3 of 6 (graph replay already queued, waiting on its flag): the process gets the error
    within seconds, the GPU is released and drained, and the same pipeline then runs a whole prefill."""
    import subprocess
    import sys
    if backend == "gds":
        pytest.importorskip("kvikio")
    from gds_gather.model.synth import write_model
    path = write_model(tmp_path / "m.gguf", "qwen4exp", qtype="IQ4_NL", rows=30000, progress=False)
    res = subprocess.run([sys.executable, "-P", "-c", _INJECT, str(path), backend, platform, "1" if graph else "0"],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    out = res.stdout
    assert res.returncode == 0 and "DONE" in out, (out, res.stderr[-3000:])
    err = next(ln for ln in out.splitlines() if ln.startswith("ERR"))
    assert float(err.split()[1]) < 30.0
    assert "ubatch 3 of 6" in err and "released and drained" in err
    assert "OK 6 [0, 0]" in out
    assert "VALUES SAME" in out, out          # the run after the error: the resident table's per-layer inputs
    if platform == "unified" or backend == "gds":     # captured staging: the size guard refuses, then runs again
        assert "REFUSED" in out and "AGAIN 6" in out


# ---- the GPU-code review's findings (issue 17), on a real GPU; tests/gpu/test_cuda_glue_on_a_fake_device.py shows
# each on the CPU -----
def test_side_stream_gather_copies_and_launches_on_torchs_stream(tmp_path, ggufs, monkeypatch):
    """Finding 1: with the legacy stream busy (a sleep queued on it inside each fetch), a gather under
    torch.cuda.stream(s) with stream=None must still see its own staging: copies and kernel all on s."""
    torch = pytest.importorskip("torch")
    from gds_gather.gpu import destinations
    rows = ggufs.rows(Q.Q8_0, 4000, 160, seed=5)
    path = ggufs.write(tmp_path / "t.gguf", rows, Q.Q8_0)
    ref = ggufs.reference(path)
    orig = destinations.Copy.stage

    def delayed(self, plan, s):
        with torch.cuda.stream(torch.cuda.default_stream()):
            torch.cuda._sleep(100_000_000)      # tens of ms on the legacy stream: a copy queued there waits
        return orig(self, plan, s)
    monkeypatch.setattr(destinations.Copy, "stage", delayed)
    rng = np.random.default_rng(5)
    first, ids = rng.integers(0, 4000, (500, 4)), rng.integers(0, 4000, (500, 4))
    s = torch.cuda.Stream()
    with gg.open_table(path, config=gg.Config(platform="discrete", cache_bytes=0)) as t, torch.cuda.stream(s):
        t.gather(torch.as_tensor(first, device="cuda"))         # other rows in the staging and offsets
        got = t.gather(torch.as_tensor(ids, device="cuda"))
        s.synchronize()
        np.testing.assert_array_equal(got.cpu().numpy(), ref[ids])


@pytest.mark.parametrize("cache", [0, 1 << 20], ids=["copy", "copy+cache"])
def test_a_busy_legacy_stream_before_the_first_side_stream_gather(tmp_path, ggufs, cache):
    """Issue 34: the destination is built during the first gather on a side stream while stream 0 is kept busy
    (a sleep queued there): its buffers are zeroed on the side stream, so no memset lands after their first use;
    the gathers after stream 0 ran are exact too (a compact destination's offsets are uploaded once)."""
    torch = pytest.importorskip("torch")
    rows = ggufs.rows(Q.Q8_0, 4000, 160, seed=6)
    path = ggufs.write(tmp_path / "t.gguf", rows, Q.Q8_0)
    ref = ggufs.reference(path)
    rng = np.random.default_rng(6)
    batches = [rng.integers(0, 4000, (400, 3)) for _ in range(3)]
    dev_ids = [torch.as_tensor(b, device="cuda") for b in batches]
    torch.cuda.synchronize()                        # the ids are in place before stream 0 is kept busy
    s = torch.cuda.Stream()
    got = []
    with gg.open_table(path, config=gg.Config(platform="discrete", cache_bytes=cache)) as t:
        with torch.cuda.stream(torch.cuda.default_stream()):
            torch.cuda._sleep(1_000_000_000)        # about half a second on the legacy stream
        got += [t.gather(dev_ids[0], "direct", stream=s), t.gather(dev_ids[1], "direct", stream=s)]
        s.synchronize()
        torch.cuda.synchronize()                    # stream 0's work has run now
        got += [t.gather(dev_ids[2], "direct", stream=s), t.gather(dev_ids[0], "direct", stream=s)]
        s.synchronize()
        assert t.readers()[1][0].name == "copy"
    for g, b in zip(got, batches + batches[:1]):
        np.testing.assert_array_equal(g.cpu().numpy(), ref[b])


@pytest.mark.parametrize("trunk", ["none", "tiny"])
def test_an_eager_prefill_after_a_long_default_stream_sleep(tmp_path, trunk):
    """Issue 34: GpuPrefill set up while the default stream sleeps (its zeros, and the trunk's weights, queue
    behind the sleep unless made on or ordered before the prefill's stream), run eagerly at once: the per-layer
    inputs are the CPU pipeline's (rows bit for bit without the trunk; with it, the same float32 math on
    another device)."""
    torch = pytest.importorskip("torch")
    from gds_gather.model.synth import write_model
    from gds_gather.prefill.pipeline import CpuPrefill, GpuPrefill
    from gds_gather.prefill.run import RowMapper
    path = write_model(tmp_path / "g.gguf", "gemma4-e2b", qtype="Q8_0", rows=3000, progress=False)
    cfg = gg.Config(platform="discrete", cache_bytes=0)
    with gg.open_table(path, config=cfg) as t:
        m = RowMapper(t)
        tok = np.random.default_rng(7).integers(1, min(m.n_vocab, t.n_rows), 300)
        want = CpuPrefill(t, m, backend="direct", ubatch=128, trunk=trunk, seed=34).run(tok, collect=True)["outputs"]
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.default_stream()):
            torch.cuda._sleep(2_000_000_000)        # about a second on the default stream
        p = GpuPrefill(t, m, backend="direct", ubatch=128, graph=False, dtype="float32", trunk=trunk, seed=34,
                       config=cfg)
        try:
            got = p.run(tok, collect=True)["outputs"]
        finally:
            p.close()
    assert len(got) == len(want) == 3
    for (ple, hid), (ple0, hid0) in zip(got, want):
        if trunk == "none":
            n = ple0.shape[0] // m.rows_per_token
            ple0 = (ple0.view(n, m.n_layer, m.per_layer) * m.row_scale).permute(1, 0, 2).contiguous()
            assert torch.equal(ple, ple0)
        else:
            torch.testing.assert_close(ple, ple0, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(hid, hid0, rtol=1e-3, atol=1e-3)


def test_a_replay_waits_for_its_flag():
    """Issue 34: a captured step that starts with the wait on host flag 1 (graph.py) is not done before the host
    sets the flag and is done after it, with the flag re-armed to 0 by the step itself; twice."""
    torch = pytest.importorskip("torch")
    import time
    from gds_gather.gpu import accel
    a = accel.get("cuda")
    s = torch.cuda.Stream()
    flags = a.flags(2)
    flags.probe(s)
    x = torch.zeros(1024, device="cuda")
    torch.cuda.synchronize()

    def step():
        flags.wait(s, 1, 1)
        x.add_(1)
        flags.write(s, 1, 0)
        return (x,)
    g, _ = a.capture(s, step)
    for k in (1, 2):
        done = torch.cuda.Event()
        with torch.cuda.stream(s):
            g.replay()
            done.record(s)
        time.sleep(0.2)
        early = done.query()
        flags.set(1, 1)                             # released before any assert: a failed one must not hang
        done.synchronize()
        assert not early, "the replay ran before its flag was set"
        assert flags.host.tolist() == [0, 0] and torch.equal(x.cpu(), torch.full((1024,), float(k)))


def test_cupy_stream_wraps_a_torch_stream_without_deprecation():
    """Finding 3: arrays.cupy_stream uses Stream.from_external on cupy 14 (no DeprecationWarning: warnings are
    errors here) and ExternalStream on cupy 13; work queued on it runs on the torch stream."""
    import cupy as cp
    torch = pytest.importorskip("torch")
    from gds_gather.gpu import arrays
    s = torch.cuda.Stream()
    cs = arrays.cupy_stream(s)
    assert cs.ptr == s.cuda_stream
    with cs:
        x = cp.arange(10) * 2
    cs.synchronize()
    assert cp.asnumpy(x).tolist() == list(range(0, 20, 2))


_CLOSE_EARLY = r"""
import sys
import numpy as np
import torch
import gds_gather as gg
from gds_gather.gpu import destinations
path, n = sys.argv[1], int(sys.argv[2])
orig = destinations.ZeroCopy.inputs
def inputs(self, s, n, stream):
    out = orig(self, s, n, stream)
    torch.cuda._sleep(200_000_000)      # the kernel is queued behind this on the same stream
    return out
destinations.ZeroCopy.inputs = inputs
ids = np.random.default_rng(0).integers(0, n, (2000, 3))
s = torch.cuda.Stream()
t = gg.open_table(path, config=gg.Config(platform="unified", cache_bytes=0))
want = t.gather(ids)
with torch.cuda.stream(s):
    got = t.gather(torch.as_tensor(ids, device="cuda"))
    t.close()                           # unpins and unmaps the zero-copy staging the queued kernel reads
s.synchronize()
print("SAME" if np.array_equal(got.cpu().numpy(), want) else "DIFFERENT", flush=True)
"""


def test_close_waits_for_queued_kernels_reading_the_staging(table_and_rows):
    """Finding 4: Table.close right after a zero-copy gather whose kernel is still queued: close waits for the
    stream, so the kernel reads mapped staging (not unmapped memory). In a subprocess: a fault would be sticky."""
    import subprocess
    import sys
    path, rows = table_and_rows
    r = subprocess.run([sys.executable, "-P", "-c", _CLOSE_EARLY, str(path), str(rows.shape[0])], capture_output=True,
                       text=True, timeout=120, cwd=path.parent)
    assert r.returncode == 0 and "SAME" in r.stdout, (r.stdout, r.stderr[-2000:])


def test_refused_host_register_leaves_close_clean(table_and_rows, monkeypatch):
    """Finding 5: hostRegister refused: the gather fails with that error and close() does not unregister the range
    it never registered."""
    import cupy as cp
    path, _ = table_and_rows

    def refuse(ptr, n, flags):
        raise cp.cuda.runtime.CUDARuntimeError(2)       # cudaErrorMemoryAllocation
    monkeypatch.setattr(cp.cuda.runtime, "hostRegister", refuse)
    t = gg.open_table(path, config=gg.Config(platform="unified"))      # zero-copy registers its staging
    with pytest.raises(cp.cuda.runtime.CUDARuntimeError):
        t.read_rows(cp.arange(0, 100), "direct")
    t.close()                                           # raised cudaErrorHostMemoryNotRegistered before the fix
    assert t.closed


def test_gds_compat_reads_bypass_the_page_cache(table_and_rows):
    """Finding 6: without real GPU-direct storage, KvikIO reads with O_DIRECT (auto_direct_io_read): a gds
    gather of a file dropped from the page cache leaves its table pages out of it."""
    kvikio = pytest.importorskip("kvikio")
    import mmap
    import os

    import cupy as cp
    import kvikio.defaults
    from gds_gather.io import native
    path, rows = table_and_rows
    with gg.open_table(path) as t:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)                                    # dirty pages would stay cached
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        got = t.read_rows(cp.arange(0, rows.shape[0]), "gds")
        np.testing.assert_array_equal(cp.asnumpy(got), rows)
        how = t.readers()[1][0].how
        if "real GPU-direct" in how:
            pytest.skip(f"real GPU-direct storage here: {how}")
        if not hasattr(kvikio.defaults, "get") or "BUFFERED" in how:
            pytest.skip(f"this KvikIO has no auto_direct_io_read: {how}")
        assert "O_DIRECT" in how and kvikio.defaults.get("auto_direct_io_read") is True
        lib, why = native.library()
        if lib is None:
            pytest.skip(why)
        size = os.path.getsize(path)
        mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        view = np.frombuffer(mm, np.uint8)
        try:
            page = mmap.PAGESIZE
            pages = np.arange(-(-t.data_offset // page), size // page, dtype=np.int64)
            resident = native.mincore_rows(lib, view.ctypes.data, pages, np.ones_like(pages), page,
                                           -(-size // page))
        finally:
            del view
            mm.close()
            os.close(fd)
        assert resident.mean() < 0.5, f"{resident.mean():.0%} of the table's pages are in the page cache"


def test_one_device_choice_per_table_and_streams_by_handle(table_and_rows, monkeypatch):
    """Finding 7: gds_state is asked once per table (not twice per gather) and the last stream is compared by
    handle (torch.cuda.current_stream() is a new wrapper per call)."""
    import importlib
    torch = pytest.importorskip("torch")
    backends = importlib.import_module("gds_gather.backends")
    calls = []
    real = backends.gds_state
    monkeypatch.setattr(backends, "gds_state", lambda: calls.append(1) or real())
    path, rows = table_and_rows
    ids = torch.as_tensor(_ids(rows.shape[0]), device="cuda")
    with gg.open_table(path) as t:
        t.read_rows(ids)
        first = len(calls)
        for _ in range(3):
            got = t.read_rows(ids)
        assert len(calls) == first
        assert t.device_path.last.key == torch.cuda.current_stream().cuda_stream
        np.testing.assert_array_equal(got.cpu().numpy(), rows[_ids(rows.shape[0])])


def test_prefill_probe_and_refused_wait_value_fall_back_to_eager(tmp_path, monkeypatch):
    """Finding 8: on this GPU the wait/write-value probe passes (graphs); a driver that refuses cuStreamWaitValue32
    makes the same prefill run eagerly, with the reason, and give the same per-layer inputs."""
    torch = pytest.importorskip("torch")
    from gds_gather.gpu import graph
    from gds_gather.model.synth import write_model
    from gds_gather.prefill.pipeline import GpuPrefill
    from gds_gather.prefill.run import RowMapper
    path = write_model(tmp_path / "m.gguf", "qwen4exp", qtype="IQ4_NL", rows=30000, progress=False)
    outs = {}
    with gg.open_table(path) as t:
        mapper = RowMapper(t)
        tokens = np.random.default_rng(0).integers(1, min(mapper.n_vocab, t.n_rows), 256 * 3)
        for refused in (False, True):
            if refused:
                class Refusing:
                    def __getattr__(self, name):
                        return lambda *a: 801           # CUDA_ERROR_NOT_SUPPORTED
                monkeypatch.setattr(graph, "_libcuda", lambda: Refusing())
            pipe = GpuPrefill(t, mapper, backend="direct", ubatch=256, graph=True, dtype="float32", trunk="tiny")
            try:
                res = pipe.run(tokens, collect=True)
            finally:
                pipe.close()
            assert res["graph"] is (not refused), res["graph_reason"]
            if refused:
                assert "801" in res["graph_reason"] and res["schedule"] == "eager"
            else:
                flags = graph.HostFlags(1)
                flags.set(0, 1)
                assert flags.host.tolist() == [1]
            outs[refused] = res["outputs"]
    for (p1, _), (p2, _) in zip(outs[False], outs[True]):
        assert torch.equal(p1, p2)
