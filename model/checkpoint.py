"""Write synthetic float8 / NVFP4 tables as Hugging Face safetensors checkpoints, the form they are published in.

A checkpoint directory gets ``model.safetensors`` (the table ``model.embed_tokens_per_layer.weight``, F8_E4M3 or
F8_E5M2 ``[rows, row_width]``, and optionally its scales ``..._scale``: one per `scale_block` elements of a row,
F8_E8M0, F32 or BF16; or F4_E2M1 in ModelOpt's NVFP4 layout: U8 ``[rows, row_width / 2]``, F8_E4M3 ``_scale`` per
16 elements and an F32 ``_scale_2``) and ``config.json`` (the text config transformers-style readers take, and under
``gds_gather_gguf_metadata`` the GGUF keys a qwen4exp row mapping needs: a real checkpoint's hash constants are
not in its config). The header is padded so the table starts 4 KiB-aligned. Rows are random finite float8 codes of
moderate magnitude, generated chunk by chunk (chunk i from ``np.random.default_rng([seed, i])``), never held whole;
the file is written through gds_gather.io.safe_write (a temporary file, then a rename).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
from tqdm import tqdm

from gds_gather.errors import GatherError
from gds_gather.formats import quants
from gds_gather.formats.safetensors_file import GGUF_KEYS, PLE_NAMES
from gds_gather.io.safe_write import atomic_output, check_free_space

from .presets import get_preset
from .synth import CHUNK_BYTES, MAX_ROWS, model_kv

SCALE_DTYPES = {"F8_E8M0": 1, "F32": 4, "BF16": 2, "F8_E4M3": 1}
NVFP4_GLOBAL = np.float32(1 / 2688)         # ModelOpt's amax / (6 x 448) for amax 1
DATA_ALIGN = 4096


def _codes(qt, n: int, rng: np.random.Generator) -> np.ndarray:
    """n random float8 codes (a random sign, an exponent field of moderate values, a random mantissa), or n / 2
    random bytes of packed E2M1."""
    if qt == quants.RowType.F4_E2M1:
        return rng.integers(0, 256, n // 2, dtype=np.uint8)
    ebits = 4 if qt == quants.RowType.F8_E4M3 else 5
    mbits = 7 - ebits
    bias = (1 << (ebits - 1)) - 1
    e = rng.integers(bias - 4, bias + 2, n, dtype=np.uint8)           # |value| in [2^-4, 2^2)
    return (rng.integers(0, 2, n, dtype=np.uint8) << 7) | (e << mbits) | rng.integers(0, 1 << mbits, n, dtype=np.uint8)


def _scale_codes(stype: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if stype == "F8_E8M0":
        return rng.integers(120, 131, n, dtype=np.uint8)              # 2^-7 .. 2^3
    if stype == "F8_E4M3":
        return rng.integers(0x20, 0x50, n, dtype=np.uint8)            # 2^-3 .. 2^3
    v = rng.uniform(0.01, 0.5, n).astype(np.float32)
    if stype == "BF16":
        return (v.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    return v.view(np.uint8)


def write_fp8_checkpoint(directory, preset, qtype="F8_E4M3", *, rows: int | None = None, seed: int = 0,
                         scale_type: str | None = None, scale_block: int = 32, progress: bool = True) -> Path:
    """Write `preset`'s table as a float8 safetensors checkpoint into `directory` (new or empty); return it."""
    preset = get_preset(preset)
    qt = quants.qtype_of(qtype)
    if not quants.is_small_float(qt) or qt == quants.RowType.F8_E8M0:
        raise GatherError(f"a float8 checkpoint's table is F8_E4M3, F8_E5M2 or F4_E2M1 (NVFP4), got {qt.name}")
    if qt == quants.RowType.F4_E2M1:        # ModelOpt's layout, always scaled
        scale_type, scale_block = "F8_E4M3", 16
    if scale_type is not None and scale_type not in SCALE_DTYPES:
        raise GatherError(f"scales are {', '.join(SCALE_DTYPES)}, got {scale_type!r}")
    if scale_block < 1:
        raise GatherError(f"scale_block must be >= 1, got {scale_block}")
    rows = preset.n_rows if rows is None else int(rows)
    if not 1 <= rows <= MAX_ROWS:
        raise GatherError(f"rows must be in [1, {MAX_ROWS:,}], got {rows:,}")
    out = Path(directory)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise GatherError(f"{out}: exists and is not an empty directory; a float8 checkpoint is a new directory")
    width = preset.row_width
    n_scales = -(-width // scale_block)
    fp4 = qt == quants.RowType.F4_E2M1
    if fp4 and width % 16:
        raise GatherError(f"an NVFP4 row is whole blocks of 16 elements, got {width}")
    row_bytes = width // 2 if fp4 else width
    tensors = [(PLE_NAMES[0], "U8" if fp4 else qt.name, [rows, row_bytes], rows * row_bytes)]
    if scale_type is not None:
        tensors.append((PLE_NAMES[0] + "_scale", scale_type, [rows, n_scales],
                        rows * n_scales * SCALE_DTYPES[scale_type]))
    if fp4:
        tensors.append((PLE_NAMES[0] + "_scale_2", "F32", [], 4))
    header, at = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape, nbytes in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + nbytes]}
        at += nbytes
    h = json.dumps(header).encode()
    h += b" " * (-(8 + len(h)) % DATA_ALIGN)
    out.mkdir(parents=True, exist_ok=True)
    target = out / "model.safetensors"
    check_free_space(target, 8 + len(h) + at)
    config = {"model_type": preset.arch if preset.is_ngram else f"{preset.arch}_text",
              "num_hidden_layers": preset.n_layer, "hidden_size_per_layer_input": preset.n_embd_per_layer,
              "vocab_size_per_layer_input": rows, "hidden_size": preset.n_embd,
              GGUF_KEYS: {k: v for k, v, _, _ in model_kv(preset, rows)}}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    chunk = max(1, CHUNK_BYTES // row_bytes)
    with atomic_output(target) as tmp, open(tmp, "wb") as f, tqdm(total=at, unit="B", unit_scale=True,
                                                                    disable=not progress, desc=target.name) as bar:
        f.write(struct.pack("<Q", len(h)) + h)
        for i, start in enumerate(range(0, rows, chunk)):
            n = min(chunk, rows - start)
            f.write(_codes(qt, n * width, np.random.default_rng([seed, i])).tobytes())
            bar.update(n * row_bytes)
        if scale_type is not None:
            for i, start in enumerate(range(0, rows, chunk)):
                n = min(chunk, rows - start)
                b = _scale_codes(scale_type, n * n_scales, np.random.default_rng([seed, 1 << 40, i]))
                f.write(b.tobytes())
                bar.update(b.nbytes)
        if fp4:
            f.write(NVFP4_GLOBAL.tobytes())
    return out
