"""The main job: a prefill's per-layer-embedding fetch, ubatch by ubatch, with the table on disk.

This version runs the CPU pipeline: per ubatch the host computes the PLE row ids (qwen4exp n-gram hashes, or
gemma's token rows), plans the deduplicated reads, reads and dequantizes them exactly.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .config import Config
from .table import open_table
from .text import prompt_tokens

DEFAULT_PRESET = "qwen4exp"
DEFAULT_ROWS = 2_000_000     # 180 MB of IQ4_NL rows: small enough to build in seconds, big enough to be sparse


def default_model(cfg: Config, progress: bool = True) -> Path:
    """The built-in default model, built once into the cache directory."""
    from .model import write_model
    path = Path(cfg.cache_dir) / f"default-{DEFAULT_PRESET}-{DEFAULT_ROWS}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_model(path, DEFAULT_PRESET, rows=DEFAULT_ROWS, progress=progress)
    return path


class RowMapper:
    """Token ids -> PLE row ids for one model, carrying qwen4exp's n-gram history across ubatches."""

    def __init__(self, table):
        self.arch = table.arch
        self.prev = None
        if self.arch == "qwen4exp":
            from .model import PRESETS, Qwen4expHParams
            self.hp = Qwen4expHParams.from_reader(table.reader)
            n_tok = table.field("tokenizer.ggml.tokens")
            self.n_vocab = len(n_tok) if n_tok else PRESETS["qwen4exp"].n_vocab
            self.reserved = tuple(x for x in (self.hp.eos_token_id, self.hp.image_token_id) if x is not None)
            self.rows_per_token = self.hp.n_heads
        else:   # gemma4, gemma3n and any token-indexed table: one row per token
            self.n_vocab = table.n_rows
            self.reserved = ()
            self.rows_per_token = 1

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        if self.arch == "qwen4exp":
            from .model import next_prev, ple_rows
            rows = ple_rows(tokens, self.hp, prev=self.prev)
            self.prev = next_prev(tokens, self.prev, self.hp.ngram_size)
            return rows
        return tokens


def run_prefill(model=None, cfg: Config | None = None, *, prompt=None, n_tokens: int | None = 8192,
                ubatch: int = 2048, backend: str | None = None, progress: bool = True, log=print) -> dict:
    """Gather the PLE rows of a prompt, ubatch by ubatch, and return the measured figures."""
    cfg = cfg or Config.from_env()
    if ubatch <= 0:
        raise ValueError(f"--ubatch must be > 0, got {ubatch}")
    path = Path(model) if model else default_model(cfg, progress)
    from .backends import resolve
    backend_name, why = resolve(backend or "auto", cfg)
    with open_table(path, config=cfg) as t:
        mapper = RowMapper(t)
        tokens = prompt_tokens(mapper.n_vocab, mapper.reserved, prompt, n_tokens)
        n_ub = -(-tokens.size // ubatch)
        if log:
            log(f"model     {path} ({t.arch or '?'}, {t.qtype.name} table of {t.n_rows:,} rows x {t.row_bytes} B)")
            log(f"prompt    {tokens.size:,} tokens ({'default text' if prompt is None else prompt}), "
                f"{n_ub} ubatches of {ubatch}")
            log(f"backend   {backend_name}: {why}")
            log("pipeline  CPU (no GPU path in this version): plan -> read -> dequantize on the host, no CUDA graph")
        ids_total = unique_total = window_bytes = 0
        t_index = t_gather = 0.0
        out_elems = 0
        t0 = time.perf_counter()
        bar = tqdm(total=int(tokens.size), unit="tok", disable=not progress, leave=False)
        for k in range(n_ub):
            tok = tokens[k * ubatch:(k + 1) * ubatch]
            a = time.perf_counter()
            rows = mapper(tok)
            b = time.perf_counter()
            plan = t.plan(rows)
            x = t.gather_plan(plan, backend_name)
            c = time.perf_counter()
            t_index += b - a
            t_gather += c - b
            ids_total += plan.n_ids
            unique_total += plan.n_unique
            window_bytes += plan.window_bytes
            out_elems += x.size
            bar.update(tok.size)
        bar.close()
        wall = time.perf_counter() - t0
        res = {
            "model": str(path), "arch": t.arch, "qtype": t.qtype.name, "backend": backend_name,
            "backend_reason": why, "pipeline": "cpu", "graph": False,
            "tokens": int(tokens.size), "ubatch": ubatch, "ubatches": n_ub,
            "ple_rows": ids_total, "unique_rows": unique_total,
            "useful_bytes": unique_total * t.row_bytes, "window_bytes": window_bytes,
            "read_amplification_odirect": (window_bytes / (unique_total * t.row_bytes)) if unique_total else 0.0,
            "seconds": wall, "index_seconds": t_index, "gather_seconds": t_gather,
            "tok_per_s": tokens.size / wall if wall else 0.0,
            "rows_per_s": ids_total / t_gather if t_gather else 0.0,
            "unique_rows_per_s": unique_total / t_gather if t_gather else 0.0,
            "output_elements": out_elems,
        }
    if log:
        log(f"result    {res['tokens']:,} tokens in {wall:.3f} s = {res['tok_per_s']:,.0f} tok/s; "
            f"{ids_total:,} PLE rows ({unique_total:,} unique after per-ubatch dedup, "
            f"{unique_total / max(ids_total, 1):.1%}) at {res['rows_per_s']:,.0f} rows/s")
        log(f"bytes     {res['useful_bytes']:,} useful; an O_DIRECT reader would read {window_bytes:,} "
            f"({res['read_amplification_odirect']:.1f}x); row-index time {t_index:.3f} s, gather {t_gather:.3f} s")
    return res
