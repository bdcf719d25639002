"""GdsReader's KvikIO calls (issue 34): a plan's adjacent windows are one pread, every pread is submitted before
any is waited for, the bytes land where the plan says, and KvikIO's pool is configured once per process (not at
every reader open). A stand-in `kvikio` module records the calls and reads the real file (pread into the device
buffer of host.HostAccel, whose device memory is host memory); cuda.CudaAccel.cufile opens it."""
from __future__ import annotations

import importlib.machinery
import os
import sys
import types

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import gds_gather as gg
from gds_gather.gpu.cuda import CudaAccel
from gds_gather.gpu.host import HostAccel
from gds_gather.gpu.device import GdsReader

pytest.importorskip("torch")        # (HostAccel)


class KvikioOnHost(HostAccel):
    """HostAccel's memory and streams; cuFile through CudaAccel's glue, i.e. the (stand-in) kvikio module."""
    cufile = CudaAccel.cufile


class Future:
    def __init__(self, log, got):
        self.log, self.got = log, got

    def get(self):
        self.log.append(("get",))
        return self.got


@pytest.fixture
def kvikio(monkeypatch):
    """A kvikio stand-in: CuFile.pread(buf, size, file_offset, task_size) (KvikIO's signature) logs and reads the
    file into buf; defaults.set logs each configuration."""
    log, sets = [], []

    class CuFile:
        def __init__(self, path, flags="r"):
            self.fd = os.open(path, os.O_RDONLY)

        def pread(self, buf, size=None, file_offset=0, task_size=None):
            dst = np.asarray(buf).view(np.ndarray)
            log.append(("pread", int(file_offset), int(size), dst.nbytes))
            return Future(log, os.preadv(self.fd, [memoryview(dst)[:size]], file_offset))

        def close(self):
            os.close(self.fd)

    class Defaults:
        values = {"auto_direct_io_read": False}

        def set(self, config):
            sets.append(dict(config))
            self.values.update(config)

        def get(self, name):
            return self.values[name]

        def is_compat_mode_preferred(self):
            return True

    kv = types.ModuleType("kvikio")
    kv.__spec__ = importlib.machinery.ModuleSpec("kvikio", None)
    kv.CuFile, kv.defaults = CuFile, Defaults()
    kv.cufile_driver = types.SimpleNamespace(get=lambda key: False)
    monkeypatch.setitem(sys.modules, "kvikio", kv)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", kv.defaults)
    monkeypatch.setitem(sys.modules, "kvikio.cufile_driver", kv.cufile_driver)
    return types.SimpleNamespace(log=log, sets=sets)


def _block_runs(rows, row_bytes, data_offset, file_size, block=4096):
    """The oracle: maximal runs of consecutive 4 KiB blocks holding a wanted row, as (offset, bytes in the file)."""
    blocks = sorted({b for r in rows for b in range((data_offset + r * row_bytes) // block,
                                                    (data_offset + (r + 1) * row_bytes - 1) // block + 1)})
    runs, start = [], blocks[0]
    for prev, b in zip(blocks, blocks[1:] + [None]):
        if b != prev + 1:
            runs.append((start * block, min((prev + 1) * block, file_size) - start * block))
            start = b
    return runs


def test_adjacent_windows_are_one_pread_and_the_pool_is_configured_once(tmp_path, ggufs, kvikio):
    raw = ggufs.rows(Q.Q8_0, 5000, 32, seed=3)                  # 34-byte rows: some straddle 4 KiB blocks
    path = ggufs.write(tmp_path / "t.gguf", raw, Q.Q8_0)
    cfg = gg.Config(platform="discrete", accel="host", cache_bytes=0, max_window=4096,
                    threads=3)                                      # windows cut at 4 KiB
    with gg.open_table(path, config=cfg) as t:
        ids = np.concatenate([np.arange(100, 2100), [3000, 3001, 4990, 4999, 100]])
        plan = t.plan(ids, align=t.gds_align)
        a = KvikioOnHost()
        readers = [t.region.open(GdsReader, t.config, accel=a) for _ in range(2)]
        try:
            # two opens, one configuration: the pool's threads and threshold, then compat mode's O_DIRECT reads
            assert kvikio.sets == [{"num_threads": 3, "gds_threshold": 0}, {"auto_direct_io_read": True}]
            assert "3 threads" in readers[1].how and "O_DIRECT" in readers[1].how
            dev = readers[1].read_windows(plan)
        finally:
            for r in readers:
                r.close()
        size = os.path.getsize(path)
        want = _block_runs(plan.unique_rows.tolist(), t.row_bytes, t.data_offset, size)
        preads = [e for e in kvikio.log if e[0] == "pread"]
        assert [(off, n) for _, off, n, _ in preads] == want
        assert plan.n_windows > len(want) > 1                   # the planner's cuts were joined; gaps were not
        assert kvikio.log.index(("get",)) == len(preads)         # every read submitted before the first wait
        got = np.stack([np.asarray(dev)[o:o + t.row_bytes] for o in plan.row_staging.tolist()])
        np.testing.assert_array_equal(got, raw[plan.unique_rows])
        assert readers[1].bytes_read == plan.window_bytes
