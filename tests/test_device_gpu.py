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
