"""Prompts as token ids: real English text, tokenized by the model's own tokenizer or a word-level mapping.

A model file that carries a tokenizer (`tokenizer.ggml.tokens`) is tokenized with it (gds_gather.tokenizer).
Synthetic models carry none, so there a word (a run of letters/digits, or one punctuation mark) maps to
`1 + blake2b(word) mod (n_vocab - 1)`, skipping reserved ids (EOS, image). Equal words give equal ids, so the
prompt keeps natural text's repetition (which is what makes deduplication pay), unlike a repeated string.
The default prompt is the standard library's documentation topics (pydoc_data), shipped with every Python.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np

_WORD = re.compile(r"\w+|[^\w\s]")


def default_text() -> str:
    """The Python documentation topics that ship with the interpreter (about 100k words of English)."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in sorted(topics))


def load_text(path: str | Path | None) -> str:
    if path is None:
        return default_text()
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    if not _WORD.search(text):
        raise ValueError(f"{path}: the prompt file holds no words")
    return text


def word_ids(text: str, n_vocab: int, reserved: tuple[int, ...] = ()) -> np.ndarray:
    """Token ids (int64) of `text` under the word-level mapping; ids avoid 0 and every id in `reserved`."""
    words = _WORD.findall(text)
    if not words:
        return np.zeros(0, np.int64)
    uniq, inverse = np.unique(np.array(words, dtype=object).astype(str), return_inverse=True)
    hashed = np.fromiter(
        (int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(), "little") for w in uniq),
        np.uint64, count=len(uniq))
    span = n_vocab - 1 - len(reserved)
    if span <= 0:
        raise ValueError(f"vocabulary of {n_vocab} is too small")
    ids = (hashed % np.uint64(span)).astype(np.int64) + 1
    for r in sorted(set(int(x) for x in reserved if 0 < x < n_vocab)):   # shift past each reserved id
        ids[ids >= r] += 1
    return ids[inverse.ravel()]


def prompt_tokens(n_vocab: int, reserved: tuple[int, ...] = (), path=None, n_tokens: int | None = None,
                  tokenizer=None) -> np.ndarray:
    """The prompt's token ids, cut to n_tokens (the text is read again from its start if it is shorter).

    tokenizer: a GGUFTokenizer (the model's own; n_vocab and reserved are then unused), or None for word_ids.
    """
    text = load_text(path)
    ids = tokenizer.encode(text) if tokenizer is not None else word_ids(text, n_vocab, reserved)
    if n_tokens is None:
        return ids
    if n_tokens < 0:
        raise ValueError(f"--tokens must be >= 0, got {n_tokens}")
    if ids.size == 0:
        raise ValueError("the prompt holds no words")
    reps = -(-n_tokens // ids.size)
    return np.tile(ids, reps)[:n_tokens] if reps > 1 else ids[:n_tokens]
