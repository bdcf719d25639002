"""units.py: byte counts as text both ways, the size parser every command line shares, and fit's 120 columns."""
from __future__ import annotations

import argparse

import pytest

from gds_gather import units
from gds_gather.units import AUTO, SizeError, fit, human_bytes, human_size, parse_size


def test_human_bytes():
    assert [human_bytes(n) for n in (0, 1023, 1536, 5 << 20, 3 << 30, 7 << 40, 5000 << 40)] == \
        ["0 B", "1023 B", "1.5 KiB", "5.0 MiB", "3.0 GiB", "7.0 TiB", "5000.0 TiB"]


@pytest.mark.parametrize("n, text", [(1023, "1023 B"), (1024, "1.0 KiB"), ((1 << 20) - 1, "1.0 MiB"),
                                     (1 << 20, "1.0 MiB"), ((1 << 30) - 1, "1.0 GiB"), (1 << 30, "1.0 GiB"),
                                     ((1 << 40) - 1, "1.0 TiB"), (1 << 40, "1.0 TiB"), (1023 << 10, "1023.0 KiB"),
                                     (1.5, "1 B"), (-1536, "-1.5 KiB")])
def test_human_bytes_at_unit_boundaries(n, text):
    """A unit's last values never print as '1024.0' of it: they are the next unit's 1.0."""
    assert human_bytes(n) == text


def test_human_size_is_what_parse_size_reads_back():
    assert [human_size(x) for x in (4096, 1 << 20, 8 << 30, 7680, 3 << 40, 0, 1)] == \
        ["4K", "1M", "8G", "7680B", "3T", "0B", "1B"]
    for n in (0, 1, 512, 4096, 7680, 3 * (1 << 20) + 4096, 8 << 30, 3 << 40):
        assert parse_size(human_size(n)) == n


@pytest.mark.parametrize("text, n", [("0", 0), ("512", 512), ("4096", 4096), ("4K", 4096), ("64k", 65536),
                                     ("1M", 1 << 20), ("16MiB", 16 << 20), ("16mib", 16 << 20), ("2GB", 2 << 30),
                                     ("8G", 8 << 30), ("1T", 1 << 40), ("1KB", 1024), ("1B", 1), ("1.5K", 1536),
                                     (".5K", 512), ("1.K", 1024), (" 16M ", 16 << 20), ("2 G", 2 << 30),
                                     ("0.3K", 307), (4096, 4096)])
def test_parse_size_accepts_both_old_forms(text, n):
    assert parse_size(text) == n and parse_size(text, allow_auto=True) == n


def test_auto_only_where_allowed():
    assert parse_size("auto", allow_auto=True) == parse_size(" AUTO ", allow_auto=True) == AUTO == -1
    with pytest.raises(SizeError, match=r"^not a size: 'auto' \(e\.g\. 4K, 1M, 8G\)$"):
        parse_size("auto")


@pytest.mark.parametrize("text", ["lots", "", "K", "1.5.5K", "1X", "1KK", "inf", "nan", "1e3", "0x10", "1_000",
                                  "4 K B", "--1", "auto", "1P"])
def test_junk_is_refused_in_one_line(text):
    with pytest.raises(ValueError) as e:
        parse_size(text)
    msg = str(e.value)
    assert msg == f"not a size: {text!r} (e.g. 4K, 1M, 8G)" and "\n" not in msg


def test_negative_sizes_are_refused():
    with pytest.raises(SizeError, match=r"^a size must be >= 0, got '-5'$"):
        parse_size("-5", allow_auto=True)
    with pytest.raises(SizeError, match="must be >= 0"):
        parse_size("-1.5K")


def test_huge_sizes_stay_exact():
    """No float in between: a size past a double's range is still a whole number, never inf."""
    assert parse_size("9" * 400 + "T") == int("9" * 400) << 40


def test_an_argparse_type_with_its_message(capsys):
    p = argparse.ArgumentParser(prog="x")
    p.add_argument("--cache", type=lambda t: parse_size(t, allow_auto=True))
    assert p.parse_args(["--cache", "16M"]).cache == 16 << 20
    assert p.parse_args(["--cache", "auto"]).cache == AUTO
    with pytest.raises(SystemExit):
        p.parse_args(["--cache", "lots"])
    assert "argument --cache: not a size: 'lots' (e.g. 256M, 0, auto)" in capsys.readouterr().err


def test_fit_wraps_at_width_without_breaking_words():
    text = " ".join(["word"] * 60) + " " + "x" * 150
    lines = fit(text, "  ").splitlines()
    assert all(len(l) <= units.WIDTH for l in lines[:-1]) and lines[-1] == "  " + "x" * 150
    assert all(l.startswith("  ") for l in lines[1:]) and fit("short") == "short"
