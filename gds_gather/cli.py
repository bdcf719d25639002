"""The `gds-gather` command: info, make-model, prefill, convert, bench."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import sys

from . import __version__
from .backends import backends, resolve
from .config import Config
from .errors import GatherError
from .prefill.run import MAX_UBATCH
from .units import fit, human_bytes, int_in, parse_size
from .platform import detect



class _Parser(argparse.ArgumentParser):
    """argparse with ONE line on stderr for a bad command line (the usage is in --help)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _check_input(path) -> None:
    """A model path that is a FIFO, socket or device would block or read forever: refuse it by name."""
    import os
    import stat
    from .io.safe_write import file_kind
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return                                     # missing etc.: the reader says so
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise GatherError(f"{path} is {file_kind(mode)}, not a model file")


def _check_prefill_args(args, cfg: Config) -> None:
    """Refuse what would fail later with a traceback or after minutes: a bad prompt file, a forced GPU platform
    on a machine without one (or without torch, which the GPU pipeline needs)."""
    if args.model is not None:
        _check_input(args.model)
    if args.prompt is not None:
        from .prefill.prompts import open_prompt
        open_prompt(args.prompt).close()
    if cfg.platform in ("discrete", "unified", "rocm"):
        import importlib.util
        probe = detect("auto")
        if probe.kind == "cpu":
            raise GatherError(f"--platform/GDS_GATHER_PLATFORM {cfg.platform}: no usable GPU here ({probe.reason})")
        if importlib.util.find_spec("torch") is None:
            raise GatherError(f"--platform/GDS_GATHER_PLATFORM {cfg.platform}: the GPU pipeline needs torch "
                              "(pip install 'gds-gather[torch]')")


def cmd_info(args, cfg: Config) -> int:
    from .table import open_table
    _check_input(args.file)
    with open_table(args.file, args.tensor, cfg) as t:
        d = t.describe()
        d["model"] = str(t.model_path)
        from .integrations.convert import describe
        d["convert"] = describe(t)
        d["memory"] = _memory_facts(t, cfg)
    plat = detect(cfg.platform)
    d["platform"] = {"kind": plat.kind, "reason": plat.reason, "device": plat.device, "path": plat.path}
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
    if d["scales"]:
        print(fit(f"  scales         {d['scales']}: value = element x scale (float32 multiplies)", " " * 17))
    if d["convert"]:
        print(f"  convert        {d['convert']}")
    print(f"  table          {human_bytes(d['table_bytes'])} at offset {d['data_offset']:,} "
          f"(F32 would be {human_bytes(d['f32_bytes'])}, {d['f32_bytes'] / d['table_bytes']:.1f}x)")
    print(f"  storage        {d['filesystem']}, O_DIRECT alignment {d['align']} B")
    print(fit(f"  memory         {_memory_line(d['memory'])}", " " * 17))
    print(f"  platform       {plat.kind}: {plat.reason}")
    print(f"  GPU path       {plat.path}")
    print("  backends")
    for b in d["backends"]:
        mark = "yes" if b["available"] else "no "
        print(fit(f"    {b['name']:<10} {mark}  {b['reason']}", " " * 19))
    print(f"  auto           {d['auto']}: {d['auto_reason']}")
    return 0


def _memory_facts(t, cfg: Config) -> dict:
    """What this process may use (io/memory.py), the row cache budget it gives and whether the whole table fits."""
    from .cache import rowcache
    from .io import memory
    lim = memory.limits(cfg.memory_root)
    avail = memory.available(lim)
    b = rowcache.table_budget(t, lim)
    too_large = rowcache.too_large(cfg.cache_bytes, t.n_bytes, avail)
    return {"available_bytes": avail, "source": memory.source(lim), "cgroup_limit_bytes": lim.cgroup_limit,
            "cgroup_usage_bytes": lim.cgroup_usage, "cgroup": lim.cgroup_source,
            "mem_available_bytes": lim.mem_available, "cache_budget_bytes": b.bytes,
            "cache_budget_reason": b.reason + ("; too large: reads through the cache are refused" if too_large
                                               else ""),
            "resident_fits": None if avail is None else t.n_bytes <= avail}


def _memory_line(m: dict) -> str:
    avail = "unknown" if m["available_bytes"] is None else human_bytes(m["available_bytes"])
    fits = {True: "resident fits", False: "resident does not fit (the table is larger)",
            None: "resident: unknown"}[m["resident_fits"]]
    return (f"{avail} available ({m['source']}); row cache budget {human_bytes(m['cache_budget_bytes'])} "
            f"({m['cache_budget_reason']}); {fits}")


def cmd_make_model(args, cfg: Config) -> int:
    from .model.presets import PRESETS
    from .model.synth import write_model
    if args.hf:
        return _make_hf_model(args)
    if args.preset is None:
        raise GatherError("make-model needs a PRESET (or --hf KIND for a tiny transformers model)")
    if args.preset not in PRESETS:
        raise GatherError(f"unknown preset {args.preset!r}; presets: {', '.join(PRESETS)}")
    preset = PRESETS[args.preset]
    if args.width is not None:
        if not preset.is_ngram:
            raise GatherError("--width applies to qwen4exp (a gemma row is n_layer x 256 elements)")
        preset = dataclasses.replace(preset, n_embd_per_layer=args.width)
    from .formats import quants
    qt = quants.qtype_of(args.qtype) if args.qtype else None
    if qt is not None and quants.is_small_float(qt):
        if qt == quants.RowType.F4_E2M1 and (args.scales or args.scale_block != 32):
            raise GatherError("F4_E2M1 is ModelOpt's NVFP4: its scales are F8_E4M3 per 16 elements, no --scales")
        from .model.checkpoint import write_fp8_checkpoint
        path = write_fp8_checkpoint(args.output, preset, qt, rows=args.rows, seed=args.seed,
                                    scale_type=args.scales, scale_block=args.scale_block, progress=not args.quiet)
    else:
        if args.scales or args.scale_block != 32:
            raise GatherError("--scales and --scale-block go with a float8 --qtype (F8_E4M3, F8_E5M2)")
        path = write_model(args.output, preset, qtype=args.qtype, rows=args.rows, seed=args.seed,
                           progress=not args.quiet)
    print(path)
    return 0


def _make_hf_model(args) -> int:
    """A tiny random transformers checkpoint with a byte-level tokenizer, written into a new or empty directory."""
    from pathlib import Path
    if args.preset or args.qtype or args.rows or args.width or args.scales:
        raise GatherError("--hf makes a tiny transformers model of its own shape: no PRESET, --qtype, --rows, "
                          "--width or --scales")
    out = Path(args.output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise GatherError(f"{out}: exists and is not an empty directory; --hf writes a new model directory")
    try:
        from .benches.tiny import tiny
    except ImportError as e:   # pragma: no cover - the hf extra's packages
        raise GatherError(f"--hf needs torch and transformers: pip install -e \".[hf]\" ({e})") from e
    print(tiny(args.hf, out, seed=args.seed, tokenizer=True))
    return 0


def cmd_prefill(args, cfg: Config) -> int:
    _check_prefill_args(args, cfg)
    if args.hf:
        from .benches.hf_ab import cmd_prefill_hf
        return cmd_prefill_hf(args, cfg)
    if args.table or args.generate:
        raise GatherError(f"{'--table' if args.table else '--generate'} goes with --hf MODEL_DIR (a transformers "
                          f"model)")
    args.dtype = args.dtype or "bfloat16"
    args.tokens = 8192 if args.tokens is None else args.tokens
    from .prefill.run import PrefillOptions, run_prefill
    options = PrefillOptions(prompt=args.prompt, n_tokens=args.tokens, ubatch=args.ubatch, backend=args.backend,
                             graph=not args.no_graph, cold=args.cold, drop_caches=args.drop_caches, trunk=args.trunk,
                             dtype=args.dtype, cache=args.cache, progress=not args.json,
                             log=_stderr if args.json else print)
    result = run_prefill(args.model, cfg, options)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "outputs"}))
    return 0


def _stderr(line: str) -> None:
    """--json: the human lines go to stderr, so stdout holds the JSON line alone."""
    print(line, file=sys.stderr)


def _cmd_convert(args, cfg: Config) -> int:
    from .integrations.convert import cmd_convert
    return cmd_convert(args, cfg)


def cmd_bench(args, cfg: Config) -> int:
    """0, or 1 where the bench process died (bench gather --memory-limit: the passes it finished are written)."""
    from . import benches
    res = benches.run(args.bench, args, cfg)
    return 1 if isinstance(res, dict) and isinstance(res.get("died"), dict) else 0


def build_parser() -> argparse.ArgumentParser:
    from .model.synth import MAX_ROWS
    from .prefill.prompts import MAX_TOKENS
    p = _Parser(prog="gds-gather", description=__doc__)
    p.add_argument("--version", action="version", version=f"gds-gather {__version__}")
    _global_options(p, verbose=False, platform=None)
    common = _Parser(add_help=False)        # the same options after the subcommand: given there, they win
    _global_options(common, verbose=argparse.SUPPRESS, platform=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("info", parents=[common],
                       help="table geometry, bytes, type; which backends run here and why not")
    s.add_argument("file", help="GGUF model (any shard of a split one), or a Hugging Face model directory or "
                                ".safetensors(.index.json) file")
    s.add_argument("--tensor", default="per_layer_token_embd.weight",
                   help="the table's name (default: found by name, *embed_tokens_per_layer.weight in safetensors)")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of the lines")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("make-model", parents=[common],
                       help="write a synthetic PLE model (GGUF) with a real model's layout")
    s.add_argument("preset", nargs="?", help="gemma4-e2b, gemma4-e4b, gemma3n-e2b or qwen4exp")
    s.add_argument("--hf", choices=("gemma4", "gemma3n"),
                   help="instead: a tiny random transformers checkpoint of this kind with a byte-level tokenizer "
                        "(a directory; needs the hf extra)")
    s.add_argument("-o", "--output", required=True,
                   help="the GGUF file to write (replaced atomically); with --hf a new or empty directory")
    s.add_argument("--qtype", help="GGML type of the table (default: the preset's); F8_E4M3, F8_E5M2 or F4_E2M1 "
                                   "(ModelOpt's NVFP4 layout) write a safetensors checkpoint directory instead (GGUF "
                                   "has no such type)")
    s.add_argument("--rows", type=int_in(1, MAX_ROWS), help="number of table rows (default: the real model's)")
    s.add_argument("--width", type=int_in(1, 1 << 16),
                   help="qwen4exp: elements per row (default 160; 256 for an Engram-like 256 B float8 row)")
    s.add_argument("--scales", choices=("F8_E8M0", "F32", "BF16"),
                   help="float8 --qtype: write scales beside the table, one per --scale-block elements of a row")
    s.add_argument("--scale-block", type=int_in(1, 1 << 16), default=32,
                   help="elements per scale along a row (default 32, OCP MX's block)")
    s.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0, help="seed of the random weights (default 0)")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_make_model)

    s = sub.add_parser("prefill", parents=[common], help="the main job: gather the PLE rows of a real text prompt")
    s.add_argument("model", nargs="?", help="GGUF model (default: a small built-in qwen4exp model, built once)")
    s.add_argument("--prompt", help="text file (default: the Python documentation topics)")
    s.add_argument("--tokens", type=int_in(1, MAX_TOKENS), default=None,
                   help="prompt length in tokens (default 8192; --hf: 2048)")
    s.add_argument("--ubatch", type=int_in(1, MAX_UBATCH), default=2048, help="tokens per ubatch (default 2048)")
    s.add_argument("--backend", default=None, help="force a backend (default: auto, or GDS_GATHER_BACKEND)")
    s.add_argument("--cold", action="store_true",
                   help="evict the table file from the page cache first (posix_fadvise; touches nothing else)")
    s.add_argument("--drop-caches", action="store_true",
                   help="empty the WHOLE machine's page cache first (echo 3 > /proc/sys/vm/drop_caches; root)")
    s.add_argument("--no-graph", action="store_true", help="run the GPU steps eagerly (no CUDA graph)")
    s.add_argument("--trunk", choices=("real", "tiny", "none"),
                   help="synthetic trunk, random weights: real (the preset's shapes; the GPU default), tiny, or none "
                        "(the PLE step alone; the CPU default)")
    s.add_argument("--hf", metavar="MODEL_DIR", help="a Hugging Face transformers model (Gemma 4 / Gemma 3n): its "
                   "prefill with the PLE table resident vs offloaded, A/B")
    s.add_argument("--table", help="with --hf: the table file (default: the checkpoint's own safetensors)")
    s.add_argument("--generate", type=int_in(1, MAX_TOKENS), default=None, metavar="N",
                   help="with --hf: also time greedy generation of N tokens both ways (ms per token)")
    s.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"),
                   help="GPU dequant output and trunk dtype (default bfloat16); --hf: the model's (default: the "
                   "checkpoint's)")
    s.add_argument("--json", action="store_true", help="print one JSON line on stdout (the human lines go to stderr)")
    s.add_argument("--cache", type=functools.partial(parse_size, allow_auto=True), default=None, metavar="BYTES",
                   help="row cache budget: bytes (K/M/G suffixes), 0 = off, auto = 10%% of the table up to 256 MiB "
                        "and 1/8 of the memory available; one too large for that memory is refused "
                        "(default: GDS_GATHER_CACHE_BYTES, else auto)")
    s.set_defaults(func=cmd_prefill)

    s = sub.add_parser("convert", parents=[common],
                       help="write a model's PLE table alone as a GGUF, optionally quantized")
    s.add_argument("model", help="Hugging Face model directory, .safetensors(.index.json) file, or GGUF")
    s.add_argument("-o", "--output", required=True, help="the GGUF file to write (replaced atomically)")
    s.add_argument("--qtype", help="F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 TQ1_0 TQ2_0 MXFP4 (gguf's quantizers; "
                   "default: the source type, an exact copy)")
    s.add_argument("--tensor", default="per_layer_token_embd.weight",
                   help="the table's name (default: found by name, *embed_tokens_per_layer.weight in safetensors)")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=_cmd_convert)

    from . import benches
    s = sub.add_parser("bench", parents=[common],
                       help="benchmarks: storage bandwidth, the gather microbenchmark, prefill A/B")
    bench = s.add_subparsers(dest="bench", required=True)
    for name, (_, _, what) in benches.BENCHES.items():
        b = bench.add_parser(name, parents=[common], help=what, description=what)
        benches.add_arguments(name, b)
        b.set_defaults(func=cmd_bench)
    return p


def _global_options(p: argparse.ArgumentParser, *, verbose, platform) -> None:
    """-v and --platform: before the subcommand (the defaults) and after it (defaults argparse.SUPPRESS, so a value
    given there replaces the one given before and an absent one leaves it)."""
    p.add_argument("-v", "--verbose", action="store_true", default=verbose,
                   help="log the chosen backend and why (before or after the subcommand)")
    p.add_argument("--platform", choices=("auto", "discrete", "unified", "rocm", "cpu"), default=platform,
                   help="override platform detection (GDS_GATHER_PLATFORM; before or after the subcommand)")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    restore = _terminate_cleanly()
    try:
        cfg = Config.from_env(platform=args.platform)
        return args.func(args, cfg)
    except (GatherError, FileNotFoundError, ValueError) as e:
        print(f"gds-gather: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gds-gather: interrupted", file=sys.stderr)
        return 130
    except (OSError, MemoryError) as e:        # e.g. a full disk while writing: the message names the file
        if args.verbose:
            raise
        print(f"gds-gather: error: {type(e).__name__}: {_one_line(e)}", file=sys.stderr)
        return 1
    finally:
        restore()


def _terminate_cleanly():
    """SIGTERM (kill, timeout) raises KeyboardInterrupt, so temporary output files are removed as on Ctrl-C.
    Returns what puts the previous handler back."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    old = signal.signal(signal.SIGTERM, stop)
    return lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL if old is None else old)


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.filename is not None and e.strerror:   # "x.gguf: No such file or directory"
        text = f"{e.filename}: {e.strerror}"
    else:
        text = str(e)
    return " ".join(text.split()) or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
