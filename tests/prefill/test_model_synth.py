"""Synthetic GGUF models: layout, metadata, determinism, every type, splits, streaming."""
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFReader, GGUFValueType as T
from gguf import quants as gq

from gds_gather.formats import quants
from gds_gather.errors import RowWidthError, UnsupportedTypeError
from gds_gather.model.presets import PRESETS
from gds_gather.model.qwen4exp import Qwen4expHParams
from gds_gather.model.synth import iter_table_chunks, random_blocks, write_model
from gds_gather.model import synth

TABLE = "per_layer_token_embd.weight"
# small tables: a few hundred KiB each
SMALL_ROWS = {"gemma4-e2b": 64, "gemma4-e4b": 64, "gemma3n-e2b": 40, "qwen4exp": 3000}


def table_of(reader):
    ts = [t for t in reader.tensors if t.name == TABLE]
    assert len(ts) == 1
    return ts[0]


def raw_rows(t):
    """The table as uint8 [rows, row_bytes] (gguf hands F32/F16 tables out as float arrays)."""
    return np.ascontiguousarray(t.data).view(np.uint8).reshape(int(t.shape[1]), -1)


def kv_of(reader):
    """{key: (contents, value type, array sub-type)} without the GGUF.* header pseudo-fields."""
    out = {}
    for name, f in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        out[name] = (f.contents(), f.types[0], f.types[1] if len(f.types) > 1 else None)
    return out


def expected_kv(preset, rows):
    a = preset.arch
    kv = {
        "general.architecture": (a, T.STRING, None),
        "general.alignment": (32, T.UINT32, None),
        "general.name": (f"gds-gather synthetic {preset.name}", T.STRING, None),
        "general.quantization_version": (2, T.UINT32, None),
        f"{a}.block_count": (preset.n_layer, T.UINT32, None),
        f"{a}.embedding_length": (preset.n_embd, T.UINT32, None),
    }
    if a == "qwen4exp":
        hp = Qwen4expHParams.from_preset(preset, rows)
        kv.update({
            "qwen4exp.ple.layers": ([1], T.ARRAY, T.UINT32),
            "qwen4exp.ple.ngram_size": (3, T.UINT32, None),
            "qwen4exp.ple.heads_per_ngram": (8, T.UINT32, None),
            "qwen4exp.ple.conv_kernel": (4, T.UINT32, None),
            "qwen4exp.ple.layer_multipliers": (
                [11400714819323198485, 14029467366897019727, 1609587929392839161], T.ARRAY, T.UINT64),
            "qwen4exp.ple.head_offsets": (list(hp.head_offsets), T.ARRAY, T.UINT64),
            "qwen4exp.ple.head_vocab_sizes": (list(hp.head_vocab_sizes), T.ARRAY, T.UINT64),
            "qwen4exp.ple.eos_token_id": (248044, T.UINT32, None),
            "qwen4exp.ple.image_token_id": (248056, T.UINT32, None),
            "qwen4exp.embedding_length_per_layer_input": (160, T.UINT32, None),
        })
    else:
        kv.update({
            f"{a}.embedding_length_per_layer_input": (256, T.UINT32, None),
            f"{a}.context_length": (preset.n_ctx, T.UINT32, None),
            f"{a}.feed_forward_length": (preset.n_ff, T.UINT32, None),
            f"{a}.attention.head_count": (preset.n_head, T.UINT32, None),
            f"{a}.attention.head_count_kv": (preset.n_head_kv, T.UINT32, None),
            f"{a}.attention.key_length": (preset.head_dim, T.UINT32, None),
            f"{a}.attention.value_length": (preset.head_dim, T.UINT32, None),
        })
    return kv


def test_preset_shapes():
    p = PRESETS
    assert (p["gemma4-e2b"].row_width, p["gemma4-e2b"].n_rows, p["gemma4-e2b"].qtype) == (8960, 262144, Q.Q6_K)
    assert (p["gemma4-e4b"].row_width, p["gemma4-e4b"].n_rows, p["gemma4-e4b"].qtype) == (10752, 262144, Q.Q5_K)
    assert (p["gemma3n-e2b"].row_width, p["gemma3n-e2b"].n_rows) == (7680, 262400)
    assert (p["qwen4exp"].row_width, p["qwen4exp"].n_rows, p["qwen4exp"].qtype) == (160, 320001536, Q.IQ4_NL)
    # row bytes quoted in ple-formats.md
    assert quants.row_bytes(Q.Q6_K, 8960) == 7350
    assert quants.row_bytes(Q.Q5_K, 10752) == 7392
    assert quants.row_bytes(Q.IQ4_NL, 160) == 90
    assert quants.row_bytes(Q.Q8_0, 160) == 170
    assert round(90 * 320001536 / 2**30, 1) == 26.8


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_write_every_preset(tmp_path, name):
    preset, rows = PRESETS[name], SMALL_ROWS[name]
    path = write_model(tmp_path / f"{name}.gguf", name, rows=rows, seed=3, progress=False)
    assert path == tmp_path / f"{name}.gguf"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]   # no .tmp left
    r = GGUFReader(path)
    t = table_of(r)
    assert t.tensor_type == preset.qtype
    assert list(t.shape) == [preset.row_width, rows]
    rb = quants.row_bytes(preset.qtype, preset.row_width)
    assert t.data.shape == (rows, rb) and t.n_bytes == rows * rb
    assert t.data_offset % 32 == 0
    assert kv_of(r) == expected_kv(preset, rows)
    # content is the documented regeneration
    np.testing.assert_array_equal(raw_rows(t), np.concatenate(list(
        iter_table_chunks(preset.qtype, preset.row_width, rows, seed=3))))
    if preset.is_ngram:
        hp = Qwen4expHParams.from_reader(r)
        assert hp == Qwen4expHParams.from_preset(preset, rows)
        assert hp.n_rows <= rows
    assert np.isfinite(quants.dequantize_rows(raw_rows(t)[:4], preset.qtype, preset.row_width)).all()


def test_deterministic_by_seed(tmp_path):
    a = write_model(tmp_path / "a.gguf", "qwen4exp", rows=500, seed=1, progress=False)
    b = write_model(tmp_path / "b.gguf", "qwen4exp", rows=500, seed=1, progress=False)
    c = write_model(tmp_path / "c.gguf", "qwen4exp", rows=500, seed=2, progress=False)
    assert a.read_bytes() == b.read_bytes()
    assert raw_rows(table_of(GGUFReader(a))).tobytes() != raw_rows(table_of(GGUFReader(c))).tobytes()


@pytest.mark.parametrize("qt", quants.supported_types(), ids=lambda q: q.name)
def test_every_type_dequantizes_finite(tmp_path, qt):
    _, size = GGML_QUANT_SIZES[qt]
    blocks = random_blocks(qt, 300, np.random.default_rng(0))
    assert blocks.dtype == np.uint8 and blocks.shape == (300, size)
    assert np.isfinite(gq.dequantize(blocks, qt)).all()
    # the Gemma 4 E2B row (8960 = 35 x 256) is whole blocks of every type
    path = write_model(tmp_path / "m.gguf", "gemma4-e2b", qtype=qt.name.lower(), rows=3, progress=False)
    t = table_of(GGUFReader(path))
    assert t.tensor_type == qt and list(t.shape) == [8960, 3]
    vals = quants.dequantize_rows(raw_rows(t), qt, 8960)
    assert vals.shape == (3, 8960) and np.isfinite(vals).all()
    assert np.abs(vals).max() < 1e4


@pytest.mark.parametrize("qt", [Q.Q4_0, Q.Q8_0, Q.Q5_1, Q.IQ4_NL, Q.MXFP4, Q.F16, Q.BF16])
def test_qwen4exp_32_element_types(tmp_path, qt):
    path = write_model(tmp_path / "q.gguf", "qwen4exp", qtype=qt, rows=200, progress=False)
    t = table_of(GGUFReader(path))
    assert t.tensor_type == qt and list(t.shape) == [160, 200]
    assert np.isfinite(quants.dequantize_rows(raw_rows(t), qt, 160)).all()


def test_bad_qtype(tmp_path):
    with pytest.raises(RowWidthError):            # 160 is not whole 256-blocks
        write_model(tmp_path / "x.gguf", "qwen4exp", qtype="Q6_K", rows=100, progress=False)
    with pytest.raises(RowWidthError):            # nor whole 64-element NVFP4 blocks
        write_model(tmp_path / "x.gguf", "qwen4exp", qtype=Q.NVFP4, rows=100, progress=False)
    with pytest.raises(UnsupportedTypeError):
        write_model(tmp_path / "x.gguf", "qwen4exp", qtype="Q8_K", rows=100, progress=False)
    with pytest.raises(UnsupportedTypeError):
        write_model(tmp_path / "x.gguf", "qwen4exp", qtype="nope", rows=100, progress=False)
    with pytest.raises(KeyError):
        write_model(tmp_path / "x.gguf", "no-such-preset", rows=100, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_split(tmp_path):
    first = write_model(tmp_path / "m.gguf", "qwen4exp", rows=400, split=3, progress=False)
    names = [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert first == tmp_path / names[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == names
    readers = [GGUFReader(tmp_path / n) for n in names]
    for i, r in enumerate(readers):
        kv = kv_of(r)
        assert kv["split.no"] == (i, T.UINT16, None)
        assert kv["split.count"] == (3, T.UINT16, None)
        assert kv["split.tensors.count"] == (3, T.INT32, None)
        assert len(r.tensors) == 1
    # shard 1: all the metadata; later shards: split keys (+ alignment) only
    kv1 = kv_of(readers[0])
    exp = expected_kv(PRESETS["qwen4exp"], 400)
    assert {k: v for k, v in kv1.items() if not k.startswith("split.")} == exp
    assert set(kv_of(readers[1])) == {"split.no", "split.count", "split.tensors.count", "general.alignment"}
    assert Qwen4expHParams.from_reader(readers[0]) == Qwen4expHParams.from_preset(PRESETS["qwen4exp"], 400)
    assert readers[0].tensors[0].name == "token_embd.weight"
    t = table_of(readers[2])
    assert list(t.shape) == [160, 400]
    np.testing.assert_array_equal(raw_rows(t), np.concatenate(list(iter_table_chunks(Q.IQ4_NL, 160, 400))))
    assert all(TABLE not in [x.name for x in r.tensors] for r in readers[:2])


def test_streaming_chunks(tmp_path):
    rows, chunk = 1000, 37           # 28 chunks, the last one short
    path = write_model(tmp_path / "s.gguf", "qwen4exp", rows=rows, seed=5, chunk_rows=chunk, progress=False)
    data = raw_rows(table_of(GGUFReader(path)))
    # the documented rule: chunk i of `chunk` rows is random_blocks(..., default_rng([seed, i]))
    bpr = 160 // 32
    expected = np.concatenate([
        random_blocks(Q.IQ4_NL, min(chunk, rows - s) * bpr, np.random.default_rng([5, i])).reshape(-1, 90)
        for i, s in enumerate(range(0, rows, chunk))])
    np.testing.assert_array_equal(data, expected)
    # the file ends with the tensor padded to the alignment, as GGUFWriter writes it
    t = table_of(GGUFReader(path))
    assert path.stat().st_size == t.data_offset + -(-t.n_bytes // 32) * 32


def test_progress_bar(tmp_path, capsys):
    write_model(tmp_path / "p.gguf", "gemma4-e4b", rows=8, progress=True)
    assert "p.gguf" in capsys.readouterr().err
    write_model(tmp_path / "q.gguf", "gemma4-e4b", rows=8, progress=False)
    assert capsys.readouterr().err == ""


def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    real = synth.iter_table_chunks

    def failing(*a, **k):
        it = real(*a, **k)
        yield next(it)
        raise KeyboardInterrupt

    monkeypatch.setattr(synth, "iter_table_chunks", failing)
    with pytest.raises(KeyboardInterrupt):
        write_model(tmp_path / "i.gguf", "qwen4exp", rows=100, chunk_rows=10, progress=False)
    with pytest.raises(KeyboardInterrupt):
        write_model(tmp_path / "j.gguf", "qwen4exp", rows=100, chunk_rows=10, split=2, progress=False)
    assert list(tmp_path.iterdir()) == []
