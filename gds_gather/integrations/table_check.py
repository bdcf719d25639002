"""Checking a table against a transformers model before it stands in for the model's per-layer embedding: its
shape (check_fit), and sampled rows against the model's own within the table type's error bound (verify_sample).
EXACT_TYPES: the table types whose rows give a weight dtype's rows exactly."""
from __future__ import annotations

import numpy as np
import torch

from ..errors import ModelMismatchError
from ..formats import quants
from ..formats.quants import Q
from ..table import Table

# table types whose rows become the weight dtype exactly: every widening (BF16/F16 -> float32), F32 -> any
# (transformers' own load-time cast, round to nearest), and the float8 types -> any: their values (times their
# scales, formats/scales.py) are the checkpoint's definition of the rows, rounded once to the weight dtype
FP8 = quants.FP8_TYPES[:2]
EXACT_TYPES = {torch.float32: (Q.F32, Q.F16, Q.BF16, *FP8), torch.float16: (Q.F16, Q.F32, *FP8),
               torch.bfloat16: (Q.BF16, Q.F32, *FP8)}


def check_fit(table: Table, module, cfg, weight_dtype, allow_quantized: bool) -> None:
    """ModelMismatchError unless the table's rows and width fit the model's per-layer embedding (`module`, text config
    `cfg`) and, without allow_quantized, its type gives the weight dtype's rows exactly."""
    n_layer, per_layer = int(cfg.num_hidden_layers), int(cfg.hidden_size_per_layer_input)
    vocab = int(getattr(cfg, "vocab_size_per_layer_input", module.num_embeddings))
    width = n_layer * per_layer
    if module.num_embeddings != vocab or module.embedding_dim != width:
        raise ModelMismatchError(f"the model's per-layer embedding is [{module.num_embeddings}, "
                                 f"{module.embedding_dim}], its config says [{vocab}, {n_layer} x {per_layer}]")
    if table.row_elems != width:
        raise ModelMismatchError(f"{table.path}: rows of {table.row_elems} elements, but the model needs "
                                 f"num_hidden_layers x hidden_size_per_layer_input = {n_layer} x {per_layer} = {width}")
    padded = table.n_rows > vocab and table.arch == "gemma3n"   # llama.cpp pads Gemma 3n's table to 262,400 rows
    if table.n_rows != vocab and not padded:
        raise ModelMismatchError(f"{table.path}: {table.n_rows:,} rows, but the model's vocab_size_per_layer_input "
                                 f"is {vocab:,}: a table of another model")
    if table.qtype not in EXACT_TYPES.get(weight_dtype, ()) and not allow_quantized:
        raise ModelMismatchError(f"{table.path}: a {table.qtype.name} table cannot give the model's {weight_dtype} "
                                 f"rows exactly; pass allow_quantized=True to accept its error (or convert the "
                                 f"checkpoint without --qtype)")


# A lossy table's error bound, per element, from its type: (levels, factor): error <= factor x the quantization step,
# step = the block's max |value| / levels (the block of the type's geometry, of the model's own rows). Q8_0: d =
# amax / 127, q = round(x / d), stored d rounded to f16, so |x - q d16| <= d / 2 + 127 |d - d16| <= 0.57 d; Q4_0 and
# Q5_0 clip the top level (up to one step); Q4_1 / Q5_1: d = range / (2^b - 1) <= 2 amax / (2^b - 1), half a step
# plus the f16 min. Types gguf cannot write (K-quants, IQ*, FP4) get a whole coarse step: generous, still far below
# another model's rows (errors of the rows' own size).
LOSSY_BOUNDS = {Q.Q8_0: (127, 0.6), Q.Q4_0: (8, 1.05), Q.Q5_0: (16, 1.05), Q.Q4_1: (7.5, 0.6), Q.Q5_1: (15.5, 0.6),
                Q.Q6_K: (31, 1.0), Q.Q5_K: (15.5, 1.0), Q.Q4_K: (7.5, 1.0), Q.Q3_K: (4, 1.0), Q.Q2_K: (1.5, 1.0),
                Q.IQ4_NL: (8, 1.0), Q.IQ4_XS: (8, 1.0), Q.IQ3_XXS: (4, 1.0), Q.IQ3_S: (4, 1.0), Q.IQ2_XXS: (2, 1.0),
                Q.IQ2_XS: (2, 1.0), Q.IQ2_S: (2, 1.0), Q.IQ1_S: (1, 1.0), Q.IQ1_M: (1, 1.0), Q.TQ1_0: (1, 0.6),
                Q.TQ2_0: (1, 0.6), Q.MXFP4: (3, 1.0), Q.NVFP4: (3, 1.0)}
FLOAT_BOUNDS = {Q.F32: 0.0, Q.F16: 2.0 ** -10, Q.BF16: 2.0 ** -8}    # relative (about one ulp of the narrower type)


def error_bound(qtype, want: torch.Tensor) -> torch.Tensor:
    """The most each element of a `qtype` table may differ from the model's own float rows `want` [n, width]."""
    want = want.double()
    if qtype in FLOAT_BOUNDS:
        return want.abs() * FLOAT_BOUNDS[qtype] + (2.0 ** -24 if qtype == Q.F16 else 0.0)   # (f16 subnormals)
    levels, factor = LOSSY_BOUNDS.get(qtype, (1, 1.0))
    block = quants.block_geometry(qtype)[0]
    amax = want.reshape(want.shape[0], -1, block).abs().amax(dim=2, keepdim=True)
    # + an f16 scale's rounding where it is subnormal (absolute, up to 2^-25 times up to `levels` quanta)
    bound = factor * amax / levels + levels * 2.0 ** -24
    return bound.expand(-1, -1, block).reshape(want.shape)


def verify_sample(table: Table, own_rows, vocab: int, weight_dtype, n: int) -> tuple[int, float, float]:
    """Compare n sampled rows (first, last, random) of the table with the model's own rows (own_rows(ids) -> float
    rows: the resident weight, or the checkpoint's table): (rows, max |err|, RMS err). An exact type must give the
    weight dtype's rows exactly, a lossy one stay within error_bound; otherwise it is another model's table:
    ModelMismatchError, whatever allow_quantized says."""
    if n <= 0:
        return 0, float("nan"), float("nan")
    ids = np.unique(np.concatenate([[0, vocab - 1], np.random.default_rng(0).integers(0, vocab, max(n - 2, 0))]))
    got = torch.from_numpy(table.gather(ids))
    want = own_rows(ids).cpu()
    diff = (got.double() - want.double()).abs()
    max_err = float(diff.max()) if diff.numel() else 0.0
    rms = float(diff.pow(2).mean().sqrt()) if diff.numel() else 0.0
    if table.qtype in EXACT_TYPES.get(weight_dtype, ()):
        ok = torch.equal(got.to(weight_dtype), want.to(weight_dtype))
        what = f"{table.qtype.name} rows must equal the model's {weight_dtype} rows"
    else:
        bound = error_bound(table.qtype, want)
        ok = bool((diff <= bound).all())
        what = f"more than the {table.qtype.name} error bound (max {float(bound.max()):.3g} on these rows)"
    if not ok:
        bad = int(ids[int(diff.amax(dim=1).argmax())])
        raise ModelMismatchError(f"{table.path}: sampled rows differ from the model's own ({what}; row {bad}: "
                                 f"max |diff| {max_err:.3g}): a table of another model")
    return len(ids), max_err, rms
