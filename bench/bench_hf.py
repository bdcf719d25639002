#!/usr/bin/env python3
"""transformers with the PLE table on disk: load memory and decode speed, resident vs
gds_gather.integrations.transformers.

    python3 bench/bench_hf.py make-model DIR [--kind gemma4] [--vocab 262144]   # the real per-layer shape, tiny trunk
    python3 bench/bench_hf.py memory DIR          # each load in a fresh process: peak / RSS after load and a forward
    python3 bench/bench_hf.py decode DIR          # the PLE module per decode step, generate ms/token: paired A/B

make-model writes a random Gemma 4 (or Gemma 3n) text model with the real per-layer embedding shape (vocab x 4
layers x 256 = 512 MiB in bf16 at vocab 262,144) and a tiny trunk (hidden 64). memory runs each case in a new
process (VmHWM / VmRSS from /proc/self/status). decode times the per-layer embedding module on 1 and 4 ids whose
rows were read before, in a loop; then, in one process, greedy generation of 1 and of 4 sequences (1 and 4 new
tokens per decode step), offloaded and resident in paired rounds: the module's time per decode step inside
generate and generate's time per decode step, each way's median and the median of the rounds' ratios (min-max).
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


def _paired(xs: dict) -> dict:
    """Medians of paired rounds {"resident": [...], "offloaded": [...]}: each way's median, the median of the
    per-round ratios offloaded / resident and their min-max (how noisy the pairs were)."""
    ratios = [o / r for r, o in zip(xs["resident"], xs["offloaded"])]
    return {"resident": statistics.median(xs["resident"]), "offloaded": statistics.median(xs["offloaded"]),
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


def decode_batch(ref, off, batch: int, prompt: int, new: int, rounds: int) -> dict:
    """Greedy generate of `batch` sequences (`batch` new tokens per decode step), resident and offloaded in paired
    rounds (the order alternating; round 0 a warm-up): per round, the PLE module's median time per decode step and
    generate's decode time per step ((generate - the prompt's forward) / (new - 1)). Paired medians (_paired)."""
    import torch
    from gds_gather.benches.hf_ab import forward_times, generate_once
    vocab = ref.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (batch, prompt), generator=torch.Generator().manual_seed(batch))
    ple = {"resident": [], "offloaded": []}          # us inside the PLE module per decode step, each round's median
    mean = {"resident": [], "offloaded": []}         # ... each round's mean (a slow step shows here, not above)
    step = {"resident": [], "offloaded": []}         # ms of generate per decode step, each round
    outs = {}
    for i in range(rounds + 1):
        for name, m in (("resident", ref), ("offloaded", off)) if i % 2 == 0 else (("offloaded", off),
                                                                                   ("resident", ref)):
            with forward_times(m.get_per_layer_input_embeddings()) as calls, forward_times(m) as fwd:
                per_token, outs[name] = generate_once(m, ids, new)
            if i:
                ple[name].append(statistics.median(calls[1:]) * 1e6)          # calls[0]: the prompt
                mean[name].append(statistics.fmean(calls[1:]) * 1e6)
                step[name].append((per_token * new - fwd[0]) / (new - 1) * 1e3)
    return {"batch": batch, "ple_us": _paired(ple), "ple_mean_us": _paired(mean), "step_ms": _paired(step),
            "generations_equal": bool(torch.equal(outs["resident"], outs["offloaded"]))}


def decode(model_dir, prompt: int = 512, new: int = 64, rounds: int = 5, dtype: str = "auto",
           batches=(1, 4), recent_rows: bool = True) -> dict:
    """The PLE module's cost per decode step in a loop and inside greedy generate, and generate's decode time per
    step, offloaded vs resident in paired rounds, for each batch size (new tokens per step). recent_rows=False:
    the module keeps no rows of its own (RecentRows of no budget), so every step takes the row-cache path."""
    import torch
    import transformers
    from gds_gather.integrations.transformers import from_pretrained
    dt = dtype if dtype == "auto" else getattr(torch, dtype)
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt)
    off = from_pretrained(model_dir, dtype=dt)
    if not recent_rows:
        from gds_gather.integrations.recent_rows import RecentRows
        m = off.get_per_layer_input_embeddings()
        m.recent = RecentRows(m.embedding_dim, m.weight_dtype, budget=0)
    vocab = ref.config.get_text_config().vocab_size
    one = torch.tensor([[1234 % vocab]])
    few = torch.tensor([[1234 % vocab, 99, 7, 1234 % vocab]])
    off.get_per_layer_input_embeddings()(one)                 # rows now read
    off.get_per_layer_input_embeddings()(few)
    load0 = os.getloadavg()[0]
    res = {"ple_us_resident_1": _ple_step_us(ref.get_per_layer_input_embeddings(), one),
           "ple_us_offloaded_1": _ple_step_us(off.get_per_layer_input_embeddings(), one),
           "ple_us_resident_4": _ple_step_us(ref.get_per_layer_input_embeddings(), few),
           "ple_us_offloaded_4": _ple_step_us(off.get_per_layer_input_embeddings(), few),
           "batches": [decode_batch(ref, off, b, prompt, new, rounds) for b in batches]}
    res["load_average"] = [load0, os.getloadavg()[0]]
    path = "" if recent_rows else ", no recent rows (the row-cache path)"
    print(f"model {model_dir}, {off.dtype}{path}; load average {load0:.1f} -> {res['load_average'][1]:.1f} on "
          f"{os.cpu_count()} cores")
    print(f"PLE module in a loop (median of 2000 calls), 1 token: resident {res['ple_us_resident_1']:.1f} us, "
          f"offloaded {res['ple_us_offloaded_1']:.1f} us; 4 tokens: {res['ple_us_resident_4']:.1f} vs "
          f"{res['ple_us_offloaded_4']:.1f} us")
    print(f"greedy generate, {prompt}-token prompts, {new} new tokens, {rounds} paired rounds (medians; offloaded / "
          f"resident: the median of the rounds' ratios, their min-max):")
    for b in res["batches"]:
        p, s, mu = b["ple_us"], b["step_ms"], b["ple_mean_us"]
        print(f"  {b['batch']} new token{'s' if b['batch'] > 1 else ''} per step: PLE module per decode step "
              f"resident {p['resident']:.0f} us, offloaded {p['offloaded']:.0f} us = {p['ratio']:.2f}x "
              f"({p['ratio_min']:.2f}-{p['ratio_max']:.2f}), mean {mu['resident']:.0f} vs {mu['offloaded']:.0f} us "
              f"= {mu['ratio']:.2f}x; generate resident {s['resident']:.2f} ms/step "
              f"({s['resident'] / b['batch']:.2f} ms/token), offloaded {s['offloaded']:.2f} ms/step "
              f"({s['offloaded'] / b['batch']:.2f} ms/token) = {s['ratio']:.3f}x ({s['ratio_min']:.3f}-"
              f"{s['ratio_max']:.3f}); generations {'equal' if b['generations_equal'] else 'DIFFER'}")
    st = off.gds_gather.table.stats()
    m = off.get_per_layer_input_embeddings()
    print(f"offloaded rows: {m.recent.hits:,} ids from the rows read lately, {st['rows_from_cache']:,} rows from the "
          f"row cache, {st['rows_from_page_cache']:,} from the page cache, {st['rows_from_device']:,} from the device")
    return res


def main(argv=None) -> dict | list:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("make-model", help="write a random model with the real per-layer embedding shape")
    s.add_argument("dir", help="the model directory to write")
    s.add_argument("--kind", default="gemma4", choices=("gemma4", "gemma3n"), help="model family (default gemma4)")
    s.add_argument("--vocab", type=int, default=262144, help="vocabulary (default 262144, the real one)")
    s = sub.add_parser("memory", help="load memory, resident vs offloaded, each load in a fresh process")
    s.add_argument("dir", help="a model directory (make-model)")
    s.add_argument("--tokens", type=int, default=2048, help="tokens of the forward after the load (default 2048)")
    s = sub.add_parser("case", help="one load of `memory` in this process (its JSON last line)")
    s.add_argument("case", choices=CASES, help="which load")
    s.add_argument("dir", help="a model directory (make-model)")
    s.add_argument("--tokens", type=int, default=2048, help="tokens of the forward after the load (default 2048)")
    s = sub.add_parser("decode", help="the PLE module per decode step and generate per step, paired A/B")
    s.add_argument("dir", help="a model directory (make-model)")
    s.add_argument("--prompt", type=int, default=512, help="prompt tokens per sequence (default 512)")
    s.add_argument("--new", type=int, default=64, help="new tokens per generate, at least 2 (default 64)")
    s.add_argument("--rounds", type=int, default=5, help="paired rounds after a warm-up round (default 5)")
    s.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="the models' dtype (default auto: the checkpoint's)")
    s.add_argument("--batches", default="1,4", help="sequences per generate, i.e. new tokens per decode step "
                   "(comma-separated; default 1,4)")
    s.add_argument("--no-recent-rows", action="store_true",
                   help="the offloaded module keeps no recent rows: every step takes the row-cache path")
    a = ap.parse_args(argv)
    if a.cmd == "decode" and (a.new < 2 or a.rounds < 1 or a.prompt < 1):
        ap.error("decode needs --new >= 2, --rounds >= 1 and --prompt >= 1")
    if a.cmd == "make-model":
        make_model(a.dir, a.kind, a.vocab)
        return {}
    if a.cmd == "case":
        r = measure_case(a.case, a.dir, a.tokens)
        print(json.dumps(r))
        return r
    if a.cmd == "memory":
        return memory(a.dir, a.tokens)
    return decode(a.dir, a.prompt, a.new, a.rounds, a.dtype, [int(b) for b in a.batches.split(",")],
                  not a.no_recent_rows)


if __name__ == "__main__":
    main()
