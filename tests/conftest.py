"""Shared fixtures: tables written independently with gguf.GGUFWriter in llama.cpp's layout."""
from __future__ import annotations

import os
import struct
import tempfile

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf import quants as gq

Q = GGMLQuantizationType
QUANTIZABLE = {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.TQ1_0, Q.TQ2_0, Q.MXFP4}
PLE = "per_layer_token_embd.weight"

# Tests write only in temporary directories: the default cache directory (built models, bench outputs, hot-row
# files) goes to one, and the hot-row files are off unless a test turns them on (they would carry one test's row
# cache into the next process's). Set before gds_gather is imported (Config's default cache_dir reads it then).
os.environ.setdefault("XDG_CACHE_HOME", tempfile.mkdtemp(prefix="gds-gather-tests-"))
os.environ.setdefault("GDS_GATHER_HOT_ROWS", "0")


@pytest.fixture(autouse=True)
def _hot_rows_only_where_asked(request):
    """Hot-row files (on by default for users) would carry one test's row cache into another's new cache, also for
    Tables made with Config(...) directly: tests without the hot_rows marker neither read nor write them. A patch
    of its own, so a test that undoes its monkeypatch (per hypothesis example) keeps this one."""
    if request.node.get_closest_marker("hot_rows") is not None:
        yield
        return
    from gds_gather.cache import hotrows
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hotrows, "load", lambda target, capacity: None)
        mp.setattr(hotrows, "save", lambda target, ids, freq, rows: None)
        yield


def pytest_report_header(config):
    """The versions this run resolved (CI installs the newest releases the ranges admit): a failure that follows a
    dependency's release shows which one."""
    from importlib import metadata
    found = []
    for name in ("numpy", "gguf", "torch", "transformers", "kernels", "safetensors", "tokenizers", "cupy-cuda13x",
                 "kvikio-cu13"):
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return "versions: " + ", ".join(found)


def _gpu_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="gpu: no usable CUDA GPU on this machine")
    for item in items:
        # the marker, not the keyword: tests/gpu/ makes "gpu" a keyword of every test in it (tests/test_gpu_marker.py)
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def width_for(qtype) -> int:
    """A row width valid for the type: qwen4exp's 160 where the block allows it."""
    block = GGML_QUANT_SIZES[qtype][0]
    return 160 if 160 % block == 0 else (192 if block == 64 else 512)


def valid_rows(qtype, n_rows: int, width: int, seed: int = 0) -> np.ndarray:
    """uint8 [n_rows, row_bytes] of valid blocks: quantized normal values, or random bytes whose blocks all
    dequantize to finite values inside the f16 range (other blocks are drawn again)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    if qtype in QUANTIZABLE:
        x = (rng.standard_normal((n_rows, width)) * 0.1).astype(np.float32)
        return gq.quantize(x, qtype).view(np.uint8).reshape(n_rows, -1)
    blocks = rng.integers(0, 256, (n_rows * width // block, size), dtype=np.uint8)
    for _ in range(200):
        with np.errstate(all="ignore"):   # keep values finite and inside the f16 range
            bad = ~(np.abs(gq.dequantize(blocks, qtype)) < 60000).all(axis=1)
        if not bad.any():
            break
        blocks[bad] = rng.integers(0, 256, (int(bad.sum()), size), dtype=np.uint8)
    return blocks.reshape(n_rows, -1)


def write_gguf(path, table_rows: np.ndarray | None, qtype, *, arch="qwen4exp", name=PLE, extra_tensor=True,
               metadata=None):
    """A GGUF in llama.cpp's layout: metadata, an F16 tensor before the table, then the table."""
    w = GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_uint32(f"{arch}.embedding_length_per_layer_input", 160)
    for k, v in (metadata or {}).items():
        w.add_uint32(k, v)
    if extra_tensor:
        w.add_tensor("token_embd.weight", np.arange(3 * 40, dtype=np.float16).reshape(3, 40))
    if table_rows is not None:
        w.add_tensor(name, table_rows, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def reference(path, name=PLE) -> np.ndarray:
    """gguf's own dequantization of the whole table (the oracle)."""
    r = GGUFReader(str(path))
    t = next(t for t in r.tensors if t.name == name)
    raw = np.asarray(t.data)
    if t.tensor_type in (Q.F32, Q.F16):
        raw = raw.view(np.uint8).reshape(raw.shape[0], -1)
    return gq.dequantize(raw, t.tensor_type).reshape(int(t.shape[1]), int(t.shape[0]))


def tensor_info_offset(path, name=PLE) -> tuple[int, int]:
    """(byte offset of the tensor's dims in the header, n_dims), found with gguf's own reader."""
    r = GGUFReader(str(path))
    t = next(t for t in r.tensors if t.name == name)
    return t.field.offset + 8 + len(name.encode()) + 4, len(t.shape)


def patch_tensor_info(path, name=PLE, ne0: int | None = None, type_id: int | None = None):
    dims_at, n_dims = tensor_info_offset(path, name)
    with open(path, "r+b") as f:
        if ne0 is not None:
            f.seek(dims_at)
            f.write(struct.pack("<Q", ne0))
        if type_id is not None:
            f.seek(dims_at + 8 * n_dims)
            f.write(struct.pack("<I", type_id))


def table_rows(path, n_rows: int, seed: int, qtype=Q.IQ4_NL, width: int = 160):
    """A table written at path: (path, its raw rows as gguf's reader sees them, gguf's dequantization of them)."""
    write_gguf(path, valid_rows(qtype, n_rows, width, seed=seed), qtype)
    t = next(t for t in GGUFReader(str(path)).tensors if t.name == PLE)
    return path, np.array(t.data).view(np.uint8).reshape(n_rows, -1), reference(path)


@pytest.fixture
def bench_sandbox(tmp_path, monkeypatch):
    """A bench test: the cache directory is the test's own, and dropping the machine's page cache fails."""
    from gds_gather.io import measure
    monkeypatch.setenv("GDS_GATHER_CACHE_DIR", str(tmp_path / "cache"))

    def refuse():
        pytest.fail("measure.drop_caches() was called without --drop-caches")
    monkeypatch.setattr(measure, "drop_caches", refuse)


@pytest.fixture
def fresh_row_caches():
    """Every row cache emptied before the test (a truly cold start) and after it (none left to the next); modules
    ask for it with pytestmark = pytest.mark.usefixtures("fresh_row_caches")."""
    from gds_gather.cache import rowcache
    rowcache.drop_all()
    yield
    rowcache.drop_all()


@pytest.fixture
def fresh_device_caches():
    """Every device row cache dropped before the test and after it; modules ask for it with
    pytestmark = pytest.mark.usefixtures("fresh_device_caches")."""
    from gds_gather.gpu import devcache
    devcache.drop_all()
    yield
    devcache.drop_all()


@pytest.fixture
def small_table(tmp_path):
    """A 300-row IQ4_NL table of width 160 (90 B rows; several straddle 4 KiB blocks)."""
    rows = valid_rows(Q.IQ4_NL, 300, 160, seed=1)
    return write_gguf(tmp_path / "small.gguf", rows, Q.IQ4_NL)


@pytest.fixture(scope="session")
def ggufs():
    """The helpers above, for test modules (pytest's importlib mode makes conftest unimportable)."""
    from types import SimpleNamespace
    return SimpleNamespace(PLE=PLE, write=write_gguf, rows=valid_rows, reference=reference, width=width_for,
                           patch=patch_tensor_info, QUANTIZABLE=QUANTIZABLE, table=table_rows)
