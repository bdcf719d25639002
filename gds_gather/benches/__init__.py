"""Benchmarks users can run: storage bandwidth (gdsio-style), the gather microbenchmark, prefill A/B.

    gds-gather bench storage [--file F | --size 8G] [--io-size 4K,64K,1M,16M] [--threads N] [--qd N]
                             [--pattern rand|seq] [--path gpu-direct,cpu-gpu,cpu] [--cold] [--seconds S]
    gds-gather bench gather  [--tables qwen4exp,gemma4-e4b] [--backends ...] [--trace text|random]
                             [--warm cache|tmpfs|none] [--no-cold] [--no-again] [--cache BYTES]
    gds-gather bench prefill [--model F] [--backends ...] [--tokens N] [--trunk none|tiny|real] [--cache BYTES]
    (every bench: [--repeat N] [--quick] [--drop-caches] [--out DIR] [--dir DIR] [--json] [--plot [FILE.png]])

bench/bench_storage.py, bench_gather.py, bench_prefill.py (and bench_io.py, the gather bench on random ids) run the
same code. Every bench prints a header of machine facts (CPU, cores, GPU, driver, GPU-direct storage state,
filesystem, device, how bytes delivered are counted), warms up, repeats each measurement (--repeat) and reports
medians (the mean of the middle two for an even count); beside the bytes requested it gives the bytes the storage
delivered (/proc/self/io read_bytes; the block device's counter, system-wide). Cold means the bench's own files
evicted (POSIX_FADV_DONTNEED, checked with mincore); --drop-caches empties the whole machine's page cache instead
(root). Outputs go to --out, default the cache directory's bench/ (never the checkout): a JSON file, --plot
[FILE.png] (matplotlib with the Agg canvas: `pip install 'gds-gather[plot]'`); --json ends the output with one
JSON line, and --quick makes a small run. Importable: storage_main(argv),
gather_main(argv), prefill_main(argv) return the result dict.

`gds-gather prefill --hf MODEL_DIR` (a transformers model, its table resident vs offloaded) is hf_ab's; the vLLM
A/B is vllm_ab's.
"""
from __future__ import annotations

import argparse

from ..config import Config
from .gather import _gather_args, run_gather
from .gather_passes import gather_pass
from .prefill import _prefill_args, run_prefill_bench
from .report import COUNT, DROP_CACHES_HELP, HOST_BACKENDS, data_dir, go_cold, median, median_run, out_dir
from ..units import human_size, parse_size
from .storage import _storage_args, gdsio_line, run_storage, storage_file, storage_run

__all__ = ["BENCHES", "HOST_BACKENDS", "add_arguments", "build_parser", "data_dir", "gather_main", "gather_pass",
           "gdsio_line", "go_cold", "human_size", "main", "median", "median_run", "out_dir", "parse_size",
           "prefill_main", "run", "storage_file", "storage_main", "storage_run"]

BENCHES = {
    "storage": (_storage_args, run_storage,
                "storage-to-memory bandwidth after gdsio: GPU_DIRECT (cuFile), CPU_GPU (pinned bounce buffer + H2D "
                "copy), CPU only; GiB/s, IOPS, mean and p99 latency per I/O size"),
    "gather": (_gather_args, run_gather,
               "the gather microbenchmark: a real-text row-id trace on qwen4exp- and gemma4-e4b-geometry tables, "
               "every backend in three passes (cold: new table; the same table again; a new table on a warm page "
               "cache), against fio on the same file"),
    "prefill": (_prefill_args, run_prefill_bench,
                "prefill A/B: backends interleaved, cold and warm, tok/s min/median/max; resident = the table in "
                "memory before the clock starts"),
}


def add_arguments(name: str, p: argparse.ArgumentParser) -> None:
    """The options of bench `name` (shared by `gds-gather bench NAME` and bench/bench_NAME.py)."""
    BENCHES[name][0](p)
    p.add_argument("--repeat", type=COUNT, help="timed repetitions per measurement, median shown "
                                                "(default 3, bench gather 5; --quick 2)")
    p.add_argument("--drop-caches", action="store_true", help=DROP_CACHES_HELP + " (POSIX_FADV_DONTNEED "
                   "after fsync, checked with mincore)")
    p.add_argument("--quick", action="store_true", help="a small, short run (smoke test)")
    p.add_argument("--out", help="where outputs go: the JSON file, the plot, made files (default: the cache "
                                 "directory's bench/, ~/.cache/gds-gather/bench or GDS_GATHER_CACHE_DIR/bench)")
    p.add_argument("--dir", help="where made files live (storage test files, built tables; default --out)")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    p.add_argument("--plot", metavar="FILE.png", nargs="?", const="",
                   help="draw the results (matplotlib); without FILE: bench_NAME.png beside the JSON file")
    p.add_argument("--json-name", help=argparse.SUPPRESS)


def build_parser(name: str, prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog or f"gds-gather bench {name}", description=BENCHES[name][2])
    add_arguments(name, p)
    return p


def run(name: str, args, cfg: Config | None = None) -> dict:
    return BENCHES[name][1](args, cfg or Config.from_env())


def main(name: str, argv=None, prog: str | None = None) -> dict:
    return run(name, build_parser(name, prog).parse_args(argv))


def storage_main(argv=None) -> dict:
    return main("storage", argv, "bench_storage.py")


def gather_main(argv=None) -> dict:
    return main("gather", argv, "bench_gather.py")


def prefill_main(argv=None) -> dict:
    return main("prefill", argv, "bench_prefill.py")
