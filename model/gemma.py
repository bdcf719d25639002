"""Gemma 4 / Gemma 3n per-layer inputs, exactly as llama.cpp computes them.

llama.cpp (``src/models/gemma4.cpp``, ``gemma3n.cpp``; shared/notes/ple-formats.md §1):

    build_inp_per_layer:      rows = get_rows(per_layer_token_embd, tokens)          # [T, n_layer*256]
                              rows = reshape(rows, [T, n_layer, 256]) * sqrt(256)   # x16
    project_per_layer_inputs: proj = (per_layer_model_proj @ h0) * 1/sqrt(n_embd)   # h0 = embd * sqrt(n_embd)
                              proj = rms_norm(reshape(proj, [T, n_layer, 256])) * per_layer_proj_norm
                              out  = (proj + rows) * 1/sqrt(2)
                              out  = permute(out) -> [n_layer, T, 256] (cont)        # layer il: out[il]

Layer ``il`` therefore owns elements ``[il*256, (il+1)*256)`` of each table row. Constants are float32 as in
llama.cpp (``1.0f/sqrtf((float)n_embd)``, ``1.0f/sqrtf(2.0f)``); ggml's ``rms_norm`` is
``x * (1.0f/sqrtf(mean(x*x) + eps))``, then ``build_norm`` multiplies by the weight.

Norm weight convention: Gemma 3 checkpoints store ``w`` for an ``x*(1+w)`` norm and llama.cpp's converter adds the
1 at conversion (``norm_shift = 1.0``); the Gemma 3n and Gemma 4 converters use ``norm_shift = 0.0`` (their HF norms
already multiply by ``w``). Either way the GGUF weight is the plain multiplier, which is what this module applies.

Gemma 3n: the same math; llama.cpp consumes layer il's slice inside the altup block (``first_prediction =
gelu(inp_gate(...)) * inp_this_layer; proj; post_norm``, added to the non-active altup streams). The synthetic
trunk (model/trunk.py) treats Gemma 3n like Gemma 4.

Embedding-only (image) batches: llama.cpp reads **row 0** of the table for every position of an embedding batch
(``ggml_view_1d(.., embd_size, 0)``); ``gemma_row_ids`` maps masked positions to row 0 the same way.

torch is imported lazily: importing this module needs numpy only.
"""
from __future__ import annotations

import numpy as np

from .tokens import token_stream

__all__ = ["gemma_row_ids", "per_layer_inputs", "per_layer_inputs_np", "ple_scales", "rms_scale"]


def ple_scales(n_embd: int, n_embd_per_layer: int = 256) -> tuple[float, float, float]:
    """(row scale sqrt(n_embd_per_layer), projection scale 1/sqrt(n_embd), input scale 1/sqrt(2)), each the
    float32 value llama.cpp computes (``sqrtf``, ``1.0f/sqrtf``), returned as Python floats (exact)."""
    f = np.float32
    return (float(np.sqrt(f(n_embd_per_layer))), float(f(1) / np.sqrt(f(n_embd))), float(f(1) / np.sqrt(f(2))))


def gemma_row_ids(tokens, n_rows: int | None = None, image_mask=None) -> np.ndarray:
    """The table rows a Gemma prefill reads: one per token, the token id itself, int64 [T].

    Positions where ``image_mask`` is True (embedding inputs) read row 0, as llama.cpp does for an embedding
    batch. Raises ValueError for a non-1-D or non-integer stream, a negative id, or an id >= ``n_rows``.
    """
    tok = token_stream(tokens, image_mask, 0)
    if tok.size and n_rows is not None and int(tok.max()) >= n_rows:
        hi = int(tok.max())
        raise ValueError(f"token id {hi} out of range for a table of {n_rows} rows [0, {n_rows})")
    return tok


def _check_shapes(rows_shape, h0_shape, proj_shape, norm_shape, n_layer: int, P: int) -> int:
    """Validate shapes (static: no data is looked at); returns T."""
    if len(h0_shape) != 2:
        raise ValueError(f"h0 must be [T, n_embd], got shape {tuple(h0_shape)}")
    T, n_embd = h0_shape
    if tuple(proj_shape) != (n_layer * P, n_embd):
        raise ValueError(f"proj_w must be [n_layer*{P}, n_embd] = {(n_layer * P, n_embd)}, got {tuple(proj_shape)}")
    if tuple(norm_shape) != (P,):
        raise ValueError(f"norm_w must be [{P}], got {tuple(norm_shape)}")
    if tuple(rows_shape) not in {(T, n_layer * P), (n_layer, T, P)}:
        raise ValueError(f"rows must be [T, n_layer*{P}] (as gathered) or [n_layer, T, {P}] (as the dequant kernel "
                         f"writes them) with T={T}, n_layer={n_layer}, got {tuple(rows_shape)}")
    return T


def rms_scale(ms, eps: float):
    """ggml's ``1.0f/sqrtf(mean + eps)`` for a float32 torch tensor of means of squares.

    The square root is taken in float64 and rounded to float32: that is the correctly rounded ``sqrtf`` on every
    backend (torch's vectorized CPU float32 sqrt is not correctly rounded; CUDA's ``sqrtf`` is).
    """
    import torch
    return 1.0 / torch.sqrt((ms + eps).to(torch.float64)).to(torch.float32)


def per_layer_inputs(rows, h0, proj_w, norm_w, *, n_layer: int, n_embd_per_layer: int = 256, eps: float = 1e-6,
                     rows_prescaled: bool | None = None):
    """Gemma's per-layer inputs [n_layer, T, n_embd_per_layer] (torch; CPU or GPU, CUDA-graph capturable).

    rows: the table rows, float32/float16/bfloat16, either 2-D [T, n_layer*P] (token-major: as gathered) or
        3-D [n_layer, T, P] (layer-major: as the GPU dequant kernel writes them).
    h0: the main token embedding already scaled by sqrt(n_embd), [T, n_embd]; its dtype is the matmul's.
    proj_w: per_layer_model_proj, [n_layer*P, n_embd] (torch Linear layout, out x in).
    norm_w: per_layer_proj_norm, [P] (the plain multiplier; see the module docstring).
    rows_prescaled: True when the rows already carry the x sqrt(P) scale (the GPU kernel applies it while
        dequantizing), False to scale them here. None (default) goes by the layout: 3-D layer-major rows are the
        kernel's output, prescaled; 2-D rows are a plain gather, unscaled.

    The matmul runs in h0's dtype; the norm, the add and the scales in float32 (as llama.cpp's F32 graph); the
    result is cast to h0's dtype. The ops touch shapes only (no .item(), no host sync), so a CUDA graph can
    capture them.
    """
    import torch

    P = int(n_embd_per_layer)
    T = _check_shapes(rows.shape, h0.shape, proj_w.shape, norm_w.shape, n_layer, P)
    n_embd = h0.shape[1]
    row_scale, proj_scale, in_scale = ple_scales(n_embd, P)
    f32 = torch.float32

    # proj: [T, n_embd] @ [n_embd, L*P] -> [T, L*P] -> [T, L, P]
    proj = torch.matmul(h0, proj_w.t()).to(f32) * proj_scale
    proj = proj.view(T, n_layer, P)
    # ggml rms_norm: x * (1/sqrt(mean(x^2) + eps)), then * weight
    ms = (proj * proj).mean(dim=-1, keepdim=True)                      # [T, L, 1]
    proj = proj * rms_scale(ms, eps) * norm_w.to(f32)
    proj = proj.permute(1, 0, 2)                                       # [L, T, P] (a view)

    layer_major = rows.dim() == 3
    if rows_prescaled is None:
        rows_prescaled = layer_major
    if layer_major:
        pl = rows.to(f32)                                              # [L, T, P]
    else:
        pl = rows.to(f32).reshape(T, n_layer, P).permute(1, 0, 2)      # [L, T, P] (a view)
    if not rows_prescaled:
        pl = pl * row_scale                                            # x sqrt(P): exact (a power of 2 for 256)
    out = (proj + pl) * in_scale                                       # [L, T, P], contiguous: layer il = out[il]
    return out.to(h0.dtype).contiguous()


def per_layer_inputs_np(rows, h0, proj_w, norm_w, *, n_layer: int, n_embd_per_layer: int = 256,
                        eps: float = 1e-6) -> np.ndarray:
    """Reference for tests: the same math in plain float32 numpy, rows unscaled [T, n_layer*P].

    Written from llama.cpp's graph (not from per_layer_inputs): returns float32 [n_layer, T, P].
    """
    f = np.float32
    rows = np.asarray(rows, dtype=f)
    h0 = np.asarray(h0, dtype=f)
    proj_w = np.asarray(proj_w, dtype=f)
    norm_w = np.asarray(norm_w, dtype=f)
    T, n_embd = h0.shape
    P = n_embd_per_layer

    per_layer = rows.reshape(T, n_layer, P) * np.sqrt(f(P))               # build_inp_per_layer
    proj = (h0 @ proj_w.T) * (f(1) / np.sqrt(f(n_embd)))                 # mul_mat, scale
    proj = proj.reshape(T, n_layer, P)
    mean = np.mean(proj * proj, axis=-1, keepdims=True)                  # rms_norm
    proj = proj * (f(1) / np.sqrt(mean + f(eps)))
    proj = proj * norm_w                                                 # build_norm's weight
    out = (proj + per_layer) * (f(1) / np.sqrt(f(2)))
    return np.ascontiguousarray(out.transpose(1, 0, 2))                  # [n_layer, T, P]
