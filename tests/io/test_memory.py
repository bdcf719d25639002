"""io/memory.py: the memory this process may use, read from fake cgroup v2 / v1 trees and /proc/meminfo, and the
budgets derived from it (the row cache's auto budget, the refusal of an explicit one, the kept staging buffer)."""
from __future__ import annotations

from pathlib import Path

import pytest

from gds_gather.cache import rowcache
from gds_gather.errors import GatherError, MemoryBudgetError
from gds_gather.io import memory, readers
from gds_gather.io.memory import Limits

MiB, GiB = 1 << 20, 1 << 30


def fake_root(tmp, cgroup: str, files: dict, avail_kib: int | None = 8 << 20):
    """A root directory with proc/self/cgroup = `cgroup`, the files {relative path: text} and a meminfo."""
    (tmp / "proc/self").mkdir(parents=True, exist_ok=True)
    (tmp / "proc/self/cgroup").write_text(cgroup)
    if avail_kib is not None:
        (tmp / "proc/meminfo").write_text(f"MemTotal: {2 * avail_kib} kB\nMemFree: 1 kB\n"
                                          f"MemAvailable: {avail_kib} kB\n")
    for rel, text in files.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text(text)
    return tmp


def test_cgroup_v2_limit_less_usage(tmp_path):
    root = fake_root(tmp_path, "0::/a/b\n", {"sys/fs/cgroup/a/b/memory.max": f"{512 * MiB}\n",
                                           "sys/fs/cgroup/a/b/memory.current": f"{100 * MiB}\n",
                                           "sys/fs/cgroup/a/memory.max": "max\n"})
    lim = memory.read(root)
    assert lim.cgroup_limit == 512 * MiB and lim.cgroup_usage == 100 * MiB and lim.cgroup_source == "cgroup v2 /a/b"
    assert lim.mem_available == 8 * GiB
    assert memory.available(lim) == 412 * MiB and memory.source(lim).startswith("cgroup v2 /a/b limit")


def test_cgroup_v2_an_ancestor_with_less_headroom_binds(tmp_path):
    root = fake_root(tmp_path, "0::/a/b\n", {"sys/fs/cgroup/a/b/memory.max": f"{512 * MiB}",
                                           "sys/fs/cgroup/a/b/memory.current": f"{10 * MiB}",
                                           "sys/fs/cgroup/a/memory.max": f"{300 * MiB}",
                                           "sys/fs/cgroup/a/memory.current": f"{250 * MiB}"})
    lim = memory.read(root)
    assert lim.cgroup_source == "cgroup v2 /a" and memory.available(lim) == 50 * MiB


def test_cgroup_v1_limit_and_its_no_limit_value(tmp_path):
    files = {"sys/fs/cgroup/memory/x/memory.limit_in_bytes": f"{GiB}\n",
             "sys/fs/cgroup/memory/x/memory.usage_in_bytes": f"{GiB // 4}\n",
             "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n"}
    lim = memory.read(fake_root(tmp_path, "5:cpu:/\n4:memory:/x\n0::/\n", files))
    assert (lim.cgroup_limit, lim.cgroup_source) == (GiB, "cgroup v1 /x") and memory.available(lim) == 3 * GiB // 4
    (tmp_path / "sys/fs/cgroup/memory/x/memory.limit_in_bytes").write_text("9223372036854771712")
    lim = memory.read(tmp_path)
    assert lim.cgroup_limit is None and memory.available(lim) == 8 * GiB and memory.source(lim) == "MemAvailable"


def test_mem_available_below_the_cgroup_headroom_binds(tmp_path):
    root = fake_root(tmp_path, "0::/\n", {"sys/fs/cgroup/memory.max": f"{4 * GiB}"}, avail_kib=1 << 20)
    lim = memory.read(root)
    assert memory.available(lim) == GiB and memory.source(lim).startswith("MemAvailable (below the cgroup v2 /")


def test_nothing_to_read_is_no_limit(tmp_path):
    lim = memory.read(tmp_path)
    assert lim == Limits(None, None, None, None) and memory.available(lim) is None
    assert rowcache.budget_for(-1, 100 * GiB, memory.available(lim)) == rowcache.AUTO_MAX_BYTES


def test_limits_are_read_once_until_refreshed(tmp_path):
    root = fake_root(tmp_path, "0::/\n", {"sys/fs/cgroup/memory.max": f"{GiB}"})
    memory.refresh()
    first = memory.limits(root)
    (root / "sys/fs/cgroup/memory.max").write_text(f"{2 * GiB}")
    assert memory.limits(root) is first
    memory.refresh()
    assert memory.limits(root).cgroup_limit == 2 * GiB
    memory.refresh()


def test_this_machine_reads():
    lim = memory.read(Path("/"))
    assert memory.available(lim) is None or memory.available(lim) > 0
    assert memory.source(lim)


@pytest.mark.parametrize("table, avail, want, why", [
    (100 * MiB, 16 * GiB, 10 * MiB, "10% of the table"),                 # small table, loose limit
    (30 * GiB, 16 * GiB, 256 * MiB, "the 256 MiB cap"),                   # large table, loose limit
    (30 * GiB, 512 * MiB, 64 * MiB, "1/8 of the memory available"),      # large table, tight limit
    (100 * MiB, 512 * MiB, 10 * MiB, "10% of the table"),                 # small table, tight limit
    (30 * GiB, None, 256 * MiB, "the 256 MiB cap"),                       # nothing known about memory
])
def test_auto_budget_takes_the_least_term(table, avail, want, why):
    b = rowcache.budget(-1, table, avail)
    assert (b.bytes, b.reason) == (want, "auto: " + why)


def test_explicit_budget_kept_and_too_large_refused_in_one_line():
    lim = Limits(512 * MiB, 12 * MiB, "cgroup v2 /x", 8 * GiB)
    assert rowcache.budget(GiB, 30 * GiB, memory.available(lim)).bytes == GiB      # never shrunk silently
    rowcache.check_budget(400 * MiB, 30 * GiB, lim)                                # fits: no error
    rowcache.check_budget(GiB, 100 * MiB, lim)              # larger than the table: only the table's rows are kept
    rowcache.check_budget(-1, 30 * GiB, lim)
    with pytest.raises(MemoryBudgetError) as e:
        rowcache.check_budget(GiB, 30 * GiB, lim)
    text = str(e.value)
    assert isinstance(e.value, GatherError) and "\n" not in text
    assert f"{GiB:,} B" in text and f"{500 * MiB:,} B" in text and "cgroup v2 /x" in text


def test_kept_staging_buffer_follows_the_limit():
    assert readers.pool_max_bytes(Limits(None, None, None, None)) == readers.POOL_MAX_BYTES
    assert readers.pool_max_bytes(Limits(512 * MiB, 0, "cgroup v2 /", 16 * GiB)) == 64 * MiB
    assert readers.pool_max_bytes(Limits(None, None, None, 64 * GiB)) == readers.POOL_MAX_BYTES


def test_inactive_page_cache_is_not_counted_as_used(tmp_path):
    """A table written or read buffered inside the cgroup is charged to it: its inactive file pages (memory.stat)
    are the kernel's first reclaim, so they leave the headroom (v2 inactive_file, v1 total_inactive_file), and the
    ancestor that binds is chosen on what is left."""
    root = fake_root(tmp_path / "v2", "0::/a/b\n", {
        "sys/fs/cgroup/a/b/memory.max": f"{512 * MiB}", "sys/fs/cgroup/a/b/memory.current": f"{470 * MiB}",
        "sys/fs/cgroup/a/b/memory.stat": f"anon {30 * MiB}\nfile {440 * MiB}\nactive_file {40 * MiB}\n"
                                         f"inactive_file {400 * MiB}\n",
        "sys/fs/cgroup/a/memory.max": f"{500 * MiB}", "sys/fs/cgroup/a/memory.current": f"{480 * MiB}",
        "sys/fs/cgroup/a/memory.stat": f"inactive_file {400 * MiB}\n"})
    lim = memory.read(root)
    assert (lim.cgroup_source, lim.cgroup_inactive_file) == ("cgroup v2 /a", 400 * MiB)
    assert memory.available(lim) == 420 * MiB          # /a: 500 - (480 - 400); /a/b would leave 512 - (470 - 400)
    assert memory.source(lim).endswith(f"{480 * MiB:,} B used ({400 * MiB:,} B of it inactive page cache, not "
                                       "counted)")
    files = {"sys/fs/cgroup/memory/x/memory.limit_in_bytes": f"{512 * MiB}",
             "sys/fs/cgroup/memory/x/memory.usage_in_bytes": f"{470 * MiB}",
             "sys/fs/cgroup/memory/x/memory.stat": f"inactive_file {1 * MiB}\ntotal_inactive_file {400 * MiB}\n"}
    lim = memory.read(fake_root(tmp_path / "v1", "4:memory:/x\n0::/\n", files))
    assert memory.available(lim) == 442 * MiB and lim.cgroup_inactive_file == 400 * MiB
    (tmp_path / "v1/sys/fs/cgroup/memory/x/memory.stat").unlink()          # no memory.stat: usage as it is
    assert memory.available(memory.read(tmp_path / "v1")) == 42 * MiB
