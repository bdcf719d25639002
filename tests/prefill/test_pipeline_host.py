"""The GPU data path run on host.HostAccel (deferred streams, the kernels built for the host, a pread stand-in
for cuFile): GpuPrefill in every destination, Table.fetch_device / gather / read_rows and the device row cache,
against the CPU pipeline and gguf's dequantizer (the independent oracles)."""
from __future__ import annotations

import os

import numpy as np
import pytest

import gds_gather as gg
from gds_gather.gpu import destinations
from gds_gather.gpu import devcache
from gds_gather.gpu.host import HostAccel, HostArray
from gds_gather.errors import ReadError, StagingCapacityError, StreamOrderError

torch = pytest.importorskip("torch")
from gds_gather.model.synth import write_model  # noqa: E402
from gds_gather.prefill.pipeline import CpuPrefill, GpuPrefill  # noqa: E402
from gds_gather.prefill.run import RowMapper  # noqa: E402

UB = 64
BUDGET = 1 << 20
# (platform, backend, cache budget) -> the destination GpuPrefill builds
DESTS = {"copy": ("discrete", "direct", 0), "copy+cache": ("discrete", "direct", BUDGET),
         "zero-copy": ("unified", "direct", 0), "gds": ("discrete", "gds", 0), "gds+cache": ("discrete", "gds", BUDGET),
         "resident": ("discrete", "resident", 0), "copy-mmap": ("unified", "mmap", 0)}


@pytest.fixture(scope="module", params=[("gemma4-e2b", "Q4_K", 600), ("qwen4exp", "IQ4_NL", 30000)],
                ids=lambda p: p[0])
def model(request, tmp_path_factory):
    preset, qtype, rows = request.param
    return write_model(tmp_path_factory.mktemp("m") / f"{preset}.gguf", preset, qtype=qtype, rows=rows,
                       progress=False)


pytestmark = pytest.mark.usefixtures("fresh_device_caches")


def _cfg(platform, budget):
    return gg.Config(platform=platform, accel="host", cache_bytes=budget, hot_rows=0)


def _tokens(t, n, seed, hi=None):
    return np.random.default_rng(seed).integers(1, min(RowMapper(t).n_vocab, t.n_rows, hi or t.n_rows), n)


def _cpu(t, tok, trunk="none"):
    """CpuPrefill's outputs (gguf's dequantizer); trunk="none": its rows in the kernel's layout."""
    m = RowMapper(t)
    outs = CpuPrefill(t, m, backend="direct", ubatch=UB, trunk=trunk).run(tok, collect=True)["outputs"]
    if trunk != "none":
        return outs
    res = []
    for rows, _ in outs:
        n = rows.shape[0] // m.rows_per_token
        res.append(((rows.view(n, m.n_layer, m.per_layer) * m.row_scale).permute(1, 0, 2).contiguous()
                    if m.family.split_per_layer else rows, None))
    return res


def _gpu(t, backend, tok, graph=True, accel=None, trunk="none", **kw):
    p = GpuPrefill(t, RowMapper(t), backend=backend, ubatch=UB, graph=graph, dtype="float32", trunk=trunk,
                   accel=accel or HostAccel(), **kw)
    try:
        return p.run(tok, collect=True), p
    finally:
        p.close()


def _same(got, want):
    assert len(got) == len(want)
    for (ple, hid), (ple0, hid0) in zip(got, want):
        assert torch.equal(ple, ple0)                       # the rows: bit for bit (kernel == gguf's dequantizer)
        if hid0 is not None:
            torch.testing.assert_close(hid, hid0)           # the trunk: the same float32 ops, host order


@pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager"])
def test_with_the_trunk_the_per_layer_inputs_and_hidden_states_match(model, graph):
    with gg.open_table(model, config=_cfg("discrete", BUDGET)) as t:
        tok = _tokens(t, 2 * UB + 5, seed=4, hi=150)
        res, _ = _gpu(t, "direct", tok, graph, trunk="tiny")
        _same(res["outputs"], _cpu(t, tok, trunk="tiny"))


@pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager"])
@pytest.mark.parametrize("dest", list(DESTS))
def test_every_destination_gives_the_cpu_pipelines_rows(model, dest, graph):
    platform, backend, budget = DESTS[dest]
    with gg.open_table(model, config=_cfg(platform, budget)) as t:
        for run in range(2):                # the second run: device-cache hits, the pool kept across prefills
            tok = _tokens(t, 5 * UB - 17, seed=run, hi=150)     # 5 ubatches: slots reused, a short last one
            res, p = _gpu(t, backend, tok, graph)
            _same(res["outputs"], _cpu(t, tok))
            assert res["destination"] == dest.split("+")[0].replace("copy-mmap", "copy")
            assert res["graph"] is graph and res["ubatches"] == 5 and res["accel"] == "host"
            assert (res.get("cache_where") == "gpu") == (budget > 0)
            if graph:
                assert p.accel.replays == 5
        if budget:
            assert t.stats()["cache_hits"] > 0


def test_device_cache_survives_across_prefills_and_a_changed_file_is_refused(tmp_path):
    path = write_model(tmp_path / "g.gguf", "gemma4-e2b", qtype="Q8_0", rows=3000, progress=False)
    with gg.open_table(path, config=_cfg("discrete", BUDGET)) as t:
        tok = np.tile(np.arange(1, 21), 8)             # every ubatch after the first: all hits
        res, _ = _gpu(t, "direct", tok)
        _same(res["outputs"], _cpu(t, tok))
        hits = t.stats()["cache_hits"]
        assert hits > 0
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))     # the file "changed"
        with pytest.raises(ReadError, match="modified"):
            _gpu(t, "direct", tok)


@pytest.mark.parametrize("dest", ["gds", "zero-copy"])
def test_a_plan_beyond_the_captured_staging_is_refused_before_it_is_read(model, dest):
    platform, backend, budget = DESTS[dest]
    with gg.open_table(model, config=_cfg(platform, budget)) as t:
        p = GpuPrefill(t, RowMapper(t), backend=backend, ubatch=UB, graph=True, dtype="float32", trunk="none",
                       accel=HostAccel())
        try:
            p.dest.capacity = [4096, 4096]
            read0 = sum(r.bytes_read for r in p.readers)
            with pytest.raises(StagingCapacityError, match="captured staging of slot 0"):
                p.run(_tokens(t, 3 * UB, 0))
            assert sum(r.bytes_read for r in p.readers) == read0
            assert p.accel.query(p.stream)                  # drained: nothing left waiting on a flag
        finally:
            p.close()


@pytest.mark.parametrize("clear", [True, False], ids=["cleared", "not-cleared"])
@pytest.mark.parametrize("dest", ["copy+cache", "gds+cache"])
def test_an_error_after_a_stage_leaves_the_device_cache_exact(tmp_path, dest, clear):
    """An error after ubatch 2's stage: its launched step is released scrubbed (no admissions), so the host index
    holds rows the pool never got; GpuPrefill.run clears it (without that, a later prompt gets wrong rows)."""
    platform, backend, _ = DESTS[dest]
    path = write_model(tmp_path / "g.gguf", "gemma4-e2b", qtype="Q8_0", rows=3000, progress=False)
    with gg.open_table(path, config=_cfg(platform, 8 << 20)) as t:        # room for every row: all admitted
        tok = _tokens(t, 4 * UB, 1)
        p = GpuPrefill(t, RowMapper(t), backend=backend, ubatch=UB, graph=True, dtype="float32", trunk="none",
                       accel=HostAccel())
        try:
            stage, calls = p._stage, []

            def failing(tk, s):
                stage(tk, s)
                calls.append(s)
                if len(calls) == 3:
                    raise RuntimeError("injected after a stage")
            p._stage = failing
            if not clear:
                p.dest.failed = lambda: None
            with pytest.raises(RuntimeError, match="injected"):
                p.run(tok)
            p._stage = stage
            p.stats.tokens = 0
            got = p.run(tok, collect=True)["outputs"]
        finally:
            p.close()
        want = _cpu(t, tok)
        same = all(torch.equal(a[0], b[0]) for a, b in zip(got, want))
        assert same is clear


@pytest.mark.parametrize("queued", [False, True])
def test_close_with_work_queued_keeps_the_staging_and_discards_the_device_cache(model, queued):
    with gg.open_table(model, config=_cfg("discrete", BUDGET)) as t:
        p = GpuPrefill(t, RowMapper(t), backend="direct", ubatch=UB, graph=True, dtype="float32", trunk="none",
                       accel=HostAccel())
        readers, dc, dest = list(p.readers), p.dest.dc, p.dest
        p._ub = [np.arange(1, UB + 1)]
        if queued:
            p.launch(UB, 0)             # a replay queued, waiting for flag 0 (never released)
        p.close()
        try:
            assert p.closed and p.readers == []
            assert [r.fd < 0 for r in readers] == [not queued] * 2       # closed readers gave their fd back
            assert (dc.key in devcache._POOLS) == (not queued) and (dc.in_use is False or queued)
            kept = [k for k in destinations.KEPT_WHILE_QUEUED if k[0] == readers]
            assert bool(kept) == queued and all(d is dest for _, d in kept)     # the buffers too, not only readers
        finally:
            if queued:
                destinations.KEPT_WHILE_QUEUED.remove(kept[0])
                for r in readers:
                    r.close()


def test_a_wait_on_an_unset_flag_is_an_error_not_a_hang(model):
    with gg.open_table(model, config=_cfg("discrete", 0)) as t:
        p = GpuPrefill(t, RowMapper(t), backend="direct", ubatch=UB, graph=True, dtype="float32", trunk="none",
                       accel=HostAccel())
        try:
            p._ub = [np.arange(1, UB + 1)]
            p.launch(UB, 1)
            with pytest.raises(StreamOrderError, match="flag 1"):
                p.drain()
        finally:
            p.close()


def test_refused_stream_memory_operations_run_eagerly(model):
    with gg.open_table(model, config=_cfg("discrete", 0)) as t:
        tok = _tokens(t, 2 * UB, 3)
        res, p = _gpu(t, "direct", tok, accel=HostAccel(refuse_waits=True))
        assert not res["graph"] and "eager" in res["graph_reason"] and p.accel.replays == 0
        _same(res["outputs"], _cpu(t, tok))


def test_gds_unavailable_is_a_clear_error(model):
    with gg.open_table(model, config=_cfg("discrete", 0)) as t:
        with pytest.raises(gg.errors.BackendError, match="gds"):
            GpuPrefill(t, RowMapper(t), backend="gds", ubatch=UB, dtype="float32", trunk="none",
                       accel=HostAccel(gds=False))


# -- Table's device path on HostAccel -------------------------------------------------------------------------------

@pytest.fixture
def table_file(small_table):
    return small_table


def _ids(n, seed=0):
    return np.random.default_rng(seed).integers(0, 300, n).reshape(-1, 4)


@pytest.mark.parametrize("dest", ["copy", "copy+cache", "zero-copy", "gds", "copy-mmap"])
def test_table_gather_on_the_device_path_is_exact(table_file, dest):
    platform, backend, budget = DESTS[dest]
    backend = {"copy-mmap": "mmap"}.get(dest, backend)
    with gg.open_table(table_file, config=_cfg(platform, budget)) as t:
        for seed in range(3):               # hits and admissions in the device cache from the second batch
            ids = _ids(80, seed % 2)
            want = t.gather(ids)
            s = t.accel.stream()
            got = t.gather(ids.view(HostArray), backend, stream=s)
            t.accel.synchronize(s)
            np.testing.assert_array_equal(np.asarray(got), want)
            rows = t.read_rows(ids.view(HostArray), backend, stream=s)
            t.accel.synchronize(s)
            np.testing.assert_array_equal(np.asarray(rows), t.read_rows(ids))
            for dtype in ("float16", "bfloat16"):
                half = t.gather(ids.view(HostArray), backend, dtype, stream=s)
                t.accel.synchronize(s)
                w = torch.from_numpy(want).to(getattr(torch, dtype))
                assert np.array_equal(np.asarray(half), w.view(torch.int16).numpy().view(np.uint16)
                                      if dtype == "bfloat16" else w.numpy())
        st = t.stats()
        assert st["cache_hits"] > 0 if budget else st["cache_hits"] == 0
        assert st["bytes_requested"] > 0


@pytest.mark.parametrize("dest", ["copy", "copy+cache", "zero-copy", "gds", "gds+cache"])
def test_a_batch_larger_than_the_slot_rebuilds_the_destination(tmp_path, ggufs, dest):
    """Table's device path starts with a slot for the first batch (at least 1,024 rows) and rebuilds it twice as
    large for a batch that does not fit: rows exact before and after, one destination open, and the device cache
    (pooled per file) still holds the rows admitted before the rebuild."""
    from gguf import GGMLQuantizationType as Q
    platform, backend, budget = DESTS[dest]
    path = ggufs.write(tmp_path / "wide.gguf", ggufs.rows(Q.Q8_0, 5000, 32, seed=3), Q.Q8_0)
    with gg.open_table(path, config=_cfg(platform, budget)) as t:
        s = t.accel.stream()
        small, big = np.arange(0, 40, 2), np.random.default_rng(1).permutation(5000)[:3000]
        hits = []
        for ids in (small, big, small):
            got = t.gather(ids.view(HostArray), backend, stream=s)
            t.accel.synchronize(s)
            np.testing.assert_array_equal(np.asarray(got), t.gather(ids))
            d = t.readers()[1][-1]
            hits.append(d.cache.hits if d.cache is not None else 0)
            if len(hits) == 1:
                first = t.readers()[1][0].bytes_read
        (d,) = t.readers()[1]
        assert d.N >= 3000 and d.name == dest.split("+")[0]
        assert (d.cache is not None) == bool(budget)
        if budget:      # the last batch: all 20 rows device-cache hits (big holds only ~60% of them)
            assert hits[2] - hits[1] == small.size
        host = sum(r.bytes_read for r in t.readers()[0])     # the closed slot's bytes are still counted
        assert t.stats()["bytes_requested"] - host == first + d.bytes_read > first > 0


@pytest.mark.parametrize("dest", ["copy+cache", "gds+cache"])
def test_a_failed_device_copy_leaves_no_false_device_cache_hits(table_file, dest, monkeypatch):
    """The admissions' copy (or the fresh rows' copy) fails after the cached source admitted the misses: the
    device cache is cleared, so the next gather of the same rows reads them again and is exact (the index would
    otherwise claim rows the pool never received)."""
    platform, backend, budget = DESTS[dest]
    with gg.open_table(table_file, config=_cfg(platform, budget)) as t:
        acc, s = t.accel, t.accel.stream()
        ids = _ids(40, 3)
        with monkeypatch.context() as m:
            def refuse(*a, **kw):
                raise RuntimeError("launch failed (test)")
            m.setattr(acc, "copy_rows", refuse)
            with pytest.raises(RuntimeError, match="launch failed"):
                t.gather(ids.view(HostArray), backend, stream=s)
        acc.synchronize(s)
        got = t.gather(ids.view(HostArray), backend, stream=s)
        acc.synchronize(s)
        np.testing.assert_array_equal(np.asarray(got), t.gather(ids))
        assert t.readers()[1][0].cache.hits == 0          # nothing was served from the cleared cache


def test_the_staging_is_waited_for_before_another_stream_reuses_it(table_file):
    """A gather on stream B after one on stream A: the destination's staging is rewritten only after A's queued kernel
    ran (Table waits for the last stream); both results exact."""
    with gg.open_table(table_file, config=_cfg("discrete", 0)) as t:
        a, b = t.accel.stream(), t.accel.stream()
        x, y = _ids(40, 0), _ids(40, 1)
        gx = t.gather(x.view(HostArray), "direct", stream=a)
        gy = t.gather(y.view(HostArray), "direct", stream=b)
        t.accel.synchronize(b)
        t.accel.synchronize(a)
        np.testing.assert_array_equal(np.asarray(gx), t.gather(x))
        np.testing.assert_array_equal(np.asarray(gy), t.gather(y))


def test_staging_on_one_stream_and_the_kernel_on_another_gives_wrong_rows(table_file):
    """Review finding 1 on HostAccel: the staging queued on stream A and the kernel on stream B, B synchronized
    first: the kernel reads staging that was never written (the bug the stream choice fixed). Everything on one
    stream: exact."""
    from gds_gather.gpu import dequant as dequant_gpu
    with gg.open_table(table_file, config=_cfg("discrete", 0)) as t:
        acc = t.accel
        ids = _ids(40, 2)
        plan = t.plan(ids)
        inv = plan.inverse.reshape(plan.shape).astype(np.int32).view(HostArray)
        want = t.gather(ids)
        for same in (False, True):          # (the wrong order first: the destination's buffers are still zeros)
            a = acc.stream()
            b = a if same else acc.stream()
            staging, offs = t.fetch_device(plan, "pread", stream=a)        # compact rows: one H2D copy on a
            out = acc.gather(staging, offs, inv, t.qtype, t.row_elems, dtype="float32", stream=b)
            if same:
                acc.synchronize(b)
                np.testing.assert_array_equal(np.asarray(out), want)
            else:
                acc.synchronize(b)          # the kernel ran before a's copies: every row read at offset 0 of zeros
                assert not np.array_equal(np.asarray(out), want)
                acc.synchronize(a)
        assert dequant_gpu.output_shape(plan.shape, t.qtype, t.row_elems) == want.shape


def test_host_accel_ids_need_a_host_accel_table(table_file):
    with gg.open_table(table_file, config=gg.Config(platform="discrete", cache_bytes=0)) as t:
        with pytest.raises(gg.errors.BackendError, match="HostAccel"):
            t.gather(_ids(8).view(HostArray))


@pytest.mark.parametrize("dest", ["copy", "copy+cache", "zero-copy", "gds"])
def test_one_synchronization_per_device_gather(table_file, dest):
    """Issue 18: device ids cost one host-device synchronization per gather: the ids' copy down on the gather's
    stream (after which the staging's earlier readers on that stream are done, so the destination does not wait again);
    none when the caller passes the host copy it made on that stream (hf's module). Results are exact although
    nothing else synchronizes between the gathers (HostAccel's deferred stream would show a reused staging)."""
    platform, backend, budget = DESTS[dest]
    with gg.open_table(table_file, config=_cfg(platform, budget)) as t:
        acc, s = t.accel, t.accel.stream()
        want = [t.gather(_ids(40, seed)) for seed in range(8)]        # (host gathers wait for the device stream)
        t.gather(_ids(8).view(HostArray), backend, stream=s)        # the destination built
        acc.synchronize(s)
        outs = []
        syncs = acc.syncs
        for seed in range(4):
            outs.append(t.gather(_ids(40, seed).view(HostArray), backend, stream=s))
        assert acc.syncs - syncs == 4
        for seed in range(4, 8):          # the caller's own copy down (hf: input_ids.cpu()), made on s
            ids = _ids(40, seed).view(HostArray)
            host = acc.to_host(ids, s)
            syncs = acc.syncs
            outs.append(t.gather(ids, backend, stream=s, host_ids=host))
            assert acc.syncs == syncs
        acc.synchronize(s)
        for got, w in zip(outs, want):
            np.testing.assert_array_equal(np.asarray(got), w)


def test_a_failed_setup_gives_the_device_cache_back(model):
    """A set-up that fails after the device cache was lent (a negative ubatch: torch refuses the pinned buffers)
    raises that error and gives the cache back: the next prefill of the table borrows the same pooled cache."""
    with gg.open_table(model, config=_cfg("discrete", BUDGET)) as t:
        a = HostAccel()
        with pytest.raises(RuntimeError, match="non-negative|negative dimension"):
            GpuPrefill(t, RowMapper(t), backend="direct", ubatch=-1, graph=False, dtype="float32", trunk="none",
                       accel=a)
        dc = devcache.acquire(t, a.prefill_device(), a)
        try:
            assert dc is not None and dc.key is not None          # the pooled one, not a private copy
        finally:
            devcache.release(dc)


def test_progress_eager_on_rocm_and_a_closed_prefill(model, caplog):
    """ROCm: graph=True runs eagerly and says why; progress is told each ubatch's tokens; the rows are the CPU
    pipeline's; a closed prefill refuses to run."""
    with gg.open_table(model, config=_cfg("rocm", 0)) as t:
        tok = _tokens(t, 2 * UB + 3, seed=8, hi=150)
        seen = []
        p = GpuPrefill(t, RowMapper(t), backend="direct", ubatch=UB, graph=True, dtype="float32", trunk="none",
                       accel=HostAccel())
        try:
            assert not p.graph and "eager on ROCm" in p.graph_why
            res = p.run(tok, progress=seen.append, collect=True)
        finally:
            p.close()
        assert any("eager on ROCm" in m for m in caplog.messages)
        assert seen == [UB, UB, 3] and res["graph"] is False
        _same(res["outputs"], _cpu(t, tok))
        with pytest.raises(ValueError, match="this GpuPrefill is closed"):
            p.run(tok)
