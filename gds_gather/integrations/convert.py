"""`gds-gather convert`: a model's PLE table alone, as a GGUF file, optionally quantized with gguf's quantizers.

The source is anything open_table reads: a Hugging Face model directory (model.safetensors or a sharded index),
one .safetensors file, or a GGUF. Rows are streamed in chunks (about 32 MiB of float32 each, the only memory it
needs), dequantized exactly (gds_gather.formats.quants), quantized with ``gguf.quants.quantize``, measured against the
source, and written through gds_gather.io.safe_write (a temporary file beside the target, then a rename; a target
that is not a regular file is refused). Without --qtype the rows are copied byte for byte (exact).

The output keeps llama.cpp's tensor name ``per_layer_token_embd.weight`` and the metadata ``gds-gather info``,
open_table and offload_per_layer_embeddings use (general.architecture gemma4/gemma3n, {arch}.block_count,
{arch}.embedding_length_per_layer_input), plus what the conversion cost:
``gds_gather.integrations.convert.max_abs_error`` and ``.rms_error`` (vs the source rows, over the whole table),
``.max_abs_value``, ``.source``, ``.source_type``. gguf's Python quantizers exist for F32 F16 BF16 Q4_0 Q4_1 Q5_0
Q5_1 Q8_0 TQ1_0 TQ2_0 MXFP4 only; the K and IQ types (Q6_K, Q4_K, IQ4_NL, ...) need llama.cpp's llama-quantize
and are refused here.
"""
from __future__ import annotations

import functools
import math
import struct
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf import quants as gq
from tqdm import tqdm

from ..formats import quants
from ..config import Config
from ..errors import GatherError, UnsupportedTypeError
from ..io.safe_write import atomic_output, check_free_space, check_output
from ..table import DEFAULT_TENSOR, open_table

CHUNK_BYTES = 32 << 20            # float32 bytes of rows per chunk
KEY = "gds_gather.integrations.convert."
ERROR_KEYS = ("max_abs_error", "rms_error", "max_abs_value")


@functools.cache
def quantizable_types() -> tuple[GGMLQuantizationType, ...]:
    """The table types gguf.quants.quantize can write (checked against the installed gguf)."""
    return quants.implemented(quants.supported_types(), lambda qt: gq.quantize(
        np.zeros((1, quants.block_geometry(qt)[0]), np.float32), qt))


def check_qtype(qtype) -> GGMLQuantizationType:
    qt = quants.qtype_of(qtype)
    if qt not in quantizable_types():
        have = " ".join(t.name for t in quantizable_types())
        raise UnsupportedTypeError(f"gguf has no quantizer for {qt.name}; convert writes {have} (K and IQ types "
                                   f"need llama.cpp's llama-quantize)")
    return qt


def _patch_float64(path: Path, values: dict[str, float]) -> None:
    """Overwrite the FLOAT64 metadata values written as placeholders (their keys are unique in the header)."""
    with open(path, "r+b") as f:
        head = f.read(1 << 20)
        for key, v in values.items():
            k = key.encode()
            at = head.find(struct.pack("<Q", len(k)) + k)
            if at < 0 or head.find(struct.pack("<Q", len(k)) + k, at + 1) >= 0:
                raise GatherError(f"{path}: cannot place metadata {key!r}")
            f.seek(at + 8 + len(k) + 4)      # key length, key, value type (u32), then the value
            f.write(struct.pack("<d", v))


def convert(source, output, qtype=None, *, tensor: str = DEFAULT_TENSOR, progress: bool = True,
            chunk_bytes: int = CHUNK_BYTES, config: Config | None = None) -> dict:
    """Write the table of `source` alone to the GGUF `output`; returns what was written (types, bytes, error)."""
    output = check_output(output)
    with open_table(source, tensor, config or Config.from_env()) as t:
        if qtype is None and quants.is_small_float(t.qtype):
            raise UnsupportedTypeError(f"{t.path}: {t.name!r} is {t.qtype.name}{' (scaled)' if t.scales else ''}, "
                                       f"and GGUF has no float8 type: pass --qtype BF16 (exact for unscaled "
                                       f"E4M3/E5M2 rows) or Q8_0 (the error is measured and recorded)")
        qt = t.qtype if qtype is None else check_qtype(qtype)
        rb = quants.row_bytes(qt, t.row_elems, what=f"{qt.name} table")
        if output.exists() and output.resolve() == Path(t.path).resolve():
            raise GatherError(f"{output} is the source file; write the table somewhere else")
        nbytes = rb * t.n_rows
        check_free_space(output, nbytes + (1 << 20))
        arch = t.arch or "gemma4"
        exact = qt == t.qtype
        chunk = max(1, chunk_bytes // (t.row_elems * 4))
        with atomic_output(output) as tmp:
            w = GGUFWriter(tmp, arch)
            for key in ("block_count", "embedding_length_per_layer_input"):
                v = t.field(f"{arch}.{key}")
                if isinstance(v, int):
                    w.add_uint32(f"{arch}.{key}", v)
            w.add_string(KEY + "source", str(t.path))
            w.add_string(KEY + "source_tensor", t.name)
            w.add_string(KEY + "source_type", t.qtype.name)
            for k in ERROR_KEYS:
                w.add_float64(KEY + k, math.nan)          # placeholders, patched once every row is measured
            w.add_tensor_info(DEFAULT_TENSOR, (t.n_rows, rb), np.dtype(np.uint8), nbytes, raw_dtype=quants.Q(int(qt)))
            max_err = sq = max_val = 0.0
            try:
                w.write_header_to_file()
                w.write_kv_data_to_file()
                w.write_ti_data_to_file()
                fout = w.fout[0]
                w.write_padding(fout, fout.tell())
                with open(t.path, "rb") as src, tqdm(total=nbytes, unit="B", unit_scale=True, disable=not progress,
                                                     desc=f"{t.qtype.name} -> {qt.name}") as bar:
                    src.seek(t.data_offset)
                    for a in range(0, t.n_rows, chunk):
                        n = min(chunk, t.n_rows - a)
                        raw = np.frombuffer(src.read(n * t.row_bytes), np.uint8)
                        if raw.size != n * t.row_bytes:
                            raise GatherError(f"{t.path}: the table ends early (row {a + raw.size // t.row_bytes})")
                        x = t.dequantize(raw.reshape(n, t.row_bytes), np.arange(a, a + n))
                        out = raw if exact else np.ascontiguousarray(gq.quantize(x, quants.Q(int(qt)))).view(np.uint8)
                        if not exact:
                            d = quants.dequantize_rows(out.reshape(n, rb), qt, t.row_elems).astype(np.float64) - x
                            with np.errstate(invalid="ignore"):
                                max_err = max(max_err, float(np.abs(d).max()))
                            sq += float(np.square(d).sum())
                        max_val = max(max_val, float(np.abs(x).max()))
                        fout.write(memoryview(out).cast("B"))
                        bar.update(out.nbytes)
                w.write_padding(fout, nbytes)
            finally:
                w.close()
            rms = math.sqrt(sq / (t.n_rows * t.row_elems))
            _patch_float64(tmp, {KEY + "max_abs_error": max_err, KEY + "rms_error": rms,
                                 KEY + "max_abs_value": max_val})
        return {"output": str(output), "source": str(t.path), "source_tensor": t.name, "source_type": t.qtype.name,
                "qtype": qt.name, "arch": arch, "n_rows": t.n_rows, "row_elems": t.row_elems, "row_bytes": rb,
                "source_row_bytes": t.row_bytes, "bytes": nbytes, "max_abs_error": max_err, "rms_error": rms,
                "max_abs_value": max_val, "exact": exact}


def describe(table) -> str | None:
    """One line on what `gds-gather convert` recorded in this table's file, or None (not made by convert)."""
    src = table.field(KEY + "source")
    if src is None:
        return None
    st = table.field(KEY + "source_type", "?")
    err, rms, top = (table.field(KEY + k) for k in ERROR_KEYS)
    if st == table.qtype.name:
        return f"{table.qtype.name} rows copied from {src} (exact)"
    return (f"{table.qtype.name} from {st} rows of {src}: max |error| {err:.3g}, RMS {rms:.3g} "
            f"(max |value| {top:.3g})")


def cmd_convert(args, cfg: Config) -> int:
    res = convert(args.model, args.output, args.qtype, tensor=args.tensor, progress=not args.quiet, config=cfg)
    from ..units import fit
    print(fit(f"{res['output']}: {res['n_rows']:,} rows x {res['row_bytes']:,} B {res['qtype']} "
              f"(source {res['source_type']}, {res['source_row_bytes']:,} B/row), "
              + ("exact copy" if res["exact"] else
                 f"max |error| {res['max_abs_error']:.3g}, RMS {res['rms_error']:.3g} (max |value| "
                 f"{res['max_abs_value']:.3g})")))
    return 0
