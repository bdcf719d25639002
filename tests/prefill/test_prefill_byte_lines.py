"""The prefill report's byte and row lines never show a part larger than its whole, also where rows were read
ahead for the next ubatch (each a device row, then a row-cache hit)."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

NUMBER = re.compile(r"(\d[\d,]*(?:\.\d+)?)(%?)((?: B)? of them)?")


def _parts_over_wholes(line: str) -> list[tuple[int, int]]:
    """(part, whole) for each "N [B] of them" of a line: the whole is the nearest figure before it that is neither a
    percentage nor itself a part."""
    out, whole = [], None
    for m in NUMBER.finditer(line):
        if m.group(2):
            continue
        n = float(m.group(1).replace(",", ""))
        if m.group(3):
            assert whole is not None, line
            out.append((n, whole))
        else:
            whole = n
    return out


def test_the_parser_finds_each_part_and_its_whole():
    """The parser against lines written by hand (the old line: a part larger than its whole)."""
    assert _parts_over_wholes("needed    4,645,080 B of rows from the file, 6,910,200 B of them from the device") \
        == [(6910200, 4645080)]
    assert _parts_over_wholes("sources   1,451 from the row cache (hit rate 6.7%; 515 of them read ahead), 0 from") \
        == [(515, 1451)]


def test_no_part_is_larger_than_its_whole_with_read_ahead(tmp_path):
    path = tmp_path / "q.gguf"
    cli = [sys.executable, "-P", "-m", "gds_gather.cli"]
    r = subprocess.run([*cli, "make-model", "qwen4exp", "--rows", "20000", "-o", str(path), "-q"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([*cli, "prefill", str(path), "--tokens", "2048", "--ubatch", "512", "--cold", "--json",
                        "--platform", "cpu"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    if not res["rows_prefetched"]:
        pytest.skip("no rows were read ahead here (io_uring unavailable, or the page cache served the file)")
    rb = res["table_bytes"] // 20000
    # the rows the file supplied, by where they came from (Table.stats: the sources add up to the rows read
    # plus those read ahead): the whole of which the device's rows are a part
    assert res["sources_known"]
    assert res["bytes_needed"] == (res["rows_from_page_cache"] + res["rows_from_device"]) * rb
    assert res["bytes_read_ahead"] == res["rows_prefetched"] * rb
    assert res["bytes_from_device_rows"] <= res["bytes_needed"]
    lines, joined = r.stderr.splitlines(), []
    for x in lines:                         # a line's continuation is indented
        if x.startswith("  ") and joined:
            joined[-1] += " " + x.strip()
        else:
            joined.append(x)
    checked = {x.split()[0]: _parts_over_wholes(x) for x in joined}
    checked = {label: pairs for label, pairs in checked.items() if pairs}
    assert {"sources", "needed"} <= set(checked), joined
    assert checked["needed"] == [(res["bytes_read_ahead"], res["bytes_needed"]),
                                 (res["bytes_from_device_rows"], res["bytes_needed"])]
    for label, pairs in checked.items():
        assert all(part <= whole for part, whole in pairs), (label, pairs)
