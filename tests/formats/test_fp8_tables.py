"""Float8 tables (issue 36): safetensors F8_E4M3 / F8_E5M2 rows, unscaled and scaled, through Table.

The oracle is independent of torch, ml_dtypes and the project: a bit-level decoder of the two formats (and of
UE8M0) in plain Python integers (`decode`), and checkpoints written byte by byte here (`write_checkpoint`).
"""
from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest

from gds_gather import open_table
from gds_gather.config import Config
from gds_gather.errors import HeaderError, TableNotFoundError, UnsupportedTypeError
from gds_gather.formats import quants

TABLE = "model.embed_tokens_per_layer.weight"


def decode(kind: str, byte: int) -> float:
    """The value of one float8 byte from the formats' definitions (OCP 8-bit floating point spec, UE8M0)."""
    byte = int(byte)
    if kind == "F8_E8M0":
        return math.nan if byte == 0xFF else math.ldexp(1.0, byte - 127)
    ebits, bias = (4, 7) if kind == "F8_E4M3" else (5, 15)
    mbits = 7 - ebits
    neg = byte >> 7
    e = (byte >> mbits) & ((1 << ebits) - 1)
    m = byte & ((1 << mbits) - 1)
    if kind == "F8_E4M3" and e == 15 and m == 7:
        v = math.nan
    elif kind == "F8_E5M2" and e == 31:
        v = math.inf if m == 0 else math.nan
    elif e == 0:
        v = math.ldexp(m, 1 - bias - mbits)
    else:
        v = math.ldexp((1 << mbits) + m, e - bias - mbits)
    return -v if neg else v      # -0.0 and -inf kept; -nan's sign is checked separately


def f32_bits(values) -> np.ndarray:
    return np.array([struct.unpack("<I", struct.pack("<f", v))[0] for v in values], np.uint32)


def bf16_rne(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even, by integer arithmetic (NaN: quiet, sign kept)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return np.where(np.isnan(x), (u >> 16) | 0x40, r).astype(np.uint16)


def write_checkpoint(d, tensors: dict, config: dict | None = None):
    """model.safetensors by hand: {name: (dtype, shape, bytes)}; config.json beside it."""
    header, blob = {}, b""
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [len(blob), len(blob) + len(data)]}
        blob += data
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    d.mkdir(parents=True, exist_ok=True)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + blob)
    (d / "config.json").write_text(json.dumps(config or {"model_type": "gemma4_text", "num_hidden_layers": 2,
                                                          "hidden_size_per_layer_input": 8}))
    return d


@pytest.fixture(params=["F8_E4M3", "F8_E5M2"])
def kind(request):
    return request.param


def every_byte_table(tmp_path, kind, extra=None):
    raw = np.arange(256, dtype=np.uint8).reshape(16, 16)      # every byte value once
    t = {TABLE: (kind, (16, 16), raw.tobytes())}
    t.update(extra or {})
    return write_checkpoint(tmp_path / "ckpt", t), raw


def test_every_byte_value_float32_and_float16(tmp_path, kind):
    d, raw = every_byte_table(tmp_path, kind)
    want = [decode(kind, b) for b in range(256)]
    with open_table(d, config=Config(cache_bytes=0)) as t:
        assert t.qtype.name == kind and t.row_bytes == 16 and t.scales is None
        ids = np.arange(16)[::-1].copy()
        got = t.gather(ids).reshape(16, 16)[::-1].ravel()
        nan = np.isnan(np.array(want))
        assert np.array_equal(np.isnan(got), nan)
        assert np.array_equal(got.view(np.uint32)[~nan], f32_bits(want)[~nan])       # -0 and inf bit for bit
        assert np.array_equal(np.signbit(got[nan]), raw.ravel()[nan] >= 0x80)          # NaN keeps its sign
        h = t.gather(ids, dtype=np.float16).reshape(16, 16)[::-1].ravel()
        assert np.array_equal(h.astype(np.float32)[~nan], np.array(want, np.float32)[~nan])   # exact in f16
        assert np.isnan(h[nan]).all()
        assert np.array_equal(t.read_rows(np.array([3])), raw[3:4])          # raw rows are the bytes


def test_bfloat16_is_correctly_rounded(tmp_path, kind):
    torch = pytest.importorskip("torch")
    scales = np.linspace(0.3, 7.1, 16, dtype=np.float32).tobytes()
    d, _ = every_byte_table(tmp_path, kind, {TABLE + "_scale": ("F32", (16,), scales)})
    with open_table(d) as t:
        got = t.gather(torch.arange(16), dtype=torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        f32 = t.gather(np.arange(16))
    want = bf16_rne(f32)
    nan = np.isnan(f32)
    assert np.array_equal(got[~nan], want[~nan]) and np.isnan(f32).sum() == (got & 0x7FFF > 0x7F80).sum()


def scaled_oracle(raw, kind, scales, skind, kr, kc):
    """value x scale, one float32 multiply, scale of row r // kr and element j // kc."""
    v = np.array([[decode(kind, b) for b in row] for row in raw], np.float32)
    s = np.array([[decode(skind, b) if skind == "F8_E8M0" else float(b) for b in row] for row in scales], np.float32)
    full = s[np.arange(raw.shape[0])[:, None] // kr, np.arange(raw.shape[1])[None, :] // kc]
    return v * full


@pytest.mark.parametrize("skind", ["F32", "BF16", "F8_E8M0"])
@pytest.mark.parametrize("layout", ["tensor", "row", "row32", "block128"])
def test_scaled_tables(tmp_path, kind, skind, layout):
    rng = np.random.default_rng(1)
    n_rows, width = 300, 160                                   # qwen4exp's 160-wide rows; 32 does not divide 300
    raw = rng.integers(0, 256, (n_rows, width), dtype=np.uint8)
    raw[(raw & 0x7F) >= 0x7C] = 0x11                            # keep to finite values here (NaN/inf: above)
    kr, kc = {"tensor": (n_rows, width), "row": (1, width), "row32": (1, 32), "block128": (128, 128)}[layout]
    shape = (-(-n_rows // kr), -(-width // kc))
    if skind == "F8_E8M0":
        sc = rng.integers(120, 135, shape, dtype=np.uint8)
        data, svals = sc.tobytes(), sc
    else:
        sv = rng.uniform(0.01, 3.0, shape).astype(np.float32)
        if skind == "BF16":
            bits = (sv.view(np.uint32) >> 16).astype(np.uint16)
            sv = (bits.astype(np.uint32) << 16).view(np.float32)
            data = bits.tobytes()
        else:
            data = sv.tobytes()
        svals = sv
    sshape = {"tensor": [1], "row": [n_rows], "row32": list(shape), "block128": list(shape)}[layout]
    sname = TABLE + ("_scale_inv" if layout == "block128" else "_scale")
    d = write_checkpoint(tmp_path / "ck", {TABLE: (kind, (n_rows, width), raw.tobytes()),
                                           sname: (skind, sshape, data)})
    want = scaled_oracle(raw, kind, svals, skind, kr, kc)
    ids = rng.integers(0, n_rows, (7, 9))
    with open_table(d) as t:
        assert t.scales is not None and t.scales.name == sname
        got = t.gather(ids)
        assert np.array_equal(got.view(np.uint32), want[ids].view(np.uint32))
        with np.errstate(over="ignore"):            # e5m2 x scale beyond float16's range is inf, both ways
            assert np.array_equal(t.gather(ids, dtype=np.float16), want[ids].astype(np.float16))
        assert "scales" in t.describe() and sname in t.describe()["scales"]
    with open_table(d, scales=False) as t:                      # the float8 values alone
        assert np.array_equal(t.gather(ids), scaled_oracle(raw, kind, np.ones((1, 1)), "F32", n_rows, width)[ids])


def test_scale_found_by_name_or_argument_and_refusals(tmp_path):
    raw = np.full((64, 64), 0x38, np.uint8)                     # e4m3 1.0
    sc = np.full((64, 2), 128, np.uint8)                        # e8m0 2.0, per 32 elements
    d = write_checkpoint(tmp_path / "a", {TABLE: ("F8_E4M3", (64, 64), raw.tobytes()),
                                          "my.scales": ("F8_E8M0", (64, 2), sc.tobytes())})
    with open_table(d) as t:
        assert t.scales is None and (t.gather(np.arange(3)) == 1.0).all()
    with open_table(d, scales="my.scales") as t:
        assert (t.gather(np.arange(3)) == 2.0).all() and t.scales.block == 32
    with pytest.raises(TableNotFoundError, match="no scale tensor 'nope'"):
        open_table(d, scales="nope")
    with pytest.raises(HeaderError, match="does not map onto"):
        open_table(d, scales="my.scales", scale_block=16)      # 4 blocks a row, the tensor has 2
    bad = write_checkpoint(tmp_path / "b", {TABLE: ("F8_E4M3", (64, 64), raw.tobytes()),
                                            TABLE + "_scale": ("I32", (64,), np.ones(64, np.int32).tobytes())})
    with pytest.raises(UnsupportedTypeError, match="scales must be F32, BF16, F8_E8M0"):
        open_table(bad)
    bf = write_checkpoint(tmp_path / "c", {TABLE: ("BF16", (4, 8), b"\0" * 64)})
    with pytest.raises(UnsupportedTypeError, match="float8 tables"):
        open_table(bf, scales="x")


def test_block_size_from_config(tmp_path):
    """A 2-D block the shape leaves open ([1, 1] for 100 x 96: any block >= 100 rows) comes from config.json."""
    raw = np.full((100, 96), 0x38, np.uint8)
    cfg = {"model_type": "gemma4_text", "quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 48]}}
    sv = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    d = write_checkpoint(tmp_path / "k", {TABLE: ("F8_E4M3", (100, 96), raw.tobytes()),
                                          TABLE + "_scale_inv": ("F32", (2, 2), sv.tobytes())}, cfg)
    with open_table(d) as t:
        assert (t.scales.row_block, t.scales.block) == (64, 48)
        g = t.gather(np.array([0, 63, 64, 99]))
        assert np.array_equal(g[:, :48], np.array([[1.0], [1.0], [3.0], [3.0]]).repeat(48, 1))
        assert np.array_equal(g[:, 48:], np.array([[2.0], [2.0], [4.0], [4.0]]).repeat(48, 1))


def test_gguf_may_not_carry_float8_ids():
    assert {int(t) for t in quants.FP8_TYPES}.isdisjoint(int(t) for t in quants.Q)
    assert quants.RowType.BF16 == quants.Q.BF16 and quants.qtype_of("f8_e4m3") is quants.RowType.F8_E4M3


def test_engram_layout(tmp_path):
    """DeepSeek-V4.1's Engram: `layers.N.engram.embed.weight` F8_E4M3 [rows, 256] with UE8M0 `...engram.embed.scale`
    [rows, 8] (vLLM's deepseek_v41 loader maps that name to weight_scale_inv); one table per layer, picked by name."""
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 0x70, (50, 256), dtype=np.uint8)
    sc = rng.integers(118, 136, (50, 8), dtype=np.uint8)
    d = write_checkpoint(tmp_path / "e", {"layers.2.engram.embed.weight": ("F8_E4M3", (50, 256), raw.tobytes()),
                                          "layers.2.engram.embed.scale": ("F8_E8M0", (50, 8), sc.tobytes())})
    with open_table(d) as t:
        assert t.name == "layers.2.engram.embed.weight" and t.scales.block == 32
        assert np.array_equal(t.gather(np.arange(50)), scaled_oracle(raw, "F8_E4M3", sc, "F8_E8M0", 1, 32))
    two = write_checkpoint(tmp_path / "f", {f"layers.{i}.engram.embed.weight": ("F8_E4M3", (50, 256), raw.tobytes())
                                            for i in (2, 15)})
    with pytest.raises(TableNotFoundError, match="several Engram tables"):
        open_table(two)
    with open_table(two, "layers.15.engram.embed.weight") as t:
        assert t.scales is None


def e2m1(nibble: int) -> float:
    """OCP MX E2M1: sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is subnormal (0 or 0.5)."""
    e, m = (nibble >> 1) & 3, nibble & 1
    v = m * 0.5 if e == 0 else math.ldexp(1 + m / 2, e - 1)
    return -v if nibble & 8 else v


@pytest.mark.parametrize("width", [64, 160])
def test_nvfp4_modelopt_layout(tmp_path, width):
    """ModelOpt's NVFP4: U8 [rows, n/2] packed E2M1 (low nibble first), F8_E4M3 `_scale` [rows, n/16], F32 `_scale_2`:
    value = e2m1 x (scale x scale_2), as vLLM's dequantize_to_dtype computes it."""
    rng = np.random.default_rng(3)
    rows = 40
    packed = rng.integers(0, 256, (rows, width // 2), dtype=np.uint8)
    sc = rng.integers(0x08, 0x7E, (rows, width // 16), dtype=np.uint8)          # finite e4m3, subnormals too
    g = np.float32(0.00137)
    d = write_checkpoint(tmp_path / "n", {TABLE: ("U8", (rows, width // 2), packed.tobytes()),
                                          TABLE + "_scale": ("F8_E4M3", (rows, width // 16), sc.tobytes()),
                                          TABLE + "_scale_2": ("F32", (), g.tobytes())})
    vals = np.array([[e2m1(int(b) & 15), e2m1(int(b) >> 4)] for b in packed.ravel()], np.float32).reshape(rows, width)
    s = np.array([[decode("F8_E4M3", int(b)) for b in r] for r in sc], np.float32) * g     # scale x global first
    want = vals * np.repeat(s, 16, axis=1)
    with open_table(d) as t:
        assert t.qtype.name == "F4_E2M1" and t.row_elems == width and t.row_bytes == width // 2
        assert t.scales.global_scale == float(g) and t.scales.block == 16
        ids = rng.integers(0, rows, 25)
        assert np.array_equal(t.gather(ids).view(np.uint32), want[ids].view(np.uint32))
        assert np.array_equal(t.read_rows(ids), packed[ids])
    plain = write_checkpoint(tmp_path / "u", {TABLE: ("U8", (rows, width // 2), packed.tobytes())})
    with pytest.raises(UnsupportedTypeError, match="NVFP4: U8 with F8_E4M3 scales"):
        open_table(plain)                                                      # bytes without scales: no table
