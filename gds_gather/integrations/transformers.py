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

This module loads and swaps; the module and its handle are disk_embedding's, the checks of a table against the
model table_check's.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..config import Config
from ..errors import ModelMismatchError
from ..table import Table, open_table
from .disk_embedding import DiskEmbedding, OffloadHandle, per_layer_embedding
from .table_check import EXACT_TYPES, check_fit, error_bound, verify_sample

__all__ = ["EXACT_TYPES", "DiskEmbedding", "OffloadHandle", "checkpoint_path", "error_bound", "from_pretrained",
           "offload_per_layer_embeddings", "parameter_bytes", "per_layer_embedding"]

log = logging.getLogger(__name__)


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
        check_fit(table, module, cfg, weight_dtype, allow_quantized)
        verified, max_err, rms = (0, float("nan"), float("nan")) if weight.device.type == "meta" else verify_sample(
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


# ---- loading a model without its table: gds_gather.integrations.transformers.from_pretrained -------------------------

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
        raise ModelMismatchError("the per-layer embedding was not loaded "
                                 "(gds_gather.integrations.transformers.from_pretrained did not finish)")


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
        check_fit(t, stand_in, cfg, weight_dtype, allow_quantized)
        same = ckpt is not None and Path(t.path).resolve() == _table_file(ckpt).resolve()
        if same or ckpt is None or verify_rows <= 0:
            verified, max_err, rms = 0, (0.0 if same else float("nan")), (0.0 if same else float("nan"))
            if not same:
                log.warning("%s: table not checked against the checkpoint (%s)", t.path,
                            "no checkpoint" if ckpt is None else "verify_rows=0")
        else:
            with open_table(ckpt, config=gg_config) as own:
                verified, max_err, rms = verify_sample(t, lambda ids: torch.from_numpy(own.gather(ids)),
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

