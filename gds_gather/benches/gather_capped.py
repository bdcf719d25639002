"""The capped process of `bench gather --memory-limit` (gather.run_capped): `python -m gds_gather.benches.gather_capped
JOB` enters the memory cgroup its parent made (memcap.ENV), loads the bench's arguments and Config from JOB (a pickle
the parent wrote) and runs the bench there; its new-process passes start inside the cgroup too."""
from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

from . import memcap
from .gather import run_gather


def capped_main(argv: list[str]) -> None:
    cap = memcap.MemoryCap.from_env()
    if cap is None:
        raise SystemExit(f"gather_capped: {memcap.ENV} is not set (run by bench gather --memory-limit)")
    cap.enter(os.getpid())
    a, cfg = pickle.loads(Path(argv[0]).read_bytes())
    run_gather(a, cfg)


if __name__ == "__main__":
    capped_main(sys.argv[1:])
