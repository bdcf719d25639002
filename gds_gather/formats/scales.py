"""The scales of a float8 or NVFP4 table, found beside it the way published checkpoints store them (metadata only).

A scaled float8 value is ``fp8 value x scale``, one float32 multiply rounded to nearest (as vLLM's and SGLang's
loaders dequantize: ``weight.to(float32) * scale``), then rounded once more to the output dtype. The scale tensor
sits beside the table under the name its quantizer gives it:

- ``<table>_scale_inv`` (DeepSeek's block FP8: float32 per 128 x 128 block; the name says it is the inverse of
  the quantizer's scale, so it multiplies), ``<table>_scale`` (compressed-tensors and ModelOpt FP8: float32 per
  tensor or per row; OCP MX: UE8M0 per 32 elements); for a table named ``X.weight`` also ``X.weight_scale_inv``
  and ``X.weight_scale``;
- or named by the caller (``open_table(..., scales=NAME)``; ``scales=False`` reads the float8 values unscaled).

Its shape says its granularity: one element (per tensor); ``[rows]`` or ``[rows, 1]`` (per row); ``[rows, nb]``
(per block of ``block`` elements along the row, ``nb = ceil(row_elems / block)``); ``[ceil(rows / kr),
ceil(row_elems / kc)]`` (2-D blocks of kr rows x kc elements). A block size the shape leaves open comes from the
argument, else config.json's ``quantization_config.weight_block_size`` ([kr, kc]) where it fits, else the one
size of 32 and 128 that fits, else the size that divides evenly; anything else is refused with the shapes named.
Scales are F32, BF16, F8_E8M0 or F8_E4M3.

NVFP4 (NVIDIA ModelOpt's layout, as vLLM's ``dequantize_to_dtype`` reads it): packed E2M1 rows (quants.RowType.F4_E2M1)
with F8_E4M3 scales ``<table>_scale`` per 16 elements and a float32 ``<table>_scale_2`` for the tensor: value =
e2m1 x (scale x scale_2), the scale times the global first, each product one float32 multiply.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import HeaderError, TableNotFoundError, UnsupportedTypeError
from .quants import RowType, dequantize_rows, is_small_float
from .safetensors_file import SCALE_TYPES, checkpoint_files, tensor_entry

COMMON_BLOCKS = (32, 128)       # OCP MX blocks; DeepSeek's 128 x 128
SCALE_BYTES = {RowType.F32: 4, RowType.BF16: 2, RowType.F8_E8M0: 1, RowType.F8_E4M3: 1}


@dataclass(frozen=True)
class ScaleSpec:
    """Where a float8 table's scales are and how they map onto its rows.

    Per tensor: `value` is the scale and nothing else is read. Otherwise the scale tensor is a row table of
    `n_rows` rows of `per_row` elements of `stype` at `data_offset` in `path`; table row r takes scale row
    ``r // row_block``, and element j of it scale ``j // block``."""
    name: str
    path: Path
    stype: RowType
    value: float | None
    n_rows: int
    per_row: int
    row_block: int
    block: int
    data_offset: int
    global_scale: float | None = None   # NVFP4's per-tensor `<table>_scale_2`: multiplies each scale first

    def describe(self) -> str:
        t = self.stype.name.replace("F8_", "")
        if self.global_scale is not None:
            t += f" x {self.global_scale:g} ({self.name}_2)"
        if self.value is not None:
            return f"{self.name} ({t}, one per tensor: {self.value:g})"
        if self.row_block > 1:
            return f"{self.name} ({t}, one per {self.row_block} x {self.block} block)"
        if self.per_row == 1:
            return f"{self.name} ({t}, one per row)"
        return f"{self.name} ({t}, one per {self.block} elements of a row)"

    @property
    def kernel_type(self) -> RowType:
        """The type of the scale bytes beside each row (Table.scale_rows): the scale's own, float32 per tensor."""
        return RowType.F32 if self.value is not None else self.stype

    @property
    def kernel_width(self) -> int:
        """Scales beside each row (Table.scale_rows)."""
        return 1 if self.value is not None else self.per_row

    @property
    def kernel_smul(self) -> float:
        """What the kernels multiply each scale by first (dequant.BlockScales.smul): the global scale, else 1."""
        return 1.0 if self.global_scale is None else self.global_scale

    @property
    def kernel_row_bytes(self) -> int:
        """Bytes of the scales beside each row (Table.scale_rows)."""
        return 4 if self.value is not None else self.per_row * SCALE_BYTES[self.stype]

    def rows_of(self, rows: np.ndarray) -> np.ndarray:
        """The scale row of each table row."""
        return rows // self.row_block if self.row_block > 1 else rows

    def expand(self, scale_rows: np.ndarray, row_elems: int) -> np.ndarray:
        """Each element's scale, from decoded scale rows float32 [n, scales a row]: [n, row_elems], or [n, 1] (it
        broadcasts) where a row has one scale (per row, per tensor)."""
        if scale_rows.shape[1] == 1 or self.block == 1:
            return scale_rows
        return np.repeat(scale_rows, self.block, axis=1)[:, :row_elems]


def _scalar(shard: Path, e: dict, base: int) -> float:
    """The value of a one-element scale tensor (its header entry `e`, data base `base`)."""
    with open(shard, "rb") as f:
        f.seek(base + e["data_offsets"][0])
        raw = np.frombuffer(f.read(e["data_offsets"][1] - e["data_offsets"][0]), np.uint8)
    return float(dequantize_rows(raw.reshape(1, -1), SCALE_TYPES[e["dtype"]], 1)[0, 0])


def candidates(table: str) -> list[str]:
    names = [table + "_scale_inv", table + "_scale"]
    if table.endswith(".weight"):
        names += [table.removesuffix(".weight") + ".scale"]
    return names


def _quant_block(config_dir: Path):
    f = config_dir / "config.json"
    try:
        cfg = json.loads(f.read_text(encoding="utf-8")) if f.is_file() else {}
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise HeaderError(f"{f}: bad JSON: {e}") from None
    q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    wbs = q.get("weight_block_size") if isinstance(q, dict) else None
    if isinstance(wbs, list) and len(wbs) == 2 and all(type(v) is int and v > 0 for v in wbs):
        return tuple(wbs)
    return None


def _block_of(given, config, n: int, count: int) -> int | None:
    """The block size along an axis of n elements that gives `count` blocks: the given one (which must fit); else
    the config's where it fits (it may describe the linear weights only); else the one common size that fits;
    else n / count where that divides."""
    fits = lambda b: -(-n // b) == count     # noqa: E731
    if given is not None:
        return given if fits(given) else None
    if config is not None and fits(config):
        return config
    found = [b for b in COMMON_BLOCKS if fits(b)]
    if len(found) == 1:
        return found[0]
    return n // count if n % count == 0 else None


def find_scales(path, table_name: str, qtype, n_rows: int, row_elems: int, name=None, block=None) -> ScaleSpec | None:
    """The ScaleSpec of a float8 table (None: unscaled), from its checkpoint `path` (a model directory, index or
    .safetensors file). name: the scale tensor (None: by the published names; False: none). block: elements per
    scale along a row, or (rows, elements) of a 2-D block, where the shape leaves it open."""
    if name is False or not is_small_float(qtype):
        if name not in (None, False):
            raise UnsupportedTypeError(f"{path}: scales= applies to float8 tables; {table_name!r} is "
                                       f"{RowType(int(qtype)).name}")
        return None
    names = [name] if name else candidates(table_name)
    found = next(((n, f) for n in names if (f := tensor_entry(path, n)) is not None), None)
    if found is None:
        if name:
            raise TableNotFoundError(f"{path}: no scale tensor {name!r} beside {table_name!r}")
        return None
    sname, (shard, e, base) = found
    where = f"{shard}: scale {sname!r} of {table_name!r}"
    if e["dtype"] not in SCALE_TYPES:
        raise UnsupportedTypeError(f"{where} is {e['dtype']}; scales must be {', '.join(SCALE_TYPES)}")
    stype, shape = SCALE_TYPES[e["dtype"]], list(e["shape"])
    offset = base + e["data_offsets"][0]
    spec = dict(name=sname, path=shard, stype=stype, data_offset=offset)
    if math.prod(shape) == 1:
        return ScaleSpec(**spec, value=_scalar(shard, e, base), n_rows=1, per_row=1, row_block=n_rows,
                         block=row_elems)
    if len(shape) == 1:
        shape = shape + [1]
    if len(shape) != 2:
        raise HeaderError(f"{where} has shape {shape}; scales are one value, [rows], or [rows, blocks]")
    rs, cs = shape
    given = (None, block) if isinstance(block, int) else tuple(block) if block is not None else (None, None)
    conf = _quant_block(checkpoint_files(path)[0]) or (None, None)
    kr = 1 if rs == n_rows else _block_of(given[0], conf[0], n_rows, rs)
    kc = _block_of(given[1], conf[1], row_elems, cs)
    if kr is None or kc is None:
        raise HeaderError(f"{where}: shape {[rs, cs]} does not map onto the table's {n_rows} x {row_elems} (blocks "
                          f"given {given[0]} x {given[1]}, config {conf[0]} x {conf[1]}); name the block with "
                          f"scale_block=(rows, elements)")
    found = tensor_entry(path, table_name + "_scale_2")
    if found is not None and (found[1]["dtype"] not in SCALE_TYPES or math.prod(found[1]["shape"]) != 1):
        raise HeaderError(f"{found[0]}: {table_name + '_scale_2'!r} is {found[1]['dtype']} {found[1]['shape']}; "
                          f"a global scale is one F32 value")
    return ScaleSpec(**spec, value=None, n_rows=rs, per_row=cs, row_block=kr, block=kc,
                     global_scale=None if found is None else _scalar(*found))
