"""The `gds-gather` command: info, make-model, prefill, bench."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from . import __version__
from .backends import backends, resolve
from .config import Config
from .errors import GatherError
from .platform import detect


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def cmd_info(args, cfg: Config) -> int:
    from .table import open_table
    with open_table(args.file, args.tensor, cfg) as t:
        d = t.describe()
        d["model"] = str(t.model_path)
    plat = detect(cfg.platform)
    d["platform"] = {"kind": plat.kind, "reason": plat.reason, "device": plat.device}
    d["backends"] = [b.as_dict() for b in backends(cfg)]
    d["auto"], d["auto_reason"] = resolve("auto", cfg)
    if args.json:
        print(json.dumps(d))
        return 0
    print(f"{d['model']}")
    if d["path"] != d["model"]:
        print(f"  shard          {d['path']}")
    print(f"  arch           {d['arch'] or '?'}")
    print(f"  tensor         {d['tensor']}  {d['qtype']}  [{d['row_elems']}, {d['n_rows']}] (ggml order)")
    print(f"  rows           {d['n_rows']:,} rows x {d['row_elems']} elements = {d['row_bytes']} B/row")
    print(f"  table          {_human(d['table_bytes'])} at offset {d['data_offset']:,} "
          f"(F32 would be {_human(d['f32_bytes'])}, {d['f32_bytes'] / d['table_bytes']:.1f}x)")
    print(f"  storage        {d['filesystem']}, O_DIRECT alignment {d['align']} B")
    print(f"  platform       {plat.kind}: {plat.reason}")
    print("  backends")
    for b in d["backends"]:
        mark = "yes" if b["available"] else "no "
        print(f"    {b['name']:<10} {mark}  {b['reason']}")
    print(f"  auto           {d['auto']}: {d['auto_reason']}")
    return 0


def cmd_make_model(args, cfg: Config) -> int:
    from .model import PRESETS, write_model
    if args.preset not in PRESETS:
        raise GatherError(f"unknown preset {args.preset!r}; presets: {', '.join(PRESETS)}")
    path = write_model(args.output, args.preset, qtype=args.qtype, rows=args.rows, seed=args.seed,
                       progress=not args.quiet)
    print(path)
    return 0


def cmd_prefill(args, cfg: Config) -> int:
    from .prefill import run_prefill
    result = run_prefill(args.model, cfg, prompt=args.prompt, n_tokens=args.tokens, ubatch=args.ubatch,
                         backend=args.backend, graph=not args.no_graph, cold=args.cold, trunk=args.trunk,
                         dtype=args.dtype, progress=not args.json, log=print if not args.json else None)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "outputs"}))
    return 0


def cmd_bench(args, cfg: Config) -> int:
    from . import benches
    benches.run(args.bench, args, cfg)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gds-gather", description=__doc__)
    p.add_argument("--version", action="version", version=f"gds-gather {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log the chosen backend and why")
    p.add_argument("--platform", choices=("auto", "discrete", "unified", "rocm", "cpu"),
                   help="override platform detection (GDS_GATHER_PLATFORM)")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("info", help="table geometry, bytes, type; which backends run here and why not")
    s.add_argument("file")
    s.add_argument("--tensor", default="per_layer_token_embd.weight")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("make-model", help="write a synthetic PLE model (GGUF) with a real model's layout")
    s.add_argument("preset", help="gemma4-e2b, gemma4-e4b, gemma3n-e2b or qwen4exp")
    s.add_argument("-o", "--output", required=True)
    s.add_argument("--qtype", help="GGML type of the table (default: the preset's)")
    s.add_argument("--rows", type=int, help="number of table rows (default: the real model's)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_make_model)

    s = sub.add_parser("prefill", help="the main job: gather the PLE rows of a real text prompt")
    s.add_argument("model", nargs="?", help="GGUF model (default: a small built-in qwen4exp model, built once)")
    s.add_argument("--prompt", help="text file (default: the Python documentation topics)")
    s.add_argument("--tokens", type=int, default=8192, help="prompt length in tokens (default 8192)")
    s.add_argument("--ubatch", type=int, default=2048)
    s.add_argument("--backend", default=None, help="force a backend (default: auto, or GDS_GATHER_BACKEND)")
    s.add_argument("--cold", action="store_true", help="drop the page cache first (root), else evict the file")
    s.add_argument("--no-graph", action="store_true", help="run the GPU steps eagerly (no CUDA graph)")
    s.add_argument("--trunk", choices=("real", "tiny", "none"),
                   help="synthetic trunk: real shapes (GPU default), tiny (CPU default), none (CPU: fetch only)")
    s.add_argument("--dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"),
                   help="GPU dequant output and trunk dtype")
    s.add_argument("--json", action="store_true", help="end with one JSON line")
    s.set_defaults(func=cmd_prefill)

    from . import benches
    s = sub.add_parser("bench", help="benchmarks: storage bandwidth, the gather microbenchmark, prefill A/B")
    bench = s.add_subparsers(dest="bench", required=True)
    for name, (_, _, what) in benches.BENCHES.items():
        b = bench.add_parser(name, help=what, description=what)
        benches.add_arguments(name, b)
        b.set_defaults(func=cmd_bench)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = Config.from_env(platform=args.platform)
        return args.func(args, cfg)
    except (GatherError, FileNotFoundError, ValueError) as e:
        print(f"gds-gather: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
