"""host.HostAccel's primitives against independent oracles: the kernel against gguf's dequantizer
(host_kernels.reference_gather), the copy kernels against numpy, and its streams' deferred order."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import gds_gather as gg
from gds_gather.gpu import accel
from gds_gather.gpu import dequant as dequant_gpu
from gds_gather.gpu import host_kernels
from gds_gather.gpu.host import HostAccel, HostArray, numpy_view
from gds_gather.errors import BackendError, StreamOrderError

torch = pytest.importorskip("torch")


def _rows(ggufs, qt, n, width):
    return ggufs.rows(qt, n, width, seed=3)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["flat", "per_layer"])
def test_the_kernel_is_gguf_s_dequantizer_and_runs_only_when_its_stream_does(ggufs, dtype, layout):
    a = HostAccel()
    raw = _rows(ggufs, Q.Q4_K, 40, 512)
    staging = raw.reshape(-1).view(HostArray)
    offs = (np.arange(40, dtype=np.int64) * raw.shape[1]).view(HostArray)
    inv = np.random.default_rng(0).integers(0, 40, (6, 5)).astype(np.int32)
    kw = dict(layout=layout, n_layer=4, scale=16.0) if layout == "per_layer" else {}
    want = host_kernels.reference_gather(raw.reshape(-1), offs.view(np.ndarray), inv, Q.Q4_K, 512, dtype=dtype,
                                         **kw)
    s = a.stream()
    for ids in (inv.view(HostArray), torch.from_numpy(inv)):
        out = a.gather(staging, offs if arrays_kind(ids) != "torch" else torch.from_numpy(offs.view(np.ndarray)),
                       ids, Q.Q4_K, 512, dtype=dtype, stream=s, **kw)
        assert not s.query()                       # queued, not run
        a.synchronize(s)
        got = np.asarray(numpy_view(out))
        assert got.shape == want.shape == dequant_gpu.output_shape(inv.shape, Q.Q4_K, 512, layout, 4)
        assert np.array_equal(got.view(np.uint8), np.ascontiguousarray(want).view(np.uint8))


def arrays_kind(x):
    from gds_gather.gpu import arrays
    return arrays.kind(x)


@pytest.mark.parametrize("bad,match,exc", [
    (dict(inverse=np.zeros(3, np.float32)), "inverse must be int32 or int64", TypeError),
    (dict(staging=np.zeros(64, np.int64)), "staging must hold bytes", TypeError),
    (dict(offsets=np.zeros((1, 1), np.int64)), "1-D int64", TypeError),
    (dict(staging=[0] * 64), "host array", TypeError),
    (dict(offsets=np.zeros(4, np.int64)[::2]), "C-contiguous", ValueError),
    (dict(out=np.zeros((3, 10), np.float32)), "out must be float32 of shape", ValueError),
    (dict(row_elems=100), "not a positive multiple", gg.errors.RowWidthError),
])
def test_the_kernel_refuses_what_gather_rows_refuses(ggufs, bad, match, exc):
    a = HostAccel()
    raw = _rows(ggufs, Q.Q8_0, 4, 64)
    args = dict(staging=raw.reshape(-1).view(HostArray), offsets=(np.arange(4, dtype=np.int64) * raw.shape[1]),
                inverse=np.array([0, 3, 1], np.int32), row_elems=64, out=None)
    args.update(bad)
    with pytest.raises(exc, match=match):
        a.gather(args["staging"], args["offsets"], args["inverse"], Q.Q8_0, args["row_elems"], dtype="float32",
                 stream=None, out=args["out"])
    assert a.null.query()                            # nothing was queued


def test_copy_kernels_match_numpy_and_refuse_counts_beyond_their_launch():
    a = HostAccel()
    pool = np.zeros(256, np.uint8)
    fresh = np.arange(1, 33, dtype=np.uint8)
    ctl = np.array([3, 2], np.int64)                              # 3 words; 2 admitted rows of 8 B
    adm = np.array([64, 72, 128, 200], np.int64)                 # pool[64:72] -> [128:136], [72:80] -> [200:208]
    s = a.stream()
    a.copy_words(fresh.ctypes.data, pool.ctypes.data + 64, ctl.ctypes.data, 4, s)
    a.copy_rows(pool.ctypes.data, adm.ctypes.data, adm.ctypes.data + 16, ctl.ctypes.data, 8, 2, s)
    assert not pool.any()
    a.synchronize(s)
    want = np.zeros(256, np.uint8)
    want[64:88] = fresh[:24]
    want[128:136], want[200:208] = fresh[:8], fresh[8:16]
    np.testing.assert_array_equal(pool, want)
    a.copy_words(fresh.ctypes.data, pool.ctypes.data, ctl.ctypes.data, 2, s)     # 3 words, launched for 2
    with pytest.raises(StreamOrderError, match="3 words"):
        a.synchronize(s)
    ctl[1] = 0
    a.copy_rows(pool.ctypes.data, adm.ctypes.data, adm.ctypes.data + 16, ctl.ctypes.data, 8, 2, s)
    a.synchronize(s)                                  # no rows: nothing to do


def test_streams_events_flags_and_graphs_run_in_queue_order():
    a = HostAccel()
    s, log = a.stream(), []
    a.defer(s, lambda: log.append(1))
    e = a.event(timing=True)
    e.record(s)
    end = a.event(timing=True)
    a.defer(s, lambda: log.append(2))
    end.record(s)
    assert not e.query() and log == []
    e.synchronize()                                   # runs the queue up to the event only
    assert log == [1] and e.query() and not end.query()
    with pytest.raises(RuntimeError):
        e.elapsed_time(end)
    a.synchronize(s)
    assert log == [1, 2] and e.elapsed_time(end) >= 0
    f = a.flags(2)
    f.wait(s, 0, 1)
    f.write(s, 0, 0)
    f.set(0, 1)
    a.synchronize(s)
    assert f.host.tolist() == [0, 0]
    g, out = a.capture(s, lambda: (len(log),))
    assert out == [] and log == [1, 2]
    g.replay()
    with a.using(s):
        assert a.current() is s
    a.synchronize(s)
    assert out == [2] and a.replays == 1
    up = a.empty(8)
    a.upload(up.view(np.int64), np.array([7]), s)
    a.h2d(up, np.arange(4, dtype=np.uint8), 4, s, dst_offset=0)
    a.synchronize(s)
    assert up[:4].tolist() == [0, 1, 2, 3] and a.key(s) is s
    with pytest.raises(TypeError):
        a.current(0x1234)


def test_selection_is_explicit():
    assert accel.get("host").name == "host" and accel.get("cuda").name == "cuda"
    with pytest.raises(BackendError, match="unknown accelerator"):
        accel.get("tpu")
    with pytest.raises(ValueError, match="GDS_GATHER_ACCEL"):
        gg.Config(accel="tpu")
    assert gg.Config.from_env({"GDS_GATHER_ACCEL": "host"}).accel == "host"
    refused = HostAccel(refuse_waits=True)
    with pytest.raises(gg.errors.WaitValueRefused):
        refused.flags(2).probe(None)
    with pytest.raises(BackendError, match="cuFile"):
        HostAccel(gds=False).cufile("/dev/null", 1)
