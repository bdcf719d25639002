"""Validation shared by the per-model row indexes: a prompt's token stream as 1-D int64."""
from __future__ import annotations

import numpy as np


def token_stream(tokens, image_mask=None, image_value: int = 0) -> np.ndarray:
    """`tokens` as a 1-D int64 array, positions where `image_mask` is True replaced by `image_value`.

    Raises ValueError for a non-1-D or non-integer stream, a negative token id, or a mask of another shape.
    """
    tok = np.asarray(tokens)
    if tok.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tok.shape}")
    if tok.size and not np.issubdtype(tok.dtype, np.integer):
        raise ValueError(f"tokens must be integers, got dtype {tok.dtype}")
    tok = tok.astype(np.int64)
    if tok.size and int(tok.min()) < 0:
        raise ValueError(f"negative token id {int(tok.min())} in tokens")
    if image_mask is not None:
        mask = np.asarray(image_mask, dtype=bool)
        if mask.shape != tok.shape:
            raise ValueError(f"image_mask shape {mask.shape} != tokens shape {tok.shape}")
        tok = np.where(mask, np.int64(image_value), tok)
    return tok
