"""qwen4exp: the n-gram hash that turns a token stream into PLE table rows.

This mirrors llama.cpp's ``llm_graph_input_ple::set_input``:
for token i, ctx[0] is the token and ctx[s] the token s positions back; a missing
predecessor or an EOS cuts the window and everything at or before the cut reads as EOS.
For n = 2..ngram_size, ``mixed = XOR_j<n (u64 ctx[j] * m[j])`` (wrapping) and head
h = (n-2)*heads_per_ngram + g reads row ``mixed % vocab[h] + offset[h]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from gguf import GGUFValueType

from .tokens import token_stream

ARCH = "qwen4exp"

# llama.cpp's metadata keys (src/llama-arch.cpp)
KEY_PLE_LAYERS = f"{ARCH}.ple.layers"
KEY_NGRAM_SIZE = f"{ARCH}.ple.ngram_size"
KEY_HEADS_PER_NGRAM = f"{ARCH}.ple.heads_per_ngram"
KEY_CONV_KERNEL = f"{ARCH}.ple.conv_kernel"
KEY_MULTIPLIERS = f"{ARCH}.ple.layer_multipliers"
KEY_HEAD_OFFSETS = f"{ARCH}.ple.head_offsets"
KEY_HEAD_VOCAB_SIZES = f"{ARCH}.ple.head_vocab_sizes"
KEY_EOS = f"{ARCH}.ple.eos_token_id"
KEY_IMAGE = f"{ARCH}.ple.image_token_id"
KEY_HEAD_DIM = f"{ARCH}.embedding_length_per_layer_input"

_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class Qwen4expHParams:
    """The PLE hash parameters of a qwen4exp model (one PLE layer)."""

    ngram_size: int
    heads_per_ngram: int
    multipliers: tuple[int, ...]
    head_offsets: tuple[int, ...]
    head_vocab_sizes: tuple[int, ...]
    eos_token_id: int
    image_token_id: int | None = None
    head_dim: int = 160
    ple_layer: int = 1
    conv_kernel: int = 4

    def __post_init__(self) -> None:
        # normalise sequences (lists from GGUF, numpy arrays) to tuples of plain ints
        for name in ("multipliers", "head_offsets", "head_vocab_sizes"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        if self.ngram_size < 2:
            raise ValueError(f"ngram_size must be >= 2, got {self.ngram_size}")
        if self.heads_per_ngram < 1:
            raise ValueError(f"heads_per_ngram must be >= 1, got {self.heads_per_ngram}")
        if len(self.multipliers) < self.ngram_size:
            raise ValueError(f"need >= {self.ngram_size} multipliers, got {len(self.multipliers)}")
        if any(not 0 <= m <= _U64 for m in self.multipliers):
            raise ValueError("multipliers must be unsigned 64-bit integers")
        if len(self.head_offsets) != self.n_heads or len(self.head_vocab_sizes) != self.n_heads:
            raise ValueError(f"need {self.n_heads} head offsets and vocab sizes, got "
                             f"{len(self.head_offsets)} and {len(self.head_vocab_sizes)}")
        if any(v < 1 for v in self.head_vocab_sizes) or any(o < 0 for o in self.head_offsets):
            raise ValueError("head vocab sizes must be >= 1 and offsets >= 0")
        if self.eos_token_id < 0 or (self.image_token_id is not None and self.image_token_id < 0):
            raise ValueError("token ids must be >= 0")

    @property
    def n_heads(self) -> int:
        """Rows read per token: (ngram_size - 1) * heads_per_ngram."""
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def n_rows(self) -> int:
        """Smallest table that holds every head: max(offset + vocab)."""
        return max(o + v for o, v in zip(self.head_offsets, self.head_vocab_sizes))

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_fields(cls, get: Callable[[str], Any]) -> "Qwen4expHParams":
        """Build from a key -> value lookup (None for a missing key), e.g. a GGUF's fields."""
        def need(key):
            v = get(key)
            if v is None:
                raise KeyError(f"GGUF key {key!r} is missing")
            return v

        layers = list(need(KEY_PLE_LAYERS))
        if len(layers) != 1:
            raise ValueError(f"{KEY_PLE_LAYERS} must hold exactly one layer, got {layers}")
        image = get(KEY_IMAGE)
        conv = get(KEY_CONV_KERNEL)
        return cls(
            ngram_size=int(need(KEY_NGRAM_SIZE)),
            heads_per_ngram=int(need(KEY_HEADS_PER_NGRAM)),
            multipliers=tuple(need(KEY_MULTIPLIERS)),
            head_offsets=tuple(need(KEY_HEAD_OFFSETS)),
            head_vocab_sizes=tuple(need(KEY_HEAD_VOCAB_SIZES)),
            eos_token_id=int(need(KEY_EOS)),
            image_token_id=None if image is None else int(image),
            head_dim=int(need(KEY_HEAD_DIM)),
            ple_layer=int(layers[0]),
            conv_kernel=4 if conv is None else int(conv),
        )

    @classmethod
    def from_reader(cls, reader) -> "Qwen4expHParams":
        """Build from an open gguf.GGUFReader."""
        def get(key):
            field = reader.get_field(key)
            return None if field is None else field.contents()
        return cls.from_fields(get)

    @classmethod
    def from_preset(cls, preset, rows: int | None = None) -> "Qwen4expHParams":
        """The hparams write_model writes for `preset` with a table of `rows` rows.

        Head vocab sizes are distinct values just under rows // n_heads
        (``rows // n_heads - 3*h - 1``, at least 1), offsets are cumulative, so every head
        fits in `rows`. The real checkpoint's sizes are ~20,000,003 each; these are close.
        """
        if not preset.is_ngram:
            raise ValueError(f"preset {preset.name!r} has no n-gram PLE")
        rows = preset.n_rows if rows is None else int(rows)
        n_heads = (preset.ngram_size - 1) * preset.heads_per_ngram
        base = rows // n_heads
        if base < 1:
            raise ValueError(f"a qwen4exp table needs at least {n_heads} rows, got {rows}")
        vocab = [max(1, base - 3 * h - 1) for h in range(n_heads)]
        offsets = np.concatenate([[0], np.cumsum(vocab)[:-1]]).tolist()
        return cls(
            ngram_size=preset.ngram_size, heads_per_ngram=preset.heads_per_ngram,
            multipliers=preset.multipliers, head_offsets=tuple(offsets), head_vocab_sizes=tuple(vocab),
            eos_token_id=preset.eos_token_id, image_token_id=preset.image_token_id,
            head_dim=preset.n_embd_per_layer, ple_layer=preset.ple_layer, conv_kernel=preset.conv_kernel,
        )

    def gguf_kv(self) -> list[tuple[str, Any, GGUFValueType, GGUFValueType | None]]:
        """(key, value, type, array sub-type) for GGUFWriter.add_key_value, llama.cpp's types."""
        u32, u64, arr = GGUFValueType.UINT32, GGUFValueType.UINT64, GGUFValueType.ARRAY
        kv = [
            (KEY_PLE_LAYERS, [self.ple_layer], arr, u32),
            (KEY_NGRAM_SIZE, self.ngram_size, u32, None),
            (KEY_HEADS_PER_NGRAM, self.heads_per_ngram, u32, None),
            (KEY_CONV_KERNEL, self.conv_kernel, u32, None),
            # explicit UINT64: GGUFWriter would infer INT32 from Python ints
            (KEY_MULTIPLIERS, list(self.multipliers), arr, u64),
            (KEY_HEAD_OFFSETS, list(self.head_offsets), arr, u64),
            (KEY_HEAD_VOCAB_SIZES, list(self.head_vocab_sizes), arr, u64),
            (KEY_EOS, self.eos_token_id, u32, None),
        ]
        if self.image_token_id is not None:
            kv.append((KEY_IMAGE, self.image_token_id, u32, None))
        kv.append((KEY_HEAD_DIM, self.head_dim, u32, None))
        return kv


# ---- the row index --------------------------------------------------------------------------

def hashed_tokens(tokens, hparams: Qwen4expHParams, image_mask=None) -> np.ndarray:
    """The int64 token ids the hash sees: image positions replaced by the image token (or EOS).

    Raises ValueError for negative tokens, a non-1-D stream or a mask of another length.
    Carry these (not the raw ids) across chunks when the stream has image positions.
    """
    img = hparams.image_token_id if hparams.image_token_id is not None else hparams.eos_token_id
    tok = token_stream(tokens, image_mask, img)
    return tok


def _prev_window(prev, k: int) -> np.ndarray:
    """The k tokens before the stream, left-padded with -1 (sequence start = cut)."""
    window = np.full(k, -1, dtype=np.int64)
    if prev is not None and k:
        p = np.asarray(prev, dtype=np.int64).ravel()[-k:]
        if p.size:
            window[k - p.size:] = p
    return window


def ple_rows(tokens, hparams: Qwen4expHParams, prev=None, image_mask=None) -> np.ndarray:
    """Table rows int64 [n_tokens, n_heads] read by each token.

    Parameters
    ----------
    tokens : 1-D int array of token ids (>= 0).
    hparams : the model's Qwen4expHParams.
    prev : up to ngram_size-1 tokens just before `tokens` (as hashed, see next_prev); None or
        fewer than ngram_size-1 means the sequence starts there. A negative entry reads as a cut.
    image_mask : optional bool array; True positions hash image_token_id (EOS when absent).
    """
    tok = hashed_tokens(tokens, hparams, image_mask)
    n, N, eos = tok.size, hparams.ngram_size, hparams.eos_token_id
    k = N - 1
    ext = np.concatenate([_prev_window(prev, k), tok])  # ext[k + i] is token i

    # ctx[s][i] = token s back, or EOS once the window has been cut at or after it
    ctx = np.empty((N, n), dtype=np.uint64)
    ctx[0] = tok.astype(np.uint64)
    cut = np.zeros(n, dtype=bool)
    for s in range(1, N):
        t = ext[k - s:k - s + n]
        cut |= (t < 0) | (t == eos)
        ctx[s] = np.where(cut, np.int64(eos), t).astype(np.uint64)

    mult = np.array(hparams.multipliers[:N], dtype=np.uint64)
    vocab = np.array(hparams.head_vocab_sizes, dtype=np.uint64)
    offs = np.array(hparams.head_offsets, dtype=np.uint64)
    out = np.empty((n, hparams.n_heads), dtype=np.int64)
    hpn = hparams.heads_per_ngram
    # uint64 array arithmetic wraps modulo 2**64, as the C code does; no float ever appears
    with np.errstate(over="ignore"):
        mixed = ctx[0] * mult[0]
        for g in range(2, N + 1):
            mixed = mixed ^ (ctx[g - 1] * mult[g - 1])
            hs = slice((g - 2) * hpn, (g - 1) * hpn)
            out[:, hs] = (mixed[:, None] % vocab[hs] + offs[hs]).astype(np.int64)
    return out


def next_prev(tokens, prev, ngram_size: int) -> np.ndarray:
    """The last ngram_size-1 tokens of prev + tokens: the `prev` for the next chunk.

    Shorter than ngram_size-1 while the sequence itself is shorter. Pass hashed tokens
    (hashed_tokens(...)) when the stream has image positions.
    """
    k = int(ngram_size) - 1
    if k <= 0:
        return np.empty(0, dtype=np.int64)
    parts = [np.asarray(tokens, dtype=np.int64).ravel()]
    if prev is not None:
        parts.insert(0, np.asarray(prev, dtype=np.int64).ravel())
    return np.concatenate(parts)[-k:].copy()
