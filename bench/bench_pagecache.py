#!/usr/bin/env python3
"""Two ways for `direct` to serve the rows the page cache already holds, timed per batch on a real-text trace:

  (a) mincore: today's engine path, DirectReader.read(plan): pagecache.Residency (cachestat-gated mincore) says which
      unique rows are resident, those are copied from a mapping, the other windows are read O_DIRECT;
  (b) nowait:  every unique row of the batch read buffered through io_uring with RWF_NOWAIT (exact rows, adjacent
      rows as one read; Ring.read(nowait=True)), then the planned windows holding a missed row read O_DIRECT
      (the same DirectReader's ring, staging and queue depth, page-cache reads off), the missed rows copied in.

in three page-cache states, each set up again (untimed) before every timed pass, both ways interleaved:
  cold: the file evicted (fsync + POSIX_FADV_DONTNEED, checked with mincore);
  warm: evicted, then the trace's rows read by an untimed buffered pass (gather bench's _warm_page_cache);
  half: evicted, then only every other batch's rows read that way.
Readers are opened fresh (outside the timing) for each pass and closed before the next eviction; planning is
done once, untimed (both ways use the same plans). Every pass's rows are checked against the file's bytes
(np.fromfile). Wrap runs in `flock /tmp/gg-bench.lock` (no two benchmarks at once).

    flock /tmp/gg-bench.lock python3 bench/bench_pagecache.py
    python3 bench/bench_pagecache.py --file /tmp/gg-bench/gemma4-e4b-262144.gguf --repeats 5
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's gds_gather, installed or not

import gds_gather as gg  # noqa: E402
from gds_gather import measure, uring  # noqa: E402
from gds_gather.benches.gather import _trace, _warm_page_cache  # noqa: E402
from gds_gather.planner import row_runs  # noqa: E402
from gds_gather.readers import PAGE_CACHE_QD, DirectReader, rows_at  # noqa: E402

FILES = ("/tmp/gg-bench/qwen4exp-24000000.gguf", "/tmp/gg-bench/gemma4-e4b-262144.gguf")
STATES = ("cold", "warm", "half")
WAYS = ("mincore", "nowait")
PASSES = ("first", "again")
MiB = 1 << 20


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--file", action="append", help=f"GGUF with a PLE table (repeatable; default {', '.join(FILES)})")
    p.add_argument("--states", default=",".join(STATES), help="comma list of cold, warm, half (default all)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per way and state, interleaved (default 3)")
    p.add_argument("--prompt", help="text file for the trace (default: the Python documentation topics)")
    p.add_argument("--tokens", type=int, default=8192, help="prompt tokens per pass (default 8192)")
    p.add_argument("--ubatch", type=int, default=2048, help="tokens per batch (default 2048)")
    return p.parse_args(argv)


def _references(path, t, plans) -> list[np.ndarray]:
    """Each batch's unique rows as the file holds them (np.fromfile, 256 MiB at a time), uint8 [U, row_bytes]."""
    rb = t.row_bytes
    refs = [np.empty((p.n_unique, rb), np.uint8) for p in plans]
    step = max(1, (256 * MiB) // rb)
    for r0 in range(0, t.n_rows, step):
        r1 = min(t.n_rows, r0 + step)
        chunk = np.fromfile(path, np.uint8, (r1 - r0) * rb, offset=t.data_offset + r0 * rb).reshape(-1, rb)
        for p, ref in zip(plans, refs):
            sel = (p.unique_rows >= r0) & (p.unique_rows < r1)
            ref[sel] = chunk[p.unique_rows[sel] - r0]
    return refs


def _set_state(state, path, cfg, trace) -> None:
    """Put the file in `state` (see the module's docstring)."""
    measure.evict_file(path)
    if state == "warm":
        _warm_page_cache(path, cfg, trace)
    elif state == "half":
        _warm_page_cache(path, cfg, trace[::2])


class Nowait:
    """Way (b): RWF_NOWAIT buffered io_uring reads of every unique row, O_DIRECT windows for the misses."""

    def __init__(self, path, t, cfg):
        self.direct = DirectReader(path, t.data_offset, t.n_bytes, config=dataclasses.replace(cfg, page_cache_reads=0))
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        self.ring = uring.Ring(PAGE_CACHE_QD)
        self.ring.register_file(self.fd)
        self.file_size = self.direct.file_size
        self.hits = self.misses = 0

    def read(self, plan) -> np.ndarray:
        rb, n = plan.row_bytes, plan.n_unique
        out = np.empty((n, rb), np.uint8)
        offs, lens, dst = row_runs(plan.unique_rows, rb, plan.data_offset)
        addrs = np.uint64(out.ctypes.data) + dst.astype(np.uint64)
        missed = self.ring.read(self.fd, offs, lens, addrs, path=self.direct.path, nowait=True,
                                queue_depth=self.ring.sq_entries)
        if missed.any():
            miss = np.repeat(missed, lens // rb)                   # a missed run: every row of it
            rw = plan.row_window
            need = np.zeros(plan.win_offsets.shape[0], bool)
            need[rw[miss]] = True
            woff, wlen = plan.win_offsets[need], plan.win_lengths[need]
            wst = np.zeros_like(wlen)
            np.cumsum(wlen[:-1], out=wst[1:])
            staging = self.direct.staging.ensure(int(wlen.sum()))
            self.direct._submit(woff, wlen, np.minimum(woff + wlen, self.file_size) - woff, staging, wst)
            remap = np.cumsum(need) - 1
            at = wst[remap[rw[miss]]] + (plan.row_staging[miss] - plan.win_staging[rw[miss]])
            out[miss] = rows_at(staging, at, rb)
            k = int(miss.sum())
        else:
            k = 0
        self.misses += k
        self.hits += n - k
        return out

    def close(self):
        self.ring.close()
        os.close(self.fd)
        self.direct.close()


def _pass(r, way, path, t, plans, refs) -> dict:
    """One timed pass over the trace's batches through reader `r`; rows checked against the file afterwards."""
    pc0 = measure.resident_bytes(path, t.data_offset, t.n_bytes)
    counter = measure.ReadCounter(path)
    n0 = _served(r, way)
    secs, outs, mincore_s = [], [], 0.0
    for plan in plans:
        refreshes = r._pc.refreshes if way == "mincore" and r._pc is not None else 0
        a = time.perf_counter()
        outs.append(r.read(plan))
        secs.append(time.perf_counter() - a)
        if way == "mincore" and r._pc is not None and r._pc.refreshes > refreshes:
            mincore_s += r._pc.cost
    dev = counter.stop()["device_bytes"]
    n1 = _served(r, way)
    ok = all(np.array_equal(o, ref) for o, ref in zip(outs, refs))
    pc1 = measure.resident_bytes(path, t.data_offset, t.n_bytes)
    return dict(ms=1e3 * sum(secs) / len(secs), from_pc=n1[0] - n0[0], from_dev=n1[1] - n0[1], ok=ok,
                dev_MiB=None if dev is None else dev / MiB, pc_growth_MiB=(pc1 - pc0) / MiB,
                mincore_ms=1e3 * mincore_s / len(secs))


def _served(r, way) -> tuple[int, int]:
    return (r.rows_from_page_cache, r.rows_from_device) if way == "mincore" else (r.hits, r.misses)


def _run(way, path, t, cfg, plans, refs) -> dict:
    """A fresh reader (opened untimed): the trace once ("first"), then again through the same reader ("again",
    the page cache as the first pass left it)."""
    r = DirectReader(path, t.data_offset, t.n_bytes, config=cfg) if way == "mincore" else Nowait(path, t, cfg)
    try:
        return {k: _pass(r, way, path, t, plans, refs) for k in PASSES}
    finally:
        r.close()


KEYS = ("ms", "from_pc", "from_dev", "pc_growth_MiB", "mincore_ms")


def bench_file(path, a, cfg) -> list[dict]:
    ns = argparse.Namespace(trace="text", prompt=a.prompt, tokens=a.tokens, ubatch=a.ubatch)
    with gg.open_table(path, config=cfg) as t:
        trace, desc = _trace(t, ns)
        plans = [t.plan(ids) for ids in trace]
        refs = _references(t.path, t, plans)
        data = t.path
        print(f"\n## {path}: {t.n_rows:,} rows x {t.row_bytes:,} B {t.qtype.name}; {desc}; "
              f"{sum(p.n_unique for p in plans):,} unique rows in all", flush=True)
        rows = []
        for state in a.states.split(","):
            runs = {(w, k): [] for w in WAYS for k in PASSES}
            before = []
            for rep in range(a.repeats):
                for way in (WAYS if rep % 2 == 0 else WAYS[::-1]):
                    _set_state(state, data, cfg, trace)
                    before.append(measure.resident_bytes(data, t.data_offset, t.n_bytes) / MiB)
                    for k, run in _run(way, data, t, cfg, plans, refs).items():
                        runs[way, k].append(run)
            for (way, k), rs in sorted(runs.items(), key=lambda x: (PASSES.index(x[0][1]), x[0][0])):
                med = {key: statistics.median(r[key] for r in rs) for key in KEYS}
                devs = [r["dev_MiB"] for r in rs if r["dev_MiB"] is not None]
                rows.append(dict(file=Path(path).name, state=state, way=way, passno=k, **med,
                                 ms_all=[round(r["ms"], 2) for r in rs], ok=all(r["ok"] for r in rs),
                                 dev_MiB=statistics.median(devs) if devs else None,
                                 cached_before_MiB=statistics.median(before)))
            _print(rows[-2 * len(PASSES):])
    return rows


def _print(rows) -> None:
    for r in rows:
        dev = "?" if r["dev_MiB"] is None else f"{r['dev_MiB']:.1f}"
        print(f"{r['state']:<5} {r['passno']:<5} {r['way']:<8} {r['ms']:7.2f} ms/batch {str(r['ms_all']):<22} "
              f"page cache {int(r['from_pc']):>6,}  device {int(r['from_dev']):>6,} rows  "
              f"dev {dev:>6} MiB  cache +{r['pc_growth_MiB']:6.1f} MiB  "
              f"(cached before {r['cached_before_MiB']:6.1f} MiB)  mincore {r['mincore_ms']:.2f} ms/batch  "
              f"{'exact' if r['ok'] else 'WRONG BYTES'}", flush=True)


def main(argv=None) -> list[dict]:
    a = _args(argv)
    cfg = gg.Config.from_env(cache_bytes=0)
    ok, why = uring.probe()
    if not ok:
        sys.exit(f"io_uring is needed for way (b): {why}")
    print(f"# page-cache reads: (a) mincore vs (b) RWF_NOWAIT; medians of {a.repeats} interleaved passes; "
          f"ms per batch of {a.ubatch} tokens (planning excluded); kernel {os.uname().release}, {os.cpu_count()} cpus")
    rows = []
    for f in a.file or FILES:
        rows += bench_file(f, a, cfg)
    print("\n# summary: ms per batch, mincore vs RWF_NOWAIT (medians)")
    by = {(r["file"], r["state"], r["passno"], r["way"]): r["ms"] for r in rows}
    for (f, state, k, way), ms in by.items():
        if way == "mincore":
            nw = by[f, state, k, "nowait"]
            print(f"{f:<32} {state:<5} {k:<5} mincore {ms:8.2f}  nowait {nw:8.2f}  nowait/mincore {nw / ms:5.2f}x")
    if any(not r["ok"] for r in rows):
        sys.exit("WRONG BYTES in a pass (see the table)")
    return rows


if __name__ == "__main__":
    main()
