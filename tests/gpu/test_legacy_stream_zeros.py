"""Device buffers are zeroed in the order of the stream that uses them, not on CUDA's legacy stream (issue 34).

On host.HostAccel the legacy stream (cupy's current stream, torch's default one) is a deferred stream of its own
(`null`), and `device_array` queues its memset on its stream as cupy does: a destination whose buffers were zeroed
there, then uploaded and used on a side stream, is wiped when the legacy stream runs (a GPU whose stream 0 is
busy does the same). Oracles: the host path (gguf's dequantizer) and the CPU pipeline."""
from __future__ import annotations

import numpy as np
import pytest

import gds_gather as gg
from gds_gather.gpu.host import HostAccel, HostArray

torch = pytest.importorskip("torch")
from gds_gather.model.synth import write_model  # noqa: E402
from gds_gather.prefill.pipeline import CpuPrefill, GpuPrefill  # noqa: E402
from gds_gather.prefill.run import RowMapper  # noqa: E402


pytestmark = pytest.mark.usefixtures("fresh_device_caches")


def _cfg(platform="discrete", budget=0):
    return gg.Config(platform=platform, accel="host", cache_bytes=budget, hot_rows=0)


def test_a_memset_runs_in_its_own_streams_order():
    """The model itself: zeros queued on the stream given (there: before the upload, so the upload survives), or
    on the legacy stream (there: after the side stream's upload, which it wipes when the legacy stream runs);
    `order` makes a stream's later work wait for another's."""
    a = HostAccel()
    s = a.stream()
    mine, legacy = a.device_array(3, np.int64, s), a.device_array(3, np.int64)
    for buf in (mine, legacy):
        a.upload(buf, np.array([7, 8, 9]), s)
    a.synchronize(s)
    assert mine.tolist() == legacy.tolist() == [7, 8, 9]
    a.synchronize(None)                              # the legacy stream's turn
    assert mine.tolist() == [7, 8, 9] and legacy.tolist() == [0, 0, 0]
    late = a.device_array(3, np.int64)               # queued on the legacy stream ...
    a.order(s)                                       # ... which s now waits for
    a.upload(late, np.array([1, 2, 3]), s)
    a.synchronize(s)
    a.synchronize(None)
    assert late.tolist() == [1, 2, 3]


def test_a_table_destination_built_for_a_side_stream_survives_the_legacy_stream(small_table):
    """Table's device destination is built during a gather on side stream s; the legacy stream runs in between
    (here the host waits for it); every later gather on s is still exact (a compact destination's row offsets are
    uploaded once: wiped, every row would be read at offset 0)."""
    with gg.open_table(small_table, config=_cfg()) as t:
        a = t.accel
        s = a.stream()
        rng = np.random.default_rng(0)
        for k in range(3):
            ids = rng.integers(0, t.n_rows, (30, 4))
            got = t.gather(ids.view(HostArray), "direct", stream=s)
            a.synchronize(s)
            np.testing.assert_array_equal(np.asarray(got), t.gather(ids))
            a.synchronize(None)


@pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager"])
def test_a_prefill_s_destination_survives_the_legacy_stream(tmp_path, graph):
    """GpuPrefill (the copy destination, whose compact offsets are uploaded by the first step on the prefill's
    stream) run twice with the legacy stream run in between: both runs give the CPU pipeline's rows."""
    path = write_model(tmp_path / "g.gguf", "gemma4-e2b", qtype="Q8_0", rows=600, progress=False)
    with gg.open_table(path, config=_cfg()) as t:
        m = RowMapper(t)
        a = HostAccel()
        p = GpuPrefill(t, m, backend="direct", ubatch=32, graph=graph, dtype="float32", trunk="none", accel=a)
        try:
            assert p.dest.name == "copy"
            for seed in range(2):
                tok = np.random.default_rng(seed).integers(1, min(m.n_vocab, t.n_rows), 70)
                got = p.run(tok, collect=True)["outputs"]
                want = CpuPrefill(t, m, backend="direct", ubatch=32, trunk="none").run(tok, collect=True)["outputs"]
                assert len(got) == len(want) == 3
                for (rows, _), (rows0, _) in zip(got, want):
                    n = rows0.shape[0] // m.rows_per_token
                    w = (rows0.view(n, m.n_layer, m.per_layer) * m.row_scale).permute(1, 0, 2).contiguous()
                    assert torch.equal(rows, w)
                a.synchronize(None)
        finally:
            p.close()


def test_the_resident_backend_keeps_the_whole_table_in_device_memory(small_table):
    """backend="resident" on Table's device path is the prefill's Resident destination (no reader, no I/O per
    gather): rows exact, read_rows exact."""
    with gg.open_table(small_table, config=_cfg()) as t:
        a, s = t.accel, t.accel.stream()
        ids = np.random.default_rng(1).integers(0, t.n_rows, (25, 3))
        got = t.gather(ids.view(HostArray), "resident", stream=s)
        raw = t.read_rows(ids.view(HostArray), "resident", stream=s)
        a.synchronize(s)
        np.testing.assert_array_equal(np.asarray(got), t.gather(ids))
        np.testing.assert_array_equal(np.asarray(raw), t.read_rows(ids))
        (d,) = t.readers()[1]
        assert d.name == "resident" and d.readers == [] and t.device_choice("resident")[:2] == ("resident",
                                                                                                 "resident")
