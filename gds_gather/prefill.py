"""The main job: a prefill's per-layer-embedding fetch, ubatch by ubatch, with the table on disk.

This version runs the CPU pipeline: per ubatch the host computes the PLE row ids (qwen4exp n-gram hashes, or
gemma's token rows), plans the deduplicated reads, reads and dequantizes them exactly.
"""
from __future__ import annotations

import functools
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
        from .tokenizer import tokenizer_name
        self.arch = table.arch
        self.n_rows = table.n_rows
        self.prev = None
        self._meta = table.reader
        # the model's own tokenizer when the first shard carries tokenizer.ggml.tokens, else text.py's word level
        self.tokenizer_name = tokenizer_name(table.reader)    # 'gguf-<tokenizer.ggml.model>' or 'word-level'
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

    @functools.cached_property
    def tokenizer(self):
        """The model's GGUFTokenizer (read on first use), or None for the word-level mapping."""
        from .tokenizer import GGUFTokenizer
        return GGUFTokenizer.from_reader(self._meta)

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        if self.arch == "qwen4exp":
            from .model import next_prev, ple_rows
            rows = ple_rows(tokens, self.hp, prev=self.prev)
            self.prev = next_prev(tokens, self.prev, self.hp.ngram_size)
            return rows
        from .model import gemma_row_ids
        return gemma_row_ids(tokens, self.n_rows)     # one row per token; clear error past the table's end


def run_prefill(model=None, cfg: Config | None = None, *, prompt=None, n_tokens: int | None = 8192,
                ubatch: int = 2048, backend: str | None = None, graph: bool = True, cold: bool = False,
                trunk: str | None = None, dtype: str = "bfloat16", seed: int = 0, progress: bool = True,
                log=print, collect: bool = False, tokens_override=None, cache: int | None = None,
                drop_caches: bool = False) -> dict:
    """Run the prefill: on the GPU (graph-captured fetch-dequant + trunk) where there is one, else on the CPU.

    trunk: 'real' (the preset's shapes; default on a GPU), 'tiny' (default on the CPU, where real shapes would
    take minutes per ubatch) or 'none' (CPU only: the PLE fetch alone). collect=True returns each ubatch's
    per-layer inputs and hidden states under "outputs" (tests); tokens_override replaces the prompt.
    cold: evict the table file's pages from the page cache first (posix_fadvise; nothing else is touched);
    drop_caches: instead empty the WHOLE machine's page cache (root; what `--drop-caches` asks for).
    """
    from . import measure
    from .pipeline import CpuPrefill, GpuPrefill
    from .platform import detect
    cfg = cfg or Config.from_env()
    if cache is not None:
        cfg = cfg.with_(cache_bytes=cache)       # row cache budget in bytes (-1 auto, 0 off)
    if ubatch <= 0:
        raise ValueError(f"--ubatch must be > 0, got {ubatch}")
    path = Path(model) if model else default_model(cfg, progress)
    plat = detect(cfg.platform)
    gpu = plat.kind != "cpu"
    if trunk is None:
        import importlib.util
        trunk = "real" if gpu else ("tiny" if importlib.util.find_spec("torch") else "none")
        if trunk == "none" and log:
            log("note      torch is not installed: the PLE fetch and dequantization only "
                "(pip install 'gds-gather[torch]' adds the synthetic trunk)")
    with open_table(path, config=cfg) as t:
        mapper = RowMapper(t)
        tokens = (np.asarray(tokens_override, np.int64) if tokens_override is not None else
                  prompt_tokens(mapper.n_vocab, mapper.reserved, prompt, n_tokens, tokenizer=mapper.tokenizer))
        cold = cold or drop_caches
        if drop_caches and not measure.drop_caches():
            if log:
                log("note      --drop-caches needs root: evicting the table file only")
            drop_caches = False
        if cold and not drop_caches:
            measure.evict_file(t.path)
        cache0 = measure.resident_bytes(t.path)
        if gpu:
            pipe = GpuPrefill(t, mapper, backend=backend or "auto", ubatch=ubatch, graph=graph, dtype=dtype,
                              seed=seed, trunk=trunk, config=cfg)
        else:
            pipe = CpuPrefill(t, mapper, backend=backend or "auto", ubatch=ubatch, seed=seed, trunk=trunk, config=cfg)
        n_ub = -(-tokens.size // ubatch)
        if log:
            log(f"model     {path} ({t.arch or '?'}, {t.qtype.name} table of {t.n_rows:,} rows x {t.row_bytes} B)")
            log(f"prompt    {tokens.size:,} tokens ({'default text' if prompt is None else prompt}; "
                f"tokenizer {mapper.tokenizer_name}), "
                f"{n_ub} ubatches of {ubatch}"
                f"{(', system page cache dropped' if drop_caches else ', table file evicted') if cold else ''}")
            log(f"platform  {plat.kind}: {plat.reason}")
            log(f"backend   {pipe.backend}: {pipe.why}")
            log("pipeline  " + (f"GPU, {'CUDA graph per (ubatch size, slot)' if pipe.graph else 'eager'} ({pipe.graph_why}), "
                                 f"{pipe.how}, trunk {trunk} ({dtype})" if gpu else
                                 "CPU (no GPU here): read -> gguf dequantize -> " +
                                 (f"torch CPU trunk ({trunk})" if trunk != "none" else "no trunk (the PLE fetch only)")
                                 + ", no graph"))
        if pipe.backend == "resident" and not gpu:     # resident = in memory before the clock: load it untimed
            t.read_plan(t.plan(np.zeros(1, np.int64)), "resident")
        try:
            bar = tqdm(total=int(tokens.size), unit="tok", disable=not progress, leave=False)
            io = measure.ReadCounter(t.path)          # bytes the storage delivered during the run
            res = pipe.run(tokens, progress=bar.update, collect=collect)
            got = io.stop()
            bar.close()
        finally:
            pipe.close()
        growth = measure.resident_bytes(t.path) - cache0
        useful = res["useful_bytes"]
        res.update(bytes_delivered=got["delivered_bytes"], bytes_device=got["device_bytes"],
                   delivered_method=got["delivered_method"], device_method=got["device_method"],
                   ampl_requested=res["bytes_read"] / useful if useful else None,
                   ampl_delivered=got["delivered_bytes"] / useful if useful and got["delivered_bytes"] is not None
                   else None)
        res.update(model=str(path), arch=t.arch, qtype=t.qtype.name, cold=cold, trunk=trunk,
                   tokenizer=mapper.tokenizer_name,
                   platform=plat.kind, page_cache_growth_bytes=growth)
        res.update(t.stats())       # rows from the row cache / page cache / device, hit rate, cache size
        if res.get("cache_where") == "gpu":     # the GPU prefill's device-resident cache (devcache.py)
            res["cache_bytes"] += res["device_cache_bytes"]
    if log:
        share = res.get("ple_wait_share")
        log(f"result    {res['tokens']:,} tokens in {res['seconds']:.3f} s = {res['tok_per_s']:,.0f} tok/s; "
            f"{res['ple_rows']:,} PLE rows at {res['rows_per_s']:,.0f} rows/s "
            f"({res['unique_rows']:,} unique after per-ubatch dedup, {res['unique_rows'] / max(res['ple_rows'], 1):.1%})")
        dl, dv, amp = res["bytes_delivered"], res["bytes_device"], res["ampl_delivered"]
        log(f"bytes     {res['bytes_read']:,} requested for {res['useful_bytes']:,} useful "
            f"({res['read_amplification']:.1f}x); delivered {'n/a' if dl is None else f'{dl:,}'} "
            f"(read amplification {'n/a' if amp is None else f'{amp:.1f}x'}; {res['delivered_method'] or 'no counter'})"
            f"; device {'n/a' if dv is None else f'{dv:,}'} ({res['device_method'] or 'no block device'}); "
            f"page cache +{growth / 2**20:.1f} MiB")
        log(f"cache     unique rows: {res['rows_from_cache']:,} from the row cache (hit rate "
            f"{res['cache_hit_rate']:.1%}), {res['rows_from_page_cache']:,} from the page cache, "
            f"{res['rows_from_device']:,} from the device; row cache {res['cache_bytes'] / 2**20:.1f} of "
            f"{res['cache_budget_bytes'] / 2**20:.1f} MiB"
            + (" (rows in GPU memory, index on the host)" if res.get("cache_where") == "gpu" else ""))
        log(f"time      reads {res['io_seconds']:.3f} s, row ids + plans {res['index_seconds']:.3f} s"
            + (f"; PLE step (wait + copy + dequant) {share:.1%} of wall time" if share is not None else ""))
    return res
