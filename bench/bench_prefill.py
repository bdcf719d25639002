#!/usr/bin/env python3
"""Prefill A/B: run_prefill with the backends interleaved (A/B/A/B), cold and warm, tok/s min/median/max. On the CPU
the default trunk is none (the PLE fetch + dequant alone).

    python3 bench/bench_prefill.py                       # the built-in qwen4exp model, 8192 tokens
    python3 bench/bench_prefill.py --quick --plot prefill.png
    python3 bench/bench_prefill.py --model M.gguf --backends direct,mmap --trunk tiny

The code is gds_gather/benches/ (also `gds-gather bench prefill`); `--help` lists every option.
Importable: main(argv=None) -> dict.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's gds_gather, installed or not

from gds_gather.benches import prefill_main as main  # noqa: E402

if __name__ == "__main__":
    main()
    sys.exit(0)
