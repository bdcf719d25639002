"""Hugging Face transformers models (Gemma 4, Gemma 3n) with the per-layer embedding table on disk.

transformers keeps the PLE table as ``embed_tokens_per_layer``: a scaled ``nn.Embedding`` of
``[vocab_size_per_layer_input, num_hidden_layers * hidden_size_per_layer_input]`` whose forward is
``embedding(ids) * embed_scale.to(weight.dtype)``. ``DiskEmbedding`` has the same forward, its rows gathered from
a table file with gds_gather. Two ways in:

    model = from_pretrained("google/gemma-3n-E2B-it", dtype=torch.bfloat16)   # the table never loaded
    out = model.generate(**inputs)
    print(model.gds_gather.stats())

    model = AutoModelForCausalLM.from_pretrained(path)                         # a model already loaded:
    with offload_per_layer_embeddings(model, path) as h:                       # swap the module, free the weight
        out = model.generate(**inputs)

Token ids on the CPU take the host path (planned, deduplicated reads, exact CPU dequantization; a decode step's
few ids skip the planner on row-cache hits); CUDA ids the GPU path (rows read into GPU memory, dequantized by the
CUDA kernel). The output is in the weight dtype on the ids' device and equals (torch.equal) transformers' own
module's whenever the table's type gives the weight dtype's rows exactly (EXACT_TYPES: the same type, a widening,
or F32 cast as transformers casts it). Another table is checked against the model's own rows: exactly for those
types, within error_bound for a lossy one (which needs allow_quantized=True), else ModelMismatchError.

Not supported: saving the offloaded model (its state dict lacks the table), autograd through the table,
torch.compile / CUDA graph capture of the forward (the plan is made on the host, which synchronizes).
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ..io.measure import fit
from ..backends import resolve
from ..config import Config
from ..errors import BadIdsError, ModelMismatchError, TableClosedError
from ..formats import quants
from ..formats.quants import Q
from ..table import Table, open_table

log = logging.getLogger(__name__)

# table types whose rows become the weight dtype exactly: every widening (BF16/F16 -> float32), and F32 -> any
# (transformers' own load-time cast, round to nearest)
EXACT_TYPES = {torch.float32: (Q.F32, Q.F16, Q.BF16), torch.float16: (Q.F16, Q.F32), torch.bfloat16: (Q.BF16, Q.F32)}


SMALL_BATCH = 64       # ids per call served by Table.read_unique (no plan on row-cache hits): decode steps
FLOAT_TORCH = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def per_layer_embedding(model, stand_in=None):
    """(the per-layer embedding module, text config) of a transformers model; ModelMismatchError without one (or,
    with stand_in, when the module is not of that type)."""
    get = getattr(model, "get_per_layer_input_embeddings", None)
    module = None
    if callable(get):
        try:
            module = get()
        except (AttributeError, NotImplementedError):
            module = None
    name = type(model).__name__
    if module is None:
        raise ModelMismatchError(f"{name} has no per-layer embeddings (embed_tokens_per_layer): only Gemma 4 "
                                 f"E2B/E4B and Gemma 3n models carry a PLE table")
    if stand_in is not None and not isinstance(module, stand_in):
        raise ModelMismatchError(f"{name}'s per-layer embedding is a {type(module).__name__}, not {stand_in.__name__}")
    if isinstance(module, DiskEmbedding):
        raise ModelMismatchError(f"{name}'s per-layer embeddings are already on disk ({module.table.path})")
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return module, cfg


class DiskEmbedding(torch.nn.Module):
    """A drop-in for transformers' scaled per-layer embedding: rows from a gds_gather Table, same forward.

    forward(ids) = rows(ids) in the weight dtype * embed_scale.to(weight dtype), on the ids' device.
    """

    def __init__(self, table: Table, num_embeddings: int, embedding_dim: int, weight_dtype: torch.dtype,
                 embed_scale: torch.Tensor, padding_idx=None, backend: str = "auto"):
        super().__init__()
        self.table = table
        self.num_embeddings = int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        self.weight_dtype = weight_dtype
        self.padding_idx = padding_idx
        self.backend = backend
        self.register_buffer("embed_scale", embed_scale.detach().clone(), persistent=False)
        self.row_ids = 0          # ids looked up (cumulative)
        self.rows_read = 0        # unique rows read after per-call deduplication (cumulative)
        self.device_backend = None    # (backend, mode, why) after the first CUDA call

    def extra_repr(self) -> str:
        t = self.table
        return (f"{self.num_embeddings}, {self.embedding_dim}, table={str(t.path)!r} ({t.qtype.name}), "
                f"dtype={self.weight_dtype}, backend={self.backend}")

    def _check(self, ids_np: np.ndarray) -> None:
        if ids_np.size and self.table.n_rows != self.num_embeddings:   # a padded table: refuse ids past the vocab
            lo, hi = int(ids_np.min()), int(ids_np.max())
            if lo < 0 or hi >= self.num_embeddings:
                bad = lo if lo < 0 else hi
                raise BadIdsError(f"token id {bad} out of range [0, {self.num_embeddings})")

    def rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The unscaled rows in the weight dtype, shape ids.shape + (embedding_dim,), on the ids' device."""
        if self.table.closed:
            raise TableClosedError(f"the per-layer embedding table {self.table.path} was closed (handle.close(), or "
                                   f"the end of a `with` block): this model cannot compute its per-layer inputs any "
                                   f"more; load it again (gds_gather.integrations.transformers.from_pretrained) or keep the handle open")
        ids_np = input_ids.detach().cpu().numpy()       # CUDA ids: one small copy down (the plan is made on the host)
        self._check(ids_np)
        if input_ids.device.type == "cuda":
            return self._rows_cuda(input_ids, ids_np)
        flat = ids_np.reshape(-1)
        if flat.shape[0] <= SMALL_BATCH:        # a decode step: no plan where the row cache holds the rows
            unique, inverse = (flat, None) if flat.shape[0] == 1 else np.unique(flat, return_inverse=True)
            if unique.shape[0] and not 0 <= int(unique[0]) <= int(unique[-1]) < self.num_embeddings:
                bad = int(unique[0]) if unique[0] < 0 else int(unique[-1])
                raise BadIdsError(f"token id {bad} out of range [0, {self.num_embeddings})")
            raw = self.table.read_unique(unique, self.backend)
        else:
            plan = self.table.plan(ids_np)
            unique, inverse = plan.unique_rows, plan.inverse
            raw = self.table.read_plan(plan, self.backend)
        self.row_ids += flat.shape[0]
        self.rows_read += unique.shape[0]
        rows = self._as_torch(raw)
        if inverse is not None:
            rows = rows.index_select(0, torch.from_numpy(inverse.reshape(-1)))
        return rows.reshape(tuple(input_ids.shape) + (self.embedding_dim,))

    def _as_torch(self, raw: np.ndarray) -> torch.Tensor:
        """Raw rows -> torch rows in the weight dtype: a float table's bytes are viewed as its torch dtype and cast
        (exactly gguf's dequantization, without its per-call overhead); a quantized one is dequantized."""
        t = self.table
        as_dtype = FLOAT_TORCH.get(t.qtype)
        if as_dtype is not None:
            rows = torch.from_numpy(np.ascontiguousarray(raw)).view(as_dtype).reshape(raw.shape[0], -1)
        else:
            rows = torch.from_numpy(quants.dequantize_rows(raw, t.qtype, t.row_elems))
        return rows.to(self.weight_dtype)

    def _rows_cuda(self, input_ids: torch.Tensor, ids_np: np.ndarray) -> torch.Tensor:
        """Table.gather's GPU flavour: rows read into GPU memory, dequantized by the CUDA kernel on the current
        stream straight into the weight dtype."""
        t = self.table
        if self.device_backend is None:
            self.device_backend = t.device_choice(self.backend)   # what Table.fetch_device will use
        self.row_ids += ids_np.size
        self.rows_read += np.unique(ids_np).size
        with torch.cuda.device(input_ids.device):
            return t.gather(input_ids, self.backend, dtype=self.weight_dtype,
                            stream=torch.cuda.current_stream(input_ids.device), host_ids=ids_np)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.rows(input_ids) * self.embed_scale.to(self.weight_dtype)


class OffloadHandle:
    """What offload_per_layer_embeddings did: bytes_freed, rows_read, row_ids, backend, why, the table.

    close() closes the table (the model can no longer compute its per-layer inputs). With keep_original=True the
    original module is kept: use("resident" | "offloaded") swaps between the two (for A/B timing) and release()
    frees it.
    """

    def __init__(self, model, module: DiskEmbedding, original, setter, weight_bytes: int, verified: int,
                 max_abs_error: float, rms_error: float):
        self.model = model
        self.module = module
        self.table = module.table
        self._setter = setter
        self._original = original
        self.weight_bytes = weight_bytes
        self.bytes_freed = 0
        self.verified_rows = verified
        self.max_abs_error = max_abs_error
        self.rms_error = rms_error
        self.backend, self.why = resolve(module.backend, self.table.config)

    @property
    def rows_read(self) -> int:
        return self.module.rows_read

    @property
    def row_ids(self) -> int:
        return self.module.row_ids

    @property
    def bytes_read(self) -> int:
        return self.module.rows_read * self.table.row_bytes

    @property
    def exact(self) -> bool:
        return self.max_abs_error == 0.0

    def use(self, which: str) -> None:
        if which not in ("resident", "offloaded"):
            raise ValueError(f"use('resident') or use('offloaded'), got {which!r}")
        if which == "resident" and self._original is None:
            raise ValueError("the original per-layer embedding was released")
        self._setter(self._original if which == "resident" else self.module)

    def release(self) -> int:
        """Put the disk-backed module in place and free the original weight; returns the bytes freed."""
        self._setter(self.module)
        if self._original is not None:
            self.bytes_freed = _free_weight(self.model, self._original)
            self._original = None
        return self.bytes_freed

    def stats(self) -> dict:
        d = self.device_backend
        return {"table": str(self.table.path), "tensor": self.table.name, "qtype": self.table.qtype.name,
                "row_bytes": self.table.row_bytes, "bytes_freed": self.bytes_freed, "row_ids": self.row_ids,
                "rows_read": self.rows_read, "bytes_read": self.bytes_read, "backend": self.backend, "why": self.why,
                "device_backend": None if d is None else f"{d[0]}@{d[1]}", "device_why": None if d is None else d[2],
                "verified_rows": self.verified_rows, "max_abs_error": self.max_abs_error, "rms_error": self.rms_error}

    @property
    def device_backend(self):
        return self.module.device_backend

    def close(self) -> None:
        self.table.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return (f"OffloadHandle({str(self.table.path)!r}, {self.table.qtype.name}, freed={self.bytes_freed}, "
                f"rows_read={self.rows_read}, backend={self.backend})")


def _free_weight(model, module) -> int:
    """Drop the module's weight storage unless another parameter of the model shares it; returns bytes freed."""
    w = module.weight
    if w.device.type == "meta":
        return 0
    n = w.numel() * w.element_size()
    ptr = w.untyped_storage().data_ptr()
    if any(p.device == w.device and p.untyped_storage().data_ptr() == ptr for p in model.parameters()):
        log.warning("per-layer embedding weight is shared with another parameter: not freed")
        return 0
    w.data = torch.empty(0, dtype=w.dtype, device=w.device)
    return n


def _check_fit(table: Table, module, cfg, weight_dtype, allow_quantized: bool) -> None:
    n_layer, per_layer = int(cfg.num_hidden_layers), int(cfg.hidden_size_per_layer_input)
    vocab = int(getattr(cfg, "vocab_size_per_layer_input", module.num_embeddings))
    width = n_layer * per_layer
    if module.num_embeddings != vocab or module.embedding_dim != width:
        raise ModelMismatchError(f"the model's per-layer embedding is [{module.num_embeddings}, "
                                 f"{module.embedding_dim}], its config says [{vocab}, {n_layer} x {per_layer}]")
    if table.row_elems != width:
        raise ModelMismatchError(f"{table.path}: rows of {table.row_elems} elements, but the model needs "
                                 f"num_hidden_layers x hidden_size_per_layer_input = {n_layer} x {per_layer} = {width}")
    padded = table.n_rows > vocab and table.arch == "gemma3n"   # llama.cpp pads Gemma 3n's table to 262,400 rows
    if table.n_rows != vocab and not padded:
        raise ModelMismatchError(f"{table.path}: {table.n_rows:,} rows, but the model's vocab_size_per_layer_input "
                                 f"is {vocab:,}: a table of another model")
    if table.qtype not in EXACT_TYPES.get(weight_dtype, ()) and not allow_quantized:
        raise ModelMismatchError(f"{table.path}: a {table.qtype.name} table cannot give the model's {weight_dtype} "
                                 f"rows exactly; pass allow_quantized=True to accept its error (or convert the "
                                 f"checkpoint without --qtype)")


# A lossy table's error bound, per element, from its type: (levels, factor): error <= factor x the quantization step,
# step = the block's max |value| / levels (the block of the type's geometry, of the model's own rows). Q8_0: d =
# amax / 127, q = round(x / d), stored d rounded to f16, so |x - q d16| <= d / 2 + 127 |d - d16| <= 0.57 d; Q4_0 and
# Q5_0 clip the top level (up to one step); Q4_1 / Q5_1: d = range / (2^b - 1) <= 2 amax / (2^b - 1), half a step
# plus the f16 min. Types gguf cannot write (K-quants, IQ*, FP4) get a whole coarse step: generous, still far below
# another model's rows (errors of the rows' own size).
LOSSY_BOUNDS = {Q.Q8_0: (127, 0.6), Q.Q4_0: (8, 1.05), Q.Q5_0: (16, 1.05), Q.Q4_1: (7.5, 0.6), Q.Q5_1: (15.5, 0.6),
                Q.Q6_K: (31, 1.0), Q.Q5_K: (15.5, 1.0), Q.Q4_K: (7.5, 1.0), Q.Q3_K: (4, 1.0), Q.Q2_K: (1.5, 1.0),
                Q.IQ4_NL: (8, 1.0), Q.IQ4_XS: (8, 1.0), Q.IQ3_XXS: (4, 1.0), Q.IQ3_S: (4, 1.0), Q.IQ2_XXS: (2, 1.0),
                Q.IQ2_XS: (2, 1.0), Q.IQ2_S: (2, 1.0), Q.IQ1_S: (1, 1.0), Q.IQ1_M: (1, 1.0), Q.TQ1_0: (1, 0.6),
                Q.TQ2_0: (1, 0.6), Q.MXFP4: (3, 1.0), Q.NVFP4: (3, 1.0)}
FLOAT_BOUNDS = {Q.F32: 0.0, Q.F16: 2.0 ** -10, Q.BF16: 2.0 ** -8}    # relative (about one ulp of the narrower type)


def error_bound(qtype, want: torch.Tensor) -> torch.Tensor:
    """The most each element of a `qtype` table may differ from the model's own float rows `want` [n, width]."""
    want = want.double()
    if qtype in FLOAT_BOUNDS:
        return want.abs() * FLOAT_BOUNDS[qtype] + (2.0 ** -24 if qtype == Q.F16 else 0.0)   # (f16 subnormals)
    levels, factor = LOSSY_BOUNDS.get(qtype, (1, 1.0))
    block = quants.block_geometry(qtype)[0]
    amax = want.reshape(want.shape[0], -1, block).abs().amax(dim=2, keepdim=True)
    # + an f16 scale's rounding where it is subnormal (absolute, up to 2^-25 times up to `levels` quanta)
    bound = factor * amax / levels + levels * 2.0 ** -24
    return bound.expand(-1, -1, block).reshape(want.shape)


def _verify(table: Table, own_rows, vocab: int, weight_dtype, n: int) -> tuple[int, float, float]:
    """Compare n sampled rows (first, last, random) of the table with the model's own rows (own_rows(ids) -> float
    rows: the resident weight, or the checkpoint's table): (rows, max |err|, RMS err). An exact type must give the
    weight dtype's rows exactly, a lossy one stay within error_bound; otherwise it is another model's table:
    ModelMismatchError, whatever allow_quantized says."""
    if n <= 0:
        return 0, float("nan"), float("nan")
    ids = np.unique(np.concatenate([[0, vocab - 1], np.random.default_rng(0).integers(0, vocab, max(n - 2, 0))]))
    got = torch.from_numpy(table.gather(ids))
    want = own_rows(ids).cpu()
    diff = (got.double() - want.double()).abs()
    max_err = float(diff.max()) if diff.numel() else 0.0
    rms = float(diff.pow(2).mean().sqrt()) if diff.numel() else 0.0
    if table.qtype in EXACT_TYPES.get(weight_dtype, ()):
        ok = torch.equal(got.to(weight_dtype), want.to(weight_dtype))
        what = f"{table.qtype.name} rows must equal the model's {weight_dtype} rows"
    else:
        bound = error_bound(table.qtype, want)
        ok = bool((diff <= bound).all())
        what = f"more than the {table.qtype.name} error bound (max {float(bound.max()):.3g} on these rows)"
    if not ok:
        bad = int(ids[int(diff.amax(dim=1).argmax())])
        raise ModelMismatchError(f"{table.path}: sampled rows differ from the model's own ({what}; row {bad}: "
                                 f"max |diff| {max_err:.3g}): a table of another model")
    return len(ids), max_err, rms


def offload_per_layer_embeddings(model, source=None, backend: str = "auto", *, tensor: str | None = None,
                                 allow_quantized: bool = False, verify_rows: int = 64, keep_original: bool = False,
                                 config: Config | None = None) -> OffloadHandle:
    """Swap the model's per-layer embedding for a disk-backed one and free the table's memory.

    source: a GGUF file (e.g. from ``gds-gather convert``), a Hugging Face model directory, a
        model.safetensors(.index.json) file, or an open Table; None uses the directory the model was loaded from.
    backend: the gds_gather backend ("auto": direct reads; see gds_gather.backends()).
    tensor: the table's name in the file (default: found by name: per_layer_token_embd.weight in a GGUF,
        *embed_tokens_per_layer.weight in safetensors).
    allow_quantized: accept a table that cannot reproduce the weights exactly (quantized, or a narrower float).
    verify_rows: rows compared against the resident weight before it is freed (0: none): an exact type must match
        exactly, a lossy one stay within its type's error bound (error_bound; handle.max_abs_error records the
        error); otherwise ModelMismatchError, whatever allow_quantized says.
    keep_original: keep the original module (handle.use() swaps, handle.release() frees it later).

    Raises ModelMismatchError for a model without per-layer embeddings or a table whose rows, width or dtype do
    not fit; the open_table errors for a bad file.
    """
    module, cfg = per_layer_embedding(model)
    weight = module.weight
    weight_dtype = weight.dtype
    if source is None:
        source = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
        if not source or not Path(source).exists():
            raise ModelMismatchError("no table source given and the model was not loaded from a local directory "
                                     f"({source!r}): pass source=")
    table = source if isinstance(source, Table) else (
        open_table(source, tensor, config=config) if tensor else open_table(source, config=config))
    try:
        _check_fit(table, module, cfg, weight_dtype, allow_quantized)
        verified, max_err, rms = (0, float("nan"), float("nan")) if weight.device.type == "meta" else _verify(
            table, lambda ids: weight.detach()[torch.from_numpy(ids).to(weight.device)], module.num_embeddings,
            weight_dtype, verify_rows)
        scale = getattr(module, "embed_scale", None)
        if not isinstance(scale, torch.Tensor):
            scale = torch.tensor(float(getattr(module, "scalar_embed_scale", 1.0)), device=weight.device)
        disk = DiskEmbedding(table, module.num_embeddings, module.embedding_dim, weight_dtype, scale,
                             getattr(module, "padding_idx", None), backend)
        setter = model.set_per_layer_input_embeddings
        handle = OffloadHandle(model, disk, module, setter, weight.numel() * weight.element_size(), verified,
                               max_err, rms)
    except BaseException:
        if not isinstance(source, Table):
            table.close()
        raise
    if keep_original:
        setter(disk)
    else:
        handle.release()
    log.info("per-layer embedding of %s on disk: %s (%s), %d bytes freed, backend %s (%s)", type(model).__name__,
             table.path, table.qtype.name, handle.bytes_freed, handle.backend, handle.why)
    return handle


# ---- loading a model without its table: gds_gather.integrations.transformers.from_pretrained -------------------------------------------

PLE_KEY_PATTERN = r"embed_tokens_per_layer\.weight$"     # the checkpoint key left unread (text and multimodal)


class _NotLoaded(torch.nn.Module):
    """Stands where the per-layer embedding is while transformers loads the rest: no parameter, so the checkpoint's
    table is an unexpected key that transformers never reads (nor allocates on any device)."""

    def __init__(self, module):
        super().__init__()
        self.num_embeddings, self.embedding_dim = int(module.num_embeddings), int(module.embedding_dim)
        self.padding_idx = getattr(module, "padding_idx", None)
        self.scalar_embed_scale = float(getattr(module, "scalar_embed_scale", 1.0))

    def forward(self, input_ids):
        raise ModelMismatchError("the per-layer embedding was not loaded (gds_gather.integrations.transformers.from_pretrained did not finish)")


def _without_table(cls):
    """A subclass of the model class whose instances swap their per-layer embedding for _NotLoaded right after
    construction (on the meta device, inside transformers' from_pretrained), before any weight is loaded."""
    def __init__(self, config, *args, **kwargs):
        cls.__init__(self, config, *args, **kwargs)
        module, _ = per_layer_embedding(self)
        self.set_per_layer_input_embeddings(_NotLoaded(module))
        self._keys_to_ignore_on_load_unexpected = set(self._keys_to_ignore_on_load_unexpected or ()) | {
            PLE_KEY_PATTERN}
    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


def _model_class(model_class, name_or_path, kwargs):
    """The concrete transformers class: model_class itself, or what an Auto class (default AutoModelForCausalLM)
    maps the checkpoint's config to. The config is loaded once and passed on to from_pretrained."""
    import transformers
    auto = model_class or transformers.AutoModelForCausalLM
    public = {transformers.AutoModelForCausalLM: "MODEL_FOR_CAUSAL_LM_MAPPING", transformers.AutoModel: "MODEL_MAPPING",
              transformers.AutoModelForImageTextToText: "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING"}
    mapping = getattr(transformers, public[auto]) if auto in public else None     # the Auto classes' mappings
    if mapping is None and not auto.__module__.startswith("transformers.models.auto."):
        return auto                 # a concrete class
    config = kwargs.get("config")
    if config is None or isinstance(config, (str, Path)):
        hub = {k: kwargs[k] for k in ("cache_dir", "force_download", "local_files_only", "token", "revision",
                                      "subfolder", "proxies", "trust_remote_code") if k in kwargs}
        config = transformers.AutoConfig.from_pretrained(config or name_or_path, **hub)
        kwargs["config"] = config
    try:
        if mapping is not None:
            return mapping[type(config)]
        import torch
        with torch.device("meta"):  # another Auto class: built without memory, for its class (no public mapping)
            return type(auto.from_config(config))
    except (KeyError, ValueError):
        raise ModelMismatchError(f"{name_or_path}: {auto.__name__} has no model class for "
                                 f"{type(config).__name__}; pass model_class=") from None


def checkpoint_path(name_or_path, cache_dir=None, revision=None, subfolder: str = "") -> Path | None:
    """The local safetensors checkpoint (index or single file) of a model directory or a hub id (resolved in the
    local Hugging Face cache only: after transformers loaded the model, its files are there); None without one."""
    from ..formats.safetensors_file import INDEX, SINGLE
    p = Path(name_or_path) / subfolder
    if p.is_dir():
        return next((p / f for f in (INDEX, SINGLE) if (p / f).is_file()), None)
    from huggingface_hub import try_to_load_from_cache
    for f in (INDEX, SINGLE):
        got = try_to_load_from_cache(str(name_or_path), f"{subfolder}/{f}" if subfolder else f,
                                     cache_dir=cache_dir, revision=revision)
        if isinstance(got, str):
            return Path(got)
    return None


def from_pretrained(name_or_path, *, table=None, backend: str = "auto", model_class=None,
                    allow_quantized: bool = False, verify_rows: int = 64, gg_config: Config | None = None,
                    **kwargs):
    """A transformers model loaded without its per-layer embedding table, which is gathered from disk instead.

    The table is never allocated nor read whole, on any device: the model is built with a parameterless stand-in
    for ``embed_tokens_per_layer`` (its checkpoint key stays unread), then gets a DiskEmbedding on `table`.

    name_or_path: a model directory or a hub id (transformers resolves it: from the Hugging Face cache, and
        downloads only where transformers itself would).
    table: a GGUF (e.g. from ``gds-gather convert``), a safetensors checkpoint or an open Table; default the
        checkpoint itself. Another file is checked against `verify_rows` sampled rows of the checkpoint.
    model_class: the transformers class or Auto class (default AutoModelForCausalLM; e.g.
        Gemma4ForConditionalGeneration for the multimodal model).
    allow_quantized: accept a quantized or narrower table (its rows are still checked against the checkpoint's
        within the type's own error bound: another model's table is refused).
    gg_config: gds_gather's Config for the table (default Config.from_env()).
    kwargs: passed to transformers' from_pretrained (config, dtype, device_map, attn_implementation, cache_dir, ...).

    Returns the model; ``model.gds_gather`` is its OffloadHandle (stats, close). The table closes with the model;
    after handle.close() the model's forward raises TableClosedError.
    """
    if isinstance(kwargs.get("config"), Config):
        raise TypeError("from_pretrained(config=...) is transformers' model config; pass gds_gather's Config as "
                        "gg_config=")
    cls = _model_class(model_class, name_or_path, kwargs)
    kwargs.setdefault("dtype", "auto")
    model = _without_table(cls).from_pretrained(name_or_path, **kwargs)
    model.__class__ = cls           # (the subclass only changed __init__: the user gets the plain class)
    stand_in, cfg = per_layer_embedding(model, _NotLoaded)
    ckpt = checkpoint_path(name_or_path, kwargs.get("cache_dir"), kwargs.get("revision"), kwargs.get("subfolder", ""))
    source = table if table is not None else ckpt
    if source is None:
        raise ModelMismatchError(f"{name_or_path}: no safetensors checkpoint found to read the table from: pass table=")
    weight_dtype = model.get_input_embeddings().weight.dtype     # what transformers gave the other weights
    device = model.get_input_embeddings().weight.device
    t = source if isinstance(source, Table) else open_table(source, config=gg_config)
    try:
        _check_fit(t, stand_in, cfg, weight_dtype, allow_quantized)
        same = ckpt is not None and Path(t.path).resolve() == _table_file(ckpt).resolve()
        if same or ckpt is None or verify_rows <= 0:
            verified, max_err, rms = 0, (0.0 if same else float("nan")), (0.0 if same else float("nan"))
            if not same:
                log.warning("%s: table not checked against the checkpoint (%s)", t.path,
                            "no checkpoint" if ckpt is None else "verify_rows=0")
        else:
            with open_table(ckpt, config=gg_config) as own:
                verified, max_err, rms = _verify(t, lambda ids: torch.from_numpy(own.gather(ids)),
                                                 stand_in.num_embeddings, weight_dtype, verify_rows)
        scale = torch.tensor(stand_in.scalar_embed_scale, device=device)
        disk = DiskEmbedding(t, stand_in.num_embeddings, stand_in.embedding_dim, weight_dtype, scale,
                             stand_in.padding_idx, backend)
    except BaseException:
        if not isinstance(source, Table):
            t.close()
        raise
    model.set_per_layer_input_embeddings(disk)
    model.gds_gather = OffloadHandle(model, disk, None, model.set_per_layer_input_embeddings,
                                     t.n_rows * t.row_elems * torch.empty(0, dtype=weight_dtype).element_size(),
                                     verified, max_err, rms)
    log.info("%s loaded without its per-layer embedding: rows from %s (%s), backend %s (%s)", type(model).__name__,
             t.path, t.qtype.name, model.gds_gather.backend, model.gds_gather.why)
    return model


def _table_file(ckpt: Path) -> Path:
    """The file holding the checkpoint's per-layer embedding (the shard, for an index)."""
    from ..formats.safetensors_file import find_table_tensor
    return Path(find_table_tensor(ckpt)[0].path)


def parameter_bytes(model) -> int:
    """Bytes of the model's parameters (each shared tensor once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


# ---- the prefill A/B: `gds-gather prefill --hf MODEL_DIR [--table FILE]` ------------------------------------------

class _HFTokenizer:
    """An HF tokenizer with the encode(text) -> int64 array interface gds_gather.prefill.prompts.prompt_tokens uses."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok(text)["input_ids"], np.int64)


def _tokenizer(model_dir: Path):
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer
    return _HFTokenizer(AutoTokenizer.from_pretrained(model_dir))


@contextlib.contextmanager
def timed_forward(module, device):
    """Accumulate the wall time spent in `module`'s forward into the yielded one-element list."""
    spent = [0.0]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def pre(*_):
        sync()
        spent.append(time.perf_counter())

    def post(*_):
        sync()
        spent[0] += time.perf_counter() - spent.pop()
    handles = [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        yield spent
    finally:
        for h in handles:
            h.remove()


def _prefill_once(model, ids: torch.Tensor, ubatch: int) -> tuple[float, torch.Tensor]:
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


def _generate_once(model, ids: torch.Tensor, n: int) -> tuple[float, torch.Tensor]:
    """Greedy generation of exactly n tokens after the prompt: (seconds per new token, the generated ids)."""
    sync = torch.cuda.synchronize if ids.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    sync()
    return (time.perf_counter() - t0) / n, out[0, ids.shape[1]:].cpu()


def run_hf_prefill(model_dir, table=None, cfg: Config | None = None, *, prompt=None, n_tokens: int = 2048,
                   ubatch: int = 512, backend: str | None = None, dtype: str | None = None, repeat: int = 5,
                   generate: int = 0, device: str | None = None, progress: bool = True, log=print) -> dict:
    """The real model's prefill with the PLE table resident vs offloaded (A/B, interleaved, in the same process).

    Loads MODEL_DIR with transformers (local files only), tokenizes the prompt (default: the Python documentation
    topics) with the model's tokenizer when the directory has one, else with gds_gather.prefill.prompts's word-level mapping,
    and runs a chunked prefill (ubatch tokens per forward, KV cache) in `repeat` rounds after one warm-up round,
    each round both ways, the order alternating. generate: also greedy-generate that many tokens after a 512-token
    prompt both ways in each round (ms per token). Medians with their spread; a ratio is reported as noise where
    either side's spread exceeds NOISE. table: the table file (default: the checkpoint's own safetensors).
    Returns the figures as a dict.
    """
    from transformers import AutoModelForCausalLM
    from tqdm import tqdm

    from ..prefill.prompts import prompt_tokens
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
    _, tcfg = per_layer_embedding(model)
    tok = _tokenizer(model_dir)
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
                f"parameters {_size(params0)}")
            log(fit(f"table     {t.path} ({t.name}, {t.qtype.name}, {t.n_rows:,} rows x {t.row_bytes:,} B = "
                    f"{_size(t.n_bytes)}); {handle.verified_rows} sampled rows vs the weights: "
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
                with timed_forward(model.get_per_layer_input_embeddings(), ids.device) as spent:
                    sec, logits[which] = _prefill_once(model, ids, ubatch)
                if which == "offloaded":
                    per_run = (handle.row_ids - before[0], handle.rows_read - before[1])
                if generate:
                    g_s, gen[which] = _generate_once(model, gen_ids, generate)
                if r:                       # round 0 is the warm-up
                    times[which].append(sec)
                    ple[which].append(spent[0])
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
        log(f"PLE step  {res['ple_seconds_resident'] * 1e3:,.1f} ms resident, {res['ple_seconds_offloaded'] * 1e3:,.1f} "
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
            f"({_size(res['rows_read_per_run'] * t.row_bytes)})")
        log(f"memory    {freed:,} B freed ({_size(freed)}): parameters {params0:,} -> {params1:,} B")
    return res


def _size(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 1024:,.1f} KiB"


def cmd_prefill_hf(args, cfg: Config) -> int:
    import json
    n_tokens = 2048 if args.tokens is None else args.tokens
    res = run_hf_prefill(args.hf, args.table, cfg, prompt=args.prompt, n_tokens=n_tokens, ubatch=args.ubatch,
                         backend=args.backend, dtype=args.dtype, generate=args.generate or 0, progress=not args.json,
                         log=(lambda line: print(line, file=sys.stderr)) if args.json else print)
    if args.json:
        print(json.dumps(res))
    return 0
