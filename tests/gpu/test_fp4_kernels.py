"""The NVFP4 kernels (NVIDIA ModelOpt's layout: packed E2M1 rows, F8_E4M3 scales per 16 elements, a float32 global
scale) against an oracle written here from the formats' definitions, independent of torch and of gds_gather's own
decoders: each nibble decoded with math.ldexp from its sign, exponent and mantissa bits (the first element of a byte
in its low nibble, as vLLM's break_fp4_bytes), each E4M3 scale byte from its bits (test_fp8_kernels.fp8_value), and
the value computed in vLLM's order (dequantize_to_dtype): e2m1 * (scale * global), two numpy float32 products, then
the output rounding (float16 by numpy's cast, bfloat16 rounded to nearest even on the bits: test_fp8_kernels.rounded).

The host build (kernels/host_check.cu, and its HIP multiply path) is checked on every machine; the `gpu` tests run
the same cases through gather_rows on a GPU (NaN compared as NaN: mul.rn and the conversion instructions write a
canonical NaN).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from gds_gather.errors import RowWidthError, UnsupportedTypeError
from gds_gather.formats import quants
from gds_gather.gpu import dequant as dg
from gds_gather.gpu import host_kernels as hk
from gds_gather.gpu.host import HostAccel, HostArray, numpy_view

from .test_fp8_kernels import (DevArray, assert_same, fp8_value, host_launches, laid_out, rounded, scale_bytes,
                               scale_values, with_output_scale)

DTYPES = ("float32", "float16", "bfloat16")
TINY = np.finfo(np.float32).tiny
# Global scales: 1 (every value exact in float16 and bfloat16), a power of two, ModelOpt's usual 1 / (6 * 448)
# (amax / (6 * 448) with amax = 1), 0.1 and 3 (inexact products), the smallest normal and a subnormal (subnormal
# scale products and values), and one large enough to overflow to infinity.
SMULS = (1.0, 2.0**-7, 1 / 2688, 0.1, 3.0, 2.0**-126, 1e-40, 1e38)
# (row_elems, sblock, n_layer): NVFP4's 16-element blocks flat, per layer with power-of-two (128) and other (40)
# segments; 32- and 8-element blocks, a block that does not line up with the 8-element items (12) or is not a power
# of two (24), and one scale per row (160).
GEOMETRIES = ((160, 16, None), (256, 16, 2), (160, 16, 4), (256, 32, None), (160, 8, None), (160, 12, None),
              (168, 24, 7), (160, 160, None))


# ---- the oracle ------------------------------------------------------------------------------------------------
def e2m1_value(n: int) -> float:
    """The value of nibble n (OCP MX FP4 E2M1): bit 3 the sign, bits 2..1 the exponent (bias 1), bit 0 the mantissa;
    exponent 0 is subnormal (m * 2^-1)."""
    e, m = (n >> 1) & 3, n & 1
    mag = math.ldexp(m, -1) if e == 0 else math.ldexp(2 + m, e - 2)
    return math.copysign(mag, -1.0 if n & 8 else 1.0)


PAIRS = np.array([[e2m1_value(b & 15), e2m1_value(b >> 4)] for b in range(256)], np.float32)   # [byte, element]
E4M3 = np.array([fp8_value("F8_E4M3", b) for b in range(256)], np.float64).astype(np.float32)


def elements(packed: np.ndarray) -> np.ndarray:
    """uint8 [rows, width / 2] -> float32 [rows, width], the low nibble first."""
    return PAIRS[packed].reshape(packed.shape[0], -1)


def nvfp4(values: np.ndarray, scales: np.ndarray, sblock: int, smul) -> np.ndarray:
    """vLLM's order: scale * global first (one float32 product), then the element times that."""
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        s = scales * np.float32(smul)
        return values * s[:, np.arange(values.shape[1]) // sblock]


def place(rows: np.ndarray, rng, gap: int = 40):
    """Unique rows (uint8 [U, nbytes]) at random byte offsets with gaps: (staging, offsets)."""
    nbytes = rows.shape[1]
    starts = np.cumsum(rng.integers(0, gap, rows.shape[0])) + np.arange(rows.shape[0]) * nbytes
    staging = np.zeros(int(starts[-1]) + nbytes + 3, np.uint8)
    staging[starts[:, None] + np.arange(nbytes)] = rows
    return staging, starts.astype(np.int64)


# ---- cases -------------------------------------------------------------------------------------------------------
def every_pair_case():
    """Every (packed byte, E4M3 scale byte) pair: 256 rows of 512 elements (256 bytes, 32 scales of 16 elements);
    block b of row r holds the bytes 8b..8b+7 (in a per-row order) and scale byte (r + b) % 256, so each scale byte
    meets every packed byte. Returns (staging, offsets, ids, inverse), (sstaging, soffsets), elements, scales."""
    rng = np.random.default_rng(1003)
    n_rows, nb = 256, 32
    packed = np.stack([(8 * np.arange(nb)[:, None] + rng.permuted(np.tile(np.arange(8), (nb, 1)), axis=1)).ravel()
                       for _ in range(n_rows)]).astype(np.uint8)
    sraw = ((np.arange(n_rows)[:, None] + np.arange(nb)) % 256).astype(np.uint8)
    pairs = {(int(d), int(s)) for d, s in zip(packed.ravel(), np.repeat(sraw, 8, axis=1).ravel())}
    assert len(pairs) == 65536
    ids = np.concatenate([rng.permutation(n_rows), rng.integers(0, n_rows, 9)])
    uniq, inv = np.unique(ids, return_inverse=True)
    staging, offsets = place(packed[uniq], rng)
    sstaging, soffsets = place(sraw[uniq], rng, gap=5)
    return (staging, offsets, ids, inv), (sstaging, soffsets), elements(packed[ids]), E4M3[sraw[ids]]


def scaled_case(width: int, sblock: int, seed: int, skind: str = "F8_E4M3", smul=1.0, share: int = 8,
                n_rows: int = 50):
    """Random packed rows with one scale row per `share` rows (2-D blocks: soffsets repeat): ((staging, offsets,
    inverse), BlockScales of numpy arrays, the oracle's float32 [N, width] before any output scale)."""
    rng = np.random.default_rng(seed)
    packed = rng.integers(0, 256, (n_rows, width // 2), dtype=np.uint8)
    ids = rng.integers(0, n_rows, 45)
    uniq, inv = np.unique(ids, return_inverse=True)
    staging, offsets = place(packed[uniq], rng)
    raw = scale_bytes(skind, (-(-n_rows // share), -(-width // sblock)), rng)   # subnormal, zero, NaN among them
    svals = scale_values(skind, raw)
    sstaging = np.concatenate([np.zeros(1, np.uint8), raw.reshape(-1)])      # scale rows at odd addresses
    soffsets = (1 + (uniq // share) * raw.shape[1]).astype(np.int64)
    f32 = nvfp4(elements(packed[uniq]), svals[uniq // share], sblock, smul)
    return (staging, offsets, inv), dg.BlockScales(sstaging, soffsets, skind, sblock, smul), f32[inv]


# ---- the oracle and the format ---------------------------------------------------------------------------------
def test_the_oracle_knows_the_formats():
    """E2M1's published magnitudes by code 0..7 and its signed codes; the low nibble is the first element; the
    E4M3 scale's max 448 and smallest subnormal 2^-9."""
    assert [e2m1_value(n) for n in range(8)] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert [e2m1_value(n) for n in range(8, 16)] == [-0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert math.copysign(1.0, e2m1_value(8)) == -1.0
    assert PAIRS[0x2F].tolist() == [-6.0, 1.0] and PAIRS[0x71].tolist() == [0.5, 6.0]
    assert E4M3[0x7E] == 448 and E4M3[0x01] == 2.0**-9 and np.isnan(E4M3[[0x7F, 0xFF]]).all()


def test_fp4_geometry_in_the_source(lib):
    assert hk.host_geometry("F4_E2M1") == quants.block_geometry("F4_E2M1") == (8, 4)
    assert int(quants.qtype_of("F4_E2M1")) == 1003
    assert quants.RowType.F4_E2M1 in dg.SCALED_TYPES and quants.RowType.F8_E4M3 in dg.SCALE_TYPES


@pytest.mark.parametrize("soft", (False, True))
def test_every_byte_decodes_exactly(lib, soft):
    """All 256 packed bytes (two elements each, the low nibble first), -0 kept; the host build and its HIP path."""
    every = np.arange(256, dtype=np.uint8).reshape(64, 4)
    got = hk.host_dequantize(every, "F4_E2M1", soft_mul=soft)
    assert got.shape == (64, 8)
    assert_same(got.reshape(-1), PAIRS.reshape(-1), "float32", what="e2m1")
    assert got.view(np.uint32).reshape(-1)[[1, 2 * 0x80 + 1]].tolist() == [0x00000000, 0x80000000]
    staging, offsets = np.arange(256, dtype=np.uint8), np.array([0, 128], np.int64)     # unscaled: two rows
    for dtype in DTYPES:
        got = hk.host_gather(staging, offsets, np.array([1, 0, 1]), "F4_E2M1", 256, dtype=dtype, soft_mul=soft)
        want = rounded(PAIRS.reshape(2, 256)[[1, 0, 1]], dtype)
        assert_same(got, want, dtype, what=dtype)
        if dtype == "float16":                             # every E2M1 value is a float16
            exact = np.array([e2m1_value(n) for n in range(16)])[np.stack([staging & 15, staging >> 4], 1)]
            np.testing.assert_array_equal(got.astype(np.float64), exact.reshape(2, 256)[[1, 0, 1]])


# ---- every packed byte x every scale byte x global scales ---------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_byte_with_every_scale_byte(lib, dtype):
    """Every (packed byte, E4M3 scale byte) pair, subnormal scales and NaN among them, under every global scale;
    int32 / int64 ids, flat and per layer, with and without an output scale, the host build and its HIP multiply
    path: the oracle's bits. With global scale 1 every value is e2m1 x e4m3 exactly, in float16 and bfloat16 too."""
    (staging, offsets, ids, inv), (sst, soffs), vals, svals = every_pair_case()
    subnormal = other_order = 0
    for smul in SMULS:
        f32 = nvfp4(vals, svals, 16, smul)
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            swapped = (vals * svals[:, np.arange(512) // 16]) * np.float32(smul)
        other_order += int((f32.view(np.uint32) != swapped.view(np.uint32)).sum())
        subnormal += int(((f32 != 0) & (np.abs(f32) < TINY)).sum())
        bs = dg.BlockScales(sst, soffs, "F8_E4M3", 16, smul)
        for n_layer in (None, 4):     # (test_scaled_geometries_exact: segments that are not powers of two)
            layout = "flat" if n_layer is None else "per_layer"
            for idx in (np.int32, np.int64):
                for scale in (None, 0.1):
                    want = laid_out(rounded(with_output_scale(f32, scale), dtype), ids.shape, n_layer)
                    for soft in (False, True):
                        got = hk.host_gather(staging, offsets, inv.astype(idx), "F4_E2M1", 512, dtype=dtype,
                                             scale=scale, layout=layout, n_layer=n_layer, block_scales=bs,
                                             soft_mul=soft)
                        assert_same(got, want, dtype, nan_sign=False,
                                    what=f"smul={smul} {layout} {idx.__name__} scale={scale} soft={soft}")
                        if smul == 1.0 and scale is None and n_layer is None and dtype != "float32":
                            exact = vals.astype(np.float64) * svals[:, np.arange(512) // 16]
                            wide = (got.astype(np.float64) if dtype == "float16" else
                                    (got.astype(np.uint32) << 16).view(np.float32).astype(np.float64))
                            finite = ~np.isnan(exact)
                            np.testing.assert_array_equal(wide[finite], exact[finite])
    assert subnormal > 1000 and other_order > 1000      # the cases tell the order of the products apart


# ---- every geometry and scale type -------------------------------------------------------------------------------
@pytest.mark.parametrize("skind", ("F8_E4M3", "F32", "BF16", "F8_E8M0"))
def test_scaled_geometries_exact(lib, skind):
    """Blocks of 16, 32, 8, 12, 24 and a whole row, per-layer segments, shared scale rows, scales of every type,
    global scales 1 and 1 / 2688: the oracle's bits for every output dtype and index type."""
    for k, (width, sblock, n_layer) in enumerate(GEOMETRIES):
        layout = "flat" if n_layer is None else "per_layer"
        for smul in (1.0, 1 / 2688):
            (staging, offsets, inv), bs, f32 = scaled_case(width, sblock, seed=10 * k + len(skind), skind=skind,
                                                           smul=smul)
            for idx in (np.int32, np.int64):
                for dtype in DTYPES:
                    want = laid_out(rounded(with_output_scale(f32, 16.0), dtype), inv.shape, n_layer)
                    for soft in (False, True):
                        got = hk.host_gather(staging, offsets, inv.astype(idx), "F4_E2M1", width, dtype=dtype,
                                             scale=16.0, layout=layout, n_layer=n_layer, block_scales=bs,
                                             soft_mul=soft)
                        assert_same(got, want, dtype, nan_sign=False,
                                    what=f"{skind} w={width} sblock={sblock} smul={smul} {idx.__name__} {dtype}")


def test_smul_one_is_the_four_field_gather(lib):
    """smul = 1 changes no value: a 4-tuple, a 5-tuple with 1.0 and BlockScales without smul give the same bits,
    for float8 rows with each scale type (subnormal and NaN scales among them)."""
    from .test_fp8_kernels import scaled_case as fp8_case
    for skind in ("F32", "BF16", "F8_E8M0", "F8_E4M3"):
        (staging, offsets, inv), bs, f32 = fp8_case("F8_E5M2", skind, 160, 12, seed=len(skind))
        fields = (bs.sstaging, bs.soffsets, bs.stype, bs.sblock)
        four = hk.host_gather(staging, offsets, inv, "F8_E5M2", 160, block_scales=fields)
        five = hk.host_gather(staging, offsets, inv, "F8_E5M2", 160, block_scales=(*fields, 1.0))
        assert bs.smul == 1.0
        np.testing.assert_array_equal(four.view(np.uint32), five.view(np.uint32))
        assert_same(four, f32, "float32", nan_sign=False, what=skind)


def test_reference_gather_is_the_oracle(lib):
    """host_kernels.reference_gather (HostAccel's kernel without a C++ compiler) with E4M3 scales and smul."""
    (staging, offsets, inv), bs, f32 = scaled_case(160, 16, seed=5, smul=1 / 2688)
    for dtype in DTYPES:
        got = hk.reference_gather(staging, offsets, inv, "F4_E2M1", 160, dtype=dtype, scale=16.0, block_scales=bs)
        assert_same(got, rounded(with_output_scale(f32, 16.0), dtype), dtype, nan_sign=False, what=dtype)


def test_host_accel_gathers_nvfp4_tables():
    """HostAccel.gather with NVFP4 scales (BlockScales of HostArrays, or a 5-tuple of torch CPU tensors): queued on
    its stream, run at the synchronize, equal to the oracle."""
    torch = pytest.importorskip("torch")
    (staging, offsets, inv), bs, f32 = scaled_case(256, 16, seed=8, smul=0.1)
    a = HostAccel()
    s = a.stream()
    want = laid_out(rounded(f32, "bfloat16"), inv.shape, 2)
    dev = lambda x: np.asarray(x).view(HostArray)       # noqa: E731
    for conv, scales in ((dev, dg.BlockScales(dev(bs.sstaging), dev(bs.soffsets), "F8_E4M3", 16, 0.1)),
                         (torch.from_numpy, (torch.from_numpy(bs.sstaging), torch.from_numpy(bs.soffsets), 1000, 16,
                                             np.float32(0.1)))):
        out = a.gather(conv(staging), conv(offsets), conv(inv.astype(np.int32)), quants.RowType.F4_E2M1, 256,
                       dtype="bfloat16", stream=s, layout="per_layer", n_layer=2, block_scales=scales)
        assert not s.query()                               # queued, not run
        a.synchronize(s)
        assert_same(numpy_view(out), want, "bfloat16", nan_sign=False)


@pytest.mark.parametrize("change,exc,match", [
    (dict(smul="0.5"), TypeError, "block_scales.smul must be a real number, got '0.5'"),
    (dict(smul=None), TypeError, "smul must be a real number"),
    (dict(row_elems=36), RowWidthError, "not a positive multiple of the F4_E2M1 block size 8"),
    (dict(stype="F8_E5M2"), UnsupportedTypeError, "block scales must be F32, BF16, F8_E8M0, F8_E4M3, got F8_E5M2"),
])
def test_nvfp4_arguments_are_checked(change, exc, match):
    """HostAccel.gather (check_launch, as gather_rows) refuses a bad smul, width or scale type before queueing."""
    args = dict(row_elems=64, stype="F8_E4M3", smul=1.0)
    args.update(change)
    a = HostAccel()
    bs = (np.zeros(64, np.uint8), np.zeros(4, np.int64), args["stype"], 16, args["smul"])
    with pytest.raises(exc, match=match):
        a.gather(np.zeros(4 * 32, np.uint8), np.arange(4, dtype=np.int64) * 32, np.array([0, 3, 1]), "F4_E2M1",
                 args["row_elems"], dtype="float32", stream=None, block_scales=bs)
    assert a.null.query()


def test_kernel_names_of_the_nvfp4_kernels():
    assert dg.kernel_name("F4_E2M1", "bfloat16", "int32", "F8_E4M3") == "gg_gather_scaled<1003, 1000, 2, int>"
    assert dg.kernel_name("f8_e5m2", "float16", np.int64, 1000) == "gg_gather_scaled<1001, 1000, 1, long long>"
    assert dg.kernel_name("F4_E2M1") == "gg_gather<1003, 0, long long>"
    names = dg.kernel_names("F4_E2M1")
    assert len(set(names)) == 30 and sum("gg_gather_scaled<1003, 1000," in n for n in names) == 6


def test_gather_rows_passes_smul(lib, monkeypatch):
    """gather_rows' scaled launch ends with smul as a float32 (rounded from the float given), after sblock; run here
    through the host build, equal to the oracle."""
    launches = host_launches(lib, monkeypatch)
    (staging, offsets, inv), bs, f32 = scaled_case(160, 16, seed=3, smul=0.1)
    scales = dg.BlockScales(DevArray(bs.sstaging), DevArray(bs.soffsets), "F8_E4M3", 16, 0.1)
    for dtype in DTYPES:
        got = dg.gather_rows(DevArray(staging), DevArray(offsets), DevArray(inv), "F4_E2M1", 160, dtype=dtype,
                             stream=77, block_scales=scales)
        assert_same(got.a, rounded(f32, dtype), dtype, nan_sign=False, what=dtype)
    assert launches == [(1003, 1000, d, "int64", np.float32(0.1)) for d in DTYPES]


# ---- on a GPU --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_every_byte_with_every_scale_byte(cp, dtype):
    """The device kernels over every (packed byte, scale byte) pair and every global scale (subnormal products kept
    despite CuPy's -ftz=true): the oracle's bits."""
    (staging, offsets, ids, inv), (sst, soffs), vals, svals = every_pair_case()
    d_st, d_off, d_sst, d_soffs = (cp.asarray(x) for x in (staging, offsets, sst, soffs))
    for smul in SMULS:
        f32 = nvfp4(vals, svals, 16, smul)
        bs = dg.BlockScales(d_sst, d_soffs, "F8_E4M3", 16, smul)
        for n_layer in (None, 4):     # (test_scaled_geometries_exact: segments that are not powers of two)
            layout = "flat" if n_layer is None else "per_layer"
            for idx in (np.int32, np.int64):
                for scale in (None, 0.1):
                    got = dg.gather_rows(d_st, d_off, cp.asarray(inv.astype(idx)), "F4_E2M1", 512, dtype=dtype,
                                         scale=scale, layout=layout, n_layer=n_layer, block_scales=bs)
                    want = laid_out(rounded(with_output_scale(f32, scale), dtype), ids.shape, n_layer)
                    assert_same(cp.asnumpy(got), want, dtype, nan_sign=False,
                                what=f"smul={smul} {layout} {idx.__name__} scale={scale}")


@pytest.mark.gpu
@pytest.mark.parametrize("skind", ("F8_E4M3", "F32", "BF16", "F8_E8M0"))
def test_gpu_scaled_geometries_exact(cp, skind):
    for k, (width, sblock, n_layer) in enumerate(GEOMETRIES):
        layout = "flat" if n_layer is None else "per_layer"
        for smul in (1.0, 1 / 2688):
            (staging, offsets, inv), bs, f32 = scaled_case(width, sblock, seed=10 * k + len(skind), skind=skind,
                                                           smul=smul)
            scales = dg.BlockScales(cp.asarray(bs.sstaging), cp.asarray(bs.soffsets), skind, sblock, smul)
            for idx in (np.int32, np.int64):
                for dtype in DTYPES:
                    got = dg.gather_rows(cp.asarray(staging), cp.asarray(offsets), cp.asarray(inv.astype(idx)),
                                         "F4_E2M1", width, dtype=dtype, scale=16.0, layout=layout, n_layer=n_layer,
                                         block_scales=scales)
                    want = laid_out(rounded(with_output_scale(f32, 16.0), dtype), inv.shape, n_layer)
                    assert_same(cp.asnumpy(got), want, dtype, nan_sign=False,
                                what=f"{skind} w={width} sblock={sblock} smul={smul} {idx.__name__} {dtype}")


@pytest.mark.gpu
def test_gpu_nvfp4_torch_tensors(cp):
    """torch CUDA tensors in (a 5-tuple of scales), a torch bfloat16 tensor out, on torch's current stream."""
    torch = pytest.importorskip("torch")
    (staging, offsets, inv), bs, f32 = scaled_case(256, 16, seed=21, smul=1 / 2688)
    t = [torch.from_numpy(x).cuda() for x in (staging, offsets, inv, bs.sstaging, bs.soffsets)]
    got = dg.gather_rows(t[0], t[1], t[2], "F4_E2M1", 256, dtype="bfloat16", layout="per_layer", n_layer=2,
                         block_scales=(t[3], t[4], "F8_E4M3", 16, 1 / 2688))
    assert got.dtype == torch.bfloat16
    torch.cuda.synchronize()
    bits = got.cpu().view(torch.int16).numpy().view(np.uint16)
    assert_same(bits, laid_out(rounded(f32, "bfloat16"), inv.shape, 2), "bfloat16", nan_sign=False)
