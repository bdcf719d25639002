"""bench gather's device destinations (gpu:direct, gpu:gds) on accel.HostAccel (GDS_GATHER_ACCEL=host on a forced
discrete platform: host streams, pread for cuFile), beside the host backend `direct` over the same trace: the same
ids, unique rows and useful bytes per pass, the ratio lines, and --warm tmpfs with fio on the copy.

On a GPU (cupy stream, KvikIO) the same bench runs in bench/gpu_check.sh."""
from __future__ import annotations

import json

import pytest

from gds_gather import benches
from gds_gather.benches.gather import default_backends
from gds_gather.benches.report import HOST_BACKENDS
from gds_gather.benches.gather_passes import stats_delta, table_stats
from gds_gather.config import Config
from gds_gather.model.synth import write_model

pytestmark = pytest.mark.usefixtures("bench_sandbox")


def test_default_backends_follow_the_platform_and_the_accel():
    assert default_backends(Config(platform="cpu", accel="host")) == list(HOST_BACKENDS)
    assert default_backends(Config(platform="rocm", accel="host")) == [*HOST_BACKENDS, "gpu:direct"]
    assert default_backends(Config(platform="discrete", accel="host")) == [*HOST_BACKENDS, "gpu:direct", "gpu:gds"]


def test_device_destinations_on_the_host_accel(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GDS_GATHER_PLATFORM", "discrete")
    monkeypatch.setenv("GDS_GATHER_ACCEL", "host")
    shm = tmp_path / "shm"
    shm.mkdir()
    table = tmp_path / "e4b.gguf"
    write_model(table, "gemma4-e4b", rows=512)
    res = benches.gather_main(["--file", str(table), "--tokens", "256", "--ubatch", "128",
                               "--repeat", "1", "--no-newproc", "--no-restart", "--fio-runtime", "1",
                               "--warm", "tmpfs", "--tmpfs", str(shm), "--backends", "direct,gpu:direct,gpu:gds",
                               "--out", str(tmp_path), "--json"])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1])["backends"] == ["direct", "gpu:direct", "gpu:gds"]
    (t,) = res["tables"]
    assert t["label"] == "e4b.gguf" and t["n_rows"] == 512
    got = {(r["backend"], r["cache"]): r for r in t["runs"]}
    assert set(got) == {(b, p) for b in ("direct", "gpu:direct", "gpu:gds") for p in ("cold", "again", "warm")}
    for p in ("cold", "again", "warm"):
        d = got[("direct", p)]
        for b in ("gpu:direct", "gpu:gds"):
            r = got[(b, p)]
            assert (r["ids"], r["unique"], r["useful_bytes"]) == (d["ids"], d["unique"], d["useful_bytes"]) == \
                (t["ids"], d["unique"], d["unique"] * t["row_bytes"])
            assert r["rows_per_s"] > 0
    assert "cuFile stand-in" in got[("gpu:gds", "cold")]["how"]
    assert got[("gpu:direct", "cold")]["how"] and got[("gpu:direct", "cold")]["how"] != got[("gpu:gds", "cold")]["how"]
    assert "cold: gpu:direct / direct (host)" in out and "cold: gpu:gds / direct (host)" in out
    assert f"(a copy on {shm})" in " ".join(out.split()) and list(shm.iterdir()) == []   # the tmpfs copies are removed
    fw = t["fio_warm"]
    if res["facts"]["fio"] != "not installed":
        assert fw["iops"] > 0 and fw["jobs"] >= 1 and "--ioengine=psync" in fw["cmd"]
        assert "warm: direct / fio psync 4k" in out


@pytest.mark.parametrize("args, words", [
    (["--backends", "direct,nvme"], "unknown backend 'nvme'; known: direct, pread, mmap, readahead, resident, "
                                    "gpu:direct, gpu:gds"),
    (["--tables", "llama"], r"--tables: qwen4exp, qwen4exp-fp8 and/or gemma4-e4b, got 'llama' \(use --file for others\)"),
])
def test_bad_arguments(tmp_path, args, words):
    with pytest.raises(ValueError, match=words):
        benches.gather_main(["--quick", "--out", str(tmp_path), *args])
    assert not list(tmp_path.glob("*.gguf"))                # refused before any table is built


def test_row_cache_figures_of_odd_tables():
    """A table without stats() has no figures; one whose stats() fails gives the error as its figure; no figures
    after a pass give none; counters are the pass's increase, gauges as they are after, the hit rate recomputed."""
    class Failing:
        def stats(self):
            raise OSError("gone")
    assert table_stats(object()) is None
    assert table_stats(Failing()) == {"error": "OSError: gone"}
    assert stats_delta({"cache_hits": 1}, None) is None
    assert stats_delta({"cache_hits": 2, "cache_misses": 1, "cache_bytes": 9},
                       {"cache_hits": 5, "cache_misses": 2, "cache_bytes": 12, "backend": "direct"}) == \
        {"cache_hits": 3, "cache_misses": 1, "cache_bytes": 12, "backend": "direct", "cache_hit_rate": 0.75}


def test_again_and_warm_take_samples_warm_in_sweeps_across_the_backends(tmp_path, monkeypatch):
    """--samples: the again passes in a row on the cold pass's Table, the warm passes in sweeps across the backends
    (each backend's warm passes between the others'), every pass a sample of the median."""
    from gds_gather.benches import gather_passes as gather
    seen, real = [], gather.gather_pass

    def spy(t, b, trace, stream=None):
        seen.append(b)
        return real(t, b, trace, stream)
    monkeypatch.setattr(gather, "gather_pass", spy)
    table = tmp_path / "e4b.gguf"
    write_model(table, "gemma4-e4b", rows=256)
    res = benches.gather_main(["--file", str(table), "--tokens", "128", "--ubatch", "64", "--repeat", "2",
                               "--samples", "3", "--no-newproc", "--no-restart", "--no-fio", "--no-prime",
                               "--backends", "direct,mmap", "--out", str(tmp_path)])
    one = ["direct"] * 4 + ["mmap"] * 4 + ["direct", "mmap"] * 3      # round 1: cold + 3 again each, 3 sweeps
    two = ["mmap"] * 4 + ["direct"] * 4 + ["mmap", "direct"] * 3      # round 2 starts with the other backend
    assert seen == one + two
    (t,) = res["tables"]
    n = {(r["backend"], r["cache"]): r["n_runs"] for r in t["runs"]}
    assert n == {(b, p): (2 if p == "cold" else 6) for b in ("direct", "mmap") for p in ("cold", "again", "warm")}
    assert res["samples"] == 3 and all(len(r["rows_per_s_all"]) == r["n_runs"] for r in t["runs"])


@pytest.mark.parametrize("prime", [True, False])
def test_a_priming_round_first_then_the_backends_take_turns(tmp_path, capsys, monkeypatch, prime):
    """Every backend's cold pass once, untimed, before the timed rounds (a virtual disk's host cache in one state
    for all of them), unless --no-prime; round r starts with backend r, resident (which loads and frees the whole
    table) last in every round; the priming figures are printed and kept."""
    from gds_gather.benches import gather
    calls, real = [], gather.backend_passes

    def spy(path, b, a, cfg, trace, stream, passes):
        calls.append((b, tuple(passes)))
        return real(path, b, a, cfg, trace, stream, passes)
    monkeypatch.setattr(gather, "backend_passes", spy)
    table = tmp_path / "e4b.gguf"
    write_model(table, "gemma4-e4b", rows=256)
    res = benches.gather_main(["--file", str(table), "--tokens", "128", "--ubatch", "64", "--repeat", "3",
                               "--no-newproc", "--no-restart", "--no-fio", "--no-warm",
                               "--backends", "direct,mmap,resident", "--out", str(tmp_path)]
                              + ([] if prime else ["--no-prime"]))
    out = " ".join(capsys.readouterr().out.split())
    timed = [("direct", "mmap", "resident"), ("mmap", "direct", "resident"), ("direct", "mmap", "resident")]
    want = [(b, ("cold",)) for b in ("direct", "mmap")] if prime else []     # (resident: no cold pass)
    want += [(b, ("cold", "again")) for order in timed for b in order]
    assert calls == want
    (t,) = res["tables"]
    assert res["primed"] is prime and (set(t.get("prime", {})) == ({"direct", "mmap"} if prime else set()))
    assert ("priming round (untimed, cold" in out) is prime and ("an untimed priming round" in out) is prime
    assert all(v > 0 for v in t.get("prime", {}).values())


def test_cold_ratio_round_by_round(tmp_path, capsys):
    """Beside the ratio of the two medians (the target's), the cold line gives direct / the best baseline round by
    round (each round's passes close in time: the VM's drift within a run cancels), how many rounds direct led and
    their median."""
    table = tmp_path / "e4b.gguf"
    write_model(table, "gemma4-e4b", rows=256)
    res = benches.gather_main(["--file", str(table), "--tokens", "128", "--ubatch", "64", "--repeat", "3",
                               "--no-again", "--no-warm", "--no-newproc", "--no-restart", "--no-fio", "--no-prime",
                               "--backends", "direct,readahead", "--out", str(tmp_path)])
    out = " ".join(capsys.readouterr().out.split())
    (t,) = res["tables"]
    cold = {r["backend"]: r["rows_per_s_all"] for r in t["runs"] if r["cache"] == "cold"}
    want = [d / r for d, r in zip(cold["direct"], cold["readahead"])]
    got = t["ratios"]["cold"]
    assert got["vs"] == "readahead" and got["per_round"] == pytest.approx(want) and len(want) == 3
    led = sum(x >= 1 for x in want)
    assert (f"round by round {' '.join(f'{x:.2f}' for x in want)} (direct ahead in {led} of 3, median "
            f"{sorted(want)[1]:.2f}x)") in out
    assert got["ratio"] == pytest.approx(sorted(cold["direct"])[1] / sorted(cold["readahead"])[1])
