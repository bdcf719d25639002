"""open_table on Hugging Face safetensors checkpoints: single files, sharded directories, and bad headers.

Files are written by the safetensors package itself (safetensors.torch.save_file); the oracle is the tensor
that was saved, and, for offsets, the header parsed here with json.
"""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

import gds_gather as gg  # noqa: E402
from gds_gather.errors import NotSafetensorsError  # noqa: E402

PLE = "model.embed_tokens_per_layer.weight"
ROWS, WIDTH = 301, 96
CONFIG = {"model_type": "gemma4_text", "num_hidden_layers": 6, "hidden_size_per_layer_input": 16,
          "vocab_size_per_layer_input": ROWS}


def _tensors(dtype, name=PLE, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(17, 8, generator=g).to(dtype),
        name: (torch.randn(ROWS, WIDTH, generator=g) * 0.1).to(dtype),
        "model.norm.weight": torch.ones(8, dtype=torch.float32),
    }


def _ids(rng):
    return np.concatenate([rng.integers(0, ROWS, 200), [0, ROWS - 1, 0, 7, 7]])


def _data_offset(path, name):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return 8 + n + json.loads(raw[8:8 + n])[name]["data_offsets"][0]


@pytest.mark.parametrize("dtype,qtype", [(torch.float32, "F32"), (torch.bfloat16, "BF16"), (torch.float16, "F16")])
def test_single_file_exact(tmp_path, dtype, qtype):
    tensors = _tensors(dtype)
    path = tmp_path / "model.safetensors"
    st.save_file(tensors, str(path), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    want = tensors[PLE]
    rng = np.random.default_rng(0)
    for src in (path, tmp_path):                 # the file, or the model directory
        with gg.open_table(src) as t:
            assert (t.n_rows, t.row_elems, t.qtype.name, t.name) == (ROWS, WIDTH, qtype, PLE)
            assert t.path == path and t.row_bytes == WIDTH * want.element_size()
            assert t.data_offset == _data_offset(path, PLE)
            assert t.arch == "gemma4" and t.field("gemma4.block_count") == 6
            assert t.field("gemma4.embedding_length_per_layer_input") == 16
            assert t.field("safetensors.format") == "pt" and t.field("tokenizer.ggml.tokens") is None
            for backend in ("direct", "pread", "mmap", "resident"):
                ids = _ids(rng)
                got = t.gather(torch.from_numpy(ids), backend=backend, dtype=dtype)
                assert got.dtype == dtype and torch.equal(got, want[torch.from_numpy(ids)])
            ids = _ids(rng).reshape(5, -1)
            np.testing.assert_array_equal(t.gather(ids), want.float().numpy()[ids])
            raw = t.read_rows(ids[0])
            assert raw.shape == (ids.shape[1], t.row_bytes)
            assert raw.tobytes() == want[torch.from_numpy(ids[0])].contiguous().view(torch.uint8).numpy().tobytes()


def test_sharded_index(tmp_path):
    a, b = _tensors(torch.bfloat16), {"lm_head.weight": torch.zeros(4, 4)}
    b[PLE] = a.pop(PLE)
    st.save_file(a, str(tmp_path / "model-00001-of-00002.safetensors"))
    st.save_file(b, str(tmp_path / "model-00002-of-00002.safetensors"))
    wm = {**{k: "model-00001-of-00002.safetensors" for k in a}, **{k: "model-00002-of-00002.safetensors" for k in b}}
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": wm}))
    ids = torch.from_numpy(_ids(np.random.default_rng(1)))
    for src in (tmp_path, index):
        with gg.open_table(src) as t:
            assert t.path == tmp_path / "model-00002-of-00002.safetensors" and t.qtype.name == "BF16"
            assert t.data_offset == _data_offset(t.path, PLE)
            assert torch.equal(t.gather(ids, dtype=torch.bfloat16), b[PLE][ids])
            assert t.arch == ""                   # no config.json: no architecture
    # a missing shard, a shard outside the directory, a name the index puts in a shard that lacks it
    for shard, err in (("model-00003-of-00003.safetensors", FileNotFoundError), ("../x.safetensors", gg.HeaderError),
                       ("model-00001-of-00002.safetensors", gg.TableNotFoundError)):
        index.write_text(json.dumps({"weight_map": {**wm, PLE: shard}}))
        with pytest.raises(err):
            gg.open_table(tmp_path)
    index.write_text("[1, 2]")
    with pytest.raises(gg.HeaderError, match="weight_map"):
        gg.open_table(index)


def test_names(tmp_path):
    mm = "model.language_model.embed_tokens_per_layer.weight"      # multimodal checkpoints
    path = tmp_path / "mm.safetensors"
    st.save_file(_tensors(torch.float32, mm), str(path))
    with gg.open_table(path) as t:
        assert t.name == mm
    with gg.open_table(path, "model.embed_tokens.weight") as t:      # any 2-D float tensor by name
        assert (t.n_rows, t.row_elems) == (17, 8)
    with pytest.raises(gg.TableNotFoundError, match="no tensor 'nope'"):
        gg.open_table(path, "nope")
    with pytest.raises(gg.HeaderError, match="1-D|2-D"):
        gg.open_table(path, "model.norm.weight")
    none = tmp_path / "none.safetensors"
    st.save_file({"model.embed_tokens.weight": torch.zeros(3, 4)}, str(none))
    with pytest.raises(gg.TableNotFoundError, match="no per-layer embedding"):
        gg.open_table(none)
    st.save_file({PLE: torch.zeros(3, 4, dtype=torch.int32)}, str(tmp_path / "i32.safetensors"))
    with pytest.raises(gg.UnsupportedTypeError, match="I32"):
        gg.open_table(tmp_path / "i32.safetensors")
    with pytest.raises(FileNotFoundError):
        gg.open_table(tmp_path / "absent.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        gg.open_table(tmp_path / "empty")


def _write_raw(path, header: dict | bytes, data: bytes = b"", length: int | None = None) -> None:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h) if length is None else length) + h + data)


def _entry(offsets, dtype="F32", shape=(2, 4)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


@pytest.mark.parametrize("case,err,match", [
    ("short", gg.TruncatedFileError, "too short"),
    ("absurd_length", gg.HeaderError, "absurd"),
    ("length_past_eof", gg.TruncatedFileError, "past the end"),
    ("not_json", NotSafetensorsError, "not a safetensors file"),
    ("not_object", NotSafetensorsError, "not a JSON object|not a safetensors"),
    ("duplicate", gg.HeaderError, "duplicate key"),
    ("past_eof", gg.TruncatedFileError, "past the end"),
    ("overlap", gg.HeaderError, "overlap"),
    ("size_mismatch", gg.HeaderError, "hold 16 bytes"),
    ("bad_dtype", gg.HeaderError, "unknown dtype"),
    ("bad_shape", gg.HeaderError, "shape"),
    ("bad_offsets", gg.HeaderError, "data_offsets"),
    ("extra_field", gg.HeaderError, "exactly dtype"),
    ("deep_nesting", NotSafetensorsError, "not a safetensors file"),     # json's RecursionError, caught
])
def test_bad_headers(tmp_path, case, err, match):
    p = tmp_path / "model.safetensors"
    data = bytes(64)
    if case == "short":
        p.write_bytes(b"\x01\x00")
    elif case == "absurd_length":
        _write_raw(p, b"{}", length=1 << 62)
    elif case == "length_past_eof":
        _write_raw(p, b"{}", length=4096)
    elif case == "not_json":
        _write_raw(p, b"{not json at all}")
    elif case == "not_object":
        _write_raw(p, b"[1, 2, 3]")
    elif case == "deep_nesting":
        _write_raw(p, b'{"a":' + b"[" * 200_000 + b"]" * 200_000 + b"}")
    elif case == "duplicate":
        _write_raw(p, ('{"%s": %s, "%s": %s}' % (PLE, json.dumps(_entry([0, 32])), PLE,
                                                 json.dumps(_entry([32, 64])))).encode(), data)
    elif case == "past_eof":
        _write_raw(p, {PLE: _entry([0, 32])}, bytes(16))
    elif case == "overlap":
        _write_raw(p, {PLE: _entry([0, 32]), "other": _entry([16, 48])}, data)
    elif case == "size_mismatch":
        _write_raw(p, {PLE: _entry([0, 16])}, data)
    elif case == "bad_dtype":
        _write_raw(p, {PLE: _entry([0, 32], dtype="Q9")}, data)
    elif case == "bad_shape":
        _write_raw(p, {PLE: _entry([0, 32], shape=(-2, -4))}, data)
    elif case == "bad_offsets":
        _write_raw(p, {PLE: {"dtype": "F32", "shape": [2, 4], "data_offsets": [32, 0]}}, data)
    elif case == "extra_field":
        _write_raw(p, {PLE: {**_entry([0, 32]), "extra": 1}}, data)
    with pytest.raises(err, match=match) as e:
        gg.open_table(p)
    assert isinstance(e.value, gg.GatherError)
    if case in ("not_json", "not_object"):
        assert isinstance(e.value, gg.NotGGUFError)      # "no table format fits", as for any non-GGUF file


def test_gguf_unchanged(tmp_path, small_table):
    """A GGUF still opens as before, whatever its name; a file that is neither format is NotGGUFError."""
    renamed = tmp_path / "table.bin"
    renamed.write_bytes(small_table.read_bytes())
    with gg.open_table(renamed) as t:
        assert t.qtype.name == "IQ4_NL" and t.n_rows == 300
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"hello world, not a model")
    with pytest.raises(gg.NotGGUFError):
        gg.open_table(junk)
