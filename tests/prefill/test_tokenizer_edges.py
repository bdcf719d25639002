"""GGUFTokenizer's refusals (each a TokenizerError naming what is wrong, never a wrong encoding) and decode's
handling of control tokens and bad ids, on small hand-made vocabularies whose answers are known."""
from __future__ import annotations

import pytest

from gds_gather.errors import TokenizerError
from gds_gather.prefill.tokenizer import BYTE, CONTROL, NORMAL, SPACE, GGUFTokenizer

LLAMA = ["<unk>", "<s>", "</s>", SPACE + "hello", SPACE + "world", "<0x41>", "!"]
TYPES = [2, CONTROL, CONTROL, NORMAL, NORMAL, BYTE, NORMAL]


@pytest.mark.parametrize("kw, words", [
    (dict(model="bert", tokens=["a"]), "tokenizer model 'bert' is not supported; supported: gpt2, llama, gemma4"),
    (dict(model="llama", tokens=[]), "the tokenizer has no tokens"),
    (dict(model="llama", tokens=["a", "b"], types=[NORMAL]), "1 token types for 2 tokens"),
    (dict(model="llama", tokens=["a", "b"], scores=[0.0]), "1 token scores for 2 tokens"),
    (dict(model="gemma4", tokens=["a"]), "a 'gemma4' tokenizer needs tokenizer.ggml.merges"),
    (dict(model="gpt2", tokens=["a"], merges=[], pre="nonesuch"),
     "pre-tokenizer \\(tokenizer.ggml.pre\\) 'nonesuch' is not supported"),
])
def test_refusals(kw, words):
    with pytest.raises(TokenizerError, match=words):
        GGUFTokenizer(**kw)


def test_llama_decode_skips_control_and_refuses_bad_ids():
    tok = GGUFTokenizer("llama", LLAMA, types=TYPES, scores=[0.0] * 7, bos_id=1, eos_id=2)
    assert repr(tok) == "GGUFTokenizer('llama', 7 tokens)"
    # <s> and </s> skipped, <0x41> is "A", the space prefix the encoder adds is dropped (as llama.cpp)
    assert tok.decode([1, 3, 4, 5, 6, 2]) == "hello worldA!"
    for bad in (7, -1):
        with pytest.raises(ValueError, match=f"token id {bad} is out of range \\[0, 7\\)"):
            tok.decode([3, bad])
