"""The prefill's host-side schedule (gds_gather.gpu.schedule) against a stand-in device with the GPU's ordering
contract.

The stand-in's "stream" is a thread running queued steps in order; a gated step blocks until the host sets its
slot's flag, exactly as the captured cuStreamWaitValue32 node does, and then re-arms the flag. Each step reads
its slot's staging at the moment it runs, so a step that ran before its staging was complete, or a host that
wrote a slot the device was still reading, shows up as a wrong output or a recorded conflict.
"""
from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np
import pytest

from gds_gather.errors import GatherError, ReadError
from gds_gather.model.synth import write_model
from gds_gather.planner import plan_rows
from gds_gather.errors import StagingCapacityError
from gds_gather.gpu.schedule import check_fits, graph_mode, run_ubatches, staging_bound, staging_bound_for

HANG = 5.0      # a step blocked this long counts as a hang (the real GPU would wait forever)


class StandInDevice:
    """Two slots of staging, two flags, one in-order stream thread."""

    def __init__(self, width: int, step_delay: float = 0.002):
        self.staging = [np.zeros(width, np.int64) for _ in range(2)]
        self.flags = [0, 0]
        self.cv = threading.Condition()
        self.queue: deque = deque()
        self.outputs: list = []
        self.conflicts: list = []
        self.reading = [False, False]
        self.writing = [False, False]
        self.done_k: dict = {}
        self.completed = -1
        self.hung = False
        self.step_delay = step_delay
        self.gated = True
        self.stop = False
        self.t = threading.Thread(target=self._stream, daemon=True)
        self.t.start()

    # -- the "GPU" ---------------------------------------------------------------------------------------------
    def _stream(self):
        while True:
            with self.cv:
                while not self.queue and not self.stop:
                    self.cv.wait()
                if self.stop and not self.queue:
                    return
                op = self.queue[0]
            kind, arg = op
            if kind == "step":
                n, s, gated = arg
                if gated:
                    with self.cv:
                        if not self.cv.wait_for(lambda: self.flags[s] == 1, timeout=HANG):
                            self.hung = True
                            return
                with self.cv:
                    self.reading[s] = True
                    if self.writing[s]:
                        self.conflicts.append(("device read while host writes", s))
                time.sleep(self.step_delay)
                out = self.staging[s][:n].copy()
                with self.cv:
                    self.reading[s] = False
                    self.outputs.append(out)
                    if gated:
                        self.flags[s] = 0                 # the captured write-value node re-arms the flag
            elif kind == "event":
                with self.cv:
                    self.completed = max(self.completed, arg)
            with self.cv:
                self.queue.popleft()
                self.cv.notify_all()

    def _enqueue(self, op):
        with self.cv:
            self.queue.append(op)
            self.cv.notify_all()

    # -- the contract ------------------------------------------------------------------------------------------
    def slot_free(self, k, s):
        if k >= 2:
            with self.cv:
                assert self.cv.wait_for(lambda: self.completed >= k - 2 or self.hung, timeout=HANG)

    def launch(self, n, s):
        self._enqueue(("step", (n, s, self.gated)))

    def release(self, s):
        with self.cv:
            self.flags[s] = 1
            self.cv.notify_all()

    def scrub(self, s):
        self.staging[s][:] = 0

    def done(self, k, s):
        self._enqueue(("event", k))

    def drain(self, timeout=HANG):
        with self.cv:
            if not self.cv.wait_for(lambda: not self.queue or self.hung, timeout=timeout):
                raise TimeoutError("stand-in stream did not drain")
            if self.hung:
                raise TimeoutError("stand-in stream hung on a flag")

    def rearm(self):
        with self.cv:
            self.flags = [0, 0]

    def close(self):
        with self.cv:
            self.stop = True
            self.cv.notify_all()
        self.t.join(1)

    # -- the host staging ----------------------------------------------------------------------------------------
    def stager(self, fail_at=None, exc=None, delay=0.003):
        calls = {"k": -1}

        def stage(tok, s):
            calls["k"] += 1
            with self.cv:
                self.writing[s] = True
                if self.reading[s]:
                    self.conflicts.append(("host wrote while device reads", s))
            try:
                half = tok.size // 2
                self.staging[s][:half] = tok[:half]         # a partial write, then maybe the failure
                time.sleep(delay)
                if calls["k"] == fail_at:
                    raise exc
                self.staging[s][half:tok.size] = tok[half:]
            finally:
                with self.cv:
                    self.writing[s] = False
        return stage


def _ubatches(n, size=64, last=37):
    rng = np.random.default_rng(n)
    ub = [rng.integers(1, 1000, size) for _ in range(n - 1)]
    return ub + [rng.integers(1, 1000, last)]


@pytest.fixture
def dev():
    d = StandInDevice(64)
    yield d
    d.close()


def test_stand_in_blocks_like_the_gpu(dev):
    """The stand-in really models the hang: gated work whose flag is never set does not complete."""
    dev.launch(4, 0)
    with pytest.raises(TimeoutError):
        dev.drain(timeout=0.3)
    dev.release(0)
    dev.drain()
    assert len(dev.outputs) == 1 and dev.flags == [0, 0]


@pytest.mark.parametrize("mode", ["overlap", "staged", "eager"])
def test_every_ubatch_sees_its_own_staging(dev, mode):
    dev.gated = mode != "eager"
    ub = _ubatches(9)
    seen = []
    run_ubatches(ub, dev.stager(), dev, mode, after=lambda k, tok: seen.append(k))
    assert seen == list(range(9))
    assert len(dev.outputs) == 9
    for got, tok in zip(dev.outputs, ub):
        np.testing.assert_array_equal(got, tok)
    assert dev.conflicts == [] and dev.flags == [0, 0] and not dev.queue


@pytest.mark.parametrize("mode", ["overlap", "staged", "eager"])
@pytest.mark.parametrize("fail_at", [0, 1, 4, 8])
def test_read_error_in_ubatch_k_returns_promptly(dev, mode, fail_at):
    dev.gated = mode != "eager"
    ub = _ubatches(9)
    err = ReadError("t.gguf: I/O error at offset 4096")
    t0 = time.perf_counter()
    with pytest.raises(ReadError) as info:
        run_ubatches(ub, dev.stager(fail_at=fail_at, exc=err), dev, mode)
    assert time.perf_counter() - t0 < 2.0
    assert info.value is err                                   # the original error, not a wrapper
    assert any(f"ubatch {fail_at + 1} of 9" in n for n in info.value.__notes__)
    assert not dev.queue and not dev.hung and dev.flags == [0, 0]   # nothing left blocked, flags re-armed
    assert dev.conflicts == []
    ok = dev.outputs[:fail_at]
    for got, tok in zip(ok, ub):
        np.testing.assert_array_equal(got, tok)
    if mode == "overlap":      # the failed ubatch's launched step was released on scrubbed (zero) indices
        assert len(dev.outputs) == fail_at + 1
        assert not dev.outputs[-1].any()
    else:
        assert len(dev.outputs) == fail_at


@pytest.mark.parametrize("mode", ["overlap", "staged"])
def test_keyboard_interrupt_releases_the_device(dev, mode):
    ub = _ubatches(6)
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt) as info:
        run_ubatches(ub, dev.stager(fail_at=3, exc=KeyboardInterrupt()), dev, mode)
    assert time.perf_counter() - t0 < 2.0
    assert "ubatch 4 of 6" in " ".join(info.value.__notes__)
    assert not dev.queue and not dev.hung and dev.flags == [0, 0]


def test_interrupt_right_after_launch_still_releases(dev):
    """Ctrl-C between queuing the gated step and staging: the step is released, not left waiting."""
    ub = _ubatches(4)
    calls = {"n": 0}
    orig = dev.launch

    def launch(n, s):
        orig(n, s)
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
    dev.launch = launch
    with pytest.raises(KeyboardInterrupt):
        run_ubatches(ub, dev.stager(), dev, "overlap")
    assert not dev.queue and not dev.hung and dev.flags == [0, 0]


def test_error_in_collect_and_device_error_in_cleanup(dev):
    """An error after launch (collect) drains normally; a failing drain is noted, the first error kept."""
    ub = _ubatches(3)

    def after(k, tok):
        if k == 1:
            raise ValueError("bad token id 99999999")
    with pytest.raises(ValueError, match="bad token id"):
        run_ubatches(ub, dev.stager(), dev, "overlap", after=after)
    assert not dev.queue and dev.flags == [0, 0]

    class Broken:
        def __getattr__(self, name):
            def f(*a):
                if name == "drain":
                    raise RuntimeError("cudaErrorIllegalAddress")
            return f
    with pytest.raises(ReadError) as info:
        run_ubatches(ub, lambda tok, s: (_ for _ in ()).throw(ReadError("boom")), Broken(), "overlap")
    assert any("drain failed" in n and "cudaErrorIllegalAddress" in n for n in info.value.__notes__)


def test_mode_is_checked(dev):
    with pytest.raises(ValueError):
        run_ubatches([], dev.stager(), dev, "graph")


# ---- captured staging sizes --------------------------------------------------------------------------------------
@pytest.mark.parametrize("row_bytes,align", [(90, 512), (90, 4096), (170, 4096), (7392, 4096), (4097, 4096)])
@pytest.mark.parametrize("max_gap,max_window,max_waste", [(0, 0, None), (8192, 1 << 20, 16.0), (1 << 20, 0, None),
                                                          (65536, 4096, 2.0)])
def test_staging_bound_holds_for_every_plan(row_bytes, align, max_gap, max_window, max_waste):
    """The size graphs capture is an upper bound of plan.window_bytes, whatever the ids and gap settings."""
    rng = np.random.default_rng(row_bytes + max_gap)
    n_rows = 50_000
    for n_ids, hi in ((2048, n_rows), (2048, 300), (4096, 5000), (1, n_rows)):
        ids = rng.integers(0, hi, n_ids)
        plan = plan_rows(ids, n_rows=n_rows, row_bytes=row_bytes, data_offset=12345, align=align,
                         max_gap=max_gap, max_window=max_window, max_waste=max_waste)
        bound = staging_bound(n_ids, row_bytes, align, max_gap, max_waste)
        assert plan.window_bytes <= bound
        check_fits(plan, bound, odirect=True)
    contiguous = plan_rows(np.arange(2048), n_rows=n_rows, row_bytes=row_bytes, data_offset=0, align=align,
                           max_gap=max_gap, max_window=max_window, max_waste=max_waste)
    assert contiguous.window_bytes <= staging_bound(2048, row_bytes, align, max_gap, max_waste)


def test_staging_bound_is_tight_enough():
    """Not absurdly large: within 2 blocks + the gap per id of what scattered rows really need."""
    assert staging_bound(1000, 90, 4096) == 1000 * 8192
    assert staging_bound(1000, 90, 4096, max_gap=1 << 20, max_waste=16.0) == 1000 * 8192   # 16 x 90 < 1 block
    assert (staging_bound(1000, 7392, 4096, max_gap=1 << 20, max_waste=16.0)
            == 1000 * (3 * 4096 + 118272 - 118272 % 4096))
    assert staging_bound(0, 90, 4096) == 0


def test_plan_over_capacity_is_refused_with_a_clear_error():
    plan = plan_rows(np.arange(0, 40_000, 97), n_rows=50_000, row_bytes=90, data_offset=0, align=4096)
    with pytest.raises(StagingCapacityError, match="refused before any read") as info:
        check_fits(plan, plan.window_bytes - 1, odirect=True)
    assert isinstance(info.value, GatherError)
    assert f"{plan.window_bytes:,} B" in str(info.value)
    assert check_fits(plan, plan.n_unique * 90, odirect=False) == plan.n_unique * 90


def test_bound_for_a_table_uses_its_config(tmp_path):
    import gds_gather as gg
    path = tmp_path / "m.gguf"
    write_model(path, "qwen4exp", rows=20_000, qtype="IQ4_NL", seed=1, progress=False)
    cfg = gg.Config(max_gap=1 << 20)
    with gg.open_table(path, config=cfg) as t:
        want = staging_bound(4096, t.row_bytes, t.align, cfg.max_gap, cfg.max_waste)
        assert staging_bound_for(t, 4096) == want
        plan = t.plan(np.random.default_rng(0).integers(0, t.n_rows, 4096))
        assert plan.window_bytes <= want


def test_gpu_prefill_implements_the_device_contract():
    """GpuPrefill is run_ubatches' device: every method the schedule calls exists with the contract's arity."""
    import inspect

    from gds_gather.prefill.pipeline import GpuPrefill
    arity = {"slot_free": 2, "launch": 2, "release": 1, "scrub": 1, "done": 2, "drain": 0, "rearm": 0}
    for name, n in arity.items():
        fn = getattr(GpuPrefill, name)
        params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
        assert len(params) == n, (name, params)
        sd = getattr(StandInDevice, name)
        assert len([p for p in inspect.signature(sd).parameters.values()
                    if p.name != "self" and p.default is inspect.Parameter.empty]) == n, name


def test_graph_mode_per_platform():
    assert graph_mode(True, "discrete") == (True, "CUDA graph per (ubatch size, slot)")
    assert graph_mode(True, "unified")[0] is True
    on, why = graph_mode(True, "rocm")
    assert on is False and "eager on ROCm" in why and "cuStreamWaitValue32" in why
    assert graph_mode(False, "discrete") == (False, "eager: graph=False (--no-graph)")
