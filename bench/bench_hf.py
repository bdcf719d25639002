#!/usr/bin/env python3
"""transformers with the PLE table on disk: load memory and decode speed, resident vs
gds_gather.integrations.transformers.

    python3 bench/bench_hf.py make-model DIR [--kind gemma4] [--vocab 262144]   # the real per-layer shape, tiny trunk
    python3 bench/bench_hf.py memory DIR          # each load in a fresh process: peak / RSS after load and a forward
    python3 bench/bench_hf.py decode DIR          # the PLE module per decode step, and greedy generate ms/token A/B

make-model writes a random Gemma 4 (or Gemma 3n) text model with the real per-layer embedding shape (vocab x 4
layers x 256 = 512 MiB in bf16 at vocab 262,144) and a tiny trunk (hidden 64). memory runs each case in a new
process (VmHWM / VmRSS from /proc/self/status). decode times the per-layer embedding module on a 1-token lookup
whose row is cached, and greedy generation offloaded vs resident, interleaved rounds, medians (min-max).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's gds_gather, installed or not

CASES = ("bf16-resident", "bf16-offloaded", "f32-resident", "f32-offloaded")


def make_model(path, kind: str = "gemma4", vocab: int = 262144, n_layer: int = 4, per_layer: int = 256,
               seed: int = 0):
    """A random bf16 text model with a [vocab, n_layer * per_layer] per-layer embedding and a tiny trunk. Built on
    the meta device and filled in place (a 512 MiB table in a few seconds, not a full random init)."""
    import numpy as np
    import torch
    from gds_gather.benches.tiny import text_model
    cls, cfg = text_model(kind, vocab=vocab, n_layer=n_layer, per_layer=per_layer)
    with torch.device("meta"):
        model = cls(cfg)
    model = model.to_empty(device="cpu")
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if p.dtype.is_floating_point:
                if p.numel() > 1 << 22:     # the tables: random bf16 bits of magnitude 2^-15 .. 2^-2, either sign
                    bits = rng.integers(0x3800, 0x3E80, p.numel(), dtype=np.uint16)
                    bits |= rng.integers(0, 2, p.numel(), dtype=np.uint16) << 15
                    p.data = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).reshape(p.shape)
                else:
                    v = rng.standard_normal(tuple(p.shape), dtype=np.float32) * 0.05 + (1.0 if p.ndim <= 1 else 0.0)
                    p.data = torch.from_numpy(np.asarray(v, np.float32)).to(torch.bfloat16)
        model.get_per_layer_input_embeddings().embed_scale.fill_(per_layer ** 0.5)
    model.tie_weights()         # (to_empty untied lm_head from embed_tokens; the config ties them)
    model.save_pretrained(path)
    return Path(path)


def _status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM", "VmRSS")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) // 1024          # MiB
    return out


def measure_case(case: str, model_dir, tokens: int = 2048) -> dict:
    """One load in this process: {peak_load, rss_load, rss_forward, peak_forward} in MiB. Both cases import
    gds_gather.integrations.transformers first, so the difference is the loads'."""
    import torch
    import transformers

    # in both cases: its modules (~4 MiB) are not the table's memory
    from gds_gather.integrations.transformers import from_pretrained
    dtype = torch.float32 if case.startswith("f32") else "auto"
    if case.endswith("offloaded"):
        model = from_pretrained(model_dir, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    a = _status()
    cfg = model.config.get_text_config()
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = model(ids, logits_to_keep=1).logits
    b = _status()
    return {"case": case, "peak_load": a["VmHWM"], "rss_load": a["VmRSS"], "rss_forward": b["VmRSS"],
            "peak_forward": b["VmHWM"], "logit0": float(logits.float()[0, -1, 0])}


def run_cases(model_dir, tokens: int = 2048, jobs: int = 1, threads: int | None = None) -> dict:
    """{case: measure_case in a fresh Python process}, `jobs` processes at a time (each measures only itself).
    threads: torch's CPU threads in each (OMP_NUM_THREADS): with several, a float32 forward on a busy machine gives
    one of two logits from run to run, resident or offloaded alike (docs/decisions/transformers-offload.md); 1 makes
    them comparable."""
    from concurrent.futures import ThreadPoolExecutor
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))

    def one(case):
        out = subprocess.run([sys.executable, __file__, "case", case, str(model_dir), "--tokens", str(tokens)],
                             check=True, capture_output=True, text=True, env=env)
        return json.loads(out.stdout.strip().splitlines()[-1])
    with ThreadPoolExecutor(jobs) as ex:
        return dict(zip(CASES, ex.map(one, CASES)))


def memory(model_dir, tokens: int = 2048) -> list[dict]:
    rows = list(run_cases(model_dir, tokens).values())
    print("| load | peak MiB | RSS after load | RSS after one %d-token forward |" % tokens)
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['peak_load']:,} | {r['rss_load']:,} | {r['rss_forward']:,} |")
    return rows


def _ple_step_us(module, ids, n: int = 2000) -> float:
    """Median of n calls of the per-layer embedding module on `ids`, in microseconds."""
    import torch
    times = []
    with torch.inference_mode():
        for _ in range(n):
            a = time.perf_counter_ns()
            module(ids)
            times.append(time.perf_counter_ns() - a)
    return statistics.median(times) / 1e3


def decode(model_dir, prompt: int = 512, new: int = 64, rounds: int = 5, dtype: str = "auto") -> dict:
    """The PLE module's cost per decode step, and greedy generate ms/token, offloaded vs resident (interleaved)."""
    import torch
    import transformers
    from gds_gather.benches.hf_ab import forward_times, generate_once
    from gds_gather.integrations.transformers import from_pretrained
    dt = dtype if dtype == "auto" else getattr(torch, dtype)
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt)
    off = from_pretrained(model_dir, dtype=dt)
    vocab = ref.config.get_text_config().vocab_size
    one = torch.tensor([[1234 % vocab]])
    few = torch.tensor([[1234 % vocab, 99, 7, 1234 % vocab]])
    off.get_per_layer_input_embeddings()(one)                 # rows now in the row cache
    off.get_per_layer_input_embeddings()(few)
    res = {"ple_us_resident_1": _ple_step_us(ref.get_per_layer_input_embeddings(), one),
           "ple_us_offloaded_1": _ple_step_us(off.get_per_layer_input_embeddings(), one),
           "ple_us_resident_4": _ple_step_us(ref.get_per_layer_input_embeddings(), few),
           "ple_us_offloaded_4": _ple_step_us(off.get_per_layer_input_embeddings(), few)}
    ids = torch.randint(0, vocab, (1, prompt), generator=torch.Generator().manual_seed(0))
    ms = {"resident": [], "offloaded": []}
    ple = {"resident": [], "offloaded": []}         # ms inside the PLE module: a decode step (median), the prompt
    ple_prompt = {"resident": [], "offloaded": []}
    steps = {"resident": [], "offloaded": []}       # ms of each decode step's model forward (all rounds)
    outs = {}
    for i in range(rounds + 1):
        for name, m in (("resident", ref), ("offloaded", off)) if i % 2 == 0 else (("offloaded", off),
                                                                                   ("resident", ref)):
            with forward_times(m.get_per_layer_input_embeddings()) as calls, forward_times(m) as fwd:
                per_token, outs[name] = generate_once(m, ids, new)
            if i:                                   # round 0 is the warm-up
                ms[name].append(per_token * 1e3)
                ple[name].append(statistics.median(calls[1:]) * 1e3)      # the decode steps (calls[0]: prompt)
                ple_prompt[name].append(calls[0] * 1e3)
                steps[name].extend(x * 1e3 for x in fwd[1:])
    res.update({f"generate_ms_per_token_{k}": statistics.median(v) for k, v in ms.items()})
    res.update({f"generate_ms_spread_{k}": [min(v), max(v)] for k, v in ms.items()})
    res.update({f"generate_ple_ms_per_step_{k}": statistics.median(v) for k, v in ple.items()})
    res.update({f"generate_ple_ms_prompt_{k}": statistics.median(v) for k, v in ple_prompt.items()})
    res["generate_ratio"] = res["generate_ms_per_token_offloaded"] / res["generate_ms_per_token_resident"]
    res["generations_equal"] = bool(torch.equal(outs["resident"], outs["offloaded"]))
    res.update({f"step_ms_{k}": statistics.median(v) for k, v in steps.items()})
    res["step_ratio"] = res["step_ms_offloaded"] / res["step_ms_resident"]
    print(f"model {model_dir}, {off.dtype}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"PLE module, 1 cached token: resident {res['ple_us_resident_1']:.1f} us, offloaded "
          f"{res['ple_us_offloaded_1']:.1f} us; 4 tokens: {res['ple_us_resident_4']:.1f} vs "
          f"{res['ple_us_offloaded_4']:.1f} us (median of 2000 calls)")
    print(f"greedy generate, {prompt}-token prompt, {new} new tokens, {rounds} interleaved rounds: resident "
          f"{res['generate_ms_per_token_resident']:.2f} ms/token ({ms['resident'] and min(ms['resident']):.2f}-"
          f"{max(ms['resident']):.2f}), offloaded {res['generate_ms_per_token_offloaded']:.2f} "
          f"({min(ms['offloaded']):.2f}-{max(ms['offloaded']):.2f}) = {res['generate_ratio']:.3f}x; "
          f"generations {'equal' if res['generations_equal'] else 'DIFFER'}")
    print(f"one decode step's model forward, median of {len(steps['resident'])} steps each: resident "
          f"{res['step_ms_resident']:.2f} ms, offloaded {res['step_ms_offloaded']:.2f} ms = {res['step_ratio']:.3f}x")
    print(f"inside the PLE module in generate: a decode step resident "
          f"{res['generate_ple_ms_per_step_resident'] * 1e3:.0f} us,"
          f" offloaded {res['generate_ple_ms_per_step_offloaded'] * 1e3:.0f} us (medians); the {prompt}-token prompt "
          f"{res['generate_ple_ms_prompt_resident']:.2f} vs {res['generate_ple_ms_prompt_offloaded']:.2f} ms")
    st = off.gds_gather.table.stats()
    print(f"offloaded rows: {st['rows_from_cache']:,} from the row cache, {st['rows_from_page_cache']:,} from the page "
          f"cache, {st['rows_from_device']:,} from the device")
    return res


def main(argv=None) -> dict | list:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("make-model")
    s.add_argument("dir")
    s.add_argument("--kind", default="gemma4", choices=("gemma4", "gemma3n"))
    s.add_argument("--vocab", type=int, default=262144)
    s = sub.add_parser("memory")
    s.add_argument("dir")
    s.add_argument("--tokens", type=int, default=2048)
    s = sub.add_parser("case")
    s.add_argument("case", choices=CASES)
    s.add_argument("dir")
    s.add_argument("--tokens", type=int, default=2048)
    s = sub.add_parser("decode")
    s.add_argument("dir")
    s.add_argument("--prompt", type=int, default=512)
    s.add_argument("--new", type=int, default=64)
    s.add_argument("--rounds", type=int, default=5)
    s.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    a = ap.parse_args(argv)
    if a.cmd == "make-model":
        make_model(a.dir, a.kind, a.vocab)
        return {}
    if a.cmd == "case":
        r = measure_case(a.case, a.dir, a.tokens)
        print(json.dumps(r))
        return r
    if a.cmd == "memory":
        return memory(a.dir, a.tokens)
    return decode(a.dir, a.prompt, a.new, a.rounds, a.dtype)


if __name__ == "__main__":
    main()
