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
        sink = next(iter(t._sinks.values()))
        want = "zero-copy" if platform == "unified" and backend in ("auto", "direct", "pread") else "copy"
        assert want in sink.how or (want == "copy" and "H2D" in sink.how), sink.how


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
        assert "KvikIO" in t._sinks["gds@gds"].how


def test_staging_reuse_waits_for_the_stream(table_and_rows):
    """Two fetches in a row: the second must not overwrite rows the first batch's consumer still reads."""
    import cupy as cp
    path, rows = table_and_rows
    with gg.open_table(path, config=gg.Config(platform="unified")) as t:
        a = t.read_rows(cp.arange(0, 100), "direct")
        b = t.read_rows(cp.arange(100, 200), "direct")
        np.testing.assert_array_equal(cp.asnumpy(a), rows[:100])
        np.testing.assert_array_equal(cp.asnumpy(b), rows[100:200])


def test_auto_reports_the_choice(table_and_rows):
    from gds_gather.backends import resolve_device
    name, mode, why = resolve_device("auto", gg.Config())
    assert name in ("direct", "gds") and why
    name, mode, why = resolve_device("auto", gg.Config(platform="unified"))
    assert (name, mode) == ("direct", "zero-copy")


from gds_gather.quants import supported_types  # noqa: E402

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
from gds_gather.pipeline import GpuPrefill
from gds_gather.prefill import RowMapper
from gds_gather.schedule import StagingCapacityError
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
    if pipe.capacity[0] is not None:            # a plan larger than the captured staging is refused
        pipe.capacity = [1, 1]
        try:
            pipe.run(tokens)
            print("NOT REFUSED")
        except StagingCapacityError as e:
            print("REFUSED", str(e)[:60])
        pipe.capacity = [None, None]
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
    from gds_gather.model import write_model
    path = write_model(tmp_path / "m.gguf", "qwen4exp", qtype="IQ4_NL", rows=30000, progress=False)
    res = subprocess.run([sys.executable, "-c", _INJECT, str(path), backend, platform, "1" if graph else "0"],
                         capture_output=True, text=True, timeout=240)
    out = res.stdout
    assert res.returncode == 0 and "DONE" in out, (out, res.stderr[-3000:])
    err = next(ln for ln in out.splitlines() if ln.startswith("ERR"))
    assert float(err.split()[1]) < 30.0
    assert "ubatch 3 of 6" in err and "released and drained" in err
    assert "OK 6 [0, 0]" in out
    if platform == "unified" or backend == "gds":     # captured staging: the size guard refuses, then runs again
        assert "REFUSED" in out and "AGAIN 6" in out
