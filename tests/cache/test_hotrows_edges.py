"""hotrows.save/load at their edges, against the table file's own bytes: a smaller budget keeps the hottest rows,
an empty file is valid, repeated or out-of-table ids are refused even with a good CRC, and a cache directory that
cannot be written or a hot-row path that cannot be read are warnings, never errors."""
from __future__ import annotations

import logging

import numpy as np
import pytest

import gds_gather as gg
from gds_gather.cache import hotrows
from gds_gather.config import Config
from gds_gather.formats.quants import GGMLQuantizationType as Q

pytestmark = pytest.mark.hot_rows


@pytest.fixture
def target(tmp_path, ggufs):
    path = ggufs.write(tmp_path / "t.gguf", ggufs.rows(Q.Q8_0, 500, 64), Q.Q8_0)
    cfg = Config.from_env(hot_rows=1, cache_dir=tmp_path / "cache")
    with gg.open_table(path, config=cfg) as t:
        raw = np.fromfile(path, np.uint8, t.n_bytes, offset=t.data_offset).reshape(t.n_rows, t.row_bytes)
        return hotrows.Target.of(t), raw


def test_a_smaller_budget_keeps_the_hottest(target):
    tg, raw = target
    ids = np.array([5, 1, 9, 400])
    assert hotrows.save(tg, ids, np.array([1, 200, 50, 7], np.uint8), raw[ids]) == hotrows.path_for(tg)
    got_ids, freq, rows = hotrows.load(tg, 2)
    assert got_ids.tolist() == [1, 9] and freq.tolist() == [200, 50] and np.array_equal(rows, raw[[1, 9]])
    got_ids, _, rows = hotrows.load(tg, 10)
    assert got_ids.tolist() == [5, 1, 9, 400] and np.array_equal(rows, raw[ids])


def test_an_empty_file_is_valid(target):
    tg, raw = target
    hotrows.save(tg, np.zeros(0, np.int64), np.zeros(0, np.uint8), raw[:0])
    ids, freq, rows = hotrows.load(tg, 10)
    assert ids.shape == (0,) and freq.shape == (0,) and rows.shape == (0, raw.shape[1])


@pytest.mark.parametrize("ids", [[3, 3], [2, 500], [-1, 4]])
def test_ids_outside_the_table_or_repeated(target, caplog, ids):
    tg, raw = target
    ids = np.array(ids)
    hotrows.save(tg, ids, np.ones(2, np.uint8), raw[np.clip(ids, 0, 499)])   # a valid CRC over bad ids
    with caplog.at_level(logging.WARNING, "gds_gather.cache.hotrows"):
        assert hotrows.load(tg, 10) is None
    assert "ignored: row ids outside the table or repeated" in caplog.text


def test_unwritable_cache_and_unreadable_file_are_warnings(target, tmp_path, caplog, ggufs):
    tg, raw = target
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory should be")
    with gg.open_table(tg.path, config=Config.from_env(hot_rows=1, cache_dir=blocked)) as t:
        tb = hotrows.Target.of(t)
    with caplog.at_level(logging.WARNING, "gds_gather.cache.hotrows"):
        assert hotrows.save(tb, np.array([1]), np.ones(1, np.uint8), raw[[1]]) is None
        assert hotrows.load(tb, 10) is None
        hotrows.path_for(tg).mkdir(parents=True)            # a directory where the file should be
        assert hotrows.load(tg, 10) is None
    assert f"hot rows of {tg.path} not saved: " in caplog.text
    assert f"hot rows {hotrows.path_for(tg)} not read: " in caplog.text
