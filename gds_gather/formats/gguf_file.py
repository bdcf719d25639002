"""Open GGUF files (metadata only) with the strict parser in gguf_parse; find split shards."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import NotGGUFError, TableNotFoundError
from .gguf_parse import GGUFHeader

SPLIT_RE = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def read_gguf(path, table: str | None = None) -> GGUFHeader:
    """Parse a GGUF file's header, metadata and tensor infos (no tensor data is read).

    Malformed input of any kind raises NotGGUFError, HeaderError or TruncatedFileError. `table` names a tensor
    whose unknown type or ragged row width is left for the caller to report (UnsupportedTypeError,
    RowWidthError); any other tensor's ragged width is a HeaderError, as in llama.cpp's loader.
    """
    path = Path(path)
    try:
        path.stat()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    if not path.is_file():
        raise NotGGUFError(f"{path}: not a regular file")
    return GGUFHeader(path, table)


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor's bytes are: metadata only."""

    path: Path
    name: str
    type_id: int             # raw GGML type id (may be one gguf does not know)
    shape: tuple[int, ...]   # ggml order: shape[0] = ne0, the contiguous row width
    data_offset: int         # absolute offset in `path`
    n_bytes: int
    container: str = "gguf"  # or "safetensors" (where float8 row types may be)


def tensor_infos(reader: GGUFHeader, path: Path) -> dict[str, TensorInfo]:
    return {name: TensorInfo(path=path, name=name, type_id=type_id, shape=shape, data_offset=offset, n_bytes=n_bytes)
            for name, type_id, shape, offset, n_bytes in reader.tensor_infos}


def shard_paths(path) -> list[Path]:
    """All shards of a split model (`-00001-of-0000N.gguf`), in order; [path] for a single file."""
    path = Path(path)
    m = SPLIT_RE.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    if count < 1 or not 1 <= int(m["no"]) <= count:
        raise NotGGUFError(f"{path}: bad split name (shard {m['no']} of {m['count']})")
    shards = [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [str(p) for p in shards if not p.exists()]
    if missing:
        raise FileNotFoundError(f"{path}: split model is missing shard(s): {', '.join(missing)}")
    return shards


def field_value(reader: GGUFHeader, key: str, default=None):
    f = reader.get_field(key)
    return default if f is None else f.contents()


def find_tensor(path, name: str) -> tuple[TensorInfo, GGUFHeader, GGUFHeader]:
    """(tensor info, header of the shard holding it, header of the first shard: the model's metadata).

    Each shard is parsed once, also when the tensor is in none of them."""
    shards = shard_paths(path)
    first, names = None, []
    for p in shards:
        reader = read_gguf(p, table=name)
        first = first or reader
        for t_name, type_id, shape, offset, n_bytes in reader.tensor_infos:
            if t_name == name:
                return TensorInfo(p, t_name, type_id, shape, offset, n_bytes), reader, first
        names += reader.tensor_names[:9 - len(names)]
    where = f"{len(shards)} shards of {shards[0].name}" if len(shards) > 1 else str(shards[0])
    hint = ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
    raise TableNotFoundError(f"no tensor {name!r} in {where}; it has: {hint or 'no tensors'}")
