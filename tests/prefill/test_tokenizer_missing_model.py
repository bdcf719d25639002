"""A GGUF with tokenizer.ggml.tokens but no tokenizer.ggml.model is refused by name (issue 17); without tokens
there is no tokenizer at all."""
from __future__ import annotations

import pytest
from gguf import GGUFReader, GGUFWriter

from gds_gather.errors import TokenizerError
from gds_gather.prefill.tokenizer import GGUFTokenizer


def _write(path, tokens):
    w = GGUFWriter(str(path), "gemma4")
    if tokens:
        w.add_token_list(["<pad>", "a", "b"])
    w.add_uint32("gemma4.block_count", 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFReader(str(path))


def test_tokens_without_a_model_are_refused(tmp_path):
    reader = _write(tmp_path / "t.gguf", tokens=True)
    assert reader.get_field("tokenizer.ggml.model") is None
    with pytest.raises(TokenizerError, match=r"^the file has tokenizer\.ggml\.tokens but no tokenizer\.ggml\.model$"):
        GGUFTokenizer.from_reader(reader)


def test_no_tokens_no_tokenizer(tmp_path):
    assert GGUFTokenizer.from_reader(_write(tmp_path / "n.gguf", tokens=False)) is None
