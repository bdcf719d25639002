"""Write synthetic GGUF models that carry a PLE table laid out exactly as llama.cpp expects.

The table is ``per_layer_token_embd.weight``, GGUF shape [row_width, n_rows] (ggml order),
rows packed back to back. It may be tens of GiB, so it is generated and written in chunks,
never held in memory. Content is deterministic: chunk i of `chunk_rows` rows comes from
``np.random.default_rng([seed, i])``, so chunks are independent and reproducible
(iter_table_chunks regenerates them).
"""
from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf import quants as gq
from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGUFValueType
from tqdm import tqdm

from gds_gather.formats import quants
from gds_gather.errors import UnsupportedTypeError
from gds_gather.io.safe_write import atomic_output, check_free_space, check_output

from .presets import Preset, get_preset
from .qwen4exp import Qwen4expHParams

Q = GGMLQuantizationType

TABLE_NAME = "per_layer_token_embd.weight"
CHUNK_BYTES = 64 << 20          # bytes of table written per chunk
MAX_ROWS = 1 << 31              # ggml_get_rows takes int32 row ids: a larger table is not addressable
_HEADER_ALLOWANCE = 1 << 20     # bytes allowed per file for the header, metadata and padding
CHUNK_ELEMS = 4 << 20           # floats per chunk on the quantize path (gguf makes several float temporaries)

# Byte offsets of the fp16 scale fields (`d`, plus `dmin`/`m` where present) in one block,
# from ggml-common.h, checked against gguf.quants dequantize_blocks.
_FP16_SCALES: dict[GGMLQuantizationType, tuple[int, ...]] = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q2_K: (80, 82),           # scales[16], qs[64], d, dmin
    Q.Q3_K: (108,),             # hmask[32], qs[64], scales[12], d
    Q.Q4_K: (0, 2), Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),             # ql[128], qh[64], scales[16], d
    Q.IQ2_XXS: (0,), Q.IQ2_XS: (0,), Q.IQ2_S: (0,), Q.IQ3_XXS: (0,), Q.IQ3_S: (0,),
    Q.IQ1_S: (0,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,),
    Q.TQ1_0: (52,), Q.TQ2_0: (64,),  # qs..., d last
}
_IQ1M_SCALES = 48   # IQ1_M: qs[32], qh[16], scales u16[4]; fp16 d = top nibbles of the 4 words
_NVFP4_SCALES = 4   # NVFP4: 4 unsigned e4m3 sub-block scales, then qs[32]


@functools.cache
def _quantizable(qtype: GGMLQuantizationType) -> bool:
    """True when the installed gguf can quantize `qtype` (tried once on one block)."""
    block, _ = GGML_QUANT_SIZES[qtype]
    try:
        gq.quantize(np.zeros((1, block), np.float32), qtype)
    except NotImplementedError:
        return False
    return True


def _random_fp16(n: int, rng: np.random.Generator, signed: bool) -> np.ndarray:
    """n finite fp16 values of magnitude 2^-10..2^-3 (~1e-3..1.2e-1), as uint16 bits.

    Built from the bit fields (exponent 5..11, random mantissa), no float math: fast on
    the hundreds of millions of blocks of a full-size table.
    """
    bits = rng.integers(0, 1 << 10, n, dtype=np.uint16)
    bits |= rng.integers(5, 12, n, dtype=np.uint16) << np.uint16(10)
    if signed:
        bits |= rng.integers(0, 2, n, dtype=np.uint16) << np.uint16(15)
    return bits


def _random_bytes(n: int, rng: np.random.Generator) -> np.ndarray:
    """n uniformly random bytes, writable (drawn as u64 words: ~5x faster than rng.bytes)."""
    words = rng.integers(0, np.iinfo(np.uint64).max, (n + 7) // 8, dtype=np.uint64, endpoint=True)
    return words.view(np.uint8)[:n]


def random_blocks(qtype, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n_blocks, type_size] of valid blocks whose dequantized values are finite.

    Types gguf can quantize get real values (normal * 0.05, float32) quantized. The others
    (K and IQ types, NVFP4) get random bytes whose scale fields are then overwritten with
    finite, moderate scales, so the result is a plausible block of any bit pattern.
    """
    qt = quants.qtype_of(qtype)
    block, size = GGML_QUANT_SIZES[qt]
    n_blocks = int(n_blocks)
    if _quantizable(qt):
        x = rng.standard_normal((n_blocks, block), dtype=np.float32) * np.float32(0.05)
        with np.errstate(all="ignore"):   # all-zero sub-blocks divide by zero inside gguf
            q = gq.quantize(x, qt)
        return np.ascontiguousarray(q).view(np.uint8).reshape(n_blocks, size)

    out = _random_bytes(n_blocks * size, rng).reshape(n_blocks, size)
    if qt == Q.IQ1_M:
        words = out[:, _IQ1M_SCALES:_IQ1M_SCALES + 8].copy().view("<u2")           # [n, 4]
        d = _random_fp16(n_blocks, rng, signed=True)
        nibs = (d[:, None] >> np.array([0, 4, 8, 12], np.uint16)) & np.uint16(0xF)  # word k holds bits 4k..4k+3
        words = (words & np.uint16(0x0FFF)) | (nibs << np.uint16(12))
        out[:, _IQ1M_SCALES:_IQ1M_SCALES + 8] = words.astype("<u2").view(np.uint8)
    elif qt == Q.NVFP4:
        # unsigned e4m3, exponent 1..7: 2^-6 .. ~2 (x0.5 in gguf's kvalues convention); never 0x7F
        e = rng.integers(1, 8, (n_blocks, _NVFP4_SCALES), dtype=np.uint8)
        m = rng.integers(0, 8, (n_blocks, _NVFP4_SCALES), dtype=np.uint8)
        out[:, :_NVFP4_SCALES] = (e << np.uint8(3)) | m
    elif qt in _FP16_SCALES:
        for j, off in enumerate(_FP16_SCALES[qt]):
            # d may be negative (real quantizers produce that); dmin/m stay positive
            bits = _random_fp16(n_blocks, rng, signed=(j == 0)).astype("<u2", copy=False)
            out[:, off:off + 2] = bits.view(np.uint8).reshape(n_blocks, 2)
    else:
        raise UnsupportedTypeError(f"no random block recipe for {qt.name}")
    return out


def default_chunk_rows(qtype, row_width: int) -> int:
    """Rows per generated chunk: ~64 MiB of table, fewer on the (float-hungry) quantize path."""
    qt = quants.qtype_of(qtype)
    rows = CHUNK_BYTES // quants.row_bytes(qt, row_width)
    if _quantizable(qt):
        rows = min(rows, CHUNK_ELEMS // row_width)
    return max(1, rows)


def iter_table_chunks(qtype, row_width: int, n_rows: int, seed: int = 0,
                      chunk_rows: int | None = None) -> Iterator[np.ndarray]:
    """Yield the table's rows as uint8 [rows, row_bytes] chunks, chunk i from rng([seed, i])."""
    qt = quants.check_supported(qtype)
    rb = quants.row_bytes(qt, row_width, what="PLE table row")
    block, _ = GGML_QUANT_SIZES[qt]
    chunk_rows = default_chunk_rows(qt, row_width) if chunk_rows is None else int(chunk_rows)
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    blocks_per_row = row_width // block
    for i, start in enumerate(range(0, n_rows, chunk_rows)):
        n = min(chunk_rows, n_rows - start)
        rng = np.random.default_rng([seed, i])
        yield random_blocks(qt, n * blocks_per_row, rng).reshape(n, rb)


def shard_paths(path, count: int) -> list[Path]:
    """llama.cpp gguf-split names: model.gguf -> model-00001-of-0000K.gguf, ..."""
    path = Path(path)
    stem = path.name[:-5] if path.name.endswith(".gguf") else path.name
    return [path.with_name(f"{stem}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def model_kv(preset: Preset, rows: int) -> list[tuple[str, object, GGUFValueType, GGUFValueType | None]]:
    """The architecture metadata llama.cpp reads for `preset`."""
    a, u32 = preset.arch, GGUFValueType.UINT32
    kv = [(f"{a}.block_count", preset.n_layer, u32, None),
          (f"{a}.embedding_length", preset.n_embd, u32, None)]
    if preset.is_ngram:
        return kv + Qwen4expHParams.from_preset(preset, rows).gguf_kv()
    return kv + [
        (f"{a}.embedding_length_per_layer_input", preset.n_embd_per_layer, u32, None),
        (f"{a}.context_length", preset.n_ctx, u32, None),
        (f"{a}.feed_forward_length", preset.n_ff, u32, None),
        (f"{a}.attention.head_count", preset.n_head, u32, None),
        (f"{a}.attention.head_count_kv", preset.n_head_kv, u32, None),
        (f"{a}.attention.key_length", preset.head_dim, u32, None),
        (f"{a}.attention.value_length", preset.head_dim, u32, None),
    ]


def _new_writer(tmp: Path, arch: str, alignment: int, first: bool) -> GGUFWriter:
    w = GGUFWriter(tmp, arch)
    if not first:
        # gguf-split writes only the split.* keys into later shards; keep alignment so each
        # shard parses on its own
        w.kv_data[0].pop("general.architecture", None)
    w.add_custom_alignment(alignment)
    return w


def _add_split_kv(w: GGUFWriter, no: int, count: int, n_tensors: int) -> None:
    w.add_uint16("split.no", no)
    w.add_uint16("split.count", count)
    w.add_int32("split.tensors.count", n_tensors)


def _write_small(w: GGUFWriter, name: str, arr: np.ndarray) -> None:
    """Finish a shard that holds one small in-memory tensor."""
    w.add_tensor(name, arr)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()


def _write_table(w: GGUFWriter, qt, row_width: int, n_rows: int, seed: int,
                 chunk_rows: int | None, progress: bool, desc: str) -> None:
    """Finish a shard whose only tensor is the table, streamed chunk by chunk."""
    rb = quants.row_bytes(qt, row_width)
    nbytes = rb * n_rows
    w.add_tensor_info(TABLE_NAME, (n_rows, rb), np.dtype(np.uint8), nbytes, raw_dtype=qt)
    try:
        _stream_table(w, qt, row_width, n_rows, seed, chunk_rows, progress, desc, nbytes)
    finally:
        w.close()


def _stream_table(w: GGUFWriter, qt, row_width: int, n_rows: int, seed: int,
                  chunk_rows: int | None, progress: bool, desc: str, nbytes: int) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    # same layout as GGUFWriter.write_tensors_to_file: pad to the data section, the tensor,
    # then pad the tensor to the alignment
    w.write_padding(fout, fout.tell())
    written = 0
    with tqdm(total=nbytes, unit="B", unit_scale=True, desc=desc, disable=not progress) as bar:
        for chunk in iter_table_chunks(qt, row_width, n_rows, seed, chunk_rows):
            fout.write(memoryview(chunk).cast("B"))
            written += chunk.nbytes
            bar.update(chunk.nbytes)
    assert written == nbytes
    w.write_padding(fout, nbytes)


def write_model(path, preset, *, qtype=None, rows: int | None = None, seed: int = 0,
                progress: bool = True, split: int | None = None, chunk_rows: int | None = None,
                alignment: int = GGUF_DEFAULT_ALIGNMENT) -> Path:
    """Write a synthetic model with `preset`'s PLE table and metadata; return its (first) path.

    Parameters
    ----------
    path : output file (for split, the name the shard names derive from).
    preset : a Preset or a name in PRESETS.
    qtype : table type (name, id or enum); default the preset's. Raises UnsupportedTypeError
        for a type gds_gather cannot dequantize, RowWidthError when the row width is not
        whole blocks of it.
    rows : table rows; default the preset's. Gemma: the token ids covered. qwen4exp: the
        head vocab sizes are scaled to fit (Qwen4expHParams.from_preset).
    seed : content seed; see iter_table_chunks (content also depends on chunk_rows).
    progress : show a tqdm bar (bytes).
    split : K >= 2 writes llama.cpp gguf-split shards name-0000i-of-0000K.gguf: shard 1 holds
        the metadata, the table is alone in the last shard and earlier shards hold a small
        dummy tensor. None or 1: one file.
    chunk_rows : rows generated and written per chunk (default ~64 MiB worth).
    alignment : general.alignment.

    Every file is written to a temporary file beside it and renamed over it at the end
    (gds_gather.io.safe_write.atomic_output), so an interrupted run leaves no partial model behind
    and a symlink, FIFO, directory or device node at the path is refused, never replaced. The
    bytes it will write are checked against the free space first.
    """
    preset = get_preset(preset)
    qt = quants.check_supported(preset.qtype if qtype is None else qtype)
    width = preset.row_width
    quants.row_bytes(qt, width, what=f"{preset.name} PLE row")   # validates before any file is made
    rows = preset.n_rows if rows is None else int(rows)
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    split = 1 if split is None else int(split)
    if split < 1:
        raise ValueError(f"split must be >= 1, got {split}")

    if rows > MAX_ROWS:
        raise ValueError(f"rows must be at most {MAX_ROWS:,} (llama.cpp's get_rows indexes rows with int32), "
                         f"got {rows:,}")

    finals = [Path(path)] if split == 1 else shard_paths(path, split)
    for final in finals:
        check_output(final)
    check_free_space(finals[-1], quants.row_bytes(qt, width) * rows + _HEADER_ALLOWANCE * split)
    kvs = model_kv(preset, rows)
    rng = np.random.default_rng([seed, 1 << 32])   # dummy tensors: a stream no table chunk uses
    with contextlib.ExitStack() as stack:
        temps = [stack.enter_context(atomic_output(final)) for final in finals]
        for i, tmp in enumerate(temps):
            w = _new_writer(tmp, preset.arch, alignment, first=(i == 0))
            if i == 0:
                w.add_name(f"gds-gather synthetic {preset.name}")
                w.add_quantization_version(2)
                for key, val, vtype, sub in kvs:
                    w.add_key_value(key, val, vtype, sub)
            if split > 1:
                _add_split_kv(w, i, split, split)
            if i < split - 1:
                if i == 0:
                    _write_small(w, "token_embd.weight", (rng.standard_normal((4, 8)) * 0.05).astype(np.float16))
                else:
                    _write_small(w, f"blk.{i - 1}.attn_norm.weight", rng.standard_normal(8).astype(np.float32))
            else:
                desc = finals[i].name
                _write_table(w, qt, width, rows, seed, chunk_rows, progress, desc)
    return finals[0]
