"""`gds-gather prefill --hf MODEL_DIR [--table FILE]`: a transformers model's prefill (and greedy generation) with
its per-layer embedding table resident vs offloaded (gds_gather.integrations.transformers), A/B in one process.
bench/bench_hf.py (load memory, the per-layer embedding's decode step) uses its timing helpers."""
from __future__ import annotations

import contextlib
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ..config import Config
from ..integrations.transformers import offload_per_layer_embeddings, parameter_bytes, per_layer_embedding
from ..units import fit, human_bytes
from ..prefill.prompts import prompt_tokens


class HFTokenizer:
    """An HF tokenizer with the encode(text) -> int64 array interface gds_gather.prefill.prompts.prompt_tokens uses."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok(text)["input_ids"], np.int64)


def hf_tokenizer(model_dir: Path) -> HFTokenizer | None:
    """The model directory's own tokenizer (transformers' AutoTokenizer); None where it has no tokenizer files."""
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer
    return HFTokenizer(AutoTokenizer.from_pretrained(model_dir))


@contextlib.contextmanager
def forward_times(module, calls: list | None = None, device=None):
    """Append the wall time (seconds) of each forward of `module` to `calls` (default a new list), yielded; on a
    CUDA device the device is synchronized around each forward, so the time is the module's work."""
    calls = [] if calls is None else calls
    start = []
    sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else (lambda: None)

    def pre(*_):
        sync()
        start.append(time.perf_counter())

    def post(*_):
        sync()
        calls.append(time.perf_counter() - start.pop())
    handles = [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def prefill_once(model, ids: torch.Tensor, ubatch: int) -> tuple[float, torch.Tensor]:
    """A chunked prefill through the KV cache: (seconds, the last position's logits)."""
    from transformers import DynamicCache
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = DynamicCache(config=model.config)
    sync = torch.cuda.synchronize if ids.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.inference_mode():
        for a in range(0, ids.shape[1], ubatch):
            out = model(input_ids=ids[:, a:a + ubatch], use_cache=True, logits_to_keep=1, **{kw: cache})
    sync()
    return time.perf_counter() - t0, out.logits[0, -1].float().cpu()


NOISE = 0.20       # a spread (max - min) / median above this: the machine was too noisy for a ratio to hold


def _spread(v: list) -> float:
    return (max(v) - min(v)) / statistics.median(v)


def generate_once(model, ids: torch.Tensor, n: int) -> tuple[float, torch.Tensor]:
    """Greedy generation of exactly n tokens after the prompt: (seconds per new token, the generated ids)."""
    sync = torch.cuda.synchronize if ids.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    sync()
    return (time.perf_counter() - t0) / n, out[0, ids.shape[1]:].cpu()


def _scaled_table_values(module, model_dir: Path, cfg: Config) -> None:
    """transformers loads a scaled float8 table by casting its bytes, without its scales: the resident side gets the
    table's values instead (value x scale, gds_gather's dequantization, chunk by chunk), so both sides hold the same
    model."""
    from ..table import open_table
    with open_table(model_dir, config=cfg) as t:
        if t.scales is None:
            return
        w = module.weight
        step = max(1, (64 << 20) // (4 * t.row_elems))
        with torch.no_grad():
            for a in range(0, min(t.n_rows, w.shape[0]), step):
                ids = np.arange(a, min(a + step, w.shape[0]))
                w[a:a + ids.size].copy_(torch.from_numpy(t.gather(ids)))


def run_hf_prefill(model_dir, table=None, cfg: Config | None = None, *, prompt=None, n_tokens: int = 2048,
                   ubatch: int = 512, backend: str | None = None, dtype: str | None = None, repeat: int = 5,
                   generate: int = 0, device: str | None = None, progress: bool = True, log=print) -> dict:
    """The real model's prefill with the PLE table resident vs offloaded (A/B, interleaved, in the same process).

    Loads MODEL_DIR with transformers (local files only), tokenizes the prompt (default: the Python documentation
    topics) with the model's tokenizer when the directory has one, else with gds_gather.prefill.prompts's word-level
    mapping,
    and runs a chunked prefill (ubatch tokens per forward, KV cache) in `repeat` rounds after one warm-up round,
    each round both ways, the order alternating. generate: also greedy-generate that many tokens after a 512-token
    prompt both ways in each round (ms per token). Medians with their spread; a ratio is reported as noise where
    either side's spread exceeds NOISE. table: the table file (default: the checkpoint's own safetensors).
    Returns the figures as a dict.
    """
    from transformers import AutoModelForCausalLM
    from tqdm import tqdm

    cfg = cfg or Config.from_env()
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir}: not a model directory")
    if ubatch <= 0 or repeat <= 0 or generate < 0:
        raise ValueError(f"--ubatch and the repeat count must be > 0 and --generate >= 0, got {ubatch}, {repeat}, "
                         f"{generate}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or "auto", local_files_only=True)
    model = model.to(device).eval()
    module, tcfg = per_layer_embedding(model)
    _scaled_table_values(module, model_dir, cfg)
    tok = hf_tokenizer(model_dir)
    n_vocab = min(int(tcfg.vocab_size), int(tcfg.vocab_size_per_layer_input))
    tokens = prompt_tokens(n_vocab, (), prompt, n_tokens, tokenizer=tok)
    ids = torch.as_tensor(tokens, dtype=torch.int64, device=device)[None]
    params0 = parameter_bytes(model)
    handle = offload_per_layer_embeddings(model, table or model_dir, backend or "auto", allow_quantized=True,
                                          keep_original=True, config=cfg)
    with handle:
        t = handle.table
        if log:
            log(f"model     {model_dir} ({type(model).__name__}, {model.dtype}, {device}), "
                f"parameters {human_bytes(params0)}")
            log(fit(f"table     {t.path} ({t.name}, {t.qtype.name}, {t.n_rows:,} rows x {t.row_bytes:,} B = "
                    f"{human_bytes(t.n_bytes)}); {handle.verified_rows} sampled rows vs the weights: "
                    + ("exact" if handle.exact else
                       f"max |err| {handle.max_abs_error:.3g}, RMS {handle.rms_error:.3g}"), " " * 10))
            log(f"prompt    {ids.shape[1]:,} tokens ({'default text' if prompt is None else prompt}; tokenizer "
                f"{'hf' if tok else 'word-level'}), ubatches of {ubatch}; {repeat} rounds after a warm-up, "
                f"interleaved" + (f"; then {generate} generated tokens each way per round" if generate else ""))
            log(f"backend   {handle.backend}: {handle.why}")
        ways = ("resident", "offloaded")
        times = {w: [] for w in ways}
        ple = {w: [] for w in ways}         # seconds inside the per-layer embedding module
        gen_s = {w: [] for w in ways}
        logits, gen = {}, {}
        gen_ids = ids[:, -512:]
        for r in tqdm(range(repeat + 1), desc="A/B rounds", disable=not progress, leave=False):
            for which in ways if r % 2 == 0 else ways[::-1]:
                handle.use(which)
                before = (handle.row_ids, handle.rows_read)
                with forward_times(model.get_per_layer_input_embeddings(), device=ids.device) as spent:
                    sec, logits[which] = prefill_once(model, ids, ubatch)
                if which == "offloaded":
                    per_run = (handle.row_ids - before[0], handle.rows_read - before[1])
                if generate:
                    g_s, gen[which] = generate_once(model, gen_ids, generate)
                if r:                       # round 0 is the warm-up
                    times[which].append(sec)
                    ple[which].append(sum(spent))
                    if generate:
                        gen_s[which].append(g_s)
        freed = handle.release()
        params1 = parameter_bytes(model)
        med = {k: statistics.median(v) for k, v in times.items()}
        tps = {k: ids.shape[1] / v for k, v in med.items()}
        spread = {k: _spread(v) for k, v in times.items()}
        noisy = max(spread.values()) > NOISE
        diff = (logits["resident"] - logits["offloaded"]).abs()
        lstd = float(logits["resident"].std())
        max_diff = float(diff.max())
        res = {
            "model": str(model_dir), "table": str(t.path), "qtype": t.qtype.name, "device": device,
            "dtype": str(model.dtype).replace("torch.", ""), "tokens": int(ids.shape[1]), "ubatch": ubatch,
            "repeat": repeat, "tok_per_s_resident": tps["resident"], "tok_per_s_offloaded": tps["offloaded"],
            "offloaded_vs_resident": None if noisy else tps["offloaded"] / tps["resident"],
            "offloaded_vs_resident_median": tps["offloaded"] / tps["resident"],
            "spread_resident": spread["resident"], "spread_offloaded": spread["offloaded"], "noisy": noisy,
            "seconds_resident": times["resident"], "seconds_offloaded": times["offloaded"],
            "ple_seconds_resident": statistics.median(ple["resident"]),
            "ple_seconds_offloaded": statistics.median(ple["offloaded"]),
            "logits_equal": bool(torch.equal(logits["resident"], logits["offloaded"])),
            "logits_max_abs_diff": max_diff, "logits_std": lstd,
            "logits_max_abs_diff_vs_std": max_diff / lstd if lstd else float("nan"),
            "bytes_freed": freed, "parameter_bytes_before": params0, "parameter_bytes_after": params1,
            "row_ids_per_run": per_run[0], "rows_read_per_run": per_run[1], **{
                k: v for k, v in handle.stats().items() if k not in ("bytes_freed", "row_ids", "rows_read")},
        }
        if generate:
            gm = {k: statistics.median(v) for k, v in gen_s.items()}
            gspread = {k: _spread(v) for k, v in gen_s.items()}
            gnoisy = max(gspread.values()) > NOISE
            res.update(generate=generate, generate_ms_per_token_resident=gm["resident"] * 1e3,
                       generate_ms_per_token_offloaded=gm["offloaded"] * 1e3,
                       generate_spread_resident=gspread["resident"], generate_spread_offloaded=gspread["offloaded"],
                       generate_noisy=gnoisy,
                       generate_offloaded_vs_resident=None if gnoisy else gm["offloaded"] / gm["resident"],
                       generate_offloaded_vs_resident_median=gm["offloaded"] / gm["resident"],
                       generations_equal=bool(torch.equal(gen["resident"], gen["offloaded"])))
    if log:
        say = log
        log = lambda text: say(fit(text, " " * 10))     # noqa: E731 (every line within 120 columns)

        def line(name, k):
            v = times[k]
            return (f"{name} {tps[k]:,.0f} tok/s (median of {repeat}; {ids.shape[1] / max(v):,.0f}-"
                    f"{ids.shape[1] / min(v):,.0f}, spread {spread[k]:.0%})")
        log(line("resident ", "resident") + "; table in memory")
        log(line("offloaded", "offloaded"))
        if noisy:
            log(f"ratio     none: a spread above {NOISE:.0%} (machine noise); the medians give "
                f"{res['offloaded_vs_resident_median']:.2f}x, which does not hold at that noise: rerun on a quiet "
                f"machine or with more rounds")
        else:
            log(f"ratio     offloaded {res['offloaded_vs_resident']:.2f}x resident (tok/s, medians)")
        log("logits    last token: " + ("equal (torch.equal)" if res["logits_equal"] else
            f"max |diff| {max_diff:.3g} = {res['logits_max_abs_diff_vs_std']:.2%} of the logits' std ({lstd:.3g})"))
        log(f"PLE step  {res['ple_seconds_resident'] * 1e3:,.1f} ms resident, "
            f"{res['ple_seconds_offloaded'] * 1e3:,.1f} "
            f"ms offloaded per prefill (inside the per-layer embedding module; the rest is the trunk)")
        if generate:
            g = {k: [x * 1e3 for x in v] for k, v in gen_s.items()}
            log(f"generate  {generate} tokens after {gen_ids.shape[1]} of the prompt, ms/token: resident "
                f"{res['generate_ms_per_token_resident']:.2f} ({min(g['resident']):.2f}-{max(g['resident']):.2f}), "
                f"offloaded {res['generate_ms_per_token_offloaded']:.2f} ({min(g['offloaded']):.2f}-"
                f"{max(g['offloaded']):.2f}); " + (
                    f"noise (spread above {NOISE:.0%}): no ratio" if res["generate_noisy"] else
                    f"offloaded {res['generate_offloaded_vs_resident']:.3f}x resident")
                + f"; generations {'equal' if res['generations_equal'] else 'differ'}")
        log(f"rows      {res['row_ids_per_run']:,} row ids per prefill, {res['rows_read_per_run']:,} unique rows read "
            f"({human_bytes(res['rows_read_per_run'] * t.row_bytes)})")
        log(f"memory    {freed:,} B freed ({human_bytes(freed)}): parameters {params0:,} -> {params1:,} B")
    return res



def cmd_prefill_hf(args, cfg: Config) -> int:
    n_tokens = 2048 if args.tokens is None else args.tokens
    res = run_hf_prefill(args.hf, args.table, cfg, prompt=args.prompt, n_tokens=n_tokens, ubatch=args.ubatch,
                         backend=args.backend, dtype=args.dtype, generate=args.generate or 0, progress=not args.json,
                         log=(lambda line: print(line, file=sys.stderr)) if args.json else print)
    if args.json:
        print(json.dumps(res))
    return 0
