#!/usr/bin/env python3
"""Storage-to-memory bandwidth after gdsio: GPU_DIRECT (KvikIO/cuFile into GPU memory), CPU_GPU (O_DIRECT into a
pinned bounce buffer + one H2D copy per batch), CPUONLY (O_DIRECT through io_uring); GiB/s, IOPS, mean and p99
latency per I/O, one gdsio-style line per configuration.

    python3 bench/bench_storage.py                       # an 8 GiB file of random bytes (made once), 4K..16M
    python3 bench/bench_storage.py --quick               # 256 MiB, 4K and 1M, short runs
    python3 bench/bench_storage.py --file F --io-size 4K,1M --threads 4 --qd 64 --pattern seq --cold

The code is gds_gather/benches/ (also `gds-gather bench storage`); `--help` lists every option.
Importable: main(argv=None) -> dict.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's gds_gather, installed or not

from gds_gather.benches import storage_main as main  # noqa: E402

if __name__ == "__main__":
    main()
    sys.exit(0)
