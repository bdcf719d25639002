"""Sizes and lines for people: bytes as text (`human_bytes` to read, `human_size` to write back), size text as bytes
(`parse_size`, also an argparse type), and `fit` for the 120-column lines every command and bench prints.
Imports only gds_gather.errors: every layer may use it."""
from __future__ import annotations

import argparse
import re
import textwrap
from fractions import Fraction

from .errors import SizeError

WIDTH = 120      # every CLI, bench and prefill line fits a terminal of this many columns
AUTO = -1        # parse_size's answer for "auto" (Config's cache_bytes convention: sized per table)

_UNITS = ("KiB", "MiB", "GiB", "TiB")
_SIZE = re.compile(r"\s*(-?)(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(?:i?b)?\s*", re.I)


def fit(text: str, indent: str = "    ") -> str:
    """text wrapped at WIDTH columns at spaces, continuation lines indented."""
    return textwrap.fill(text, WIDTH, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def human_bytes(n: float) -> str:
    """A byte count to read: whole bytes below 1 KiB ('1023 B'), else one decimal in the largest binary unit that
    keeps it under 1024.0 as printed ('1.5 KiB', '1.0 MiB' for 1 MiB - 1 B), TiB at most ('5000.0 TiB')."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in _UNITS:
        n /= 1024
        if abs(n) < 1023.95 or unit == _UNITS[-1]:      # 1023.95 and above print as 1024.0: the next unit's 1.0
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def human_size(n: int) -> str:
    """A byte count as the shortest text parse_size reads back exactly, for names and command lines: 4096 -> '4K',
    16 MiB -> '16M', 8 GiB -> '8G' (exact multiples of K/M/G/T), else bytes ('7680B')."""
    for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"


def parse_size(text, allow_auto: bool = False) -> int:
    """Bytes from '4096', '4K', '1.5k', '16M', '16MiB', '2GB', '1T' (binary units, any case, an optional 'B' or
    'iB'; a fraction of a byte is dropped); with allow_auto, 'auto' (any case) -> AUTO. Raises SizeError (one line)
    for anything else, a negative size included."""
    s = str(text)
    if allow_auto and s.strip().lower() == "auto":
        return AUTO
    m = _SIZE.fullmatch(s)
    if not m:
        raise SizeError(f"not a size: {text!r} " + ("(e.g. 256M, 0, auto)" if allow_auto else "(e.g. 4K, 1M, 8G)"))
    if m.group(1):
        raise SizeError(f"a size must be >= 0, got {text!r}")
    return int(Fraction(m.group(2)) * 1024 ** " kmgt".index(m.group(3).lower() or " "))


def int_in(lo: int, hi: int):
    """An argparse type: an integer in lo..hi; argparse's message then names the flag and the bounds (0 is not a
    way to ask for a default: where lo >= 1 it is refused like any other value out of range)."""
    def parse(text: str) -> int:
        try:
            v = int(text, 0)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be in {lo:,}..{hi:,}, got {text}")
        return v
    parse.__name__ = "integer"
    return parse
