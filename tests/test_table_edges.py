"""Table's remaining edges against the file's bytes and gguf's dequantization: torch CPU ids, read_unique's checks
and its wait for a device gather's stream (HostAccel), the gds-or-direct timing on HostAccel's cuFile stand-in,
a tensor running past the end of the file, bfloat16 numpy output without ml_dtypes."""
from __future__ import annotations

import os
import re
import sys

import numpy as np
import pytest

import gds_gather as gg
from gds_gather.gpu.host import HostArray
from gds_gather.errors import BadIdsError, TruncatedFileError


@pytest.fixture
def table(tmp_path, ggufs):
    return ggufs.table(tmp_path / "t.gguf", 300, seed=11)


pytestmark = pytest.mark.usefixtures("fresh_row_caches")


def host_device(**kw) -> gg.Config:
    return gg.Config(platform="discrete", accel="host", cache_bytes=0, hot_rows=0, **kw)


def test_torch_cpu_ids_give_torch_rows(table):
    torch = pytest.importorskip("torch")
    path, raw, _ = table
    ids = np.array([[7, 0], [299, 7]])
    with gg.open_table(path) as t:
        got = t.read_rows(torch.from_numpy(ids), "pread")
        assert isinstance(got, torch.Tensor) and got.dtype == torch.uint8
        np.testing.assert_array_equal(got.numpy(), raw[ids])
        assert repr(t) == (f"Table({str(path)!r}, {t.name!r}, IQ4_NL, rows=300, row_elems=160, "
                           f"row_bytes={raw.shape[1]})")


@pytest.mark.parametrize("rows", [[3, 2], [1, 1], [-1, 4], [5, 300]])
def test_read_unique_takes_sorted_unique_ids_in_range(table, rows):
    path, _, _ = table
    with gg.open_table(path) as t:
        with pytest.raises(BadIdsError, match=r"read_unique takes sorted unique row ids in \[0, 300\)"):
            t.read_unique(np.array(rows), "direct")


def test_a_host_read_after_a_device_gather_does_not_wait_for_it(table):
    """A device gather on a HostAccel stream leaves its kernel queued; a host read_unique then runs without
    synchronizing that stream (the device destination reads with readers of its own, so no staging is shared),
    and both give the file's rows."""
    pytest.importorskip("torch")
    path, raw, ref = table
    with gg.open_table(path, config=host_device()) as t:
        a = t.accel
        s = a.stream()
        ids = np.array([4, 9, 4, 250])
        out = t.gather(ids.view(HostArray), stream=s)
        assert not s.query()                                # the kernel is queued on s, not run
        rows = np.array([1, 4, 200])
        np.testing.assert_array_equal(t.read_unique(rows, "direct"), raw[rows])
        assert not s.query()                                # read_unique did not wait for s
        a.synchronize(s)
        np.testing.assert_array_equal(np.asarray(out), ref[ids])


def test_gds_faster_times_both_destinations_once(table):
    """HostAccel's cuFile stand-in: the verdict compares the two best-of-3 times it reports, and is asked once."""
    pytest.importorskip("torch")
    path, _, _ = table
    with gg.open_table(path, config=host_device()) as t:
        faster, detail = v = t.gds_faster()
        m = re.fullmatch(r"512 rows: gds (\d+\.\d\d) ms, direct (\d+\.\d\d) ms", detail)
        assert m, detail
        tg, td = float(m[1]), float(m[2])
        assert faster == (tg < td) or tg == td                # (equal to 2 decimals: either)
        assert t.gds_faster() is v
        assert t.readers() == ([], [])      # each timed through a destination of its own, closed after
        st = t.stats()                      # direct's three batches were all read: more rows than the table has
        assert st["cache_hits"] == 0 and st["rows_from_device"] + st["rows_from_page_cache"] > t.n_rows


def test_a_table_running_past_the_end_of_the_file_is_refused(table):
    path, _, _ = table
    with gg.open_table(path) as t:
        end = t.data_offset + t.n_bytes
    os.truncate(path, end - 1)
    with pytest.raises(TruncatedFileError, match=rf"t\.gguf: tensor .* data \[\d+, {end}\) runs past the end of "
                                                 rf"the file \({end - 1} bytes\)"):
        gg.open_table(path)


def test_bfloat16_numpy_output_needs_ml_dtypes(table, monkeypatch):
    path, _, _ = table
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)
    with gg.open_table(path) as t:
        with pytest.raises(TypeError, match="bfloat16 output of numpy arrays needs the ml_dtypes package"):
            t.gather([1, 2], "pread", dtype="bfloat16")
