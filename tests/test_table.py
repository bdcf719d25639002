"""CPU gathers are bit-exact against gguf.quants.dequantize(table)[ids] for every type gguf dequantizes."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import gds_gather as gg
from gds_gather.formats.quants import Q, supported_types


TYPES = supported_types()


def test_all_listed_types_are_supported():
    names = {t.name for t in TYPES}
    want = ("F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K IQ1_S IQ1_M IQ2_XXS IQ2_XS IQ2_S "
            "IQ3_XXS IQ3_S IQ4_NL IQ4_XS TQ1_0 TQ2_0 MXFP4 NVFP4").split()
    assert set(want) <= names, set(want) - names


def _test_ids(t, rng):
    """Random ids with duplicates, unsorted, the first and last row, and every row straddling a 4 KiB block."""
    off = t.data_offset + np.arange(t.n_rows) * t.row_bytes
    straddle = np.flatnonzero(off // 4096 != (off + t.row_bytes - 1) // 4096)
    ids = np.concatenate([rng.integers(0, t.n_rows, 150), [0, t.n_rows - 1, 0], straddle, straddle[:3]])
    rng.shuffle(ids)
    return ids, straddle


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_gather_exact_every_type(tmp_path, qtype, ggufs):
    n_rows, width = 97, ggufs.width(qtype)
    path = ggufs.write(tmp_path / f"{qtype.name}.gguf", ggufs.rows(qtype, n_rows, width, seed=int(qtype)), qtype)
    ref = ggufs.reference(path)
    rng = np.random.default_rng(int(qtype))
    with gg.open_table(path) as t:
        assert (t.n_rows, t.row_elems, t.qtype) == (n_rows, width, qtype)
        ids, straddle = _test_ids(t, rng)
        if t.row_bytes > 40:   # small rows of a 97-row table may all sit in one block
            assert straddle.size > 0
        for backend in ("mmap", "resident"):
            out = t.gather(ids, backend=backend)
            assert out.dtype == np.float32 and out.shape == ids.shape + (width,)
            np.testing.assert_array_equal(out, ref[ids])
        ids2 = ids[:80].reshape(40, 2)
        out16 = t.gather(ids2, dtype=np.float16)
        assert out16.dtype == np.float16 and out16.shape == (40, 2, width)
        np.testing.assert_array_equal(out16, ref[ids2].astype(np.float16))
        raw = t.read_rows(ids[:10])
        assert raw.shape == (10, t.row_bytes) and raw.dtype == np.uint8


def test_table_geometry_and_offsets(small_table, ggufs):
    from gguf import GGUFReader
    r = GGUFReader(str(small_table))
    ref_t = next(x for x in r.tensors if x.name == ggufs.PLE)
    with gg.open_table(small_table) as t:
        assert t.path == small_table
        assert t.data_offset == ref_t.data_offset and t.data_offset % 4096 != 0
        assert t.row_bytes == 90 and t.n_rows == 300 and t.row_elems == 160
        assert t.arch == "qwen4exp" and t.field("qwen4exp.block_count") == 2
        raw = t.read_rows(np.array([[5, 0], [299, 5]]))
        np.testing.assert_array_equal(raw, np.asarray(ref_t.data)[[[5, 0], [299, 5]]])


def test_other_tensor_and_shapes(small_table, ggufs):
    ref = ggufs.reference(small_table, "token_embd.weight")
    with gg.open_table(small_table, tensor="token_embd.weight") as t:
        assert (t.n_rows, t.row_elems) == (3, 40)
        np.testing.assert_array_equal(t.gather(np.array(2)), ref[2])           # 0-d ids
        np.testing.assert_array_equal(t.gather([[0, 1, 2]]), ref[[[0, 1, 2]]])   # a list


def test_empty_ids(small_table):
    with gg.open_table(small_table) as t:
        assert t.gather(np.array([], np.int64)).shape == (0, 160)
        assert t.gather(np.zeros((3, 0), np.int32)).shape == (3, 0, 160)
        assert t.gather([]).shape == (0, 160)
        assert t.read_rows(np.zeros((0,), np.int64)).shape == (0, 90)


def test_int_dtypes_and_auto_backend(small_table, ggufs):
    ref = ggufs.reference(small_table)
    with gg.open_table(small_table) as t:
        for dt in (np.int8, np.uint8, np.int16, np.int32, np.uint32, np.uint64):
            ids = np.array([1, 7, 7, 120 % np.iinfo(dt).max], dtype=dt)
            np.testing.assert_array_equal(t.gather(ids), ref[ids.astype(np.int64)])


def test_torch_cpu_ids_give_torch_out(small_table, ggufs):
    torch = pytest.importorskip("torch")
    ref = ggufs.reference(small_table)
    with gg.open_table(small_table) as t:
        ids = torch.tensor([[3, 1], [299, 3]])
        out = t.gather(ids)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
        np.testing.assert_array_equal(out.numpy(), ref[ids.numpy()])
        bf = t.gather(ids, dtype=torch.bfloat16)
        assert bf.dtype == torch.bfloat16
        assert torch.equal(bf, torch.from_numpy(ref[ids.numpy()]).to(torch.bfloat16))


def test_closed_table_refuses(small_table):
    t = gg.open_table(small_table)
    t.close()
    with pytest.raises(ValueError, match="closed"):
        t.gather([1])


def test_backends_listing():
    names = {b.name: b for b in gg.backends()}
    assert names["mmap"].available and names["resident"].available
    assert not names["gds"].available and names["gds"].reason


def test_forced_backend_env(small_table):
    cfg = gg.Config.from_env({"GDS_GATHER_BACKEND": "resident"})
    with gg.open_table(small_table, config=cfg) as t:
        t.gather([1, 2])
        assert set(t._readers) == {"resident"}
    with pytest.raises(gg.BackendError, match="unknown backend"):
        with gg.open_table(small_table) as t:
            t.gather([1], backend="nope")
    with pytest.raises(gg.BackendError, match="not available"):
        with gg.open_table(small_table) as t:
            t.gather([1], backend="gds")


def test_split_model_opens_from_any_shard(tmp_path, ggufs):
    from gds_gather.model.synth import write_model
    first = write_model(tmp_path / "m.gguf", "qwen4exp", qtype="Q4_0", rows=5000, split=3, progress=False)
    shards = sorted(tmp_path.glob("m-*-of-00003.gguf"))
    assert len(shards) == 3 and first == shards[0]
    ref = ggufs.reference(shards[-1])
    ids = np.random.default_rng(3).integers(0, 5000, (7, 16))
    for shard in shards:
        with gg.open_table(shard) as t:
            assert t.path == shards[-1] and t.model_path == shard
            assert t.arch == "qwen4exp" and t.field("qwen4exp.ple.ngram_size") == 3   # metadata from shard 1
            np.testing.assert_array_equal(t.gather(ids), ref[ids])
    shards[1].unlink()
    with pytest.raises(FileNotFoundError, match="missing shard"):
        gg.open_table(shards[0])


def test_a_plan_of_another_table_is_refused(small_table, tmp_path, ggufs):
    """read_plan/gather_plan take any ReadPlan: one made for a table of other geometry must not be read (it would
    read another table's bytes, or rows past this table's end)."""
    big = ggufs.write(tmp_path / "big.gguf", ggufs.rows(Q.IQ4_NL, 600, 160, seed=2), Q.IQ4_NL)
    with gg.open_table(small_table) as s, gg.open_table(big) as b:
        other = gg.plan_rows([0, 5], n_rows=s.n_rows, row_bytes=170, data_offset=s.data_offset)   # Q8_0 rows
        for plan in (b.plan([599]), other):
            with pytest.raises(gg.BadIdsError, match="made for another table"):
                s.read_plan(plan, "direct")
        np.testing.assert_array_equal(s.read_plan(s.plan([299]), "direct")[0], s.read_rows([299], "direct")[0])


def test_a_host_read_probes_no_device(small_table, tmp_path):
    """Host paths never pay for device probing: open, plan, gather and read_rows with numpy ids import none of
    torch, cupy or kvikio (a new process; torch is installed where the suite runs, and an importable stand-in
    cupy and kvikio make sure a probe would show)."""
    for name in ("cupy", "kvikio"):
        (tmp_path / "stub" / name).mkdir(parents=True)
        (tmp_path / "stub" / name / "__init__.py").write_text("raise ImportError('stand-in')\n")
    code = ("import builtins, sys, numpy as np, gds_gather as gg\n"
            "tried, real = [], builtins.__import__\n"
            "def imp(name, *a, **k):\n"
            "    if name.split('.')[0] in ('torch', 'cupy', 'kvikio'): tried.append(name)\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = imp\n"
            f"t = gg.open_table({str(small_table)!r})\n"
            "ids = np.array([[1, 5, 1], [299, 0, 7]])\n"
            "t.gather(ids); t.read_rows(ids); t.gather(ids, backend='pread'); t.close()\n"
            "print(sorted(m for m in ('torch', 'cupy', 'kvikio') if m in sys.modules))\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "stub")}
    r = subprocess.run([sys.executable, "-P", "-c", code.replace("print(", "print(tried, ")], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[] []"


def test_readers_and_typical_window_are_public(small_table):
    """What a bench reads of a Table without its privates: the readers it has opened (how they run, the bytes
    they requested, the same total Table.stats() reports) and one row's aligned window."""
    with gg.open_table(small_table) as t:
        assert t.readers() == ([], [])
        t.read_rows(np.array([0, 5, 299]), "pread")
        t.read_rows(np.array([7]), "mmap")
        host, dev = t.readers()
        assert [r.name for r in host] == ["pread", "mmap"] and dev == [] and all(r.how for r in host)
        assert sum(r.bytes_read for r in host) == t.stats()["bytes_requested"] == 4 * t.row_bytes
        w = t.typical_window
        assert w >= t.row_bytes and w % t.gds_align == 0 and w - t.row_bytes < t.gds_align
