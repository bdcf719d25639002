"""Prompts as token ids: real English text, tokenized by the model's own tokenizer or a word-level mapping.

A model file that carries a tokenizer (`tokenizer.ggml.tokens`) is tokenized with it (gds_gather.prefill.tokenizer).
Synthetic models carry none, so there a word (a run of letters/digits, or one punctuation mark) maps to
`1 + blake2b(word) mod (n_vocab - 1)`, skipping reserved ids (EOS, image). Equal words give equal ids, so the
prompt keeps natural text's repetition (which is what makes deduplication pay), unlike a repeated string.
The default prompt is the standard library's documentation topics (pydoc_data), shipped with every Python.

A prompt file is read only as far as needed: in 64 KiB chunks, decoded as UTF-8 (undecodable bytes become U+FFFD,
as `errors="replace"`), tokenized chunk by chunk until `n_tokens` ids exist, and never past MAX_PROMPT_BYTES (the
text read so far then counts as the whole prompt). Chunks are cut only where the tokenizer's `safe_cut` says the
ids of the parts equal the ids of the whole (before a space that follows a non-space; see
gds_gather.prefill.tokenizer), so the ids are those a full read gives; text with no such cut in MAX_UNCUT characters
(no spaces at all, e.g. Chinese) is cut there anyway, which may change the few ids at that point but keeps the
memory bounded. Only regular files are read: a directory, FIFO, socket or device is refused.
"""
from __future__ import annotations

import codecs
import hashlib
import os
import re
import stat
from typing import Iterator

import numpy as np

from ..errors import PromptError
from ..io.safe_write import file_kind

_WORD = re.compile(r"\w+|[^\w\s]")

MAX_TOKENS = 1 << 24              # prompt length bound (--tokens): 128 MiB of int64 ids before any row ids
MAX_PROMPT_BYTES = 64 << 20       # never read more of a prompt file than this
CHUNK_BYTES = 64 << 10
MAX_UNCUT = 1 << 18               # characters encoded at most in one piece (see _stream_ids)


def default_text() -> str:
    """The Python documentation topics that ship with the interpreter (about 100k words of English)."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in sorted(topics))


def open_prompt(path):
    """The prompt file opened for binary reading; PromptError naming `path` unless it is a readable regular file."""
    try:     # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused just below)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise PromptError(f"prompt file {path}: no such file") from None
    except OSError as e:
        raise PromptError(f"prompt file {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PromptError(f"prompt file {path} is {file_kind(st.st_mode)}, not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def iter_text(path, max_bytes: int | None = None, chunk: int | None = None) -> Iterator[str]:
    """The text of a prompt file in pieces of about `chunk` bytes (CHUNK_BYTES), at most `max_bytes` bytes
    (MAX_PROMPT_BYTES) read in all."""
    max_bytes = MAX_PROMPT_BYTES if max_bytes is None else max_bytes
    chunk = CHUNK_BYTES if chunk is None else chunk
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with open_prompt(path) as f:
        left = max_bytes
        while left > 0:
            try:
                b = f.read(min(chunk, left))
            except OSError as e:
                raise PromptError(f"prompt file {path}: {e.strerror or e}") from None
            if not b:
                break
            left -= len(b)
            text = dec.decode(b)
            if text:
                yield text
    tail = dec.decode(b"", final=True)
    if tail:
        yield tail


class _WordLevel:
    """The word-level mapping with the tokenizer's streaming interface (encode, safe_cut)."""

    def __init__(self, n_vocab: int, reserved: tuple[int, ...]):
        self.n_vocab, self.reserved = n_vocab, reserved

    def encode(self, text: str, continued: bool = False) -> np.ndarray:
        return word_ids(text, self.n_vocab, self.reserved)

    @staticmethod
    def safe_cut(text: str, lo: int = 0) -> int:
        """Words never hold whitespace: any space is a cut."""
        return max(text.rfind(" ", lo), 0)


def _stream_ids(path, n_tokens: int | None, enc) -> tuple[np.ndarray, bool]:
    """Ids of the file's text, read and encoded chunk by chunk until n_tokens exist; (ids, saw a word)."""
    parts, count, pending, scanned, first, words = [], 0, "", 0, True, False
    for piece in iter_text(path):
        pending += piece
        k = enc.safe_cut(pending, scanned)      # cuts before `scanned` were looked for already
        scanned = len(pending)
        if k <= 0:
            if len(pending) < MAX_UNCUT:
                continue
            k = len(pending)      # no safe cut in MAX_UNCUT characters (no spaces): cut anyway, memory stays bounded
        head, pending = pending[:k], pending[k:]
        scanned -= k
        words = words or _WORD.search(head) is not None
        ids = enc.encode(head, continued=not first)
        first = False
        parts.append(ids)
        count += ids.size
        if n_tokens is not None and count >= n_tokens:
            words = True       # enough ids: the rest of the file is not read (nor searched for words)
            break
    else:
        if pending:
            words = words or _WORD.search(pending) is not None
            parts.append(enc.encode(pending, continued=not first))
    ids = np.concatenate(parts).astype(np.int64, copy=False) if parts else np.zeros(0, np.int64)
    return ids, words


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
    A file is read only as far as n_tokens need (see the module docstring); n_tokens <= MAX_TOKENS.
    """
    if n_tokens is not None and not 0 <= n_tokens <= MAX_TOKENS:
        raise PromptError(f"--tokens must be in 0..{MAX_TOKENS:,}, got {n_tokens:,}")
    enc = tokenizer if tokenizer is not None else _WordLevel(n_vocab, reserved)
    if path is None:
        ids = enc.encode(default_text())
    else:
        ids, words = _stream_ids(path, n_tokens, enc)
        if not words:
            raise PromptError(f"prompt file {path} holds no words")
    if n_tokens is None:
        return ids
    if ids.size == 0:
        raise PromptError("the prompt holds no words")
    reps = -(-n_tokens // ids.size)
    return np.tile(ids, reps)[:n_tokens] if reps > 1 else ids[:n_tokens]
