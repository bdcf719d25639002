"""The prefill pipeline: per-layer inputs exact and hidden states equal to an eager prefill with the table resident.

CPU tests run everywhere; the GPU ones (graph vs eager, every destination) carry the gpu marker.
"""
from __future__ import annotations

import numpy as np
import pytest

import gds_gather as gg
from gds_gather.model.qwen4exp import Qwen4expHParams, ple_rows
from gds_gather.model.synth import write_model
from gds_gather.prefill.run import RowMapper, run_prefill

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module", params=[("qwen4exp", "IQ4_NL", 30000), ("gemma4-e2b", "Q4_K", 3000),
                                        ("gemma3n-e2b", "Q8_0", 2000)], ids=lambda p: p[0])
def model(request, tmp_path_factory):
    preset, qtype, rows = request.param
    return write_model(tmp_path_factory.mktemp("m") / f"{preset}.gguf", preset, qtype=qtype, rows=rows,
                       progress=False)


def _tokens(n, vocab, seed=0):
    return np.random.default_rng(seed).integers(1, vocab, n)


def _reference_ple(t, tokens, ubatch):
    """Per ubatch, from gguf's dequantization of the whole table (the resident-table oracle)."""
    from gguf import quants as gq
    raw = np.fromfile(t.path, np.uint8, t.n_bytes, offset=t.data_offset).reshape(t.n_rows, t.row_bytes)
    table = gq.dequantize(raw, t.qtype).reshape(t.n_rows, t.row_elems)
    out = []
    for k in range(0, tokens.size, ubatch):
        tok = tokens[k:k + ubatch]
        if t.arch == "qwen4exp":
            hp = Qwen4expHParams.from_reader(t.reader)
            full = ple_rows(tokens[:k + tok.size], hp)[k:]        # the whole history, then this ubatch
            out.append(table[full].reshape(tok.size, -1))
        else:
            out.append(table[tok])
    return out


@pytest.mark.parametrize("backend", ["direct", "pread", "mmap", "resident"])
def test_cpu_pipeline_matches_resident_reference(model, backend):
    ubatch = 256
    with gg.open_table(model) as t:
        mapper = RowMapper(t)
        tokens = _tokens(700, min(mapper.n_vocab, t.n_rows))
        ref_rows = _reference_ple(t, tokens, ubatch)
    res = run_prefill(model, prompt=None, n_tokens=None, ubatch=ubatch, backend=backend, progress=False,
                      log=None, collect=True, trunk="tiny", tokens_override=tokens)
    assert res["pipeline"] == "cpu" and res["tokens"] == 700 and res["ubatches"] == 3
    from gds_gather.prefill.pipeline import CpuPrefill
    with gg.open_table(model) as t:
        pipe = CpuPrefill(t, RowMapper(t), ubatch=ubatch, trunk="tiny")
        for k, ((ple, hid), rows) in enumerate(zip(res["outputs"], ref_rows)):
            n = rows.shape[0]
            tk = torch.from_numpy(tokens[k * ubatch:k * ubatch + n])
            with torch.no_grad():
                want_ple = pipe.trunk.ple_inputs(torch.from_numpy(rows), pipe.trunk.embed(tk))
                want_hid = pipe.trunk(tk, want_ple)
            assert torch.equal(ple, want_ple)          # per-layer inputs: exact
            assert torch.equal(hid, want_hid)          # same ops on the same CPU: exact too


def test_cpu_pipeline_figures(model):
    res = run_prefill(model, n_tokens=600, ubatch=200, progress=False, log=None, trunk="none")
    assert res["tokens"] == 600 and res["ubatches"] == 3 and res["graph"] is False
    per_tok = 16 if "qwen4exp" in str(model) else 1
    assert res["ple_rows"] == 600 * per_tok
    assert 0 < res["unique_rows"] <= res["ple_rows"] and res["useful_bytes"] > 0
    rb = res["useful_bytes"] // res["unique_rows"]       # rows the row cache served are not read again
    assert res["bytes_read"] >= (res["unique_rows"] - res["rows_from_cache"]) * rb
    assert res["rows_from_cache"] + res["rows_from_page_cache"] + res["rows_from_device"] == res["unique_rows"]
    assert res["tok_per_s"] > 0 and res["rows_per_s"] > 0
    # no trunk: the whole wall time is the PLE step's, and the output says the trunk is none
    assert res["trunk_seconds"] == 0 and res["ple_seconds"] == res["seconds"] and res["ple_share"] == 1.0
    assert res["trunk_kind"] == "none" and res["trunk"].startswith("none")
    tiny = run_prefill(model, n_tokens=600, ubatch=200, progress=False, log=None, trunk="tiny")
    assert tiny["trunk_seconds"] > 0 and tiny["ple_seconds"] > 0
    assert tiny["ple_seconds"] + tiny["trunk_seconds"] == pytest.approx(tiny["seconds"])
    assert tiny["ple_share"] + tiny["trunk_share"] == pytest.approx(1.0)
    assert tiny["trunk"].startswith("synthetic tiny") and "random weights" in tiny["trunk"]


def test_cold_evicts_the_table_file_only(model, monkeypatch):
    """cold=True evicts the table file (never the whole machine's page cache); drop_caches=True asks for the
    system-wide drop and falls back to the file when refused (not root)."""
    from gds_gather.io import measure
    asked, evicted = [], []
    monkeypatch.setattr(measure, "drop_caches", lambda: asked.append(1) or False)
    real_evict = measure.evict_file
    monkeypatch.setattr(measure, "evict_file", lambda p: evicted.append(p) or real_evict(p))
    res = run_prefill(model, n_tokens=100, ubatch=100, progress=False, log=None, trunk="none", cold=True)
    assert res["cold"] is True and asked == [] and len(evicted) == 1
    res = run_prefill(model, n_tokens=100, ubatch=100, progress=False, log=None, trunk="none", drop_caches=True)
    assert res["cold"] is True and asked == [1] and len(evicted) == 2


# -- GPU ------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("platform", ["discrete", "unified"])
@pytest.mark.parametrize("backend", ["direct", "pread", "gds"])
def test_graph_prefill_equals_eager_resident(model, backend, platform):
    if backend == "gds":
        pytest.importorskip("kvikio")
    ubatch = 256
    with gg.open_table(model) as t:
        tokens = _tokens(700, min(RowMapper(t).n_vocab, t.n_rows))
    cfg = gg.Config(platform=platform)
    kw = dict(prompt=None, ubatch=ubatch, progress=False, log=None, collect=True, trunk="tiny", dtype="float32",
              tokens_override=tokens, cfg=cfg)
    graph = run_prefill(model, backend=backend, graph=True, **kw)
    eager = run_prefill(model, backend="resident", graph=False, **kw)
    assert graph["graph"] and graph["pipeline"] == "gpu"
    for (p1, h1), (p2, h2) in zip(graph["outputs"], eager["outputs"]):
        assert torch.equal(p1, p2)                                   # per-layer inputs: exact
        torch.testing.assert_close(h1, h2, rtol=1e-5, atol=1e-5)    # trunk matmuls: stated tolerance


@pytest.mark.gpu
def test_gpu_per_layer_inputs_match_cpu(model):
    ubatch = 256
    with gg.open_table(model) as t:
        tokens = _tokens(500, min(RowMapper(t).n_vocab, t.n_rows))
    kw = dict(ubatch=ubatch, progress=False, log=None, collect=True, trunk="tiny", tokens_override=tokens)
    gpu = run_prefill(model, dtype="float32", **kw)
    cpu = run_prefill(model, cfg=gg.Config(platform="cpu"), **kw)
    for (p1, _), (p2, _) in zip(gpu["outputs"], cpu["outputs"]):
        torch.testing.assert_close(p1, p2.float(), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager"])
@pytest.mark.parametrize("backend", ["direct", "gds"])
@pytest.mark.parametrize("budget", [20_000, 1 << 22], ids=["evicting", "roomy"])
def test_device_row_cache_across_ubatches_and_prompts(model, backend, graph, budget):
    """The device-resident cache (devcache.py): repeats served from GPU memory, across ubatches and across two
    prompts of one process, equal to the resident table; a small budget keeps evicting and stays exact."""
    if backend == "gds":
        pytest.importorskip("kvikio")
    from gds_gather.gpu import devcache
    devcache.drop_all()
    with gg.open_table(model) as t:
        vocab = min(RowMapper(t).n_vocab, t.n_rows)
    rng = np.random.default_rng(3)
    tokens = np.minimum(rng.zipf(1.2, 900), vocab - 1).astype(np.int64)     # real text repeats tokens
    cfg = gg.Config(platform="discrete", cache_bytes=budget)
    kw = dict(prompt=None, ubatch=128, progress=False, log=None, collect=True, trunk="tiny", dtype="float32",
              tokens_override=tokens, cfg=cfg)
    ref = run_prefill(model, backend="resident", graph=False, **kw)
    hits = []
    for run in range(2):
        got = run_prefill(model, backend=backend, graph=graph, **kw)
        assert got["cache_where"] == "gpu" and got["rows_from_cache"] > 0, got
        assert got["device_cache_bytes"] <= budget
        hits.append(got["rows_from_cache"])
        for (p1, h1), (p2, h2) in zip(got["outputs"], ref["outputs"]):
            assert torch.equal(p1, p2)
            torch.testing.assert_close(h1, h2, rtol=1e-5, atol=1e-5)
    if budget > 1 << 20:        # the second prompt starts with the first one's rows in the cache
        assert hits[1] > hits[0], hits
    devcache.drop_all()


def test_options_object_and_keywords_run_the_same_prefill(model):
    """run_prefill(path, PrefillOptions(...)) as the CLI calls it, keywords on top of it as bench prefill does, and
    bare keywords as older callers do: the same rows. A bad ubatch is refused when the options are made."""
    from gds_gather.prefill.run import PrefillOptions
    opts = PrefillOptions(n_tokens=300, ubatch=100, trunk="none", progress=False, log=None, collect=True)
    a = run_prefill(model, None, opts)
    b = run_prefill(model, None, opts.with_(ubatch=300))
    c = run_prefill(model, n_tokens=300, ubatch=300, trunk="none", progress=False, log=None, collect=True)
    assert (a["ubatches"], b["ubatches"], c["ubatches"]) == (3, 1, 1) and opts.ubatch == 100   # frozen
    rows = [np.concatenate([np.asarray(x[0]).reshape(-1) for x in r["outputs"]]) for r in (a, b, c)]
    np.testing.assert_array_equal(rows[0], rows[1])
    np.testing.assert_array_equal(rows[1], rows[2])
    with pytest.raises(ValueError, match="--ubatch must be > 0"):
        PrefillOptions(ubatch=0)
    with pytest.raises(ValueError, match="--ubatch must be > 0"):
        run_prefill(model, None, opts, ubatch=-1)
