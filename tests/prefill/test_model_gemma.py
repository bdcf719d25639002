"""Gemma per-layer inputs: torch (model/gemma.py per_layer_inputs) against the independent numpy reference.

Tolerance: the matmul and the mean of squares sum in a library-chosen order (BLAS blocking, pairwise sums), so
on random inputs torch and numpy agree to |a - b| <= 1e-6 * max|b| (+ 1e-6 relative); measured ~4e-7 * max|b|.
Elementwise relative error is not bounded (proj + rows cancels near zero). Where every sum is exact (small
integers, power-of-two scales) the remaining ops are IEEE-rounded in the same order and the results are bitwise
equal, as test_exact_where_the_order_matches checks (this needs the correctly rounded sqrt of gemma.rms_scale:
torch's vectorized CPU float32 sqrt differs from numpy's in the last bit for ~17% of inputs).
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gds_gather.model.gemma import gemma_row_ids, per_layer_inputs, per_layer_inputs_np, ple_scales  # noqa: E402

RTOL = 1e-6   # relative to the largest output magnitude (see above)


def inputs(T, L, P, D, seed=0, scale=0.1):
    rng = np.random.default_rng(seed)
    rows = (rng.standard_normal((T, L * P)) * scale).astype(np.float32)
    h0 = rng.standard_normal((T, D)).astype(np.float32)                  # an embedding x sqrt(n_embd): O(1)
    w = (rng.standard_normal((L * P, D)) / np.sqrt(D)).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal(P)).astype(np.float32)
    return rows, h0, w, nw


def torch_pli(rows, h0, w, nw, L, P, **kw):
    t = torch.from_numpy
    return per_layer_inputs(t(rows), t(h0), t(w), t(nw), n_layer=L, n_embd_per_layer=P, **kw)


def assert_close_to_ref(a, b):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL * float(np.abs(b).max()))


@pytest.mark.parametrize("T,L,P,D", [(1, 1, 256, 64), (7, 3, 256, 64), (33, 5, 256, 384), (16, 35, 256, 1536),
                                     (9, 4, 32, 96)])
def test_matches_numpy_reference(T, L, P, D):
    rows, h0, w, nw = inputs(T, L, P, D, seed=T + L)
    a = torch_pli(rows, h0, w, nw, L, P)
    assert a.shape == (L, T, P) and a.dtype == torch.float32 and a.is_contiguous()
    b = per_layer_inputs_np(rows, h0, w, nw, n_layer=L, n_embd_per_layer=P)
    assert b.shape == (L, T, P) and b.dtype == np.float32
    assert_close_to_ref(a.numpy(), b)


def test_exact_where_the_order_matches():
    # values in {-1, 0, 1}, n_embd 64 (1/sqrt(64) = 1/8), P 256: every dot product, square and mean is exact, so
    # both sides do the same IEEE-rounded ops (sqrt, 1/x, *, +) in the same order: bitwise equal
    rng = np.random.default_rng(3)
    T, L, P, D = 11, 4, 256, 64
    h0 = rng.integers(-1, 2, (T, D)).astype(np.float32)
    w = rng.integers(-1, 2, (L * P, D)).astype(np.float32)
    rows = rng.standard_normal((T, L * P)).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal(P)).astype(np.float32)
    a = torch_pli(rows, h0, w, nw, L, P).numpy()
    b = per_layer_inputs_np(rows, h0, w, nw, n_layer=L, n_embd_per_layer=P)
    np.testing.assert_array_equal(a, b)


def test_prescaled_and_layer_major_rows_equal_the_unscaled_path():
    T, L, P, D = 10, 6, 256, 128
    rows, h0, w, nw = inputs(T, L, P, D, seed=5)
    ref = torch_pli(rows, h0, w, nw, L, P)
    scaled = rows * np.float32(16)                                    # x sqrt(256): exact
    layer_major = np.ascontiguousarray(rows.reshape(T, L, P).transpose(1, 0, 2))
    # rows_prescaled=None (the default) goes by the layout: 3-D [L, T, P] is the kernel's prescaled output
    for r, pre in ((scaled, True), (layer_major * np.float32(16), True), (layer_major * np.float32(16), None),
                   (layer_major, False), (rows, False)):
        assert torch.equal(torch_pli(r, h0, w, nw, L, P, rows_prescaled=pre), ref)
    with pytest.raises(ValueError, match="rows must be"):                 # token-major 3-D is not a layout
        torch_pli(rows.reshape(T, L, P), h0, w, nw, L, P)


def test_half_precision_rows_are_upcast_exactly():
    T, L, P, D = 5, 3, 256, 64
    rows, h0, w, nw = inputs(T, L, P, D, seed=6)
    r16 = rows.astype(np.float16)
    a = per_layer_inputs(torch.from_numpy(r16), torch.from_numpy(h0), torch.from_numpy(w), torch.from_numpy(nw),
                         n_layer=L, n_embd_per_layer=P)
    assert torch.equal(a, torch_pli(r16.astype(np.float32), h0, w, nw, L, P))
    rb = torch.from_numpy(rows).bfloat16()
    b = per_layer_inputs(rb, torch.from_numpy(h0), torch.from_numpy(w), torch.from_numpy(nw), n_layer=L,
                         n_embd_per_layer=P)
    assert torch.equal(b, torch_pli(rb.float().numpy(), h0, w, nw, L, P))


def test_layer_il_gets_its_slice_of_each_row():
    T, L, P, D = 4, 5, 256, 64
    # crafted rows: element (t, il*P + j) holds t*10000 + il*1000 + j (exact in float32)
    t_, il_, j_ = np.meshgrid(np.arange(T), np.arange(L), np.arange(P), indexing="ij")
    rows = (t_ * 10000 + il_ * 1000 + j_).reshape(T, L * P).astype(np.float32)
    zeros_h0, zeros_w = np.zeros((T, D), np.float32), np.zeros((L * P, D), np.float32)
    nw = np.ones(P, np.float32)
    out = torch_pli(rows, zeros_h0, zeros_w, nw, L, P).numpy()   # the projection is 0: out = rows*16/sqrt(2)
    row_scale, _, in_scale = ple_scales(D, P)
    for il in range(L):
        want = rows[:, il * P:(il + 1) * P] * np.float32(row_scale) * np.float32(in_scale)
        np.testing.assert_array_equal(out[il], want)
    # with a live projection, one element of one row moves exactly one output element
    rows2, h0, w, nw = inputs(T, L, P, D, seed=7)
    base = torch_pli(rows2, h0, w, nw, L, P).numpy()
    t, il, j = 2, 3, 17
    bumped = rows2.copy()
    bumped[t, il * P + j] += 1.0
    diff = torch_pli(bumped, h0, w, nw, L, P).numpy() != base
    assert diff.sum() == 1 and diff[il, t, j]


def test_scales_are_llama_float32_constants():
    row, proj, inp = ple_scales(1536, 256)
    assert row == 16.0
    assert proj == float(np.float32(1) / np.sqrt(np.float32(1536)))
    assert inp == float(np.float32(1) / np.sqrt(np.float32(2))) == float(np.float32(0.70710677))


def test_bf16_matmul_output_dtype_and_tolerance():
    T, L, P, D = 8, 3, 256, 256
    rows, h0, w, nw = inputs(T, L, P, D, seed=8)
    ref = torch_pli(rows, h0, w, nw, L, P)
    t = torch.from_numpy
    b = per_layer_inputs(t(rows), t(h0).bfloat16(), t(w).bfloat16(), t(nw), n_layer=L, n_embd_per_layer=P)
    assert b.dtype == torch.bfloat16 and b.shape == (L, T, P)
    assert float((b.float() - ref).norm() / ref.norm()) < 2e-2


def test_shape_errors():
    rows, h0, w, nw = inputs(4, 3, 256, 64)
    with pytest.raises(ValueError, match="rows must be"):
        torch_pli(rows[:, :-1].copy(), h0, w, nw, 3, 256)
    with pytest.raises(ValueError, match="proj_w"):
        torch_pli(rows, h0, w[:-1].copy(), nw, 3, 256)
    with pytest.raises(ValueError, match="norm_w"):
        torch_pli(rows, h0, w, nw[:-1].copy(), 3, 256)
    with pytest.raises(ValueError, match="h0"):
        torch_pli(rows, h0[None], w, nw, 3, 256)
    with pytest.raises(ValueError, match="rows must be"):
        torch_pli(rows[:3].copy(), h0, w, nw, 3, 256)


def test_gemma_row_ids():
    ids = gemma_row_ids([5, 0, 262143], n_rows=262144)
    assert ids.dtype == np.int64 and ids.tolist() == [5, 0, 262143]
    assert gemma_row_ids(np.array([7, 9, 3], np.int32), image_mask=[False, True, True]).tolist() == [7, 0, 0]
    assert gemma_row_ids([]).shape == (0,)
    with pytest.raises(ValueError, match="out of range"):
        gemma_row_ids([1, 262144], n_rows=262144)
    with pytest.raises(ValueError, match="negative"):
        gemma_row_ids([1, -1])
    with pytest.raises(ValueError, match="1-D"):
        gemma_row_ids([[1, 2]])
    with pytest.raises(ValueError, match="integers"):
        gemma_row_ids([1.5])
    with pytest.raises(ValueError, match="image_mask"):
        gemma_row_ids([1, 2], image_mask=[True])
