#!/usr/bin/env python3
"""I/O engine benchmark: rows/s of every host reader, cold and warm, against fio on the same file.

    python3 bench/bench_io.py                  # 2.16 GB qwen4exp-geometry table, 100k random 90-byte rows
    python3 bench/bench_io.py --quick          # a small table, for a smoke run

This is the gather bench (gds_gather/benches/, `gds-gather bench gather`) with uniform random row ids instead of
a text trace, the qwen4exp-geometry table alone, the warm runs on a tmpfs copy of the table, and the I/O issue's
targets printed (direct >= 0.9x fio 4k randread at the same queue depth, >= 3x mmap, >= 1.3x pread cold; >= 0.7x
fio psync with one job warm). Cold = the table's file evicted from the page cache (--drop-caches: the whole
machine's, root). Prints, per backend and pass (cold, same table again, new table on the tmpfs copy): ns per gather,
rows/s, bytes requested and delivered (/proc/self/io; the block device's counter), read amplification, major
faults, page-cache growth, p50/p99 per gather call; then the ratios, against fio measured in this run. Any
gather-bench option may follow (`--help`); the JSON goes to --out, default ~/.cache/gds-gather/bench/bench_io.json.
Importable: main(argv=None) -> dict.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's gds_gather, installed or not

from gds_gather import benches  # noqa: E402

DEFAULTS = ["--tables", "qwen4exp", "--trace", "random", "--warm", "tmpfs", "--targets", "--json-name", "bench_io.json",
            "--no-newproc", "--no-restart"]     # the I/O targets: in-process passes only


def main(argv=None) -> dict:
    args = sys.argv[1:] if argv is None else list(argv)
    return benches.main("gather", DEFAULTS + args, "bench_io.py")


if __name__ == "__main__":
    main()
    sys.exit(0)
