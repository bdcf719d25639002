"""safetensors_file's refusals on files built here byte by byte (each a clear error naming the file), and the
per-layer embedding found by its suffix when it is the only one."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from gds_gather import errors
from gds_gather.formats.safetensors_file import find_table_tensor, load_text_config, read_header

safetensors_numpy = pytest.importorskip("safetensors.numpy")


def _raw(path, header: dict | bytes, body: bytes = b""):
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + body)
    return path


def test_not_a_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.safetensors: no such file"):
        read_header(tmp_path / "missing.safetensors")
    (tmp_path / "d.safetensors").mkdir()
    with pytest.raises(errors.NotSafetensorsError, match="d.safetensors: not a regular file"):
        read_header(tmp_path / "d.safetensors")


def test_metadata_that_is_not_an_object(tmp_path):
    p = _raw(tmp_path / "m.safetensors", {"__metadata__": ["x"]})
    with pytest.raises(errors.HeaderError, match="m.safetensors: __metadata__ is not an object"):
        read_header(p)


def test_bad_index(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(errors.NotSafetensorsError, match="not a safetensors index \\(bad JSON: "):
        find_table_tensor(tmp_path)


def test_the_one_table_found_by_suffix_and_several_refused(tmp_path):
    w = np.arange(6 * 4, dtype=np.float32).reshape(6, 4)
    one = tmp_path / "one.safetensors"
    safetensors_numpy.save_file({"thinker.embed_tokens_per_layer.weight": w, "other.weight": w[:1]}, one)
    info, entries, _ = find_table_tensor(one)
    assert info.name == "thinker.embed_tokens_per_layer.weight" and info.shape == (4, 6)    # GGML order
    assert np.array_equal(np.fromfile(one, np.float32, 24, offset=info.data_offset).reshape(6, 4), w)
    two = tmp_path / "two.safetensors"
    safetensors_numpy.save_file({"a.embed_tokens_per_layer.weight": w, "b.embed_tokens_per_layer.weight": w}, two)
    with pytest.raises(errors.TableNotFoundError, match="holds several per-layer embeddings "
                                                        "\\(a.embed_tokens_per_layer.weight, "
                                                        "b.embed_tokens_per_layer.weight\\); pick one with tensor="):
        find_table_tensor(two)


@pytest.mark.parametrize("text, words", [("{broken", "config.json: bad JSON: "), ("[1, 2]", "config.json: not a JSON "
                                                                                             "object")])
def test_bad_config_json(tmp_path, text, words):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(errors.HeaderError, match=words):
        load_text_config(tmp_path)
    assert load_text_config(tmp_path / "nowhere") == {}
