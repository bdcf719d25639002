"""Hugging Face checkpoints as row tables: a strict, bounds-checked safetensors header reader (metadata only).

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``), then the data; a tensor's
bytes are ``[8 + N + begin, 8 + N + end)``, row-major. A sharded checkpoint adds ``model.safetensors.index.json``
(``{"weight_map": {name: shard file}}``). Only the header of the shard holding the table is parsed.

The per-layer embedding of Gemma 4 / Gemma 3n is ``model.embed_tokens_per_layer.weight``
(``model.language_model.embed_tokens_per_layer.weight`` in multimodal checkpoints), ``[vocab, n_layer * P]``.
Its BF16, F16 and F32 rows map to the GGML types of the same name, F8_E4M3 and F8_E5M2 rows to quants.RowType's
float8 types, so the same planner, readers and CPU/GPU dequantizers serve it; a float8 table's scales are found
beside it (scales.py). Bad files raise the same errors as bad GGUF files: NotSafetensorsError (a NotGGUFError),
HeaderError, TruncatedFileError, TableNotFoundError, UnsupportedTypeError.
"""
from __future__ import annotations

import functools
import json
import math
import struct
from pathlib import Path

from gguf import GGUF_MAGIC

from ..errors import HeaderError, NotSafetensorsError, TableNotFoundError, TruncatedFileError, UnsupportedTypeError
from .gguf_file import TensorInfo
from .quants import RowType

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_HEADER = 100_000_000          # the safetensors library's own limit on the JSON header
PLE_NAMES = ("model.embed_tokens_per_layer.weight", "model.language_model.embed_tokens_per_layer.weight")
PLE_SUFFIX = "embed_tokens_per_layer.weight"
ENGRAM_SUFFIX = "engram.embed.weight"       # DeepSeek-V4.1: one float8 n-gram table per Engram layer
GGUF_DEFAULT_NAME = "per_layer_token_embd.weight"    # what open_table asks for by default
GGUF_KEYS = "gds_gather_gguf_metadata"      # config.json: GGUF keys a synthetic checkpoint carries (model/checkpoint)

# safetensors dtype -> bytes per element (the format's full list); the row types map to GGML types
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
            "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}
ROW_TYPES = {"BF16": RowType.BF16, "F16": RowType.F16, "F32": RowType.F32, "F8_E4M3": RowType.F8_E4M3,
             "F8_E5M2": RowType.F8_E5M2}
SCALE_TYPES = {"F32": RowType.F32, "BF16": RowType.BF16, "F8_E8M0": RowType.F8_E8M0, "F8_E4M3": RowType.F8_E4M3}
NVFP4_BLOCK = 16            # ModelOpt NVFP4: one F8_E4M3 scale per 16 packed E2M1 elements


def is_safetensors_source(path) -> bool:
    """True for a model directory with safetensors weights, an index .json, or a file that is not GGUF but
    looks like safetensors (a .safetensors name, or 8 bytes then '{')."""
    p = Path(path)
    if p.is_dir():
        return True
    if p.suffix == ".json" or p.suffix == ".safetensors":
        return True
    if not p.is_file():         # a FIFO's open would wait for a writer; a device is no model either
        return False
    try:
        with open(p, "rb") as f:
            head = f.read(9)
    except OSError:
        return False
    if len(head) >= 4 and int.from_bytes(head[:4], "little") == GGUF_MAGIC:
        return False
    return len(head) == 9 and head[8:9] == b"{"


def _no_duplicates(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise HeaderError(f"duplicate key {k!r}")
        d[k] = v
    return d


def read_header(path) -> tuple[dict, int, dict]:
    """(tensor entries, absolute offset of the data section, __metadata__) of a safetensors file, every entry checked:
    known dtype, non-negative integer shape, byte range inside the file and of the shape's size, no overlaps.

    Parsed once per file version (the path, and the dev, inode, size and mtime the row cache identifies files by):
    opening a table looks up its scales in the same header. The dicts are shared between callers: read them, never
    change them."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if not path.is_file():
        raise NotSafetensorsError(f"{path}: not a regular file")
    st = path.stat()
    return _parsed_header(path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _parsed_header(path: Path, dev: int, ino: int, size: int, mtime_ns: int) -> tuple[dict, int, dict]:
    """read_header's parse of one file version of `size` bytes (dev, ino and mtime_ns only key the cache)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise TruncatedFileError(f"{path}: {size} bytes, too short for a safetensors header length")
        n = struct.unpack("<Q", head)[0]
        if n > MAX_HEADER:
            raise HeaderError(f"{path}: safetensors header length {n} is absurd (limit {MAX_HEADER})")
        if 8 + n > size:
            raise TruncatedFileError(f"{path}: header of {n} bytes runs past the end of the file ({size} bytes)")
        raw = f.read(n)
    if not raw.lstrip().startswith(b"{"):
        raise NotSafetensorsError(f"{path}: not a safetensors file (no JSON header after the length)")
    try:
        hdr = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:   # RecursionError: absurd nesting
        if isinstance(e, HeaderError):
            raise HeaderError(f"{path}: {e}") from None
        raise NotSafetensorsError(f"{path}: not a safetensors file (bad JSON header: {e})") from None
    if not isinstance(hdr, dict):
        raise NotSafetensorsError(f"{path}: not a safetensors file (header is not a JSON object)")
    base = 8 + n
    entries = {}
    spans = []
    meta = hdr.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise HeaderError(f"{path}: __metadata__ is not an object")
    for name, e in hdr.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(e, dict) or set(e) - {"dtype", "shape", "data_offsets"} or len(e) != 3:
            raise HeaderError(f"{where}: entry must hold exactly dtype, shape and data_offsets, got {e!r:.200}")
        dtype, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if dtype not in ITEMSIZE:
            raise HeaderError(f"{where}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise HeaderError(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if (not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs)
                or not 0 <= offs[0] <= offs[1]):
            raise HeaderError(f"{where}: data_offsets {offs!r} is not [begin, end] with 0 <= begin <= end")
        want = math.prod(shape) * ITEMSIZE[dtype]
        if offs[1] - offs[0] != want:
            raise HeaderError(f"{where}: data_offsets {offs} hold {offs[1] - offs[0]} bytes, but a {dtype} tensor "
                              f"of shape {shape} is {want} bytes")
        if base + offs[1] > size:
            raise TruncatedFileError(f"{where}: data [{base + offs[0]}, {base + offs[1]}) runs past the end of "
                                     f"the file ({size} bytes)")
        entries[name] = e
        if want:
            spans.append((offs[0], offs[1], name))
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise HeaderError(f"{path}: tensors {n0!r} [{b0}, {e0}) and {n1!r} [{b1}, {e1}) overlap")
    return entries, base, meta


def _index_shards(index: Path) -> dict[str, Path]:
    """weight name -> shard path from a model.safetensors.index.json (shard names must be plain file names)."""
    try:
        doc = json.loads(index.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:   # RecursionError: absurd nesting
        raise NotSafetensorsError(f"{index}: not a safetensors index (bad JSON: {e})") from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise HeaderError(f"{index}: no weight_map of tensor name -> shard file")
    out = {}
    for k, v in wm.items():
        if not v or Path(v).name != v or v in (".", ".."):
            raise HeaderError(f"{index}: shard {v!r} of {k!r} is not a file name beside the index")
        out[k] = index.parent / v
    return out


def _pick(names, tensor: str, where: str) -> str:
    names = list(names)
    if tensor != GGUF_DEFAULT_NAME or tensor in names:
        if tensor in names:
            return tensor
        raise TableNotFoundError(f"no tensor {tensor!r} in {where}; it has: {_hint(names)}")
    for n in PLE_NAMES:
        if n in names:
            return n
    found = [n for n in names if n.endswith(PLE_SUFFIX)] or [n for n in names if n.endswith(ENGRAM_SUFFIX)]
    if len(found) == 1:
        return found[0]
    if found:
        kind = "per-layer embeddings" if found[0].endswith(PLE_SUFFIX) else "Engram tables"
        raise TableNotFoundError(f"{where} holds several {kind} ({', '.join(found)}); pick one with tensor=")
    raise TableNotFoundError(f"no per-layer embedding ({' or '.join(PLE_NAMES)}) in {where}: the model has none; "
                             f"it has: {_hint(names)}")


def _hint(names) -> str:
    names = sorted(names)
    return (", ".join(names[:8]) + (" ..." if len(names) > 8 else "")) or "no tensors"


def checkpoint_files(path) -> tuple[Path, Path | None]:
    """(the directory holding config.json, the index file or None) for a model dir, an index or a single file."""
    p = Path(path)
    if p.is_dir():
        if (p / INDEX).is_file():
            return p, p / INDEX
        if (p / SINGLE).is_file():
            return p, None
        raise FileNotFoundError(f"{p}: no {SINGLE} or {INDEX} in this directory")
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file")
    return p.parent, (p if p.suffix == ".json" else None)


class HFMeta:
    """The GGUF-style metadata a Table needs, from config.json beside the checkpoint (GGUFReader.get_field API).

    general.architecture ('gemma4', 'gemma3n', or config's model_type), {arch}.block_count,
    {arch}.embedding_length_per_layer_input, {arch}.vocab_size_per_layer_input; safetensors.<key> for the
    file's __metadata__; the GGUF keys of config.json's GGUF_KEYS object (a synthetic checkpoint's qwen4exp hash
    constants). Every other key is absent (so no GGUF tokenizer: prompts use the word-level mapping).
    """

    class _Field:
        def __init__(self, value):
            self.value = value

        def contents(self):
            return self.value

    def __init__(self, config_dir: Path, st_meta: dict | None = None):
        self.config = load_text_config(config_dir)
        arch = hf_arch(self.config)
        self.fields = {}
        if arch:
            self.fields["general.architecture"] = arch
            for key, cfg in (("block_count", "num_hidden_layers"),
                             ("embedding_length_per_layer_input", "hidden_size_per_layer_input"),
                             ("vocab_size_per_layer_input", "vocab_size_per_layer_input")):
                if isinstance(self.config.get(cfg), int):
                    self.fields[f"{arch}.{key}"] = self.config[cfg]
        for k, v in (st_meta or {}).items():
            self.fields[f"safetensors.{k}"] = v
        extra = self.config.get(GGUF_KEYS)
        for k, v in (extra.items() if isinstance(extra, dict) else ()):
            self.fields.setdefault(k, v)

    def get_field(self, key: str):
        return self._Field(self.fields[key]) if key in self.fields else None


def load_text_config(config_dir) -> dict:
    """The text part of config.json in `config_dir` ({} when there is none)."""
    f = Path(config_dir) / "config.json"
    if not f.is_file():
        return {}
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:   # RecursionError: absurd nesting
        raise HeaderError(f"{f}: bad JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise HeaderError(f"{f}: not a JSON object")
    text = cfg.get("text_config")
    out = dict(text) if isinstance(text, dict) else dict(cfg)
    out.setdefault("model_type", cfg.get("model_type", ""))
    return out


def hf_arch(text_config: dict) -> str:
    """'gemma3n' / 'gemma4' (llama.cpp's arch names) from a model_type such as 'gemma4_text'; else the type."""
    mt = str(text_config.get("model_type") or "")
    for arch in ("gemma3n", "gemma4"):
        if mt.startswith(arch):
            return arch
    return mt.removesuffix("_text")


def _shard_of(path, tensor: str) -> tuple[Path, str, dict, int, dict, Path]:
    """(shard file, tensor name, the shard's header entries, its data base, its __metadata__, config dir) of the
    table `tensor` (GGUF_DEFAULT_NAME: the per-layer embedding, found by its published names)."""
    config_dir, index = checkpoint_files(path)
    if index is not None:
        shards = _index_shards(index)
        name = _pick(shards, tensor, str(index))
        shard = shards[name]
        if not shard.is_file():
            raise FileNotFoundError(f"{index}: shard {shard.name} (holding {name!r}) is missing")
    else:
        shard = config_dir / SINGLE if Path(path).is_dir() else Path(path)
        name = None
    entries, base, st_meta = read_header(shard)
    if name is None:
        name = _pick(entries, tensor, str(shard))
    elif name not in entries:
        raise TableNotFoundError(f"{shard}: the index puts {name!r} here, but the file has no such tensor")
    return shard, name, entries, base, st_meta, config_dir


def tensor_entry(path, name: str) -> tuple[Path, dict, int] | None:
    """(shard, header entry, data base) of the tensor called exactly `name` in a checkpoint, or None: a scale's
    lookup beside its table (scales.py)."""
    config_dir, index = checkpoint_files(path)
    if index is not None:
        shard = _index_shards(index).get(name)
        if shard is None:
            return None
    else:
        shard = config_dir / SINGLE if Path(path).is_dir() else Path(path)
    entries, base, _ = read_header(shard)
    return (shard, entries[name], base) if name in entries else None


def _packed_fp4(path, name: str, e: dict) -> bool:
    """True for ModelOpt's NVFP4 layout: a U8 [rows, n / 2] tensor of packed E2M1 with F8_E4M3 scales
    `<name>_scale` [rows, n / 16] beside it."""
    if e["dtype"] != "U8" or len(e["shape"]) != 2:
        return False
    s = tensor_entry(path, name + "_scale")
    return (s is not None and s[1]["dtype"] == "F8_E4M3"
            and s[1]["shape"] == [e["shape"][0], -(-2 * e["shape"][1] // NVFP4_BLOCK)])


def find_table_tensor(path, tensor: str = GGUF_DEFAULT_NAME) -> tuple[TensorInfo, dict, HFMeta]:
    """(tensor info in GGML order, the shard's header entries, metadata) for a safetensors checkpoint: a model
    directory, a model.safetensors.index.json, or one .safetensors file. Reads headers only."""
    shard, name, entries, base, st_meta, config_dir = _shard_of(path, tensor)
    e = entries[name]
    shape = tuple(reversed(e["shape"]))       # GGML order: ne0 = the contiguous row width
    if _packed_fp4(path, name, e):
        rtype, shape = RowType.F4_E2M1, (2 * shape[0], *shape[1:])
    elif e["dtype"] in ROW_TYPES:
        rtype = ROW_TYPES[e["dtype"]]
    else:
        raise UnsupportedTypeError(f"{shard}: tensor {name!r} is {e['dtype']}; safetensors tables must be "
                                   f"{', '.join(ROW_TYPES)} (or NVFP4: U8 with F8_E4M3 scales)")
    b, end = e["data_offsets"]
    info = TensorInfo(path=shard, name=name, type_id=int(rtype), shape=shape,
                      data_offset=base + b, n_bytes=end - b, container="safetensors")
    return info, entries, HFMeta(config_dir, st_meta)
