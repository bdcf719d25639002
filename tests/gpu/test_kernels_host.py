"""The CUDA dequant-scatter source, checked without a GPU.

kernels/host_check.cu compiles dequant.cuh, float8.cuh and gather.cu as plain C++ (g++, or nvcc's host path); its block
dequantizers and the gather kernel's per-item routine must equal gguf.quants bit for bit. nvcc -arch=sm_90
then compiles every kernel instance, so a device-side syntax error cannot land. Each compiler-dependent test
skips, with the reason, where its compiler is absent.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from gds_gather.gpu import dequant as dg
from gds_gather.gpu import host_kernels as hk
from gds_gather.gpu import tables
from gds_gather.gpu import nvrtc
from gds_gather.errors import BackendError, RowWidthError, UnsupportedTypeError
from gds_gather.model.synth import random_blocks
from gds_gather.planner import plan_rows
from gds_gather.formats.quants import row_types, supported_types

Q = GGMLQuantizationType
TYPES = supported_types()                 # the GGML types (gguf is their oracle); the float8 ones: test_fp8_kernels
ALL_KERNELS = tuple(n for qt in row_types() for n in dg.kernel_names(qt))    # every instance, scaled ones too
IDS = [t.name for t in TYPES]


def _bits_equal(got: np.ndarray, ref: np.ndarray) -> None:
    """Exactly equal: same shape, same bits (NaN where gguf has NaN; payloads compared too)."""
    ref = np.asarray(ref, np.float32).reshape(got.shape)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


# ---- tables and geometry ------------------------------------------------------------------------------------------
def test_tables_come_from_gguf():
    g = tables.grids()
    for name, cls in (("IQ2XXS", gq.IQ2_XXS), ("IQ2XS", gq.IQ2_XS), ("IQ2S", gq.IQ2_S), ("IQ3XXS", gq.IQ3_XXS),
                      ("IQ3S", gq.IQ3_S), ("IQ1S", gq.IQ1_S), ("IQ1S", gq.IQ1_M)):
        cls.init_grid()
        ref = np.asarray(cls.grid, np.float32).reshape(cls.grid_shape)
        np.testing.assert_array_equal(g[name].astype(np.float32), ref)
    assert g["KSIGNS"].tobytes() == gq.IQ2_XXS.ksigns
    assert tuple(g["KV_IQ4NL"]) == gq.IQ4_NL.kvalues and tuple(g["KV_MXFP4"]) == gq.MXFP4.kvalues
    assert tuple(g["KV_NVFP4"]) == gq.NVFP4.kvalues
    assert g["IQ1S_DELTA"][0] == gq.IQ1_S.delta and g["IQ1M_DELTA"][0] == gq.IQ1_M.delta
    blob, offs = tables.table_blob(), tables.defines()
    assert not blob.flags.writeable
    for name, arr in g.items():
        at = offs[f"GG_OFF_{name}"]
        assert at % 16 == 0
        assert blob[at:at + arr.nbytes].tobytes() == arr.tobytes()


def test_no_table_literals_in_sources():
    """Grids and kvalues come from gguf at load time; the C++ holds none of their values."""
    from gds_gather.gpu.kernel_sources import source
    text = "".join(source(n) for n in (*tables.KERNEL_SOURCES, "host_check.cu"))
    for needle in ("-127, -104", "0x08, 0x19", "113", "0x2b"):
        assert needle not in text, needle


def test_geometry_matches_gguf(lib):
    for qt in TYPES:
        assert hk.host_geometry(qt) == GGML_QUANT_SIZES[qt], qt.name


def test_kernel_names():
    assert dg.kernel_name("IQ4_NL", "float16", "int32") == "gg_gather<20, 1, int>"
    assert dg.kernel_name(Q.Q5_K, np.float32, np.int64) == "gg_gather<13, 0, long long>"
    assert len(set(dg.kernel_names(Q.Q4_0))) == 6
    with pytest.raises(TypeError):
        dg.kernel_name("Q4_0", "float64")
    with pytest.raises(TypeError):
        dg.kernel_name("Q4_0", "float32", "uint8")


def test_module_imports_no_gpu_library():
    code = ("import sys, gds_gather.gpu.dequant, gds_gather.gpu.host_kernels, gds_gather.gpu.tables as t; "
            "t.grids(); t.source(); "
            "print(sorted(m for m in ('cupy', 'torch') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"


# ---- block dequantizers ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_dequant_exact_valid_blocks(lib, qtype, ggufs):
    rng = np.random.default_rng(int(qtype))
    blocks = random_blocks(qtype, 3000, rng)
    _bits_equal(hk.host_dequantize(blocks, qtype), gq.dequantize(blocks, qtype))
    rows = ggufs.rows(qtype, 40, ggufs.width(qtype), seed=int(qtype))          # rows: [n, row_bytes]
    got = hk.host_dequantize(rows, qtype)
    assert got.shape == (40, ggufs.width(qtype))
    _bits_equal(got, gq.dequantize(rows, qtype))


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_dequant_exact_any_bytes(lib, qtype):
    """Every bit pattern (inf/NaN/subnormal scales included): finite values bit-equal, NaN where gguf has NaN."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(1000 + int(qtype)).integers(0, 256, (4000, size), dtype=np.uint8)
    with np.errstate(all="ignore"):
        ref = np.asarray(gq.dequantize(raw, qtype), np.float32).reshape(4000, block)
    got = hk.host_dequantize(raw, qtype)
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got.view(np.uint32)[~nan], ref.view(np.uint32)[~nan])


def test_scalar_decoders_exhaustive(lib):
    """All 65536 fp16 and bf16 patterns, all 256 e8m0 and ue4m3 scale bytes."""
    every16 = np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(-1, 2)
    _bits_equal(hk.host_dequantize(every16, Q.F16), gq.dequantize(every16, Q.F16))
    _bits_equal(hk.host_dequantize(every16, Q.BF16), gq.dequantize(every16, Q.BF16))
    for qt, scale_bytes in ((Q.MXFP4, 1), (Q.NVFP4, 4)):
        _, size = GGML_QUANT_SIZES[qt]
        blocks = np.random.default_rng(7).integers(0, 256, (256, size), dtype=np.uint8)
        blocks[:, :scale_bytes] = np.arange(256, dtype=np.uint8)[:, None]
        with np.errstate(over="ignore"):     # e8m0 255 = 2^127: x12 overflows to inf, in gguf as here
            ref = gq.dequantize(blocks, qt)
        _bits_equal(hk.host_dequantize(blocks, qt), ref)


def test_host_dequantize_shapes_and_errors(lib):
    blocks = random_blocks(Q.Q4_0, 6, np.random.default_rng(0))
    assert hk.host_dequantize(blocks.reshape(2, 3 * 18), Q.Q4_0).shape == (2, 96)
    assert hk.host_dequantize(blocks[:0], Q.Q4_0).shape == (0, 32)
    with pytest.raises(ValueError):
        hk.host_dequantize(blocks.reshape(-1)[:17], Q.Q4_0)
    with pytest.raises(TypeError):
        hk.host_dequantize(blocks.view(np.int8), Q.Q4_0)


# ---- the gather routine --------------------------------------------------------------------------------------------
def window_staging(table: np.ndarray, plan, data_offset: int) -> np.ndarray:
    """What an O_DIRECT reader leaves in window staging: each aligned window of the file, back to back.

    `table` is the tensor's bytes (rows back to back) placed at `data_offset` in a file of zeros.
    """
    flat = table.reshape(-1)
    out = np.zeros(int(plan.win_lengths.sum()), np.uint8)
    for off, length, at in zip(plan.win_offsets.tolist(), plan.win_lengths.tolist(), plan.win_staging.tolist()):
        lo, hi = max(off, data_offset), min(off + length, data_offset + flat.size)
        out[at + lo - off:at + hi - off] = flat[lo - data_offset:hi - data_offset]
    return out


def gather_cases(qtype, ggufs, rng):
    """(width, n_layer) pairs: qwen-like flat rows and gemma-like per-layer rows for the type."""
    block = GGML_QUANT_SIZES[qtype][0]
    if block == 1:
        return [(7, None), (160, None), (12, 3), (512, 2)]
    return [(ggufs.width(qtype), None), (512, 2), (768, 3)]


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_host_gather_exact(lib, qtype, ggufs):
    rng = np.random.default_rng(2000 + int(qtype))
    block, size = GGML_QUANT_SIZES[qtype]
    for width, n_layer in gather_cases(qtype, ggufs, rng):
        rb = width // block * size
        n_rows, data_offset = 60, 4096 * 3 + 37
        table = random_blocks(qtype, n_rows * width // block, rng).reshape(n_rows, rb)
        ids = rng.integers(0, n_rows, (9, 4) if n_layer is None else (23,))
        plan = plan_rows(ids, n_rows=n_rows, row_bytes=rb, data_offset=data_offset, align=512)
        stagings = (
            (table[plan.unique_rows].reshape(-1), np.arange(plan.n_unique, dtype=np.int64) * rb),
            (window_staging(table, plan, data_offset), plan.row_staging),
        )
        layout = "flat" if n_layer is None else "per_layer"
        for staging, offsets in stagings:
            for inv in (plan.inverse.reshape(ids.shape), plan.inverse.astype(np.int32).reshape(ids.shape)):
                for dtype in ("float32", "float16", "bfloat16"):
                    for scale in (None, 16.0, 0.1):
                        kw = dict(dtype=dtype, scale=scale, layout=layout, n_layer=n_layer)
                        got = hk.host_gather(staging, offsets, inv, qtype, width, **kw)
                        ref = hk.reference_gather(staging, offsets, inv, qtype, width, **kw)
                        assert got.shape == ref.shape and got.dtype == ref.dtype, (qtype.name, width, kw)
                        np.testing.assert_array_equal(got.view(np.uint8), ref.view(np.uint8),
                                                      err_msg=f"{qtype.name} width={width} {kw}")


def test_reference_matches_gguf_oracle(ggufs):
    """reference_gather itself: gemma layout, scale, dtypes, straight from gguf + numpy."""
    qt, width, n_layer = Q.Q5_K, 256 * 3, 3
    rows = ggufs.rows(qt, 10, width, seed=3)
    ids = np.array([4, 4, 0, 9, 2])
    uniq, inv = np.unique(ids, return_inverse=True)
    rb = rows.shape[1]
    got = hk.reference_gather(rows[uniq].reshape(-1), np.arange(uniq.size) * rb, inv, qt, width,
                              scale=16.0, layout="per_layer", n_layer=n_layer, dtype="float16")
    full = gq.dequantize(rows, qt).reshape(10, width)[ids] * np.float32(16)
    with np.errstate(over="ignore"):
        want = full.reshape(5, n_layer, 256).transpose(1, 0, 2).astype(np.float16)
    np.testing.assert_array_equal(got, want)


def test_output_rounding_every_float(lib):
    """float32 -> float16 / bfloat16 rounding over random patterns plus every exponent's ties and near-ties."""
    rng = np.random.default_rng(5)
    mant = np.array([0, 1, 0xfff, 0x1000, 0x1001, 0x2000, 0x3000, 0x7fff, 0x8000, 0x8001, 0x18000,
                     0x400000, 0x7fe000, 0x7ff000, 0x7fffff], np.uint32)
    special = ((np.arange(256, dtype=np.uint32) << 23)[:, None] | mant).ravel()
    bits = np.concatenate([rng.integers(0, 1 << 32, 1 << 18, dtype=np.uint64).astype(np.uint32),
                           special, special | 0x80000000])
    bits = bits[: bits.size // 64 * 64]
    staging = bits.view(np.uint8)
    n = bits.size // 64
    offsets, inv = np.arange(n, dtype=np.int64) * 256, np.arange(n, dtype=np.int32)
    x = bits.view(np.float32).reshape(n, 64)
    h = hk.host_gather(staging, offsets, inv, Q.F32, 64, dtype="float16")
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(h.view(np.uint16), x.astype(np.float16).view(np.uint16))
    b = hk.host_gather(staging, offsets, inv, Q.F32, 64, dtype="bfloat16")
    np.testing.assert_array_equal(b, hk.bf16_bits(x))
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    finite = ~np.isnan(x)
    np.testing.assert_array_equal(b[finite], t[finite])


def test_host_gather_argument_checks(lib):
    staging = np.zeros(90 * 4, np.uint8)
    offs = np.arange(4, dtype=np.int64) * 90
    inv = np.array([0, 3, 1])
    assert hk.host_gather(staging, offs, inv, Q.IQ4_NL, 160).shape == (3, 160)
    assert hk.host_gather(staging, offs, inv[:0], Q.IQ4_NL, 160).shape == (0, 160)
    with pytest.raises(IndexError):
        hk.host_gather(staging, offs + 1, inv, Q.IQ4_NL, 160)
    with pytest.raises(IndexError):
        hk.host_gather(staging, offs, np.array([4]), Q.IQ4_NL, 160)
    with pytest.raises(ValueError):                     # RowWidthError: 150 is not whole blocks
        hk.host_gather(staging, offs, inv, Q.IQ4_NL, 150)
    with pytest.raises(ValueError):
        hk.host_gather(staging, offs, inv, Q.IQ4_NL, 160, layout="per_layer", n_layer=3)
    with pytest.raises(ValueError):
        hk.host_gather(staging, offs, inv, Q.IQ4_NL, 160, layout="columns")
    with pytest.raises(TypeError):
        hk.host_gather(staging, offs.astype(np.int32), inv, Q.IQ4_NL, 160)


def test_launch_config():
    for n, width, sms in ((32768, 160, 132), (2048, 10752, 132), (11_000_000, 160, 132), (1, 7, 132), (5, 256, 1)):
        grid, rpc = dg.launch_config(n, width, sms)
        items = -(-width // 8)
        assert grid * rpc >= n > (grid - 1) * rpc
        assert rpc * items < 2**31 and grid < 2**31
    assert dg.launch_config(32768, 160, 132)[0] >= 132 * 8      # a qwen ubatch fills the GPU


def test_gather_rows_rejects_host_arrays():
    with pytest.raises(TypeError, match="cupy array or a torch CUDA tensor"):
        dg.gather_rows(np.zeros(90, np.uint8), np.zeros(1, np.int64), np.zeros(1, np.int64), Q.IQ4_NL, 160)
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="CUDA device"):
        dg.gather_rows(torch.zeros(90, dtype=torch.uint8), torch.zeros(1, dtype=torch.int64),
                       torch.zeros(1, dtype=torch.int64), Q.IQ4_NL, 160)


# ---- device compiles ----------------------------------------------------------------------------------------------
def test_nvcc_sm90_compiles_every_kernel(tmp_path):
    """nvcc -arch=sm_90 builds all 252 instances (30 row types x 3 dtypes x 2 index types, and 3 scaled types x 4
    scale types x 3 x 2 scaled ones), without spills."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found: the sm_90 compile check of kernels/gather.cu cannot run")
    from gds_gather.gpu.kernel_sources import write_sources
    write_sources(tmp_path, tables.KERNEL_SOURCES)
    flags = [f"-D{k}={v}" for k, v in tables.defines().items()]
    cmd = [nvcc, "-std=c++17", "-arch=sm_90", "--fmad=false", "--ftz=false", "-cubin", "-DGG_INSTANTIATE_ALL",
           "-Xptxas", "-v", *flags, "-o", str(tmp_path / "gather.cubin"), str(tmp_path / "gather.cu")]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "warning" not in res.stderr.lower(), res.stderr[-4000:]
    log = res.stderr + res.stdout
    n_scaled = 6 * len(dg.SCALED_TYPES) * len(dg.SCALE_TYPES)
    assert log.count("Compiling entry function") == len(ALL_KERNELS) == 6 * len(row_types()) + n_scaled == 252
    assert "bytes spill stores" in log
    spills = [ln for ln in log.splitlines() if "spill" in ln and " 0 bytes spill stores, 0 bytes spill loads" not in ln]
    assert not spills, spills[:3]
    print(f"nvcc sm_90, {len(ALL_KERNELS)} kernels: {time.perf_counter() - t0:.1f} s")


def test_nvrtc_compiles_every_kernel():
    """The NVRTC translation unit with its name expressions, as cupy.RawModule compiles it (skips without NVRTC)."""
    try:
        from cupy.cuda import compiler
        prog = compiler._NVRTCProgram(tables.source(), "gather.cu", name_expressions=list(ALL_KERNELS))
    except Exception as e:   # cupy absent, or libnvrtc not loadable
        pytest.skip(f"NVRTC not available here ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
    # the options CuPy's RawModule ends up passing (it appends -ftz=true and the default execution space)
    _, mapping = prog.compile(nvrtc.NVRTC_OPTIONS + ("-ftz=true", "-arch=sm_90", "--device-as-default-execution-space"))
    assert len(mapping) == len(ALL_KERNELS)
    assert all(v.startswith("_Z16gg_gather_scaled" if k.startswith("gg_gather_scaled") else "_Z9gg_gather")
               for k, v in mapping.items())


# ---- gather_rows' Python side, with a stand-in for cupy whose "kernel" is the host build ----------------------------
class _FakeDeviceArray:
    """A numpy array dressed as a cupy array (module 'cupy...', .data.ptr, .device.id)."""

    def __init__(self, a):
        self.a = np.asarray(a)
        self.data = type("Ptr", (), {"ptr": self.a.ctypes.data})()
        self.device = type("Dev", (), {"id": 0})()
        self.flags, self.dtype, self.shape, self.nbytes = self.a.flags, self.a.dtype, self.a.shape, self.a.nbytes


_FakeDeviceArray.__module__ = "cupy._fake"


class _Ctx:
    def __init__(self, *a, **k):
        self.id, self.attributes, self.ptr = 0, {"MultiProcessorCount": 3}, 77

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass


class _FakeCupy:
    class cuda:
        Device = _Ctx

        class Stream:
            seen = []

            @classmethod
            def from_external(cls, obj):
                cls.seen.append(obj.__cuda_stream__())
                return _Ctx()

        @staticmethod
        def get_current_stream():
            return _Ctx()

    @staticmethod
    def empty(shape, dtype):
        return _FakeDeviceArray(np.full(shape, 0x7f, np.dtype(dtype)))

    @staticmethod
    def asarray(a):
        return _FakeDeviceArray(a)


def test_gather_rows_launch_plumbing(lib, monkeypatch):
    """gather_rows' checks, allocation, launch configuration and kernel arguments, run through the host build."""
    launches = []

    def fake_kernel(qt_id, dtype, index_dtype):
        def launch(grid, block, args):
            st, off, inv, out, tab, n, row_elems, seg, rpc, scale, has_scale = args
            assert all(isinstance(p, np.uint64) for p in (st, off, inv, out))
            assert isinstance(tab, _FakeDeviceArray) and tab.a is not None
            assert (type(n), type(row_elems), type(seg), type(rpc), type(scale), type(has_scale)) == \
                (np.int64, np.int32, np.int32, np.int32, np.float32, np.int32)
            assert block == (dg.BLOCK,) and grid[0] * int(rpc) >= int(n) > (grid[0] - 1) * int(rpc)
            launches.append((qt_id, dtype, index_dtype))
            rc = hk.host_library().gg_host_gather(
                qt_id, dg.OUT_DTYPES[dtype], int(index_dtype == "int64"), int(st), int(off), int(inv), int(out),
                tab.a.ctypes.data, int(n), int(row_elems), int(seg), float(scale), int(has_scale))
            assert rc == 0
        return launch

    monkeypatch.setattr(dg, "_cupy", lambda: _FakeCupy)
    monkeypatch.setitem(sys.modules, "cupy", _FakeCupy)     # arrays.cupy_stream wraps the stream handle
    monkeypatch.setattr(dg, "_kernel", fake_kernel)
    monkeypatch.setattr(dg, "_dev_tables", {})
    monkeypatch.setattr(dg, "_dev_sms", {})
    rng = np.random.default_rng(12)
    for qt, width, n_layer, shape in ((Q.IQ4_NL, 160, None, (50, 16)), (Q.Q5_K, 768, 3, (40,)), (Q.F16, 7, None, (9,))):
        block, size = GGML_QUANT_SIZES[qt]
        rb = width // block * size
        table = random_blocks(qt, 30 * width // block, rng).reshape(30, rb)
        ids = rng.integers(0, 30, shape)
        plan = plan_rows(ids, n_rows=30, row_bytes=rb, data_offset=1000, align=512)
        staging = window_staging(table, plan, 1000)
        layout = "flat" if n_layer is None else "per_layer"
        for idx in (np.int64, np.int32):
            inv = plan.inverse.astype(idx).reshape(shape)
            for dtype in ("float32", "float16", "bfloat16"):
                kw = dict(dtype=dtype, scale=16.0 if n_layer else None, layout=layout, n_layer=n_layer)
                got = dg.gather_rows(_FakeDeviceArray(staging), _FakeDeviceArray(plan.row_staging),
                                     _FakeDeviceArray(inv), qt, width, stream=1234, **kw)
                ref = hk.reference_gather(staging, plan.row_staging, inv, qt, width, **kw)
                assert isinstance(got, _FakeDeviceArray) and got.shape == ref.shape
                np.testing.assert_array_equal(got.a.view(np.uint8), ref.view(np.uint8))
    assert len(launches) == 3 * 2 * 3 and _FakeCupy.cuda.Stream.seen[-1] == (0, 1234)
    st = _FakeDeviceArray(np.zeros(90, np.uint8))
    off = _FakeDeviceArray(np.zeros(1, np.int64))
    with pytest.raises(TypeError):          # int32 offsets
        dg.gather_rows(st, _FakeDeviceArray(np.zeros(1, np.int32)), _FakeDeviceArray(np.zeros(3, np.int64)),
                       Q.IQ4_NL, 160)
    with pytest.raises(TypeError):          # float ids
        dg.gather_rows(st, off, _FakeDeviceArray(np.zeros(3, np.float32)), Q.IQ4_NL, 160)
    with pytest.raises(ValueError):         # wrong out shape
        dg.gather_rows(st, off, _FakeDeviceArray(np.zeros(3, np.int64)), Q.IQ4_NL, 160,
                       out=_FakeDeviceArray(np.zeros((2, 160), np.float32)))
    with pytest.raises(ValueError):         # not contiguous
        dg.gather_rows(st, off, _FakeDeviceArray(np.zeros((3, 2), np.int64)[:, :1]), Q.IQ4_NL, 160)
    assert len(launches) == 18


# ---- the host build itself, and the argument checks before any launch ---------------------------------------------
def test_host_build_compiles_into_an_empty_cache(lib, tmp_path, monkeypatch):
    """A cold cache (an empty temp dir): the source is compiled into gds_gather-<uid>/gg_host_<hash>.so, whose
    geometry is gguf's; the build directory is gone afterwards; a second call loads the same file."""
    import tempfile
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    dll = hk.host_library.__wrapped__(False)
    cache = tmp_path / f"gds_gather-{os.getuid()}"
    built = list(cache.iterdir())
    assert len(built) == 1 and built[0].name.startswith("gg_host_") and built[0].suffix == ".so"
    qk, ts = ctypes.c_int(), ctypes.c_int()
    assert dll.gg_geometry(int(Q.Q6_K), qk, ts) == 0 and (qk.value, ts.value) == GGML_QUANT_SIZES[Q.Q6_K]
    mtime = built[0].stat().st_mtime_ns
    hk.host_library.__wrapped__(False)
    assert list(cache.iterdir()) == built and built[0].stat().st_mtime_ns == mtime


def test_host_build_failure_says_what_the_compiler_said(lib, tmp_path, monkeypatch):
    import tempfile
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no g++/c++/clang++")
    monkeypatch.setattr(hk, "host_compiler", lambda: [cxx, "-x", "c++", "--no-such-flag-gg"])
    with pytest.raises(BackendError, match=r"(?s)host build of the kernels failed \(.*\):\n.*no-such-flag-gg"):
        hk.host_library.__wrapped__(False)
    assert [p.name for p in (tmp_path / f"gds_gather-{os.getuid()}").iterdir()] == []


def test_host_compiler_choice(monkeypatch):
    """g++/c++/clang++ first; nvcc's host path when only nvcc is on PATH; none: a clear error, no build."""
    monkeypatch.setattr(shutil, "which", lambda n: "/opt/cuda/bin/nvcc" if n == "nvcc" else None)
    cmd = hk.host_compiler()
    assert cmd[0] == "/opt/cuda/bin/nvcc" and cmd[-2:] == ["-x", "cu"] and "--fmad=false" in cmd
    monkeypatch.setattr(shutil, "which", lambda n: None)
    assert not hk.host_compiler_available()
    with pytest.raises(BackendError, match=r"needs a C\+\+ compiler \(g\+\+, clang\+\+\) or nvcc"):
        hk.host_library.__wrapped__(False)


def test_host_helpers_reject_bad_arguments(lib):
    with pytest.raises(ValueError, match=r"shapes differ: \(3,\) and \(4,\)"):
        hk.host_mul(np.ones(3), np.ones(4))
    with pytest.raises(UnsupportedTypeError, match="Q8_1 is not in the CUDA source"):
        hk.host_geometry(Q.Q8_1)
    staging, offs, inv = np.zeros(90, np.uint8), np.zeros(1, np.int64), np.zeros(2, np.int64)
    with pytest.raises(TypeError, match="staging must be uint8, got float32"):
        hk.host_gather(staging.astype(np.float32), offs, inv, Q.IQ4_NL, 160)
    with pytest.raises(TypeError, match=r"row_offsets must be a 1-D int64 array, got int64 \(1, 1\)"):
        hk.host_gather(staging, offs.reshape(1, 1), inv, Q.IQ4_NL, 160)
    with pytest.raises(TypeError, match="inverse must be int32 or int64, got uint8"):
        hk.host_gather(staging, offs, inv.astype(np.uint8), Q.IQ4_NL, 160)
    with pytest.raises(RowWidthError, match=r"row_elems=268435456 is beyond what the kernels index \(2\^28\)"):
        hk.host_gather(staging, offs, inv, Q.F32, 2**28)


def test_launch_checks_on_host_arrays():
    """check_launch(host=True), HostAccel's checks: torch CPU tensors must be contiguous, other objects refused."""
    torch = pytest.importorskip("torch")
    st, off = np.zeros(90, np.uint8), np.zeros(1, np.int64)
    g = dg.check_launch(st, off, torch.zeros(3, dtype=torch.int64), Q.IQ4_NL, 160, host=True)
    assert (g.kind, g.dev, g.shape, g.n) == ("torch", -1, (3, 160), 3)
    with pytest.raises(ValueError, match="inverse must be contiguous"):
        dg.check_launch(st, off, torch.zeros(3, 2, dtype=torch.int64)[:, 0], Q.IQ4_NL, 160, host=True)
    with pytest.raises(TypeError, match=r"staging must be a host array or a torch CPU tensor \(HostAccel\), got list"):
        dg.check_launch([0] * 90, off, np.zeros(3, np.int64), Q.IQ4_NL, 160, host=True)


def test_stream_handles():
    """A stream given as an object with __cuda_stream__ (the CUDA stream protocol: (version, handle)) gives its
    handle; anything else is refused, naming it."""
    class Proto:
        def __cuda_stream__(self):
            return (0, 0xBEEF)
    assert dg._stream_handle(Proto(), "cupy", 0) == 0xBEEF
    assert dg._stream_handle(np.int64(77), "cupy", 0) == 77
    with pytest.raises(TypeError,
                       match="stream must be a torch or cupy stream, a raw handle \\(int\\) or None, got 'x'"):
        dg._stream_handle("x", "cupy", 0)


def test_no_cupy_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)          # import cupy raises ImportError
    with pytest.raises(BackendError, match=r"the GPU gather needs cupy \(pip install 'gds-gather\[cuda13\]'"):
        dg.warmup(Q.Q4_0)
    with pytest.raises(TypeError):                          # not a dtype at all: refused by name, as "uint8" is
        dg.kernel_name("Q4_0", "float32", object())
