"""The float8 kernels (F8_E4M3, F8_E5M2, F8_E8M0 rows; E4M3/E5M2 rows with F32, BF16 or E8M0 block scales) against
an oracle written here from the formats' definitions, independent of torch and of gds_gather's own decoder
(quants.fp8_lut): each byte decoded with math.ldexp, bfloat16 rounded to nearest even on the float32 bits with
integer arithmetic, a block scale applied as one numpy float32 product.

The host build (kernels/host_check.cu, and its HIP multiply path) is checked on every machine; the `gpu` tests run
the same cases through gather_rows on a GPU (NaN compared as NaN there: the conversion instructions and mul.rn
write a canonical NaN).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from gds_gather.errors import RowWidthError, UnsupportedTypeError
from gds_gather.formats import quants
from gds_gather.gpu import arrays
from gds_gather.gpu import dequant as dg
from gds_gather.gpu import host_kernels as hk
from gds_gather.gpu import tables
from gds_gather.gpu.host import HostAccel, HostArray, numpy_view

KINDS = ("F8_E4M3", "F8_E5M2", "F8_E8M0")
ROW_KINDS = ("F8_E4M3", "F8_E5M2")
SCALE_KINDS = ("F32", "BF16", "F8_E8M0", "F8_E4M3")
DTYPES = ("float32", "float16", "bfloat16")
SCALE_BYTES = {"F32": 4, "BF16": 2, "F8_E8M0": 1, "F8_E4M3": 1}
# (row_elems, sblock, n_layer): 32- and 128-element blocks, a ragged last block (160 = 128 + 32), blocks that do
# not line up with the kernels' 8-element items (12), one scale per row (160), and the per-layer layout.
GEOMETRIES = ((160, 32, None), (160, 128, None), (256, 32, None), (160, 12, None), (160, 160, None),
              (256, 32, 2), (160, 128, 4))


# ---- the oracle ------------------------------------------------------------------------------------------------
def fp8_value(kind: str, b: int) -> float:
    """The value of byte b, from the format's definition (OCP FP8 e4m3fn / e5m2; OCP MX UE8M0)."""
    if kind == "F8_E8M0":
        return math.nan if b == 0xFF else math.ldexp(1.0, b - 127)
    ebits, mbits, bias = (4, 3, 7) if kind == "F8_E4M3" else (5, 2, 15)
    sign = -1.0 if b & 0x80 else 1.0
    e, m = (b >> mbits) & ((1 << ebits) - 1), b & ((1 << mbits) - 1)
    if kind == "F8_E4M3" and e == 15 and m == 7:                  # e4m3fn: S.1111.111 is NaN, no infinities
        return math.copysign(math.nan, sign)
    if kind == "F8_E5M2" and e == 31:
        return math.copysign(math.inf if m == 0 else math.nan, sign)
    mag = math.ldexp(m, 1 - bias - mbits) if e == 0 else math.ldexp((1 << mbits) + m, e - bias - mbits)
    return math.copysign(mag, sign)


def fp8_f32(kind: str) -> np.ndarray:
    """float32 [256]: every byte's value (exactly representable: the float64 -> float32 cast is exact)."""
    return np.array([fp8_value(kind, b) for b in range(256)], np.float64).astype(np.float32)


def scale_values(kind: str, raw: np.ndarray) -> np.ndarray:
    """uint8 [rows, n * size] scale rows -> float32 [rows, n]."""
    if kind in ("F8_E8M0", "F8_E4M3"):
        return fp8_f32(kind)[raw]
    if kind == "BF16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    return raw.view("<u4").view(np.float32)


def bf16_rne(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even on the bits (NaN kept NaN with its sign, quiet)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.int64)
    hi, lo = u >> 16, u & 0xFFFF
    up = (lo > 0x8000) | ((lo == 0x8000) & ((hi & 1) == 1))
    return np.where(np.isnan(x), hi | 0x40, hi + up).astype(np.uint16)


def rounded(f32: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float16":
        with np.errstate(over="ignore"):
            return f32.astype(np.float16)
    return bf16_rne(f32) if dtype == "bfloat16" else f32


def laid_out(vals: np.ndarray, id_shape, n_layer) -> np.ndarray:
    """[N, row_elems] -> the kernels' output: flat id_shape + (row_elems,), or per_layer [n_layer, N, seg]."""
    if n_layer is None:
        return vals.reshape(tuple(id_shape) + vals.shape[-1:])
    return np.ascontiguousarray(vals.reshape(vals.shape[0], n_layer, -1).transpose(1, 0, 2))


def assert_same(got, want, dtype: str, nan_sign: bool = True, what: str = "") -> None:
    """Bit-equal where `want` is not NaN; NaN exactly where `want` is NaN (with its sign when nan_sign)."""
    got = np.asarray(got)
    assert got.shape == want.shape, what
    if dtype == "float32":
        g, w, top = got.view(np.uint32), want.view(np.uint32), 0x7F800000
        mask, sign = 0x7FFFFFFF, 0x80000000
    else:
        g, w, top = got.view(np.uint16), want.view(np.uint16), 0x7C00 if dtype == "float16" else 0x7F80
        mask, sign = 0x7FFF, 0x8000
    nan = (w & mask) > top
    np.testing.assert_array_equal((g & mask) > top, nan, err_msg=f"NaN positions {what}")
    np.testing.assert_array_equal(g[~nan], w[~nan], err_msg=what)
    if nan_sign:
        np.testing.assert_array_equal(g[nan] & sign, w[nan] & sign, err_msg=f"NaN signs {what}")


# ---- cases -------------------------------------------------------------------------------------------------------
def byte_case(seed: int, width: int = 160, n_rows: int = 16):
    """Every byte value in a table of n_rows rows (ids cover each row, in random order, some twice): (table,
    staging, offsets, ids, unique rows, inverse); unique rows sit at random byte offsets with gaps."""
    rng = np.random.default_rng(seed)
    table = np.resize(rng.permutation(256).astype(np.uint8), (n_rows, width))
    ids = np.concatenate([rng.permutation(n_rows), rng.integers(0, n_rows, 7)])
    uniq, inv = np.unique(ids, return_inverse=True)
    starts = np.cumsum(rng.integers(0, 40, uniq.size)) + np.arange(uniq.size) * width
    staging = np.zeros(int(starts[-1]) + width + 5, np.uint8)
    staging[starts[:, None] + np.arange(width)] = table[uniq]
    return table, staging, starts.astype(np.int64), ids, uniq, inv


def scale_bytes(kind: str, shape, rng) -> np.ndarray:
    """Random scales of `kind` as uint8 [rows, n * size]: half of them tiny (subnormal products, subnormal F32 /
    BF16 scales, E8M0 0x00 = 2^-127), the rest anywhere; zeros, infinities and NaN (E8M0 0xFF) among them. E4M3:
    any byte, zero, the smallest subnormal and NaN for sure."""
    n = int(np.prod(shape))
    tiny = rng.random(n) < 0.5
    if kind == "F8_E4M3":
        v = rng.integers(0, 256, n).astype(np.uint8)
        v[:3] = (0x00, 0x01, 0x7F)
    elif kind == "F8_E8M0":
        v = np.where(tiny, rng.integers(0, 12, n), rng.integers(0, 256, n)).astype(np.uint8)
        v[:2] = (0x00, 0xFF)
    else:
        exp = np.where(tiny, rng.integers(0, 12, n), rng.integers(90, 256, n)).astype(np.uint32)
        bits = (rng.integers(0, 2, n).astype(np.uint32) << 31) | (exp << 23) | \
            rng.integers(0, 1 << 23, n).astype(np.uint32)
        bits[exp == 255] &= 0xFFC00000                           # infinities and NaN with a short payload
        bits[:3] = (0x00000000, 0x00000001 << 16, 0x7F800000)    # zero, a BF16-representable subnormal, inf
        v = bits if kind == "F32" else (bits >> 16).astype(np.uint16)
    return np.ascontiguousarray(v.reshape(shape)).view(np.uint8).reshape(shape[0], -1)


def scaled_case(kind: str, skind: str, width: int, sblock: int, seed: int, share: int = 8, n_rows: int = 50):
    """A scaled table (random bytes, every value kind) with one scale row per `share` rows (2-D blocks: soffsets
    repeat): ((staging, offsets, inverse), BlockScales of numpy arrays, the oracle's float32 [N, width])."""
    rng = np.random.default_rng(seed)
    table = rng.integers(0, 256, (n_rows, width), dtype=np.uint8)
    ids = rng.integers(0, n_rows, 45)
    uniq, inv = np.unique(ids, return_inverse=True)
    starts = np.cumsum(rng.integers(0, 40, uniq.size)) + np.arange(uniq.size) * width
    staging = np.zeros(int(starts[-1]) + width, np.uint8)
    staging[starts[:, None] + np.arange(width)] = table[uniq]
    n_sc = -(-width // sblock)
    raw = scale_bytes(skind, (-(-n_rows // share), n_sc), rng)
    sstaging = np.concatenate([np.zeros(1, np.uint8), raw.reshape(-1)])      # scale rows at odd addresses
    soffsets = (1 + (uniq // share) * raw.shape[1]).astype(np.int64)
    s = scale_values(skind, raw)[uniq // share][:, np.arange(width) // sblock]
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        f32 = fp8_f32(kind)[table[uniq]] * s
    return (staging, starts.astype(np.int64), inv), dg.BlockScales(sstaging, soffsets, skind, sblock), f32[inv]


def with_output_scale(f32: np.ndarray, scale) -> np.ndarray:
    if scale is None:
        return f32
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        return f32 * np.float32(scale)


# ---- the host build ------------------------------------------------------------------------------------------------
def test_the_oracle_knows_the_formats():
    """Published constants: e4m3fn max 448, min subnormal 2^-9; e5m2 max 57344, inf 0x7C; e8m0 0x7F = 1."""
    assert fp8_value("F8_E4M3", 0x7E) == 448 and fp8_value("F8_E4M3", 0x01) == 2**-9
    assert math.isnan(fp8_value("F8_E4M3", 0xFF)) and fp8_value("F8_E4M3", 0x78) == 256
    assert fp8_value("F8_E5M2", 0x7B) == 57344 and fp8_value("F8_E5M2", 0xFC) == -math.inf
    assert fp8_value("F8_E5M2", 0x01) == 2**-16 and math.isnan(fp8_value("F8_E5M2", 0x7D))
    assert fp8_value("F8_E8M0", 0x7F) == 1 and fp8_value("F8_E8M0", 0) == 2**-127
    assert bf16_rne(np.array([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20], np.float32)).tolist() == \
        [0x3F80, 0x3F82, 0x3F81]                       # ties to even (down, up), above the tie up


def test_float8_geometry_in_the_source(lib):
    for kind in KINDS:
        assert hk.host_geometry(kind) == quants.block_geometry(kind) == (1, 1)
        assert int(quants.qtype_of(kind)) == quants.FP8_IDS[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_every_byte_decodes_exactly(lib, kind):
    """All 256 bytes: float32 bits equal the oracle's, NaN where NaN with its sign, -0 kept; e8m0 0x00 is the
    float32 subnormal 2^-127."""
    every = np.arange(256, dtype=np.uint8)
    got = hk.host_dequantize(every, kind)
    want = fp8_f32(kind)
    assert_same(got, want, "float32", what=kind)
    assert {"F8_E4M3": 2, "F8_E5M2": 6, "F8_E8M0": 1}[kind] == np.isnan(want).sum()
    if kind == "F8_E8M0":
        assert got.view(np.uint32)[0] == 0x00400000
    else:
        assert got.view(np.uint32)[0x80] == 0x80000000


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_byte_gathers_exactly(lib, kind, dtype):
    """The unscaled kernel over all 256 bytes, int32 / int64 ids, flat and per-layer (power-of-two and other
    segments), with and without an output scale; float16 holds every e4m3 / e5m2 value exactly."""
    table, staging, offsets, ids, uniq, inv = byte_case(int(quants.qtype_of(kind)))
    values = fp8_f32(kind)[table[ids]]
    for n_layer in (None, 5, 4):
        layout = "flat" if n_layer is None else "per_layer"
        for idx in (np.int32, np.int64):
            for scale in (None, 0.1):
                kw = dict(dtype=dtype, scale=scale, layout=layout, n_layer=n_layer)
                got = hk.host_gather(staging, offsets, inv.astype(idx), kind, 160, **kw)
                want = laid_out(rounded(with_output_scale(values, scale), dtype), ids.shape, n_layer)
                assert_same(got, want, dtype, what=f"{kind} {idx.__name__} {kw}")
    if dtype == "float16" and kind != "F8_E8M0":
        got = hk.host_gather(staging, offsets, inv, kind, 160, dtype=dtype).astype(np.float64)
        exact = np.array([fp8_value(kind, b) for b in range(256)])[table[ids]]
        finite = ~np.isnan(exact)
        np.testing.assert_array_equal(got[finite], exact[finite])


@pytest.mark.parametrize("skind", SCALE_KINDS)
@pytest.mark.parametrize("kind", ROW_KINDS)
def test_scaled_gather_exact(lib, kind, skind):
    """value * scale in one float32 product, then the output scale, then the output rounding: every geometry,
    output dtype and index type; the host build and its HIP multiply path (soft_mul) alike."""
    subnormal_products = 0
    for k, (width, sblock, n_layer) in enumerate(GEOMETRIES):
        (staging, offsets, inv), bs, f32 = scaled_case(kind, skind, width, sblock, seed=100 * k + len(skind))
        subnormal_products += int(((f32 != 0) & (np.abs(f32) < np.finfo(np.float32).tiny)).sum())
        layout = "flat" if n_layer is None else "per_layer"
        for idx in (np.int32, np.int64):
            for dtype in DTYPES:
                for scale in (None, 0.1):
                    kw = dict(dtype=dtype, scale=scale, layout=layout, n_layer=n_layer, block_scales=bs)
                    want = laid_out(rounded(with_output_scale(f32, scale), dtype), inv.shape, n_layer)
                    for soft in (False, True):
                        got = hk.host_gather(staging, offsets, inv.astype(idx), kind, width, soft_mul=soft, **kw)
                        assert_same(got, want, dtype, nan_sign=False,
                                    what=f"{kind} x {skind} w={width} sblock={sblock} {idx.__name__} soft={soft}")
    assert subnormal_products > 20 or skind == "F8_E4M3"    # e4m3 x float8 is at least 2^-18 in magnitude


def test_scaled_reference_is_the_oracle(lib):
    """host_kernels.reference_gather (HostAccel's kernel without a C++ compiler) with block scales."""
    (staging, offsets, inv), bs, f32 = scaled_case("F8_E4M3", "F8_E8M0", 160, 32, seed=5)
    for dtype in DTYPES:
        got = hk.reference_gather(staging, offsets, inv, "F8_E4M3", 160, dtype=dtype, scale=16.0, block_scales=bs)
        assert_same(got, rounded(with_output_scale(f32, 16.0), dtype), dtype, nan_sign=False, what=dtype)


def test_host_accel_gathers_scaled_tables():
    """HostAccel.gather with block_scales (BlockScales of HostArrays, or a tuple of torch CPU tensors): queued on
    its stream, run at the synchronize, equal to the oracle."""
    torch = pytest.importorskip("torch")
    (staging, offsets, inv), bs, f32 = scaled_case("F8_E5M2", "BF16", 256, 32, seed=8)
    a = HostAccel()
    s = a.stream()
    want = laid_out(rounded(f32, "bfloat16"), inv.shape, 2)
    as_dev = (lambda x: np.asarray(x).view(HostArray), torch.from_numpy)
    for conv, scales in ((as_dev[0], dg.BlockScales(as_dev[0](bs.sstaging), as_dev[0](bs.soffsets), "BF16", 32)),
                         (as_dev[1], (torch.from_numpy(bs.sstaging), torch.from_numpy(bs.soffsets), 30, 32))):
        out = a.gather(conv(staging), conv(offsets), conv(inv.astype(np.int32)), quants.RowType.F8_E5M2, 256,
                       dtype="bfloat16", stream=s, layout="per_layer", n_layer=2, block_scales=scales)
        assert not s.query()                               # queued, not run
        a.synchronize(s)
        assert_same(numpy_view(out), want, "bfloat16", nan_sign=False)


@pytest.mark.parametrize("change,exc,match", [
    (dict(qtype="Q8_0", row_elems=160), UnsupportedTypeError,
     "block scales apply to F8_E4M3, F8_E5M2, F4_E2M1 rows, not Q8_0"),
    (dict(qtype="F8_E8M0"), UnsupportedTypeError, "not F8_E8M0"),
    (dict(stype="F16"), UnsupportedTypeError, "block scales must be F32, BF16, F8_E8M0, F8_E4M3, got F16"),
    (dict(sblock=0), ValueError, "sblock must be a positive int32, got 0"),
    (dict(sblock=2.5), TypeError, "sblock must be an int"),
    (dict(sstaging=np.zeros(64, np.float32)), TypeError, "sstaging must hold bytes"),
    (dict(soffsets=np.zeros(3, np.int32)), TypeError, r"soffsets must be int64 of row_offsets' shape \(4,\)"),
    (dict(soffsets=np.zeros(5, np.int64)), TypeError, "got int64 \\(5,\\)"),
    (dict(soffsets=np.zeros(8, np.int64)[::2]), ValueError, "block_scales.soffsets must be C-contiguous"),
    (dict(sstaging=[0] * 64), TypeError, "block_scales.sstaging must be a host array"),
])
def test_block_scale_arguments_are_checked(change, exc, match):
    """HostAccel.gather (check_launch, as gather_rows) refuses bad block scales before queueing anything."""
    args = dict(qtype="F8_E4M3", row_elems=64, sstaging=np.zeros(64, np.uint8), soffsets=np.zeros(4, np.int64),
                stype="F32", sblock=32)
    args.update(change)
    a = HostAccel()
    bs = (args["sstaging"], args["soffsets"], args["stype"], args["sblock"])
    with pytest.raises(exc, match=match):
        a.gather(np.zeros(4 * 160, np.uint8), np.arange(4, dtype=np.int64) * 160, np.array([0, 3, 1]),
                 args["qtype"], args["row_elems"], dtype="float32", stream=None, block_scales=bs)
    assert a.null.query()


def test_host_gather_bounds_checks_the_scale_rows(lib):
    staging, offs, inv = np.zeros(2 * 64, np.uint8), np.array([0, 64], np.int64), np.array([1, 0])
    sst = np.zeros(16, np.uint8)
    ok = dg.BlockScales(sst, np.array([0, 8], np.int64), "F32", 32)         # 2 F32 scales a row: 8 bytes
    assert hk.host_gather(staging, offs, inv, "F8_E4M3", 64, block_scales=ok).shape == (2, 64)
    with pytest.raises(IndexError, match="soffsets reach outside the 16-byte scale staging buffer"):
        hk.host_gather(staging, offs, inv, "F8_E4M3", 64, block_scales=(sst, np.array([0, 9], np.int64), "F32", 32))
    with pytest.raises(TypeError, match=r"soffsets must be int64 \[2\] \(one per unique row\)"):
        hk.host_gather(staging, offs, inv, "F8_E4M3", 64, block_scales=(sst, np.zeros(3, np.int64), "F32", 32))
    with pytest.raises(RowWidthError):
        hk.host_gather(staging, offs, inv, "F8_E4M3", 64, layout="per_layer", n_layer=3, block_scales=ok)


def test_kernel_names_of_the_scaled_kernels():
    assert dg.kernel_name("F8_E4M3", "bfloat16", "int32", "F8_E8M0") == "gg_gather_scaled<1000, 1002, 2, int>"
    assert dg.kernel_name("f8_e5m2", np.float32, np.int64) == "gg_gather<1001, 0, long long>"
    assert dg.kernel_name(1001, "float16", "int64", "BF16") == "gg_gather_scaled<1001, 30, 1, long long>"
    assert len(set(dg.kernel_names("F8_E4M3"))) == 30 and len(dg.kernel_names("F8_E8M0")) == 6
    with pytest.raises(UnsupportedTypeError):
        dg.kernel_name("Q4_0", "float32", "int32", "F32")


class DevArray:
    """A numpy array dressed as a cupy array on device `dev` (module 'cupy...', .data.ptr, .device.id)."""

    def __init__(self, a, dev=0):
        self.a = np.ascontiguousarray(a)
        self.data = type("Ptr", (), {"ptr": self.a.ctypes.data})()
        self.device = type("Dev", (), {"id": dev})()
        self.flags, self.dtype, self.shape = self.a.flags, self.a.dtype, self.a.shape


DevArray.__module__ = "cupy._fake"


class NullCtx:
    def __init__(self, *a, **k):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def host_launches(lib, monkeypatch) -> list:
    """gather_rows' scaled launches run through the host build (cupy, the device state and the kernel replaced by
    stand-ins): each launch's arguments are gg_gather's then sstaging (u64), soffsets, sblock (i32), smul (f32);
    the returned list gets (type id, scale type id, dtype, index dtype, smul) per launch."""
    tab = DevArray(tables.table_blob())
    fake = type("cupy", (), {"cuda": type("cuda", (), {"Device": NullCtx}),
                             "empty": staticmethod(lambda shape, dtype: DevArray(np.empty(shape, dtype)))})
    monkeypatch.setattr(dg, "_cupy", lambda: fake)
    monkeypatch.setattr(dg, "_device_state", lambda dev: (tab, 4))
    monkeypatch.setattr(arrays, "cupy_stream", lambda handle: NullCtx())
    launches = []

    def kernel(qt_id, dtype, index_dtype, st_id=None):
        def launch(grid, block, args):
            assert len(args) == 15 and type(args[-2]) is np.int32 and type(args[-3]) is np.uint64
            assert type(args[-1]) is np.float32
            launches.append((qt_id, st_id, dtype, index_dtype, args[-1]))
            rc = lib.gg_host_gather_scaled(qt_id, st_id, dg.OUT_DTYPES[dtype], int(index_dtype == "int64"),
                                           *(int(x) for x in args[:4]), tab.a.ctypes.data, int(args[5]),
                                           int(args[6]), int(args[7]), float(args[9]), int(args[10]),
                                           int(args[11]), int(args[12]), int(args[13]), float(args[14]))
            assert rc == 0
        return launch
    monkeypatch.setattr(dg, "_kernel", kernel)
    return launches


def test_gather_rows_launches_the_scaled_kernel(lib, monkeypatch):
    """gather_rows with block_scales: the scaled kernel of (type, scale type, dtype, index type), its arguments
    gg_gather's then sstaging, soffsets, sblock, smul (1.0 unless given); run here through the host build, equal to
    the oracle."""
    launches = host_launches(lib, monkeypatch)
    (staging, offsets, inv), bs, f32 = scaled_case("F8_E4M3", "F32", 160, 12, seed=3)
    for dtype in DTYPES:
        scales = dg.BlockScales(DevArray(bs.sstaging), DevArray(bs.soffsets), "F32", 12)
        got = dg.gather_rows(DevArray(staging), DevArray(offsets), DevArray(inv.astype(np.int32)), "F8_E4M3", 160,
                             dtype=dtype, scale=0.1, stream=77, block_scales=scales)
        assert_same(got.a, rounded(with_output_scale(f32, 0.1), dtype), dtype, nan_sign=False, what=dtype)
    assert launches == [(1000, 0, d, "int32", np.float32(1.0)) for d in DTYPES]
    with pytest.raises(ValueError, match=r"block_scales must be on the device of the other arguments \(0\)"):
        dg.gather_rows(DevArray(staging), DevArray(offsets), DevArray(inv), "F8_E4M3", 160,
                       block_scales=(DevArray(bs.sstaging, dev=1), DevArray(bs.soffsets), "F32", 12))
    assert len(launches) == len(DTYPES)                    # the refused call launched nothing


# ---- on a GPU --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_every_byte_exact(cp, kind):
    table, staging, offsets, ids, uniq, inv = byte_case(int(quants.qtype_of(kind)))
    values = fp8_f32(kind)[table[ids]]
    for n_layer in (None, 5, 4):
        layout = "flat" if n_layer is None else "per_layer"
        for idx in (np.int32, np.int64):
            for dtype in DTYPES:
                for scale in (None, 0.1):
                    kw = dict(dtype=dtype, scale=scale, layout=layout, n_layer=n_layer)
                    got = dg.gather_rows(cp.asarray(staging), cp.asarray(offsets), cp.asarray(inv.astype(idx)),
                                         kind, 160, **kw)
                    want = laid_out(rounded(with_output_scale(values, scale), dtype), ids.shape, n_layer)
                    assert_same(cp.asnumpy(got), want, dtype, nan_sign=dtype == "float32" and scale is None,
                                what=f"{kind} {idx.__name__} {kw}")


@pytest.mark.gpu
@pytest.mark.parametrize("skind", SCALE_KINDS)
@pytest.mark.parametrize("kind", ROW_KINDS)
def test_gpu_scaled_exact(cp, kind, skind):
    """The scaled kernels on the device (subnormal products kept despite CuPy's -ftz=true): the oracle's bits."""
    for k, (width, sblock, n_layer) in enumerate(GEOMETRIES):
        (staging, offsets, inv), bs, f32 = scaled_case(kind, skind, width, sblock, seed=100 * k + len(skind))
        layout = "flat" if n_layer is None else "per_layer"
        d_st, d_off = cp.asarray(staging), cp.asarray(offsets)
        scales = dg.BlockScales(cp.asarray(bs.sstaging), cp.asarray(bs.soffsets), skind, sblock)
        for idx in (np.int32, np.int64):
            for dtype in DTYPES:
                for scale in (None, 0.1):
                    got = dg.gather_rows(d_st, d_off, cp.asarray(inv.astype(idx)), kind, width, dtype=dtype,
                                         scale=scale, layout=layout, n_layer=n_layer, block_scales=scales)
                    want = laid_out(rounded(with_output_scale(f32, scale), dtype), inv.shape, n_layer)
                    assert_same(cp.asnumpy(got), want, dtype, nan_sign=False,
                                what=f"{kind} x {skind} w={width} sblock={sblock} {idx.__name__} {dtype} {scale}")


@pytest.mark.gpu
def test_gpu_scaled_torch_tensors(cp):
    """torch CUDA tensors in, a torch bfloat16 tensor out, on torch's current stream."""
    torch = pytest.importorskip("torch")
    (staging, offsets, inv), bs, f32 = scaled_case("F8_E4M3", "F8_E8M0", 256, 32, seed=21)
    t = [torch.from_numpy(x).cuda() for x in (staging, offsets, inv, bs.sstaging, bs.soffsets)]
    got = dg.gather_rows(t[0], t[1], t[2], "F8_E4M3", 256, dtype="bfloat16", layout="per_layer", n_layer=2,
                         block_scales=(t[3], t[4], "F8_E8M0", 32))
    assert got.dtype == torch.bfloat16
    torch.cuda.synchronize()
    bits = got.cpu().view(torch.int16).numpy().view(np.uint16)
    assert_same(bits, laid_out(rounded(f32, "bfloat16"), inv.shape, 2), "bfloat16", nan_sign=False)
