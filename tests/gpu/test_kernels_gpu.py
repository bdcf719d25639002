"""GPU: gather_rows equals gguf.quants exactly for every type x dtype x layout, with cupy arrays and torch tensors.

float32 output is compared bit for bit with gguf.quants.dequantize (the kernels are built with --fmad=false
--ftz=false and follow gguf's float32 operation order, so no ulp tolerance is needed); float16 / bfloat16
with numpy's astype(float16) / gguf's (= torch's) bfloat16 rounding of the same float32 values; the test data
hold no NaN, whose payload is the one thing the hardware conversions may write differently.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from gds_gather.gpu import dequant as dg
from gds_gather.gpu import host_kernels as hk
from gds_gather.model.synth import random_blocks
from gds_gather.planner import plan_rows
from gds_gather.formats.quants import supported_types

pytestmark = pytest.mark.gpu

Q = GGMLQuantizationType
TYPES = supported_types()
IDS = [t.name for t in TYPES]
DTYPES = ("float32", "float16", "bfloat16")


@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy


@pytest.fixture(scope="module")
def torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA on this machine")
    return torch


def window_staging(table: np.ndarray, plan, data_offset: int) -> np.ndarray:
    """Each aligned window of a file holding `table` at `data_offset`, back to back (an O_DIRECT read)."""
    flat = table.reshape(-1)
    out = np.zeros(int(plan.win_lengths.sum()), np.uint8)
    for off, length, at in zip(plan.win_offsets.tolist(), plan.win_lengths.tolist(), plan.win_staging.tolist()):
        lo, hi = max(off, data_offset), min(off + length, data_offset + flat.size)
        out[at + lo - off:at + hi - off] = flat[lo - data_offset:hi - data_offset]
    return out


def make_case(qtype, width, n_rows, id_shape, seed, data_offset=4096 * 5 + 37, align=4096):
    """(plan, [(staging, offsets) compact, (staging, offsets) windows]) for random valid rows and ids."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    rb = width // block * size
    table = random_blocks(qtype, n_rows * width // block, rng).reshape(n_rows, rb)
    ids = rng.integers(0, n_rows, id_shape)
    plan = plan_rows(ids, n_rows=n_rows, row_bytes=rb, data_offset=data_offset, align=align)
    return plan, [
        (np.ascontiguousarray(table[plan.unique_rows]).reshape(-1), np.arange(plan.n_unique, dtype=np.int64) * rb),
        (window_staging(table, plan, data_offset), plan.row_staging),
    ]


def layouts(qtype):
    """(width, n_layer, id shape): qwen-like flat [tokens, heads] ids, gemma-like per-layer [tokens] ids."""
    block = GGML_QUANT_SIZES[qtype][0]
    flat_w = 160 if 160 % block == 0 else (192 if block == 64 else 512)
    if block == 1:
        return [(7, None, (33, 3)), (flat_w, None, (50, 16)), (12, 3, (41,)), (768, 3, (70,))]
    return [(flat_w, None, (50, 16)), (768, 3, (70,))]


def as_bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint8)


def torch_to_numpy(t):
    import torch
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_gather_exact_cupy(qtype, cp):
    for k, (width, n_layer, id_shape) in enumerate(layouts(qtype)):
        plan, stagings = make_case(qtype, width, 300, id_shape, seed=int(qtype) * 10 + k)
        layout = "flat" if n_layer is None else "per_layer"
        for staging, offsets in stagings:
            d_st, d_off = cp.asarray(staging), cp.asarray(offsets)
            for idx in (np.int64, np.int32):
                inv = plan.inverse.astype(idx).reshape(id_shape)
                d_inv = cp.asarray(inv)
                for dtype in DTYPES:
                    for scale in (None, 16.0):
                        kw = dict(dtype=dtype, scale=scale, layout=layout, n_layer=n_layer)
                        got = dg.gather_rows(d_st, d_off, d_inv, qtype, width, **kw)
                        ref = hk.reference_gather(staging, offsets, inv, qtype, width, **kw)
                        assert isinstance(got, cp.ndarray) and got.shape == ref.shape
                        assert got.dtype == (np.uint16 if dtype == "bfloat16" else np.dtype(dtype))
                        np.testing.assert_array_equal(as_bits(cp.asnumpy(got)), as_bits(ref),
                                                      err_msg=f"{qtype.name} {width} idx={idx.__name__} {kw}")


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_gather_exact_torch(qtype, torch_cuda):
    torch = torch_cuda
    for k, (width, n_layer, id_shape) in enumerate(layouts(qtype)):
        plan, stagings = make_case(qtype, width, 300, id_shape, seed=int(qtype) * 10 + k + 5)
        layout = "flat" if n_layer is None else "per_layer"
        for staging, offsets in stagings:
            d_st = torch.from_numpy(staging).cuda()
            d_off = torch.from_numpy(offsets).cuda()
            for idx in (np.int64, np.int32):
                inv = plan.inverse.astype(idx).reshape(id_shape)
                d_inv = torch.from_numpy(inv).cuda()
                for dtype in DTYPES:
                    for scale in (None, 16.0):
                        kw = dict(dtype=dtype, scale=scale, layout=layout, n_layer=n_layer)
                        got = dg.gather_rows(d_st, d_off, d_inv, qtype, width, **kw)
                        ref = hk.reference_gather(staging, offsets, inv, qtype, width, **kw)
                        assert isinstance(got, torch.Tensor) and got.is_cuda
                        assert got.dtype == getattr(torch, dtype) and tuple(got.shape) == ref.shape
                        np.testing.assert_array_equal(as_bits(torch_to_numpy(got)), as_bits(ref),
                                                      err_msg=f"{qtype.name} {width} idx={idx.__name__} {kw}")


def test_matches_host_build(cp):
    """Device and host builds of the same source agree (where a host compiler exists)."""
    if not hk.host_compiler_available():
        pytest.skip("no host compiler")
    for qt in (Q.Q6_K, Q.IQ2_S, Q.NVFP4, Q.TQ1_0):
        plan, stagings = make_case(qt, 512, 100, (64,), seed=int(qt))
        staging, offsets = stagings[1]
        for dtype in DTYPES:
            got = dg.gather_rows(cp.asarray(staging), cp.asarray(offsets), cp.asarray(plan.inverse), qt, 512,
                                 dtype=dtype, scale=0.3, layout="per_layer", n_layer=2)
            host = hk.host_gather(staging, offsets, plan.inverse, qt, 512, dtype=dtype, scale=0.3,
                                  layout="per_layer", n_layer=2)
            np.testing.assert_array_equal(as_bits(cp.asnumpy(got)), as_bits(host))


@pytest.mark.parametrize("qtype,width,n_layer,n_ids", [
    (Q.IQ4_NL, 160, None, 2048 * 16),     # a qwen4exp ubatch: 2048 tokens x 16 heads of 90-byte rows
    (Q.Q5_K, 10752, 42, 512),             # gemma4-e4b rows, per-layer layout, x16
    (Q.F32, 7, None, 20000),              # short float rows: partial items, many rows per CTA
])
def test_large_gathers(cp, qtype, width, n_layer, n_ids):
    plan, stagings = make_case(qtype, width, 5000, (n_ids,), seed=11)
    staging, offsets = stagings[1]
    layout = "flat" if n_layer is None else "per_layer"
    scale = 16.0 if n_layer else None
    for dtype in ("float32", "bfloat16"):
        got = dg.gather_rows(cp.asarray(staging), cp.asarray(offsets), cp.asarray(plan.inverse), qtype, width,
                             dtype=dtype, scale=scale, layout=layout, n_layer=n_layer)
        ref = hk.reference_gather(staging, offsets, plan.inverse, qtype, width, dtype=dtype, scale=scale,
                                  layout=layout, n_layer=n_layer)
        np.testing.assert_array_equal(as_bits(cp.asnumpy(got)), as_bits(ref))


def test_out_argument_unaligned_and_reused(cp):
    """A caller's output buffer, also one not 16-byte aligned (scalar-store path), is filled in place."""
    qt, width = Q.Q8_0, 160
    plan, stagings = make_case(qt, width, 200, (37,), seed=3)
    staging, offsets = stagings[0]
    ref = hk.reference_gather(staging, offsets, plan.inverse, qt, width)
    buf = cp.zeros(37 * width + 1, cp.float32)
    out = buf[1:].reshape(37, width)                         # 4-byte aligned only
    got = dg.gather_rows(cp.asarray(staging), cp.asarray(offsets), cp.asarray(plan.inverse), qt, width, out=out)
    assert got is out
    np.testing.assert_array_equal(cp.asnumpy(out), ref)
    with pytest.raises(ValueError):
        dg.gather_rows(cp.asarray(staging), cp.asarray(offsets), cp.asarray(plan.inverse), qt, width,
                       out=cp.empty((37, width), cp.float16))


def test_streams(cp, torch_cuda):
    """Launches go to the given stream (cupy or torch) or to torch's current stream for torch inputs."""
    torch = torch_cuda
    qt, width = Q.IQ4_NL, 160
    plan, stagings = make_case(qt, width, 300, (512, 16), seed=4)
    staging, offsets = stagings[1]
    ref = hk.reference_gather(staging, offsets, plan.inverse.reshape(512, 16), qt, width, dtype="float16")
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        d_st, d_off, d_inv = cp.asarray(staging), cp.asarray(offsets), cp.asarray(plan.inverse.reshape(512, 16))
    got = dg.gather_rows(d_st, d_off, d_inv, qt, width, dtype="float16", stream=s)
    s.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(got), ref)
    ts = torch.cuda.Stream()
    t_st, t_off = torch.from_numpy(staging).cuda(), torch.from_numpy(offsets).cuda()
    t_inv = torch.from_numpy(plan.inverse.reshape(512, 16)).cuda()
    ts.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(ts):
        got_t = dg.gather_rows(t_st, t_off, t_inv, qt, width, dtype=torch.float16)
    ts.synchronize()
    np.testing.assert_array_equal(torch_to_numpy(got_t), ref)
    got_h = dg.gather_rows(t_st, t_off, t_inv, qt, width, dtype="float16", stream=ts.cuda_stream)
    ts.synchronize()
    np.testing.assert_array_equal(torch_to_numpy(got_h), ref)


def test_empty_ids(cp):
    got = dg.gather_rows(cp.zeros(90, cp.uint8), cp.zeros(1, cp.int64), cp.zeros((0, 16), cp.int64),
                         Q.IQ4_NL, 160)
    assert got.shape == (0, 16, 160)


def test_torch_graph_capture_replays(cp, torch_cuda):
    """gather_rows captured by torch.cuda.graph, on cupy.cuda.Stream.from_external(torch's capture stream),
    replays with new ids written into the captured inverse buffer."""
    torch = torch_cuda
    qt, width, n_rows, n_ids = Q.IQ4_NL, 160, 400, 256 * 16
    rng = np.random.default_rng(9)
    rows = random_blocks(qt, n_rows * width // 32, rng).reshape(n_rows, -1)
    rb = rows.shape[1]
    staging = torch.from_numpy(rows.reshape(-1)).cuda()                   # every row is a unique slot
    offsets = torch.arange(n_rows, dtype=torch.int64, device="cuda") * rb
    inv = torch.zeros(n_ids, dtype=torch.int64, device="cuda")
    out = torch.empty((n_ids, width), dtype=torch.bfloat16, device="cuda")
    dg.warmup(qt, dtypes=("bfloat16", "float32"), index_dtypes=("int64",))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                                         # warm-up launch off the capture
        dg.gather_rows(staging, offsets, inv, qt, width, out=out, dtype="bfloat16")
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cur = torch.cuda.current_stream()
        ext = cp.cuda.Stream.from_external(cur) if hasattr(cur, "__cuda_stream__") else cur
        dg.gather_rows(staging, offsets, inv, qt, width, out=out, dtype="bfloat16", stream=ext)
        out32 = dg.gather_rows(staging, offsets, inv, qt, width, scale=16.0)   # output from the graph pool
    for _ in range(3):
        ids = rng.integers(0, n_rows, n_ids)
        inv.copy_(torch.from_numpy(ids))
        graph.replay()
        torch.cuda.synchronize()
        flat_offsets = np.arange(n_rows, dtype=np.int64) * rb
        ref = hk.reference_gather(rows.reshape(-1), flat_offsets, ids, qt, width, dtype="bfloat16")
        np.testing.assert_array_equal(torch_to_numpy(out), ref)
        ref32 = hk.reference_gather(rows.reshape(-1), flat_offsets, ids, qt, width, scale=16.0)
        np.testing.assert_array_equal(torch_to_numpy(out32).view(np.uint32), ref32.view(np.uint32))


def test_float32_equals_gguf_directly(cp):
    """The float32 path against gguf.quants.dequantize itself, no reference helper in between."""
    for qt in TYPES:
        block, size = GGML_QUANT_SIZES[qt]
        blocks = random_blocks(qt, 64 * 8, np.random.default_rng(int(qt)))
        width = 8 * block
        rows = blocks.reshape(64, 8 * size)
        got = dg.gather_rows(cp.asarray(rows.reshape(-1)), cp.arange(64, dtype=cp.int64) * rows.shape[1],
                             cp.arange(63, -1, -1, dtype=cp.int32), qt, width)
        want = np.asarray(gq.dequantize(rows, qt), np.float32).reshape(64, width)[::-1]
        np.testing.assert_array_equal(cp.asnumpy(got).view(np.uint32), want.view(np.uint32), err_msg=qt.name)
