"""Float8 and NVFP4 tables (issue 36) on the GPU data path, run on host.HostAccel (the kernels built as host
code): Table's device gather and GpuPrefill in every destination against the host path (Table.gather: value x
scale in numpy, itself checked against an independent decoder in tests/formats/test_fp8_tables.py) and CpuPrefill."""
from __future__ import annotations

import numpy as np
import pytest

import gds_gather as gg
from gds_gather.gpu.host import HostAccel, HostArray

torch = pytest.importorskip("torch")
from gds_gather.model.checkpoint import write_fp8_checkpoint  # noqa: E402
from gds_gather.prefill.pipeline import CpuPrefill, GpuPrefill  # noqa: E402
from gds_gather.prefill.run import RowMapper  # noqa: E402

UB = 64
DESTS = {"copy": ("discrete", "direct", 0), "copy+cache": ("discrete", "direct", 1 << 20),
         "zero-copy": ("unified", "direct", 0), "gds": ("discrete", "gds", 0), "resident": ("discrete", "resident", 0)}


@pytest.fixture(scope="module", params=[("F8_E4M3", "F8_E8M0", 32, None), ("F8_E5M2", "F32", 128, None),
                                        ("F8_E4M3", None, 32, None), ("F8_E4M3", "BF16", 160, None),
                                        ("F4_E2M1", None, 32, None)],       # NVFP4: E4M3 per 16 and a global
                ids=lambda p: f"{p[0]}-{p[1]}-{p[2]}")
def checkpoint(request, tmp_path_factory):
    kind, scales, block, _ = request.param
    return write_fp8_checkpoint(tmp_path_factory.mktemp("fp8") / "ck", "qwen4exp", kind, rows=30000,
                                scale_type=scales, scale_block=block, progress=False)


pytestmark = pytest.mark.usefixtures("fresh_device_caches")


def _cfg(platform, budget):
    return gg.Config(platform=platform, accel="host", cache_bytes=budget, hot_rows=0)


@pytest.mark.parametrize("dest", list(DESTS))
def test_device_gather_equals_host_gather(checkpoint, dest):
    platform, backend, budget = DESTS[dest]
    with gg.open_table(checkpoint, config=_cfg(platform, budget)) as t:
        for seed in range(2):
            ids = np.random.default_rng(seed).integers(0, t.n_rows, (3, 70))
            want = t.gather(ids)
            s = t.accel.stream()
            for dtype in ("float32", "float16", "bfloat16"):
                got = t.gather(ids.view(HostArray), backend, dtype, stream=s)
                t.accel.synchronize(s)
                w = torch.from_numpy(want).to(getattr(torch, dtype))
                assert np.array_equal(np.asarray(got), w.view(torch.int16).numpy().view(np.uint16)
                                      if dtype == "bfloat16" else w.numpy())
            raw = t.read_rows(ids.view(HostArray), backend, stream=s)        # the float8 bytes themselves
            t.accel.synchronize(s)
            assert np.array_equal(np.asarray(raw), t.read_rows(ids))


@pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager"])
@pytest.mark.parametrize("dest", ["copy", "gds", "resident"])
def test_gpu_prefill_equals_cpu_prefill(checkpoint, dest, graph):
    platform, backend, budget = DESTS[dest]
    with gg.open_table(checkpoint, config=_cfg(platform, budget)) as t:
        tok = np.random.default_rng(5).integers(1, 150, 3 * UB - 9)      # (a mapper each: it carries n-grams)
        want = CpuPrefill(t, RowMapper(t), backend="direct", ubatch=UB, trunk="none").run(tok, collect=True)
        want = want["outputs"]
        p = GpuPrefill(t, RowMapper(t), backend=backend, ubatch=UB, graph=graph, dtype="float32", trunk="none",
                       accel=HostAccel())
        try:
            got = p.run(tok, collect=True)["outputs"]
        finally:
            p.close()
        assert len(got) == len(want) == 3
        for (rows, _), (rows0, _) in zip(got, want):
            assert torch.equal(rows, rows0)
