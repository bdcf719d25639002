"""text.py's edges: prompt files the OS refuses (a path through a file; a file whose reads fail), a file ending in
half a UTF-8 character, a run of text with no space longer than MAX_UNCUT (cut anyway, ids unchanged), the
vocabulary and --tokens bounds. Oracle: word_ids over the whole text at once."""
from __future__ import annotations

import numpy as np
import pytest

from gds_gather.prefill import prompts as text
from gds_gather.errors import PromptError


def test_path_through_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(PromptError, match=f"prompt file {tmp_path / 'f' / 'p.txt'}: Not a directory"):
        text.prompt_tokens(1000, path=tmp_path / "f" / "p.txt", n_tokens=4)


def test_reads_that_fail(monkeypatch, tmp_path):
    p = tmp_path / "p.txt"
    p.write_text("some words here")
    real = text.open_prompt

    class Failing:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def read(self, n):
            raise OSError(5, "Input/output error")
    monkeypatch.setattr(text, "open_prompt", lambda path: Failing(real(path)))
    with pytest.raises(PromptError, match=f"prompt file {p}: Input/output error"):
        list(text.iter_text(p))


def test_half_a_character_at_the_end(tmp_path):
    p = tmp_path / "p.txt"
    p.write_bytes("naïve café".encode() + "é".encode()[:1])
    assert "".join(text.iter_text(p, chunk=3)) == "naïve café\ufffd"      # the decoder's last word: replaced


def test_no_space_for_longer_than_max_uncut(tmp_path, monkeypatch):
    """Pieces of 50 bytes, no space anywhere, MAX_UNCUT 64: the pending text is cut whole each time it reaches 100
    characters (memory stays bounded), so the ids are those of each 100-character slice."""
    monkeypatch.setattr(text, "MAX_UNCUT", 64)
    monkeypatch.setattr(text, "CHUNK_BYTES", 50)
    body = "-".join(f"w{i}" for i in range(300))           # 1,189 ASCII characters, not one space
    p = tmp_path / "p.txt"
    p.write_text(body)
    want = np.concatenate([text.word_ids(body[i:i + 100], 50_000) for i in range(0, len(body), 100)])
    assert np.array_equal(text.prompt_tokens(50_000, path=p), want)
    assert not np.array_equal(want, text.word_ids(body, 50_000))      # the cuts split words: the test can fail


def test_bounds():
    with pytest.raises(ValueError, match="vocabulary of 2 is too small"):
        text.word_ids("a b", 2, reserved=(1,))
    with pytest.raises(PromptError, match=r"--tokens must be in 0\.\.16,777,216, got 16,777,217"):
        text.prompt_tokens(1000, n_tokens=text.MAX_TOKENS + 1)
