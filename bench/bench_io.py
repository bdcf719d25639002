"""I/O engine benchmark: rows/s of every host reader, cold and warm, against fio on the same file.

    python3 bench/bench_io.py                  # 2.16 GB qwen4exp-geometry table, 100k random 90-byte rows
    python3 bench/bench_io.py --quick          # a small table, for a smoke run

Cold = after dropping the page cache (root) or evicting the file; warm = a copy of the table on tmpfs.
Prints, per backend: rows/s, read amplification (bytes read / useful bytes), major faults, page-cache growth of
the file, p50/p99 latency per batch; then the ratios the I/O issue asks for, against fio measured in this run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import gds_gather as gg
from gds_gather import measure

HERE = Path(__file__).resolve().parent


def make_table(path: Path, rows: int) -> Path:
    if not path.exists():
        from gds_gather.model import write_model
        path.parent.mkdir(parents=True, exist_ok=True)
        write_model(path, "qwen4exp", rows=rows, progress=True)
    return path


def run_backend(path, backend, ids, batch, cfg, cold: bool) -> dict:
    """One pass over `ids` in batches with a fresh table; the cache is emptied first when cold."""
    with gg.open_table(path, config=cfg) as t:
        t.read_rows(np.zeros(1, np.int64), backend)     # open the reader (fd, ring, mapping) outside the timing
        reader = t._readers[backend]
        if cold:
            if not measure.drop_caches():
                measure.evict_file(path)
        reader.bytes_read = 0
        res0, flt0 = measure.resident_bytes(path), measure.major_faults()
        lat, useful = [], 0
        t0 = time.perf_counter()
        for k in range(0, ids.size, batch):
            plan = t.plan(ids[k:k + batch])
            a = time.perf_counter()
            t.read_plan(plan, backend)
            lat.append(time.perf_counter() - a)
            useful += plan.exact_bytes
        wall = time.perf_counter() - t0
        return {"backend": backend, "cold": cold, "rows_per_s": ids.size / wall, "seconds": wall,
                "amplification": reader.bytes_read / useful if useful else 0.0,
                "major_faults": measure.major_faults() - flt0,
                "page_cache_growth_MiB": (measure.resident_bytes(path) - res0) / 2**20,
                "p50_ms": measure.percentile_ms(lat, 50), "p99_ms": measure.percentile_ms(lat, 99),
                "how": reader.how}


def median_run(path, backend, ids, batch, cfg, cold, repeat) -> dict:
    runs = [run_backend(path, backend, ids, batch, cfg, cold) for _ in range(repeat)]
    best = sorted(runs, key=lambda r: r["rows_per_s"])[len(runs) // 2]
    best["rows_per_s_all"] = [round(r["rows_per_s"]) for r in runs]
    return best


def line(r: dict) -> str:
    return (f"  {r['backend']:<10} {'cold' if r['cold'] else 'warm'}  {r['rows_per_s']:>11,.0f} rows/s  "
            f"ampl {r['amplification']:6.1f}x  majflt {r['major_faults']:>7}  cache +{r['page_cache_growth_MiB']:8.1f} MiB"
            f"  p50 {r['p50_ms']:7.2f} ms  p99 {r['p99_ms']:7.2f} ms   [{r['how']}]")


def ratio(name, a, b, target=None) -> str:
    if not a or not b:
        return f"  {name}: n/a"
    x = a / b
    verdict = "" if target is None else ("  PASS" if x >= target else "  MISS") + f" (target >= {target})"
    return f"  {name} = {x:.2f}x{verdict}"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--file", help="a GGUF with a PLE table (default: build a qwen4exp-geometry table)")
    p.add_argument("--rows", type=int, default=24_000_000, help="rows of the built table (24M x 90 B = 2.16 GB)")
    p.add_argument("--ids", type=int, default=100_000, help="random rows gathered per pass")
    p.add_argument("--batch", type=int, default=16_384, help="ids per gather call (latency is per batch)")
    p.add_argument("--qd", type=int, default=128, help="queue depth of direct and of fio")
    p.add_argument("--backends", default="direct,pread,mmap,readahead")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--tmpfs", default="/dev/shm", help="where the warm copy goes")
    p.add_argument("--no-warm", action="store_true")
    p.add_argument("--no-cold", action="store_true")
    p.add_argument("--fio-runtime", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="small table and few ids (smoke test)")
    p.add_argument("--out", default=str(HERE / "out"), help="where built tables and the JSON go")
    p.add_argument("--json", action="store_true", help="print one JSON line at the end")
    a = p.parse_args(argv)
    if a.quick:
        a.rows, a.ids, a.batch, a.repeat, a.fio_runtime = min(a.rows, 200_000), min(a.ids, 5000), 1000, 1, 1
    out = Path(a.out)
    path = Path(a.file) if a.file else make_table(out / f"qwen4exp-{a.rows}.gguf", a.rows)
    cfg = gg.Config.from_env(queue_depth=a.qd)
    backends = [b for b in a.backends.split(",") if b]
    with gg.open_table(path, config=cfg) as t:
        n_rows, row_bytes, align = t.n_rows, t.row_bytes, t.align
    ids = np.random.default_rng(0).integers(0, n_rows, a.ids)

    facts = measure.machine_facts(path)
    print("# bench_io " + "  ".join(f"{k}: {v}" for k, v in facts.items() if k != "platform_reason"))
    print(f"# table {n_rows:,} rows x {row_bytes} B; {a.ids:,} random rows per pass in batches of {a.batch:,}; "
          f"QD {a.qd}; O_DIRECT alignment {align} B; repeat {a.repeat}, median shown")
    result = {"facts": facts, "runs": [], "fio": {}}

    if not a.no_cold:
        root = measure.drop_caches()
        print(f"cold ({'drop_caches' if root else 'POSIX_FADV_DONTNEED on the file (not root)'} before each pass)")
        cold = {}
        for b in backends:
            r = median_run(path, b, ids, a.batch, cfg, True, a.repeat)
            cold[b] = r
            result["runs"].append(r)
            print(line(r), flush=True)
        fio4k = measure.fio_randread(path, bs="4k", direct=True, iodepth=a.qd, runtime=a.fio_runtime)
        fio_blk = (measure.fio_randread(path, bs=str(align), direct=True, iodepth=a.qd, runtime=a.fio_runtime)
                   if align != 4096 else fio4k)
        result["fio"]["cold_4k"], result["fio"]["cold_block"] = fio4k, fio_blk
        for label, f in (("4k", fio4k), (f"{align}B", fio_blk)):
            if f and "iops" in f:
                print(f"  fio randread {label} O_DIRECT io_uring QD {a.qd}: {f['iops']:,.0f} IOPS   [{f['cmd']}]")
            else:
                print(f"  fio {label}: {'not installed' if f is None else f.get('error')}")
        d = cold.get("direct", {}).get("rows_per_s")
        print("ratios (cold):")
        print(ratio("direct / fio 4k", d, fio4k and fio4k.get("iops"), 0.9))
        if fio_blk is not fio4k:
            print(ratio(f"direct / fio {align}B", d, fio_blk and fio_blk.get("iops")))
        print(ratio("direct / mmap", d, cold.get("mmap", {}).get("rows_per_s"), 3.0))
        print(ratio("direct / pread", d, cold.get("pread", {}).get("rows_per_s"), 1.3))
        print(ratio("direct / readahead", d, cold.get("readahead", {}).get("rows_per_s")))

    if not a.no_warm:
        warm_path = Path(a.tmpfs) / f"gds-gather-bench-{os.getpid()}.gguf"
        free = shutil.disk_usage(a.tmpfs).free
        if free < 2 * os.path.getsize(path):
            print(f"warm: skipped, {a.tmpfs} has {free / 2**30:.1f} GiB free")
        else:
            shutil.copyfile(path, warm_path)
            try:
                print(f"warm (table copied to {a.tmpfs}, {measure.machine_facts(warm_path)['filesystem']})")
                warm = {}
                for b in backends + ["resident"]:
                    r = median_run(warm_path, b, ids, a.batch, cfg, False, a.repeat)
                    warm[b] = r
                    result["runs"].append(r)
                    print(line(r), flush=True)
                fio_w = measure.fio_randread(warm_path, bs="4k", direct=False, engine="psync", iodepth=1,
                                             numjobs=1, runtime=a.fio_runtime)
                result["fio"]["warm_psync_4k_1job"] = fio_w
                if fio_w and "iops" in fio_w:
                    print(f"  fio psync 4k, 1 job (direct's one submitting thread): {fio_w['iops']:,.0f} IOPS   "
                          f"[{fio_w['cmd']}]")
                print("ratios (warm):")
                print(ratio("direct / fio psync 4k 1 job", warm.get("direct", {}).get("rows_per_s"),
                            fio_w and fio_w.get("iops"), 0.7))
                print(ratio("direct / resident", warm.get("direct", {}).get("rows_per_s"),
                            warm["resident"]["rows_per_s"]))
            finally:
                warm_path.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_io.json").write_text(json.dumps(result, indent=1))
    if a.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
