"""run_prefill's host branches the rest of the suite leaves unexecuted (issue 17): --cache sets the row cache
budget, a CPU trunk without torch is refused before anything is read, and the summary of a resident run says the
page cache growth is the table's load."""
from __future__ import annotations

import importlib.util

import pytest

from gds_gather.errors import GatherError
from gds_gather.model.synth import write_model
from gds_gather.prefill.run import PrefillOptions, run_prefill, summary_lines


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("m") / "g.gguf", "gemma4-e2b", qtype="Q8_0", rows=2000,
                       progress=False)


def _opts(**kw):
    return PrefillOptions(n_tokens=200, ubatch=100, trunk="none", progress=False, log=None, **kw)


def test_cache_option_is_the_row_cache_budget(model):
    off = run_prefill(model, None, _opts(cache=0, backend="direct"))
    on = run_prefill(model, None, _opts(cache=1 << 20, backend="direct"))
    assert off["cache_budget_bytes"] == 0 and off["rows_from_cache"] == 0
    assert on["cache_budget_bytes"] == 1 << 20
    assert off["unique_rows"] == on["unique_rows"] > 0


def test_a_trunk_without_torch_is_refused_first(model, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    with pytest.raises(GatherError, match=r"^--trunk synth needs torch \(pip install 'gds-gather\[torch\]'\); "
                                          r"--trunk none runs the PLE step alone$"):
        run_prefill(model, None, _opts().with_(trunk="synth"))


def test_summary_of_a_resident_run_names_the_load(model):
    res = run_prefill(model, None, _opts(backend="resident"))
    lines = summary_lines(res)
    assert res["backend"] == "resident"
    assert ("note      resident: the table was read into memory before the clock (the page cache growth is that "
            "load)") in lines
    assert any(line.startswith("sources ") and "from the table in memory (resident)" in line for line in lines)
