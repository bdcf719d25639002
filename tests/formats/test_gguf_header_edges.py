"""gguf_parse.GGUFHeader on headers written by gguf.GGUFWriter and then patched: the refusals the fuzz test
does not reliably reach (too many keys, over-long and duplicate tensor names, a tensor placed before one of
unknown size, a data section past the end), and Field.parts / data against gguf.GGUFReader's (issue 17)."""
from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

from gds_gather.errors import HeaderError, TruncatedFileError
from gds_gather.formats.gguf_parse import MAX_KV, MAX_NAME, MAX_TENSORS, GGUFHeader


def _write(path, names=("a.weight", "b.weight"), *, strings=("x", "yz", "\u00e9t\u00e9"), ints=(3, 1, 4, 1, 5)):
    w = GGUFWriter(str(path), "qwen4exp")
    w.add_array("test.strings", list(strings))
    w.add_array("test.ints", list(ints))
    w.add_uint32("test.scalar", 7)
    for i, n in enumerate(names):
        w.add_tensor(n, np.full((2, 8), i, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def test_parts_and_data_match_ggufs_reader(tmp_path):
    path = tmp_path / "m.gguf"
    _write(path)
    ours, theirs = GGUFHeader(path).fields, GGUFReader(str(path)).fields
    for key in ("test.strings", "test.ints", "test.scalar"):
        a, b = ours[key], theirs[key]
        assert len(a.parts) == len(b.parts), key
        for i in list(range(len(b.parts))) + [-1, -2, -len(b.parts)]:
            assert np.array_equal(np.asarray(a.parts[i]), np.asarray(b.parts[i])), (key, i)
        for sl in (slice(1, 4), slice(-3, None), slice(None, None, 2)):
            got, want = a.parts[sl], b.parts[sl]
            assert len(got) == len(want) and all(np.array_equal(x, y) for x, y in zip(got, want)), (key, sl)
        assert list(a.data) == list(b.data), key
        with pytest.raises(IndexError):
            a.parts[len(b.parts)]
    assert ours["test.strings"].contents() == ["x", "yz", "\u00e9t\u00e9"]
    assert repr(ours["test.strings"]) == "Field('test.strings', ['ARRAY', 'STRING'])"
    assert repr(ours["test.scalar"]) == "Field('test.scalar', ['UINT32'])"


def test_more_keys_than_this_reader_accepts(tmp_path):
    path = tmp_path / "m.gguf"
    raw = bytearray(_write(path))
    n = MAX_KV + 1
    struct.pack_into("<Q", raw, 16, n)
    raw += bytes(n * 13 - len(raw) + 1)           # long enough that the count is not refused as impossible
    path.write_bytes(raw)
    with pytest.raises(HeaderError, match=rf"^{path}: header claims 2 tensors and {n} metadata keys; this reader "
                                          rf"accepts at most {MAX_TENSORS} tensors and {MAX_KV} keys$"):
        GGUFHeader(path)


def test_a_tensor_name_of_ggml_max_name_bytes_is_refused(tmp_path):
    path = tmp_path / "m.gguf"
    long = "n" * MAX_NAME
    try:
        _write(path, names=(long, "b.weight"))
    except Exception as e:                        # a gguf version that checks names itself
        pytest.skip(f"gguf's writer refuses the name: {e}")
    with pytest.raises(HeaderError, match=rf"^{path}: tensor 0 name '{long}' is {MAX_NAME} bytes; GGUF "
                                          rf"\(GGML_MAX_NAME\) allows {MAX_NAME - 1}$"):
        GGUFHeader(path)


def test_duplicate_tensor_names_are_refused(tmp_path):
    path = tmp_path / "m.gguf"
    raw = _write(path)
    assert raw.count(b"b.weight") == 1
    path.write_bytes(raw.replace(b"b.weight", b"a.weight"))
    with pytest.raises(HeaderError, match=rf"^{path}: duplicate tensor name 'a\.weight'$"):
        GGUFHeader(path)


def test_a_tensor_placed_before_one_of_unknown_size_is_refused(tmp_path):
    path = tmp_path / "m.gguf"
    raw = bytearray(_write(path, names=("a.weight", "b.weight", "c.weight")))
    info = {}
    for n in ("b.weight", "c.weight"):
        at = raw.index(n.encode()) + len(n)       # then n_dims u32, 2 dims u64, type u32, offset u64
        info[n] = at + 4 + 16
    struct.pack_into("<I", raw, info["b.weight"], 200)      # a type id gguf does not know: size unknown
    struct.pack_into("<Q", raw, info["c.weight"] + 4, 0)    # c before b
    path.write_bytes(raw)
    b_rel = struct.unpack_from("<Q", raw, info["b.weight"] + 4)[0]
    assert b_rel > 0
    with pytest.raises(HeaderError, match=rf"^{path}: tensor 'c\.weight' at data offset 0 lies before tensor "
                                          r"'b\.weight'; GGUF tensors are packed in order$"):
        GGUFHeader(path)


def test_a_data_section_starting_past_the_end_is_refused(tmp_path):
    path = tmp_path / "m.gguf"
    raw = _write(path)
    start = GGUFReader(str(path)).data_offset
    end_of_infos = raw.index(b"b.weight") + len(b"b.weight") + 4 + 16 + 4 + 8
    assert end_of_infos < start, "no padding before the data section: choose other metadata"
    path.write_bytes(raw[:end_of_infos])
    with pytest.raises(TruncatedFileError, match=rf"^{path}: the data section would start at byte {start}, past "
                                                 rf"the end of the file \({end_of_infos} bytes\)$"):
        GGUFHeader(path)
