"""bench storage's host path against the file's bytes (what the O_DIRECT reads left in the buffer), its failure
paths (O_DIRECT refused, no io_uring, a failing read: the error, every fd closed), the made file, the argument
checks and the GPU paths' skip reasons on a machine forced to a GPU platform (no GPU here: the reasons are real).

The cpu-gpu and gpu-direct transfers run here through accel.HostAccel (the same worker code: deferred streams, pread
for cuFile), and on the GPU (cupy, KvikIO) in bench/gpu_check.sh."""
from __future__ import annotations

import errno
import gc
import json
import os
import threading

import numpy as np
import pytest

from gds_gather import benches
from gds_gather.io import uring
from gds_gather.gpu.host import HostAccel
from gds_gather.benches import storage as st
from gds_gather.errors import ReadError

MiB = 1 << 20


pytestmark = pytest.mark.usefixtures("bench_sandbox")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("storage") / "data.bin"
    path.write_bytes(np.random.default_rng(7).integers(0, 256, 32 * MiB, dtype=np.uint8).tobytes())
    return path, np.fromfile(path, np.uint8)


def open_fds() -> set:
    gc.collect()        # a raised read error's traceback holds numpy views of the ring (its mmaps' fds) until then
    return set(os.listdir("/proc/self/fd"))


def _run(w, nbytes):
    w.run(None, nbytes, threading.Barrier(1))
    if w.error is not None:
        raise w.error


@pytest.mark.parametrize("pattern", ["seq", "rand"])
def test_cpu_reads_land_in_the_buffer(data, pattern):
    """One batch of 512 reads of 64 KiB (the 32 MiB buffer's 512 slots, I/O i into slot i): the buffer holds the
    file's blocks at the offsets the pattern gives (seq: block i; rand: the seeded draw, recomputed here)."""
    path, ref = data
    io = 64 << 10
    w = st.StorageWorker(path, "cpu", io, 512, pattern, 0, 1, 3, 1)
    try:
        assert w.slots == 512 and w.qd == 512 and "O_DIRECT" in w.notes
        _run(w, 32 * MiB)
        assert w.ops == 512 and w.lat.shape == (512,) and (w.lat > 0).all()
        got = w.staging.buf[:32 * MiB].reshape(512, io)
        blocks = (np.arange(512) if pattern == "seq" else
                  np.random.default_rng([3, 0]).integers(0, 512, 512))
        assert np.array_equal(got, ref.reshape(512, io)[blocks])
    finally:
        w.close()
    assert w.fd == -1 and w.ring is None and w.staging is None


def test_seq_threads_walk_their_own_regions(data):
    path, _ = data
    a = st.StorageWorker(path, "cpu", 1 * MiB, 4, "seq", 0, 2, 0, 2)
    b = st.StorageWorker(path, "cpu", 1 * MiB, 4, "seq", 1, 2, 0, 2)
    try:
        assert a.offsets(20).tolist() == [(i % 16) * MiB for i in range(20)]         # wraps in its 16 blocks
        assert b.offsets(3).tolist() == [16 * MiB, 17 * MiB, 18 * MiB]
    finally:
        a.close()
        b.close()


def test_buffered_reads_when_o_direct_is_refused(data, monkeypatch):
    path, ref = data
    real = os.open

    def no_direct(p, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(p, flags, *a)
    monkeypatch.setattr(os, "open", no_direct)
    w = st.StorageWorker(path, "cpu", 4096, 8, "seq", 0, 1, 0, 1)
    try:
        assert w.notes[0] == "buffered reads: O_DIRECT refused (Invalid argument)"
        _run(w, 8 * 4096)
        assert np.array_equal(w.staging.buf[:8 * 4096], ref[:8 * 4096])
    finally:
        w.close()


def test_no_io_uring_is_an_error_and_leaks_nothing(data, monkeypatch):
    path, _ = data
    monkeypatch.setattr(uring, "probe", lambda: (False, "io_uring_setup failed: Operation not permitted"))
    before = open_fds()
    with pytest.raises(RuntimeError, match="the storage bench needs io_uring: io_uring_setup failed"):
        st.storage_run(path, "cpu", 4096, seconds=0.05)
    assert open_fds() == before


@pytest.mark.parametrize("threads", [1, 2])
def test_a_failing_read_is_raised_and_everything_closed(data, monkeypatch, threads):
    """Every completion fails with EIO (the ring's fault-injection hook): storage_run raises that read's error
    (from either thread) and closes every worker's ring, buffer and fd."""
    path, _ = data
    real = uring.Ring.__init__

    def failing(self, *a, **kw):
        real(self, *a, **kw)
        self.inject = lambda res, idx: np.full_like(res, -errno.EIO)
    monkeypatch.setattr(uring.Ring, "__init__", failing)
    before = open_fds()
    with pytest.raises(ReadError, match=r"data\.bin: read of 4096 bytes at offset \d+ failed: Input/output error"):
        st.storage_run(path, "cpu", 4096, threads=threads, seconds=5)
    assert open_fds() == before


def test_storage_run_figures(data):
    path, _ = data
    r = st.storage_run(path, "cpu", 64 << 10, qd=8, pattern="seq", seconds=None, nbytes=2 * MiB)
    assert r["ops"] == 32 and r["bytes"] == 2 * MiB and r["qd"] == 8
    assert r["gib_s"] == pytest.approx(r["bytes"] / r["seconds"] / (1 << 30))
    assert r["iops"] == pytest.approx(32 / r["seconds"]) and 0 < r["mean_lat_us"] <= r["p99_lat_us"]


def test_storage_file_is_made_once(tmp_path, capsys):
    p = st.storage_file(tmp_path / "d", 3 * MiB + 4096)
    assert p == tmp_path / "d" / "storage-3076K.bin" and p.stat().st_size == 3 * MiB + 4096
    assert "making" in capsys.readouterr().out
    want = np.random.default_rng(0).integers(0, 2**63, (3 * MiB + 4096) // 8, dtype=np.uint64).view(np.uint8)
    assert np.array_equal(np.fromfile(p, np.uint8), want)
    mtime = p.stat().st_mtime_ns
    assert st.storage_file(tmp_path / "d", 3 * MiB + 4096) == p and p.stat().st_mtime_ns == mtime
    assert capsys.readouterr().out == ""                    # reused: not made again
    with open(p, "r+b") as f:                               # a file of another size is made again
        f.truncate(4096)
    assert st.storage_file(tmp_path / "d", 3 * MiB + 4096).stat().st_size == 3 * MiB + 4096
    assert not list((tmp_path / "d").glob("*.tmp"))


@pytest.mark.parametrize("args, words", [
    (["--path", "cpu,nvme"], "--path must be a comma list of gpu-direct, cpu-gpu, cpu; got 'nvme'"),
])
def test_bad_arguments(tmp_path, args, words):
    with pytest.raises(ValueError, match=words):
        benches.storage_main(["--size", "1M", "--dir", str(tmp_path), *args])


@pytest.mark.parametrize("platform, why", [
    ("rocm", "cuFile/KvikIO is NVIDIA only (platform rocm)"),
    ("discrete", None),         # the real reason this machine gives (no kvikio, or its failure)
])
def test_gpu_paths_skipped_with_the_reason(tmp_path, capsys, monkeypatch, platform, why):
    from gds_gather.backends import gds_state
    ok, _, reason = gds_state()
    if platform == "discrete" and ok:
        pytest.skip("KvikIO works here: gpu-direct would run (bench/gpu_check.sh)")
    why = why or reason
    monkeypatch.setenv("GDS_GATHER_PLATFORM", platform)
    res = benches.storage_main(["--size", "1M", "--dir", str(tmp_path), "--io-size", "64K", "--bytes", "256K",
                                "--repeat", "1", "--warmup", "0", "--path", "gpu-direct,cpu", "--json"])
    out = capsys.readouterr().out
    assert res["skipped"] == [{"path": "gpu-direct", "why": why}]
    assert f"XferType: GPUD (gpu-direct): skipped: {why}" in " ".join(out.split())
    assert [r["path"] for r in res["results"]] == ["cpu"] and res["results"][0]["median"]["ops"] == 4
    assert res["facts"]["platform"] == platform and "forced by configuration" in res["facts"]["platform_reason"]
    # the header's GPU facts on a forced GPU platform without a GPU: what was found, not a guess
    assert res["facts"]["gpu"] == "none"
    if platform == "discrete":
        assert res["facts"]["gds"] == f"unavailable: {reason}"
    else:
        assert res["facts"]["gds"] == "n/a on a rocm platform"
    assert json.loads(out.strip().splitlines()[-1])["skipped"] == res["skipped"]


def test_plot_of_nothing_measured_is_refused(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("GDS_GATHER_PLATFORM", "cpu")        # gpu-direct alone: skipped, nothing measured
    with pytest.raises(ValueError, match="nothing was measured: no plot"):
        benches.storage_main(["--size", "1M", "--dir", str(tmp_path), "--path", "gpu-direct",
                              "--plot", str(tmp_path / "x.png")])
    assert not (tmp_path / "x.png").exists()


# ---- the GPU transfers through accel.HostAccel (deferred streams, pread for cuFile) --------------------------------

class SnapAccel(HostAccel):
    """HostAccel whose every H2D copy is followed, on the same stream, by a snapshot of the device buffer: what
    each copy delivered, in stream order."""

    def __init__(self):
        super().__init__()
        self.snaps = []

    def h2d(self, dst, src, nbytes, stream, dst_offset=0):
        super().h2d(dst, src, nbytes, stream, dst_offset)
        self.defer(stream, lambda: self.snaps.append(np.array(dst[:nbytes])))


@pytest.fixture
def small_buffers(monkeypatch):
    monkeypatch.setattr(st, "BUF_MIN", 256 << 10)       # 4 slots of 64 KiB: every batch is 4 reads


def test_cpu_gpu_copies_each_batch_before_its_half_is_reused(data, small_buffers):
    """Three batches of 4 sequential 64 KiB reads through two halves of the pinned buffer: each H2D copy (queued on
    the bench's stream, run later) delivers its own batch's blocks, so batch 2 (half 0 again) waited for copy 0;
    the buffer is pinned through the accel and unpinned at close."""
    path, ref = data
    acc = SnapAccel()
    io = 64 << 10
    w = st.StorageWorker(path, "cpu-gpu", io, 4, "seq", 0, 1, 0, 1, acc)
    try:
        assert w.slots == 4 and w.batch_max == 4 and w.notes[-2].startswith("pinned 2 x 256K bounce buffer")
        assert list(acc.pinned_ranges.values()) == [w.staging.buf.nbytes]
        _run(w, 12 * io)
        assert w.ops == 12 and w.stream.query()
        blocks = ref[:12 * io].reshape(3, 4 * io)
        assert len(acc.snaps) == 3 and all(np.array_equal(s, b) for s, b in zip(acc.snaps, blocks))
        assert np.array_equal(w.dev, blocks[2])
    finally:
        w.close()
    assert acc.pinned_ranges == {} and w.dev is None


def test_gpu_direct_preads_into_device_slots(data, small_buffers):
    path, ref = data
    io = 64 << 10
    before = open_fds()
    w = st.StorageWorker(path, "gpu-direct", io, 4, "seq", 0, 1, 0, 2, HostAccel())
    try:
        assert w.slots == 4 and len(w.views) == 4
        assert w.notes == ["host cuFile stand-in (pread), 2 threads; gds_threshold 0, one Python submitter keeping "
                           "4 reads in flight"]
        _run(w, 8 * io)             # one batch of 8, 4 in flight: the slots hold the second 4
        assert w.ops == 8 and np.array_equal(w.dev, ref[4 * io:8 * io]) and open_fds() != before
    finally:
        w.close()
    assert w.file is None and open_fds() == before


def test_gpu_direct_short_read_is_an_error(data, small_buffers, tmp_path):
    path, ref = data
    short = tmp_path / "short.bin"
    short.write_bytes(ref[:1 * MiB].tobytes())
    w = st.StorageWorker(short, "gpu-direct", 64 << 10, 4, "seq", 0, 1, 0, 1, HostAccel())
    try:
        os.truncate(short, 100 << 10)                   # blocks 2.. are gone after the set-up
        with pytest.raises(ReadError, match=r"short\.bin: cuFile read at offset 65536 returned 36864 of 65536 bytes"):
            _run(w, 4 * (64 << 10))
    finally:
        w.close()


def test_gpu_direct_without_cufile_closes_what_it_opened(data):
    from gds_gather.errors import BackendError
    path, _ = data
    before = open_fds()
    with pytest.raises(BackendError, match=r"HostAccel\(gds=False\) has no cuFile stand-in"):
        st.storage_run(path, "gpu-direct", 64 << 10, accel=HostAccel(gds=False))
    assert open_fds() == before


def test_bench_runs_all_three_paths_on_the_host_accel(tmp_path, capsys, monkeypatch):
    """GDS_GATHER_ACCEL=host on a forced discrete platform: gpu-direct and cpu-gpu run (through HostAccel), with
    the compat-mode banner (the stand-in is not GPU-direct DMA) and each path's 4 reads of 64 KiB."""
    monkeypatch.setenv("GDS_GATHER_PLATFORM", "discrete")
    monkeypatch.setenv("GDS_GATHER_ACCEL", "host")
    res = benches.storage_main(["--size", "1M", "--dir", str(tmp_path), "--io-size", "64K", "--bytes", "256K",
                                "--repeat", "1", "--warmup", "0", "--json"])
    out = capsys.readouterr().out
    assert res["skipped"] == []
    assert [(r["path"], r["median"]["ops"], r["median"]["bytes"]) for r in res["results"]] == [
        ("gpu-direct", 4, 256 << 10), ("cpu-gpu", 4, 256 << 10), ("cpu", 4, 256 << 10)]
    assert st.COMPAT_BANNER in out and "(HostAccel: cuFile stand-in (pread into host device memory))" in out
    assert res["facts"]["kvikio_reads"] == "host cuFile stand-in (pread), 1 threads"
    assert "XferType: GPUD" in out and "XferType: CPU_GPU" in out
