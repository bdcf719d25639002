"""The new process of a bench gather pass (gather_passes.child_pass): `python -m gds_gather.benches.gather_child
PATH BACKEND TRACE.npz HOT_DIR CACHE_BYTES QUEUE_DEPTH` opens the table (off the clock), runs one pass and prints its
figures as one JSON line."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from ..config import Config
from ..io import native
from .gather_passes import gather_pass, open_for, table_stats


def child_main(argv: list[str]) -> None:
    """The new process of child_pass: prints the pass's figures as one JSON line."""
    path, b, trace_file, hot_dir, cache_bytes, qd = argv
    cfg = Config.from_env(hot_rows=1, cache_dir=Path(hot_dir), cache_bytes=int(cache_bytes), queue_depth=int(qd))
    with np.load(trace_file) as z:
        trace = [z[k] for k in sorted(z.files, key=int)]
    t0 = time.perf_counter()
    t = open_for(path, cfg, b, None)
    startup = time.perf_counter() - t0
    try:
        r = gather_pass(t, b, trace)          # (the untimed pass that primes a restart runs it too)
        r.update(startup_s=startup, hot_rows_loaded=(table_stats(t) or {}).get("hot_rows_loaded", 0),
                 native_built=bool(native.built))
    finally:
        t.close()                     # (writes the hot rows, as a user's process does at close)
    print(json.dumps(r, default=float))


if __name__ == "__main__":
    child_main(sys.argv[1:])
