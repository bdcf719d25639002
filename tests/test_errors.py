"""Each bad input raises its own GatherError subclass, before any row is read."""
from __future__ import annotations

import os
import struct
import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import gds_gather as gg


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
        with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
            t.gather([1], dtype=np.int32)


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
