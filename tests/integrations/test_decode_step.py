"""A decode step's per-layer embedding. With its rows read lately (RecentRows): no table read, plan, lock, dtype
conversion or numpy call, and one allocation, its output. With its rows only in the row cache: one look-up and
one copy, without the table's lock, read_plan, a plan or a cache_for call. Both give transformers' own module's
values. Each test builds a tiny model (vocab 512) and takes about a second."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import gds_gather.table as table_mod  # noqa: E402
from gds_gather.benches.tiny import tiny  # noqa: E402
from gds_gather.cache import rowcache  # noqa: E402
from gds_gather.errors import BadIdsError  # noqa: E402
from gds_gather.integrations import disk_embedding  # noqa: E402
from gds_gather.integrations.recent_rows import RecentRows  # noqa: E402
from gds_gather.integrations.transformers import from_pretrained  # noqa: E402
from gds_gather.table import Table  # noqa: E402

# torch ops a step that reads nothing must not run: a dtype conversion, a gather through an index tensor, the scale
# multiply (its rows are held scaled)
CONVERSIONS = ("aten::to", "aten::_to_copy", "aten::index_select", "aten::embedding", "aten::mul", "aten::mul_")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny("gemma4", tmp_path_factory.mktemp("decode") / "m", vocab=512, n_layer=2, per_layer=16)


class _CountingLock:
    """The table's lock, counting how often a read takes it."""

    def __init__(self, lock, calls):
        self.lock, self.calls = lock, calls

    def __enter__(self):
        self.calls["table lock"] = self.calls.get("table lock", 0) + 1
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


def _count(monkeypatch, owner, name, calls):
    real = getattr(owner, name)

    def counted(*a, **kw):
        calls[name] = calls.get(name, 0) + 1
        return real(*a, **kw)
    monkeypatch.setattr(owner, name, counted)


def _count_reads(monkeypatch, table, calls):
    """Count the table's lock and every step of a read: planning, the row cache, dequantizing, converting."""
    monkeypatch.setattr(table, "_lock", _CountingLock(table._lock, calls))
    for owner, name in ((Table, "read_plan"), (Table, "plan"), (table_mod, "plan_rows"), (rowcache, "cache_for"),
                        (Table, "read_unique"), (Table, "dequantize"), (disk_embedding.DiskEmbedding, "_as_torch"),
                        (RecentRows, "put"), (np, "unique"), (np, "ascontiguousarray")):
        _count(monkeypatch, owner, name, calls)


def _models(model_dir, dtype):
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).get_per_layer_input_embeddings()
    off = from_pretrained(model_dir, dtype=dtype)
    rowcache.empty_all()                    # (another test cached rows of the same file)
    return ref, off, off.get_per_layer_input_embeddings()


@pytest.mark.parametrize("ids", [[[37]], [[37, 38, 37, 5]], [[37], [5]]], ids=["1 id", "4 ids", "batch of 2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_of_recent_rows_reads_nothing_and_allocates_its_output_only(model_dir, monkeypatch, dtype, ids):
    from torch.profiler import ProfilerActivity, profile
    ref, off, m = _models(model_dir, dtype)
    ids = torch.tensor(ids)
    want = ref(ids)
    with torch.inference_mode():
        first = m(ids)                      # a miss: read, converted, kept
        calls = {}
        _count_reads(monkeypatch, off.gds_gather.table, calls)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            steps = [m(ids) for _ in range(10)]
    assert calls == {}, f"a decode step of rows read lately went through {calls}"
    ops = [e.name for e in prof.events()]
    assert not set(ops) & set(CONVERSIONS), ops
    allocs = [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0]
    assert allocs == [want.nbytes] * 10                 # each step: its output, nothing else
    assert torch.equal(first, want) and all(s.dtype == dtype and torch.equal(s, want) for s in steps)
    assert m.recent.hits == 10 * ids.numel() and m.row_ids == 11 * ids.numel()
    assert m.rows_read == 11 * len(set(ids.reshape(-1).tolist()))     # per call, after deduplication
    with torch.inference_mode():
        steps[0].add_(1)                                # a step's output is its own: the next is unchanged
        assert torch.equal(m(ids), want)
        unscaled = ref.weight[ids]                      # rows() (vLLM's): held unscaled, apart from forward's
        assert torch.equal(m.rows(ids), unscaled) and torch.equal(m.rows(ids), unscaled)
        assert calls["read_unique"] == 1 and torch.equal(m(ids), want)
    off.gds_gather.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_decode_step_takes_no_plan_nor_lock_path(model_dir, monkeypatch, dtype):
    """Rows in the row cache only (no recent rows: a budget of none): one look-up, no plan, no lock."""
    ref, off, m = _models(model_dir, dtype)
    m.recent = RecentRows(m.embedding_dim, dtype, budget=0)
    ids = torch.tensor([[37]])
    with torch.inference_mode():
        first = m(ids)                      # a miss: read, then admitted to the row cache
        m(ids)                              # the hit path is set up
        calls = {}
        table = off.gds_gather.table
        monkeypatch.setattr(table, "_lock", _CountingLock(table._lock, calls))
        for owner, name in ((Table, "read_plan"), (Table, "plan"), (table_mod, "plan_rows"),
                            (rowcache, "cache_for")):
            _count(monkeypatch, owner, name, calls)
        steps = [m(ids) for _ in range(20)]
        assert calls == {}, f"a cached decode step went through {calls}"
        want = ref(ids)
        assert torch.equal(first, want)
        assert all(torch.equal(s, want) for s in steps)
        assert m.row_ids == 22 and m.rows_read == 22 and m.recent.hits == 0
        st = off.gds_gather.table.stats()
        assert st["rows_from_cache"] >= 21
        new = torch.tensor([[38, 37, 38]])    # a miss among hits still goes the whole way, counted once
        assert torch.equal(m(new), ref(new))
        assert calls.get("table lock") == 1
    off.gds_gather.close()


def test_a_miss_among_recent_rows_reads_the_call_once(model_dir, monkeypatch):
    ref, off, m = _models(model_dir, torch.bfloat16)
    m(torch.tensor([[37]]))
    calls = {}
    _count_reads(monkeypatch, off.gds_gather.table, calls)
    new = torch.tensor([[38, 37, 38]])
    assert torch.equal(m(new), ref(new))
    assert calls["read_unique"] == 1 and calls["put"] == 1
    assert torch.equal(m(new), ref(new)) and calls["read_unique"] == 1        # now all held
    for bad in ([[-1]], [[37, 512]]):       # never a hit, whatever is held: the read says which id
        with pytest.raises(BadIdsError, match="out of range"):
            m(torch.tensor(bad))
    off.gds_gather.close()


def test_recent_rows_are_bounded_and_emptied_with_the_row_caches():
    r = RecentRows(4, torch.float32, budget=3 * 4 * 4 + 7)         # three rows
    assert r.capacity == 3 and r.nbytes == 0 and r.get(torch.tensor([1])) is None
    rows = torch.arange(20, dtype=torch.float32).reshape(5, 4)
    r.put(np.array([1, 2, 3, 4, 5]), rows)                       # the last three are kept
    assert r.nbytes == 3 * 16
    assert r.get(torch.tensor([1])) is None
    got, distinct = r.get(torch.tensor([[5, 3, 5]]))
    assert torch.equal(got, rows[[4, 2, 4]].reshape(1, 3, 4)) and distinct == 2
    got, _ = r.get(torch.tensor([[5], [3]]))
    assert torch.equal(got, rows[[4, 2]].reshape(2, 1, 4))
    got, _ = r.get(torch.tensor([[5, 3], [3, 4]]))
    assert torch.equal(got, rows[[4, 2, 2, 3]].reshape(2, 2, 4))
    got, _ = r.get(torch.tensor(4))
    assert torch.equal(got, rows[3])
    r.put(np.array([4, 6]), torch.full((2, 4), -1.0))            # 4 is held (kept as it was), 6 evicts 3
    assert r.get(torch.tensor([3])) is None
    got, _ = r.get(torch.tensor([4, 6, 5]))
    assert torch.equal(got, torch.stack([rows[3], torch.full((4,), -1.0), rows[4]]))
    assert r.get(torch.arange(65) % 3 + 4) is None                 # more ids than a decode step: not looked up
    assert r.hits == 3 + 2 + 4 + 1 + 3
    scale = torch.tensor(2.0)                                    # rows of another scale: only for that scale
    assert r.get(torch.tensor([6]), scale) is None
    r.put(np.array([6]), torch.full((1, 4), -2.0), scale)
    assert r.get(torch.tensor([4])) is None and r.get(torch.tensor([4]), scale) is None
    assert torch.equal(r.get(torch.tensor([6]), scale)[0], torch.full((1, 4), -2.0))
    assert r.get(torch.tensor([6]), torch.tensor(2.0)) is None      # (the same object, not an equal one)
    rowcache.empty_all()
    assert r.get(torch.tensor([6]), scale) is None               # the row caches were emptied: so is this
    r.put(np.array([7]), rows[:1])
    rowcache.drop_all()
    assert r.get(torch.tensor([7])) is None and r.nbytes == 3 * 16


def test_puts_that_wrap_around_keep_the_newest_rows():
    """A put whose fresh rows run past the last slot (the index copy) and one that fits before it (the slice copy)
    hold the same rows as a first-in-first-out oracle."""
    r = RecentRows(2, torch.float32, budget=4 * 2 * 4)             # four rows
    oracle: dict = {}
    for ids in ([1], [2, 3, 4], [5, 6], [6, 7, 8], [9]):
        rows = torch.tensor([[float(k), -float(k)] for k in ids])
        r.put(np.array(ids), rows)
        for k in ids:
            oracle.setdefault(k, None)
        oracle = dict(list(oracle.items())[-4:])                 # (a held id keeps its place)
    assert sorted(r.slot) == sorted(oracle) == [6, 7, 8, 9]
    got, _ = r.get(torch.tensor([9, 6, 8, 7]))
    assert torch.equal(got, torch.tensor([[9.0, -9], [6, -6], [8, -8], [7, -7]]))
    assert r.get(torch.tensor([5])) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompts_rows_serve_the_decode_steps_after_it(model_dir, monkeypatch, dtype):
    """A prefill (more ids than a decode step) keeps its rows among those read lately: a decode step on a prompt
    token reads nothing, and gives the resident module's values."""
    ref, off, m = _models(model_dir, dtype)
    prompt = torch.arange(3, 203).reshape(1, -1) % 512
    with torch.inference_mode():
        assert torch.equal(m(prompt), ref(prompt))
        calls = {}
        _count_reads(monkeypatch, off.gds_gather.table, calls)
        for tok in (202, 180, 203 - m.recent.capacity):     # (of more rows than fit, the highest ids are kept)
            ids = torch.tensor([[tok]])
            assert torch.equal(m(ids), ref(ids))
        assert calls == {}, f"a decode step on a prompt token went through {calls}"
        assert m.recent.hits == 3
    off.gds_gather.close()


def _bench_hf():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "bench" / "bench_hf.py"
    spec = importlib.util.spec_from_file_location("bench_hf", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_paired_rounds_take_the_median_of_the_rounds_ratios():
    p = _bench_hf()._paired({"resident": [10.0, 20.0, 40.0], "offloaded": [30.0, 20.0, 20.0]})
    assert p == {"resident": 20.0, "offloaded": 20.0, "ratio": 1.0, "ratio_min": 0.5, "ratio_max": 3.0}


def test_decode_benchmark_runs_both_batches_paired(model_dir, capsys):
    """bench_hf.py decode on the tiny model (a few seconds): both batch sizes, generations equal, the figures."""
    res = _bench_hf().main(["decode", str(model_dir), "--prompt", "8", "--new", "3", "--rounds", "1"])
    out = capsys.readouterr().out
    assert [b["batch"] for b in res["batches"]] == [1, 4] and all(b["generations_equal"] for b in res["batches"])
    for b in res["batches"]:
        assert b["ple_us"]["resident"] > 0 and b["ple_us"]["offloaded"] > 0 and b["step_ms"]["ratio"] > 0
    assert "1 new token per step" in out and "4 new tokens per step" in out and "DIFFER" not in out
    with pytest.raises(SystemExit):
        _bench_hf().main(["decode", str(model_dir), "--new", "1"])
    assert "decode needs --new >= 2" in capsys.readouterr().err
