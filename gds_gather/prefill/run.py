"""The main job: a prefill's per-layer-embedding fetch, ubatch by ubatch, with the table on disk.

Per ubatch the host computes the PLE row ids (qwen4exp n-gram hashes, or one row per token: family.py), plans the
deduplicated reads and reads them; pipeline.GpuPrefill dequantizes them on the GPU inside a graph where there is
one, pipeline.CpuPrefill exactly with gguf's dequantizer on the host otherwise.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
from tqdm import tqdm

from ..cache import rowcache
from ..backends import BY_CONFIG, BY_NAME
from ..config import Config
from ..errors import GatherError
from .family import family_of
from ..table import open_table
from .prompts import prompt_tokens

logger = logging.getLogger(__name__)

MAX_UBATCH = 1 << 16      # tokens per ubatch: staging for 65,536 tokens of gemma rows is already ~480 MB
DEFAULT_PRESET = "qwen4exp"
DEFAULT_ROWS = 2_000_000     # 180 MB of IQ4_NL rows: small enough to build in seconds, big enough to be sparse


def backend_reason(requested: str | None, why: str) -> str:
    """Why a prefill runs its backend, from the backend it was given (PrefillOptions.backend: --backend) and the
    pipeline's why: "requested with --backend", "set by Config.backend ..." or "auto, " and auto's reason."""
    if requested not in (None, "auto"):
        return "requested with --backend" + why.removeprefix(BY_NAME)
    return why if why.startswith(BY_CONFIG) else f"auto, {why}"


def default_model(cfg: Config, progress: bool = True) -> Path:
    """The built-in default model, built once into the cache directory."""
    from ..model.synth import write_model
    path = Path(cfg.cache_dir) / f"default-{DEFAULT_PRESET}-{DEFAULT_ROWS}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_model(path, DEFAULT_PRESET, rows=DEFAULT_ROWS, progress=progress)
    return path


class RowMapper:
    """Token ids -> PLE row ids for one table, carrying qwen4exp's n-gram history across ubatches, and the prompt's
    tokenizer. What differs between model families (row ids, per-layer layout, kernel layout, trunk) is its
    `family` (family.py); the family's geometry is copied here for the pipelines and benches."""

    def __init__(self, table):
        from .tokenizer import tokenizer_name
        self.family = f = family_of(table)
        self.arch, self.n_rows = table.arch, table.n_rows
        self.n_vocab, self.reserved, self.rows_per_token = f.n_vocab, f.reserved, f.rows_per_token
        self.n_layer, self.per_layer, self.row_scale = f.n_layer, f.per_layer, f.row_scale
        self.prev = None
        self._meta = table.reader
        # the model's own tokenizer when the first shard carries tokenizer.ggml.tokens, else text.py's word level
        self.tokenizer_name = tokenizer_name(table.reader)    # 'gguf-<tokenizer.ggml.model>' or 'word-level'

    @functools.cached_property
    def tokenizer(self):
        """The model's GGUFTokenizer (read on first use), or None for the word-level mapping."""
        from .tokenizer import GGUFTokenizer
        return GGUFTokenizer.from_reader(self._meta)

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        rows, self.prev = self.family.row_ids(tokens, self.prev)
        return rows


def default_trunk(gpu: bool) -> str:
    """The trunk `prefill` and `bench prefill` run when none is asked for: the preset's real shapes on a GPU
    (where a prefill's PLE step hides behind a trunk that size), none on the CPU, where the PLE step is the
    measurement and any synthetic trunk would set the tok/s instead of it."""
    return "real" if gpu else "none"


@dataclass(frozen=True, eq=False)
class PrefillOptions:
    """What one prefill runs: the CLI's `prefill` options, `bench prefill`'s per-run choices, a test's knobs.

    prompt: a text file (None: the default text); n_tokens: how many of its tokens (None: all); ubatch: tokens per
    ubatch; backend: None = auto; graph: CUDA graphs on a GPU; trunk: 'real' (the preset's shapes), 'tiny' or
    'none' (CPU only: the PLE step alone), None = default_trunk; cold: evict the table file's pages from the page
    cache first (posix_fadvise; nothing else is touched); drop_caches: instead empty the WHOLE machine's page cache
    (root); cache: the row cache budget in bytes (-1 auto, 0 off; None: Config's); log: where the human lines go
    (None: nowhere); collect: return each ubatch's per-layer inputs and hidden states under "outputs" (tests);
    tokens_override: these token ids instead of the prompt's.
    """
    prompt: str | Path | None = None
    n_tokens: int | None = 8192
    ubatch: int = 2048
    backend: str | None = None
    graph: bool = True
    cold: bool = False
    drop_caches: bool = False
    trunk: str | None = None
    dtype: str = "bfloat16"
    seed: int = 0
    cache: int | None = None
    progress: bool = True
    log: Callable[[str], None] | None = print
    collect: bool = False
    tokens_override: Any = None

    def __post_init__(self) -> None:
        if self.ubatch <= 0:
            raise ValueError(f"--ubatch must be > 0, got {self.ubatch}")

    def with_(self, **changes) -> "PrefillOptions":
        return replace(self, **changes)


def run_prefill(model=None, cfg: Config | None = None, options: PrefillOptions | None = None, **changes) -> dict:
    """Run the prefill: on the GPU (graph-captured fetch-dequant + trunk) where there is one, else on the CPU.

    options (default PrefillOptions()), with any of its fields given as keywords on top (`ubatch=64`)."""
    o = (options or PrefillOptions()).with_(**changes)
    log, ubatch = o.log, o.ubatch
    from ..io import measure
    from ..units import fit
    from .pipeline import CpuPrefill, GpuPrefill, trunk_label
    from ..platform import detect
    cfg = cfg or Config.from_env()
    if o.cache is not None:
        cfg = cfg.with_(cache_bytes=o.cache)     # row cache budget in bytes (-1 auto, 0 off)
    if o.cold or o.drop_caches:
        cfg = cfg.with_(hot_rows=0)              # cold: no rows from an earlier process either (hotrows.py)
    path = Path(model) if model else default_model(cfg, o.progress)
    plat = detect(cfg.platform)
    gpu = plat.kind != "cpu"
    trunk = o.trunk or default_trunk(gpu)
    if trunk != "none" and not gpu:
        import importlib.util
        if importlib.util.find_spec("torch") is None:
            raise GatherError(f"--trunk {trunk} needs torch (pip install 'gds-gather[torch]'); --trunk none runs "
                              "the PLE step alone")
    with open_table(path, config=cfg) as t:
        mapper = RowMapper(t)
        tokens = (np.asarray(o.tokens_override, np.int64) if o.tokens_override is not None else
                  prompt_tokens(mapper.n_vocab, mapper.reserved, o.prompt, o.n_tokens, tokenizer=mapper.tokenizer))
        cold, drop_caches = o.cold or o.drop_caches, o.drop_caches
        if drop_caches and not measure.drop_caches():
            if log:
                log("note      --drop-caches needs root: evicting the table file only")
            drop_caches = False
        if cold and not drop_caches:
            left = measure.evict_file(t.path)
            if left and log:        # pages a live mapping holds (this Table's metadata) stay cached
                log(f"note      not fully cold: {left:,} B of the table file stay in the page cache (mapped pages)"
                    + ("; that is the whole table: this run is warm" if left >= t.data_offset + t.n_bytes else ""))
        cache0 = measure.resident_bytes(t.path)
        if gpu:
            pipe = GpuPrefill(t, mapper, backend=o.backend or "auto", ubatch=ubatch, graph=o.graph, dtype=o.dtype,
                              seed=o.seed, trunk=trunk, config=cfg)
        else:
            pipe = CpuPrefill(t, mapper, backend=o.backend or "auto", ubatch=ubatch, seed=o.seed, trunk=trunk,
                              config=cfg)
        n_ub = -(-tokens.size // ubatch)
        reason = backend_reason(o.backend, pipe.why)
        logger.info("backend %s: %s", pipe.backend, reason)
        if log:
            log(f"model     {path}")
            log(f"table     {t.arch or '?'}, {t.qtype.name}, {t.n_rows:,} rows x {t.row_bytes} B = "
                f"{t.n_bytes / 2**20:,.1f} MiB{mapper.family.layout_note()}")
            log(f"prompt    {tokens.size:,} tokens ({'default text' if o.prompt is None else o.prompt}; "
                f"tokenizer {mapper.tokenizer_name}), {n_ub} ubatch{'es' if n_ub != 1 else ''} of up to {ubatch}"
                f"{(', page cache dropped' if drop_caches else ', table file evicted') if cold else ''}")
            log(f"platform  {plat.kind}: {plat.reason}")
            log(f"backend   {pipe.backend}: {reason}")
            log("pipeline  " + (f"GPU, {'CUDA graph per (ubatch size, slot)' if pipe.graph else 'eager'} "
                                f"({pipe.graph_why}), {pipe.how}, {o.dtype}" if gpu else
                                "CPU (no GPU here): read -> gguf dequantize -> per-layer inputs, no graph"))
            log(fit(f"trunk     {trunk_label(pipe.trunk, trunk)}", " " * 10))
        if pipe.backend == "resident" and not gpu:     # resident = in memory before the clock: load it untimed
            t.read_plan(t.plan(np.zeros(1, np.int64)), "resident")
        st0 = t.stats()     # the run's own counts: without the untimed load above
        try:
            bar = tqdm(total=int(tokens.size), unit="tok", disable=not o.progress, leave=False)
            io = measure.ReadCounter(t.path)          # bytes the storage delivered during the run
            res = pipe.run(tokens, progress=bar.update, collect=o.collect)
            got = io.stop()
            bar.close()
        finally:
            pipe.close()
        growth = measure.resident_bytes(t.path) - cache0
        st = t.stats()              # rows from the row cache / page cache / device, hit rate, cache size
        res.update({k: st[k] - st0[k] if k in rowcache.IO_COUNTERS else st[k] for k in st})
        if res.get("cache_where") == "gpu":     # the GPU prefill's device-resident cache (devcache.py)
            res["cache_bytes"] += res["device_cache_bytes"]
        # rows the file supplied: the unique rows of each ubatch less the row cache's hits, plus the rows read
        # ahead for a next ubatch (each a device row, then a hit: Table.stats), so that the device's part of them
        # is never more than the whole; direct says which of them the page cache held and which the device read
        rb, dl = t.row_bytes, got["delivered_bytes"]
        ahead = res.get("rows_prefetched") or 0
        from_file = max(res["unique_rows"] - res["rows_from_cache"], 0) + ahead
        known = res["rows_buffered"] == 0
        storage_rows = 0 if pipe.backend == "resident" else res["rows_from_device"] if known else from_file
        basis = (dl if dl is not None else res["bytes_read"])
        res.update(bytes_needed=from_file * rb, bytes_read_ahead=ahead * rb, bytes_from_device_rows=storage_rows * rb,
                   sources_known=known, bytes_requested=res["bytes_read"], bytes_delivered=dl,
                   bytes_device=got["device_bytes"], delivered_method=got["delivered_method"],
                   device_method=got["device_method"],
                   read_amplification=basis / (storage_rows * rb) if storage_rows else None,
                   amplification_of=("delivered" if dl is not None else "requested") + " / the rows' bytes read "
                   + ("from the device" if known else "from the file"))
        res.update(model=str(path), arch=t.arch, qtype=t.qtype.name, table_bytes=t.n_bytes, cold=cold,
                   trunk_kind=trunk, tokenizer=mapper.tokenizer_name, platform=plat.kind,
                   page_cache_growth_bytes=growth)
    if log:
        for line in summary_lines(res):
            log(fit(line, " " * 10))
    return res


def summary_lines(res: dict) -> list[str]:
    """The result as lines of at most 120 columns, one figure per line (the README quotes them)."""
    from ..io.measure import counter_name
    from ..units import human_bytes
    wall, ple, trunk = res["seconds"], res["ple_seconds"], res["trunk_seconds"]
    none = res["trunk_kind"] == "none"
    split = ("" if ple is None else f": PLE step {ple:.3f} s ({res['ple_share']:.0%}), " +
             ("no trunk" if none else f"trunk {trunk:.3f} s ({res['trunk_share']:.0%})"))
    tok = (f"{res['tok_per_s']:,.0f} tok/s of the PLE step alone (no trunk)" if none else
           f"{res['tok_per_s']:,.0f} tok/s with a synthetic trunk (no model's speed)")
    lines = [f"result    {res['tokens']:,} tokens in {wall:.3f} s{split}",
             f"speed     {res['ple_rows_per_s'] or 0:,.0f} PLE rows/s (over the PLE step's time); {tok}",
             f"rows      {res['ple_rows']:,} PLE rows, {res['unique_rows']:,} unique after per-ubatch dedup "
             f"({res['unique_rows'] / max(res['ple_rows'], 1):.1%})"]
    pf = res.get("rows_prefetched") or 0
    ahead = f"; {pf:,} of them read ahead from the device" if pf else ""
    incl = f" (the {pf:,} read ahead included)" if pf else ""
    src = f"sources   {res['rows_from_cache']:,} from the row cache (hit rate {res['cache_hit_rate']:.1%}{ahead}), "
    lines.append(src + (f"{res['rows_buffered']:,} from the table in memory (resident)"
                        if res["backend"] == "resident" else
                        f"{res['rows_from_page_cache']:,} from the page cache, {res['rows_from_device']:,} from "
                        f"the device{incl}" if res["sources_known"] else
                        f"{res['rows_buffered']:,} from the file (page cache or device: this backend cannot tell)"))
    needed, req, dl, dv = res["bytes_needed"], res["bytes_requested"], res["bytes_delivered"], res["bytes_device"]
    amp = res["read_amplification"]
    ahead_b = res.get("bytes_read_ahead") or 0
    lines.append(f"needed    {needed:,} B of rows from the file"
                 + (f" ({ahead_b:,} B of them read ahead)" if ahead_b else "")
                 + f", {res['bytes_from_device_rows']:,} B of them "
                 + ("from the device" if res["sources_known"] else "from the page cache or the device"))
    lines.append(f"requested {req:,} B asked of the file (aligned windows, or exact rows for buffered reads)")
    lines.append(f"delivered {'n/a' if dl is None else f'{dl:,} B'} by storage "
                 f"({counter_name(res['delivered_method'], 'no counter')}, this process)")
    lines.append("amplif.   " + (f"{amp:.1f}x = {res['amplification_of']}" if amp is not None else
                                 "n/a: no rows were read from the device"))
    lines.append(f"device    {'n/a' if dv is None else f'{dv:,} B'} read by "
                 f"{counter_name(res['device_method'], 'no counter')} (the whole device, every process)")
    table = res["table_bytes"]
    if req > table:
        lines.append(f"note      requested exceeds the {human_bytes(table)} table: each ubatch asks for its own rows "
                     "or blocks, and one")
        lines.append("          that several ubatches need is read by each of them (the row cache keeps rows, "
                     "within its budget)")
    growth = res["page_cache_growth_bytes"]
    if res["backend"] == "resident":
        lines.append("note      resident: the table was read into memory before the clock (the page cache growth "
                     "is that load)")
    elif dl is not None and dl > req + max(req // 20, 1 << 20):
        lines.append(f"note      delivered includes {dl - req:,} B beyond the requests: " +
                     ("the kernel's readahead around buffered reads of the table (its page cache grew by "
                      f"{growth / 2**20:,.1f} MiB)" if growth > (dl - req) // 2 else
                      "other files this process read (imports, the prompt)"))
    where = " in GPU memory" if res.get("cache_where") == "gpu" else ""
    lines.append(f"cache     row cache {human_bytes(res['cache_bytes'])} of {human_bytes(res['cache_budget_bytes'])}"
                 f"{where}; the table's page cache {res['page_cache_growth_bytes'] / 2**20:+.1f} MiB")
    if res.get("cache_budget_reason"):
        lines.append(f"          budget {res['cache_budget_reason']}")
    hot = res.get("hot_rows_file")
    changed = ("changed, written back at close" if res.get("hot_rows_changed") else
               "unchanged, nothing to write at close")
    lines.append("hot rows  " + (f"{res['hot_rows_loaded']:,} read at start; {changed}" if hot
                                 else "off (--cold, GDS_GATHER_HOT_ROWS=0 or no row cache)"))
    if hot:
        lines.append(f"          {hot}")
    lines.append(f"host      reads {res['io_seconds']:.3f} s, row ids + plans {res['index_seconds']:.3f} s "
                 "(the next ubatch's, during this one's)")
    return lines
