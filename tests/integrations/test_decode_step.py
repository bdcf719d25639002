"""A decode step's per-layer embedding with its row in the row cache: one look-up and one copy, without the table's
lock, read_plan, a plan or a cache_for call, and the same values as transformers' own module."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import gds_gather.table as table_mod  # noqa: E402
from gds_gather.benches.tiny import tiny  # noqa: E402
from gds_gather.cache import rowcache  # noqa: E402
from gds_gather.integrations.transformers import from_pretrained  # noqa: E402
from gds_gather.table import Table  # noqa: E402


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_decode_step_takes_no_plan_nor_lock_path(model_dir, monkeypatch, dtype):
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).get_per_layer_input_embeddings()
    off = from_pretrained(model_dir, dtype=dtype)
    m = off.get_per_layer_input_embeddings()
    rowcache.empty_all()                    # (the other dtype's test cached rows of the same file)
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
        assert m.row_ids == 22 and m.rows_read == 22
        st = off.gds_gather.table.stats()
        assert st["rows_from_cache"] >= 21
        new = torch.tensor([[38, 37, 38]])    # a miss among hits still goes the whole way, counted once
        assert torch.equal(m(new), ref(new))
        assert calls.get("table lock") == 1
    off.gds_gather.close()
