#!/usr/bin/env python3
"""The gather microbenchmark: the row ids of a real English prompt (qwen4exp: 16 n-gram rows per token; gemma4-e4b:
one row per token) gathered by every backend in three passes (cold: file evicted, new Table; the same Table again;
a new Table on a warm page cache), with ns per gather, rows/s, bytes requested and delivered, read amplification,
major faults, page-cache growth, the row cache's figures and p50/p99 per gather call, against fio on the same file.
Outputs go to --out (default ~/.cache/gds-gather/bench), never into the checkout.

    python3 bench/bench_gather.py                        # 2.16 GB qwen4exp- and 1.94 GB gemma4-e4b-geometry tables
    python3 bench/bench_gather.py --quick --plot gather.png

The code is gds_gather/benches/ (also `gds-gather bench gather`); `--help` lists every option.
Importable: main(argv=None) -> dict.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's gds_gather, installed or not

from gds_gather.benches import gather_main as main  # noqa: E402

if __name__ == "__main__":
    main()
    sys.exit(0)
