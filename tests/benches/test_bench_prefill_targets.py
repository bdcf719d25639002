"""bench prefill --targets: the prefill issue's ratios recomputed here from the figures the bench's JSON holds
(fio's IOPS on the same file, the unique rows per token of the cold run), and the default backend list."""
from __future__ import annotations

import json
import re
import shutil

import pytest

from gds_gather import benches
from gds_gather.benches.report import HOST_BACKENDS


pytestmark = pytest.mark.usefixtures("bench_sandbox")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from gds_gather.model.synth import write_model
    return write_model(tmp_path_factory.mktemp("m") / "q.gguf", "qwen4exp", rows=20000, progress=False)


def _ratio(out: str, name: str) -> float:
    return float(re.search(re.escape(name) + r" = ([\d.]+)x", out).group(1))


def test_targets(model, tmp_path, capsys):
    res = benches.prefill_main(["--model", str(model), "--tokens", "256", "--ubatch", "256", "--repeat", "1",
                                "--backends", "direct", "--targets", "--no-warm", "--quick", "--out", str(tmp_path),
                                "--json"])
    out = capsys.readouterr().out
    assert res["backends"] == ["direct", "mmap", "resident"]        # --targets adds what its ratios need
    (m,) = res["models"]
    get = {(r["backend"], r["cache"]): r for r in m["runs"]}
    cold = get[("direct", "cold")]
    t = m["targets"]
    assert t["unique_rows_per_token"] == cold["unique_rows"] / 256 and cold["unique_rows"] > 0
    assert t["direct_cold_tok_s"] == cold["tok_per_s_median"]
    assert t["resident_tok_s"] == get[("resident", "cold")]["tok_per_s_median"]
    assert "targets:" in out.splitlines()
    d = t["direct_cold_tok_s"]
    assert _ratio(out, "direct cold / mmap cold") == pytest.approx(d / get[("mmap", "cold")]["tok_per_s_median"],
                                                                   abs=0.006)
    if shutil.which("fio") is None:
        assert t["fio_4k_iops"] is None and t["storage_bound_tok_s"] is None
    else:
        iops = t["fio_4k_iops"]
        assert iops > 0 and t["storage_bound_tok_s"] == pytest.approx(iops / t["unique_rows_per_token"])
        assert (f"storage-bound tok/s = fio 4K randread {iops:,.0f} IOPS / {t['unique_rows_per_token']:.2f} unique "
                f"rows per token = {t['storage_bound_tok_s']:,.0f}") in out
    bound = min(x for x in (t["resident_tok_s"], t["storage_bound_tok_s"]) if x)
    assert _ratio(out, "direct cold / min(resident, storage-bound)") == pytest.approx(d / bound, abs=0.006)
    assert "  PASS (target" not in out and "  MISS (target" not in out     # --quick: no verdicts
    assert json.loads(out.strip().splitlines()[-1])["models"][0]["targets"] == t


def test_default_backends(model, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GDS_GATHER_PLATFORM", "cpu")
    res = benches.prefill_main(["--model", str(model), "--tokens", "64", "--ubatch", "64", "--repeat", "1",
                                "--no-cold", "--no-warm", "--out", str(tmp_path)])
    assert res["backends"] == list(HOST_BACKENDS) and res["models"][0]["runs"] == []    # the warm-ups alone
    assert "backends interleaved direct/pread/mmap/readahead/resident" in capsys.readouterr().out
