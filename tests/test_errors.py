"""Each bad input raises its own GatherError subclass, before any row is read."""
from __future__ import annotations

import os
import struct
import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import gds_gather as gg
from gds_gather.formats.gguf_file import read_gguf

PLE_NAME = b"per_layer_token_embd.weight"


def test_hierarchy():
    for cls in (gg.NotGGUFError, gg.HeaderError, gg.TruncatedFileError, gg.TableNotFoundError,
                gg.UnsupportedTypeError, gg.RowWidthError, gg.BadIdsError, gg.BackendError, gg.ReadError):
        assert issubclass(cls, gg.GatherError)


def test_not_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_text("hello, this is not a model\n" * 10)
    with pytest.raises(gg.NotGGUFError, match="not a GGUF"):
        gg.open_table(p)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(gg.NotGGUFError, match="empty"):
        gg.open_table(tmp_path / "empty.gguf")
    with pytest.raises(FileNotFoundError):
        gg.open_table(tmp_path / "missing.gguf")
    with pytest.raises(gg.NotGGUFError, match="regular file"):
        read_gguf(tmp_path)
    with pytest.raises((gg.GatherError, FileNotFoundError)):     # a directory is a (safetensors) model dir
        gg.open_table(tmp_path)
    (tmp_path / "v9.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 9, 0, 0))
    with pytest.raises(gg.NotGGUFError, match="version 9"):
        gg.open_table(tmp_path / "v9.gguf")


def test_truncated_tensor_data(small_table):
    size = os.path.getsize(small_table)
    with open(small_table, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(gg.TruncatedFileError, match="past the end"):
        gg.open_table(small_table)


def test_truncated_header(small_table):
    with open(small_table, "r+b") as f:
        f.truncate(200)
    with pytest.raises(gg.TruncatedFileError):
        gg.open_table(small_table)
    with open(small_table, "r+b") as f:
        f.truncate(10)
    with pytest.raises(gg.TruncatedFileError):
        gg.open_table(small_table)


def test_missing_table(tmp_path, ggufs):
    p = ggufs.write(tmp_path / "no-ple.gguf", None, Q.Q4_0)
    with pytest.raises(gg.TableNotFoundError, match="per_layer_token_embd.weight.*token_embd.weight"):
        gg.open_table(p)
    with pytest.raises(gg.TableNotFoundError):
        gg.open_table(p, tensor="nope.weight")


def test_a_missing_path_is_a_gather_error_naming_it(tmp_path, small_table):
    """A missing model file, shard of a split model or checkpoint file: ModelNotFoundError, a GatherError and still
    a FileNotFoundError (code that caught the latter keeps working), its message naming the path."""
    from gds_gather.errors import ModelNotFoundError
    shard = tmp_path / "m-00001-of-00002.gguf"
    small_table.rename(shard)
    (tmp_path / "empty-dir").mkdir()
    for path, names in ((tmp_path / "missing.gguf", "missing.gguf"), (tmp_path / "missing.safetensors", "missing"),
                        (shard, "m-00002-of-00002.gguf"), (tmp_path / "empty-dir", "empty-dir")):
        with pytest.raises(ModelNotFoundError) as e:
            gg.open_table(path)
        assert isinstance(e.value, gg.GatherError) and isinstance(e.value, FileNotFoundError)
        assert names in str(e.value) and str(path) in str(e.value), str(e.value)


def test_row_width_not_whole_blocks(small_table, ggufs):
    ggufs.patch(small_table, ne0=150)          # IQ4_NL blocks are 32 wide
    with pytest.raises(gg.RowWidthError, match="150.*IQ4_NL.*32"):
        gg.open_table(small_table)


@pytest.mark.parametrize("type_id", [int(Q.Q8_K), int(Q.I32), 99])
def test_unsupported_type(small_table, ggufs, type_id):
    ggufs.patch(small_table, type_id=type_id)
    with pytest.raises(gg.UnsupportedTypeError):
        gg.open_table(small_table)


@pytest.mark.parametrize("ids, match", [
    ([1, 300], r"300 .*\[0, 300\)"),
    ([5, -1, 3], r"-1 .*\[0, 300\)"),
    (np.array([1.0, 2.0]), "integers.*float64"),
    (np.array([True, False]), "integers.*bool"),
    (np.array([2**63 + 5], np.uint64), r"9223372036854775813 .*\[0, 300\)"),
    (["a", "b"], "integers"),
])
def test_bad_ids(small_table, ids, match):
    with gg.open_table(small_table) as t:
        with pytest.raises(gg.BadIdsError, match=match):
            t.gather(ids)
        with pytest.raises(gg.BadIdsError):
            t.read_rows(ids)
        assert not t._readers   # raised before any reader was opened or any row read


def _header(n_tensors, n_kv, kv=b""):
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kv


def test_absurd_tensor_count(tmp_path):
    p = tmp_path / "absurd.gguf"
    p.write_bytes(_header(2**60, 0) + bytes(64))
    t0 = time.perf_counter()
    with pytest.raises(gg.HeaderError, match="2\\*\\*60|1152921504606846976"):
        gg.open_table(p)
    assert time.perf_counter() - t0 < 2


def test_absurd_kv_count(tmp_path):
    p = tmp_path / "absurd-kv.gguf"
    p.write_bytes(_header(0, 2**62) + bytes(64))
    with pytest.raises(gg.HeaderError):
        gg.open_table(p)


def test_absurd_array_length(tmp_path):
    key = b"general.huge"
    kv = struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 0, 2**60)   # ARRAY of UINT8, 2**60 items
    p = tmp_path / "absurd-array.gguf"
    p.write_bytes(_header(0, 1, kv) + bytes(64))
    t0 = time.perf_counter()
    with pytest.raises(gg.HeaderError, match="claims"):
        gg.open_table(p)
    assert time.perf_counter() - t0 < 2


def test_absurd_string_length(tmp_path):
    key = b"general.name"
    kv = struct.pack("<Q", len(key)) + key + struct.pack("<IQ", 8, 2**61)       # STRING of 2**61 bytes
    p = tmp_path / "absurd-str.gguf"
    p.write_bytes(_header(0, 1, kv) + bytes(64))
    with pytest.raises(gg.TruncatedFileError):
        gg.open_table(p)


def test_bad_dtype(small_table):
    with gg.open_table(small_table) as t:
        with pytest.raises(gg.GatherError, match="float32.*float16.*bfloat16") as e:
            t.gather([1], dtype=np.int32)
        assert isinstance(e.value, TypeError)


def test_bad_config():
    with pytest.raises(ValueError, match="GDS_GATHER_ALIGN"):
        gg.Config.from_env({"GDS_GATHER_ALIGN": "lots"})
    with pytest.raises(ValueError, match="power of two"):
        gg.Config.from_env({"GDS_GATHER_ALIGN": "3000"})
    with pytest.raises(ValueError, match="platform"):
        from gds_gather.platform import detect
        detect("quantum")


def test_auto_device_choice_follows_the_measurement(monkeypatch):
    """Real GDS: auto asks the table's measurement; compat mode never uses it."""
    import importlib

    from gds_gather.platform import Platform
    backends = importlib.import_module("gds_gather.backends")     # (gds_gather.backends is also a function)
    monkeypatch.setattr(backends, "detect",
                        lambda override="auto": Platform("discrete" if override == "auto" else override, "test", "GPU"))
    monkeypatch.setattr(backends, "gds_state", lambda: (True, True, "real GDS (test)"))
    asked = []

    def faster(verdict):
        def f():
            asked.append(verdict)
            return verdict, "timed (test)"
        return f
    assert backends.resolve_device("auto", gg.Config(), 4096, faster(True))[:2] == ("gds", "gds")
    name, mode, why = backends.resolve_device("auto", gg.Config(), 4096, faster(False))
    assert (name, mode) == ("direct", "copy") and "measured faster" in why
    assert asked == [True, False]
    assert backends.resolve_device("auto", gg.Config(), 1 << 20)[:2] == ("gds", "gds")      # no measurement
    assert backends.resolve_device("auto", gg.Config(), 4096)[:2] == ("direct", "copy")
    monkeypatch.setattr(backends, "gds_state", lambda: (True, False, "compat (test)"))
    assert backends.resolve_device("auto", gg.Config(), 1 << 20, faster(True))[:2] == ("direct", "copy")
    assert asked == [True, False]
    assert backends.resolve_device("auto", gg.Config(platform="unified"))[:2] == ("direct", "zero-copy")
    assert backends.resolve_device("auto", gg.Config(platform="rocm"))[:2] == ("direct", "copy")
    with pytest.raises(gg.BackendError, match="no usable GPU"):
        monkeypatch.setattr(backends, "detect", lambda override="auto": Platform("cpu", "none"))
        backends.resolve_device("auto", gg.Config())


# ---- hostile GGUF headers (issue 11): each case a GatherError, fast, with bounded memory -----------------------------

def _s(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _s(key.encode()) + struct.pack("<I", vtype) + payload


def _tensor_field_at(path, name: bytes = PLE_NAME) -> int:
    """Byte offset of the tensor info's name length field, found with gguf's own reader."""
    from gguf import GGUFReader
    return next(t for t in GGUFReader(str(path)).tensors if t.name == name.decode()).field.offset


def _patch(path, at: int, fmt: str, *values) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(struct.pack(fmt, *values))


def _timed_open(path, exc, match=None, limit=2.0):
    t0 = time.perf_counter()
    with pytest.raises(exc, match=match) as e:
        gg.open_table(path)
    assert time.perf_counter() - t0 < limit
    return e.value


def test_non_utf8_architecture(small_table):
    data = bytearray(small_table.read_bytes())
    at = data.index(b"general.architecture") + len(b"general.architecture") + 4 + 8
    assert data[at:at + 8] == b"qwen4exp"
    data[at + 5] = 0xFF
    small_table.write_bytes(bytes(data))
    _timed_open(small_table, gg.HeaderError, "not valid UTF-8")


def test_non_utf8_key_and_tensor_name(small_table):
    data = small_table.read_bytes()
    bad = data.replace(b"general.architecture", b"general.architectur\xfe", 1)
    small_table.write_bytes(bad)
    _timed_open(small_table, gg.HeaderError, "UTF-8")
    small_table.write_bytes(data.replace(b"token_embd.weight", b"token_embd.weigh\xff", 1))
    _timed_open(small_table, gg.HeaderError, "UTF-8")


def test_non_utf8_string_array_item(tmp_path, ggufs):
    """A metadata string array with a bad item opens (items decode on demand) and its contents() is a HeaderError."""
    from gguf import GGUFWriter
    w = GGUFWriter(str(tmp_path / "a.gguf"), "qwen4exp")
    w.add_array("general.tags", ["good", "b\u00e9d"])
    w.add_tensor(ggufs.PLE, ggufs.rows(Q.Q8_0, 4, 64), raw_dtype=Q.Q8_0)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    p = tmp_path / "a.gguf"
    p.write_bytes(p.read_bytes().replace("b\u00e9d".encode(), b"b\xe9\xffd", 1))
    with gg.open_table(p) as t:
        with pytest.raises(gg.HeaderError, match="general.tags.*UTF-8"):
            t.field("general.tags")
        assert t.reader.get_field("general.tags").contents(0) == "good"


def test_nesting_3000_deep(tmp_path):
    """36 KB of arrays nested 3,000 deep: a HeaderError (gguf's reader: RecursionError)."""
    kv = _s(b"general.deep") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 3000 + struct.pack("<IQ", 0, 0)
    p = tmp_path / "deep.gguf"
    p.write_bytes(_header(0, 1, kv) + bytes(64))
    assert 35_000 < p.stat().st_size < 40_000
    _timed_open(p, gg.HeaderError, "nests arrays more than 2 deep", limit=0.5)


def test_nesting_two_levels_reads(tmp_path, ggufs):
    from gguf import GGUFWriter
    w = GGUFWriter(str(tmp_path / "n.gguf"), "qwen4exp")
    w.add_array("general.pairs", [[1, 2], [3, 4, 5]])
    w.add_tensor(ggufs.PLE, ggufs.rows(Q.Q8_0, 4, 64), raw_dtype=Q.Q8_0)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with gg.open_table(tmp_path / "n.gguf") as t:
        assert t.field("general.pairs") == [[1, 2], [3, 4, 5]]


def _string_array_file(path, n_real: int, zero_tail: int) -> int:
    """A GGUF whose first key is a string array of n_real items followed by `zero_tail` zero bytes (which read as
    empty strings), then a valid table; returns the byte offset of the array's count."""
    items = b"".join(_s(f"t{i}".encode()) for i in range(n_real))
    kv = _s(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, n_real) + items + bytes(zero_tail)
    path.write_bytes(_header(0, 1, kv))
    return 24 + 8 + len(b"tokenizer.ggml.tokens") + 8


@pytest.mark.parametrize("size_mb", [1, 4])
def test_inflated_string_array_count(tmp_path, size_mb):
    """A count inflated to what the file could hold (every remaining byte an empty string): gguf's reader looped
    item by item (1 MB: 27 s, 1.4 GB; 4 MB: 141 s, 5.6 GB). Here: well under 2 s, and no allocation per item."""
    import tracemalloc
    p = tmp_path / "inflated.gguf"
    count_at = _string_array_file(p, 20_000, size_mb * 2**20)
    size = p.stat().st_size
    for count in ((size - count_at - 8) // 8, (size - count_at - 8) // 8 - 1000, 20_000 + size_mb * 2**17):
        _patch(p, count_at, "<Q", count)
        err = _timed_open(p, gg.GatherError, limit=2.0)
        if count == 20_000 + size_mb * 2**17:
            assert isinstance(err, gg.TableNotFoundError)   # exactly every zero byte as empty strings: a valid file
        else:
            assert isinstance(err, (gg.HeaderError, gg.TruncatedFileError))
        if size_mb > 1:
            continue
        tracemalloc.start()                # (slows the walk down: a second, untimed open)
        try:
            _timed_open(p, type(err), limit=60)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 2 * 2**20            # Python and numpy allocations: nothing per item (131,072 items)


def test_inflated_string_length(tmp_path):
    p = tmp_path / "s.gguf"
    _string_array_file(p, 10, 0)
    data = bytearray(p.read_bytes())
    at = data.index(b"t5") - 8
    struct.pack_into("<Q", data, at, 2**63)
    p.write_bytes(bytes(data))
    _timed_open(p, gg.TruncatedFileError, "tokenizer.ggml.tokens")


def test_find_tensor_parses_once(tmp_path, ggufs, monkeypatch):
    from gds_gather.formats import gguf_file
    p = ggufs.write(tmp_path / "no-ple.gguf", None, Q.Q4_0)
    calls = []
    real = gguf_file.GGUFHeader
    monkeypatch.setattr(gguf_file, "GGUFHeader", lambda *a, **k: calls.append(a) or real(*a, **k))
    with pytest.raises(gg.TableNotFoundError, match="token_embd.weight"):
        gguf_file.find_tensor(p, ggufs.PLE)
    assert len(calls) == 1


@pytest.mark.parametrize("dims, match", [
    ((160, 2**63 + 5), "negative"),                 # below and above 2**63 mixed (was: float64 overflow warning)
    ((2**63 - 1, 1), "INT64_MAX"),
    ((2**40, 2**40), "INT64_MAX"),
    ((160, 2**62), "past the end|INT64_MAX"),
])
def test_dims_exact(small_table, dims, match):
    at = _tensor_field_at(small_table) + 8 + len(PLE_NAME) + 4
    _patch(small_table, at, "<2Q", *dims)
    _timed_open(small_table, gg.GatherError, match)


def test_too_many_dims(small_table):
    _patch(small_table, _tensor_field_at(small_table) + 8 + len(PLE_NAME), "<I", 5)
    _timed_open(small_table, gg.HeaderError, "5 dimensions")


def _offset_at(path, name: bytes = PLE_NAME) -> int:
    return _tensor_field_at(path, name) + 8 + len(name) + 4 + 2 * 8 + 4


def test_misaligned_table_offset(small_table):
    at = _offset_at(small_table)
    off = struct.unpack("<Q", small_table.read_bytes()[at:at + 8])[0]
    _patch(small_table, at, "<Q", off + 1)
    _timed_open(small_table, gg.HeaderError, "not a multiple of the alignment 32")


def test_table_overlapping_another_tensor(small_table):
    _patch(small_table, _offset_at(small_table), "<Q", 0)      # token_embd.weight's bytes
    _timed_open(small_table, gg.HeaderError, "overlaps the data of tensor 'token_embd.weight'")


def test_table_after_a_gap(small_table):
    at = _offset_at(small_table)
    off = struct.unpack("<Q", small_table.read_bytes()[at:at + 8])[0]
    _patch(small_table, at, "<Q", off + 32)
    _timed_open(small_table, gg.GatherError, "gap|past the end")


def test_other_tensor_past_eof(tmp_path, ggufs):
    """A tensor after the table whose data runs past the end: refused, naming it."""
    from gguf import GGUFWriter
    w = GGUFWriter(str(tmp_path / "t.gguf"), "qwen4exp")
    w.add_tensor(ggufs.PLE, ggufs.rows(Q.Q8_0, 4, 64), raw_dtype=Q.Q8_0)
    w.add_tensor("output.weight", np.zeros((64, 64), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    p = tmp_path / "t.gguf"
    with open(p, "r+b") as f:
        f.truncate(p.stat().st_size - 4)
    _timed_open(p, gg.TruncatedFileError, "output.weight.*past the end")


def test_big_endian_refused_by_name(small_table):
    data = bytearray(small_table.read_bytes())
    data[4:8] = struct.pack(">I", 3)
    small_table.write_bytes(bytes(data))
    assert struct.unpack("<I", data[4:8])[0] == 50331648
    _timed_open(small_table, gg.NotGGUFError, "big-endian GGUF files are not supported")


@pytest.mark.parametrize("vtype", [13, 255, 2**31])
def test_unknown_value_type(tmp_path, vtype):
    p = tmp_path / "v.gguf"
    p.write_bytes(_header(0, 1, _kv("general.x", vtype, bytes(16))) + bytes(64))
    _timed_open(p, gg.HeaderError, f"unknown value type {vtype}")
    p.write_bytes(_header(0, 1, _kv("general.x", 9, struct.pack("<IQ", vtype, 1))) + bytes(64))
    _timed_open(p, gg.HeaderError, f"unknown item type {vtype}")


@pytest.mark.parametrize("type_id", [4, 41 + 50, 2**31 + 1])
def test_unknown_type_of_another_tensor_is_tolerated(tmp_path, ggufs, type_id):
    """Only the table's type matters: another tensor of a type gguf does not know (a newer ggml) is skipped."""
    p = ggufs.write(tmp_path / "x.gguf", ggufs.rows(Q.Q8_0, 8, 64), Q.Q8_0)
    ref = ggufs.reference(p)
    ggufs.patch(p, name="token_embd.weight", type_id=type_id)
    with gg.open_table(p) as t:
        np.testing.assert_array_equal(t.gather([3, 0]), ref[[3, 0]])


def test_duplicate_key_and_bad_alignment(tmp_path):
    kv = _kv("general.a", 4, struct.pack("<I", 1)) * 2
    (tmp_path / "d.gguf").write_bytes(_header(0, 2, kv) + bytes(64))
    _timed_open(tmp_path / "d.gguf", gg.HeaderError, "duplicate metadata key 'general.a'")
    for payload, vtype, match in ((struct.pack("<I", 48), 4, "power of two"), (struct.pack("<Q", 32), 10, "UINT32")):
        (tmp_path / "a.gguf").write_bytes(_header(0, 1, _kv("general.alignment", vtype, payload)) + bytes(64))
        _timed_open(tmp_path / "a.gguf", gg.HeaderError, match)


def test_one_exception_hierarchy_in_errors_py():
    """Every exception class of the package is defined in errors.py, derives from GatherError, and stays
    importable from the module it used to live in."""
    import ast
    import importlib
    import inspect
    from pathlib import Path

    from gds_gather import errors
    root = Path(gg.__file__).parent
    elsewhere = []
    for path in list(root.rglob("*.py")) + list((root.parent / "model").rglob("*.py")):
        if path.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    getattr(b, "id", getattr(b, "attr", "")).endswith(("Error", "Exception", "Refused"))
                    for b in node.bases):
                elsewhere.append(f"{path.name}: {node.name}")
    assert elsewhere == []
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__]
    assert all(issubclass(c, gg.GatherError) for c in classes) and len(classes) >= 18
    for module, name in (("gpu.arrays", "BadDtypeError"), ("prefill.tokenizer", "TokenizerError"),
                         ("gpu.schedule", "StagingCapacityError"), ("prefill.prompts", "PromptError"),
                         ("io.safe_write", "OutputPathError"), ("gpu.graph", "WaitValueRefused")):
        assert getattr(importlib.import_module(f"gds_gather.{module}"), name) is getattr(errors, name)


def test_a_dtype_that_cannot_even_be_printed_is_a_bad_dtype():
    """An object whose str() and repr() both raise: BadDtypeError naming its type (not the error of its repr)."""
    from gds_gather.gpu import arrays

    class Weird:
        def __str__(self):
            raise RuntimeError("no str")
        __repr__ = __str__
    with pytest.raises(gg.errors.BadDtypeError, match="got an object of type Weird"):
        arrays.dtype_name(Weird())
    with pytest.raises(TypeError, match="not a CUDA stream: 'default'"):
        arrays.stream_ptr("default")


def test_a_fifo_and_a_proc_file_are_refused_by_name_without_waiting(tmp_path):
    """A FIFO's open waits for a writer (the safetensors sniffing opened it: a hang); a /proc file is "regular" with
    size 0 and refuses a seek to its end (an OSError without the file's name)."""
    import threading
    fifo = tmp_path / "table.gguf"
    os.mkfifo(fifo)
    got = []
    th = threading.Thread(target=lambda: got.append(_refusal(fifo)), daemon=True)
    th.start()
    th.join(10)
    assert got and isinstance(got[0], gg.NotGGUFError) and str(fifo) in str(got[0]), got
    if os.path.exists("/proc/self/mem"):
        e = _refusal("/proc/self/mem")
        assert isinstance(e, gg.NotGGUFError) and "/proc/self/mem" in str(e)


def _refusal(path):
    try:
        gg.open_table(path)
    except Exception as e:      # noqa: BLE001 (the test checks its type)
        return e
    return None
