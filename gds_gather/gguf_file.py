"""Open GGUF files with gguf.GGUFReader, metadata only, hardened against malformed headers; find split shards."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFReader, GGUFValueType

from .errors import HeaderError, NotGGUFError, TableNotFoundError, TruncatedFileError

# Smallest possible encodings: a KV pair is key length (8) + type (4) + at least 1 value byte;
# a tensor info is name length (8) + n_dims (4) + type (4) + offset (8).
_MIN_KV_BYTES = 13
_MIN_TI_BYTES = 24
_SCALAR_BYTES = {
    GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
    GGUFValueType.STRING: 8,
}
SPLIT_RE = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class _SafeReader(GGUFReader):
    """GGUFReader that refuses to read past the end of the file or to loop over absurd counts.

    gguf's reader slices its memmap, so a count past the end silently yields empty arrays (and an array
    of 2**60 elements would loop for ever); here every read is bounds-checked first.
    """

    def _get(self, offset, dtype, count=1, override_order=None):
        count = int(count)
        itemsize = np.dtype(dtype).itemsize
        if offset < 0 or count < 0 or offset + itemsize * count > self.data.shape[0]:
            raise TruncatedFileError(
                f"file ends at byte {self.data.shape[0]} but the header needs {itemsize * count} bytes at {offset}")
        return super()._get(offset, dtype, count, override_order)

    def _get_field_parts(self, orig_offs, raw_type):
        try:
            gtype = GGUFValueType(int(raw_type))
        except ValueError:
            raise HeaderError(f"unknown metadata value type {int(raw_type)} at byte {orig_offs}") from None
        if gtype == GGUFValueType.ARRAY:
            sub = int(self._get(orig_offs, np.uint32)[0])
            n = int(self._get(orig_offs + 4, np.uint64)[0])
            min_item = _SCALAR_BYTES.get(GGUFValueType(sub) if sub in GGUFValueType._value2member_map_ else None, 1)
            if n * min_item > self.data.shape[0] - orig_offs:
                raise HeaderError(f"metadata array at byte {orig_offs} claims {n} items, more than the file holds")
        return super()._get_field_parts(orig_offs, raw_type)

    def _build_tensors(self, start_offs, fields):
        # Keep the raw type id (a table of a type gguf does not know must give a clear error later, not a
        # ValueError here) and build no data views: nothing below touches tensor data.
        self.tensor_infos = []
        seen = set()
        for field in fields:
            _, name_data, _, dims, raw_dtype, offset_tensor = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            if name in seen:
                raise HeaderError(f"duplicate tensor name {name!r}")
            seen.add(name)
            shape = tuple(int(d) for d in dims)
            type_id = int(raw_dtype[0])
            n_elems = int(np.prod(shape, dtype=object)) if shape else 1
            try:
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
                n_bytes = n_elems // block * size
            except (ValueError, KeyError):
                n_bytes = -1   # unknown type: size unknown
            self.tensor_infos.append((name, type_id, shape, int(start_offs + int(offset_tensor[0])), n_bytes))
        self.tensors = []


def _check_counts(path: Path, size: int) -> None:
    """Reject absurd tensor/KV counts before gguf allocates or loops over anything."""
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 4 or int.from_bytes(head[:4], "little") != GGUF_MAGIC:
        raise NotGGUFError(f"{path}: not a GGUF file (bad magic {head[:4]!r})")
    if len(head) < 24:
        raise TruncatedFileError(f"{path}: file ends inside the GGUF header ({size} bytes)")
    version = int.from_bytes(head[4:8], "little")
    if version not in (2, 3):
        raise NotGGUFError(f"{path}: unsupported GGUF version {version}")
    n_tensors = int.from_bytes(head[8:16], "little")
    n_kv = int.from_bytes(head[16:24], "little")
    if n_tensors * _MIN_TI_BYTES > size or n_kv * _MIN_KV_BYTES > size:
        raise HeaderError(f"{path}: header claims {n_tensors} tensors and {n_kv} metadata keys, "
                          f"more than a {size}-byte file can hold")


def read_gguf(path) -> GGUFReader:
    """Parse a GGUF file's header, metadata and tensor infos (the mapping is lazy: no tensor data is read)."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    if not path.is_file():
        raise NotGGUFError(f"{path}: not a regular file")
    if size == 0:
        raise NotGGUFError(f"{path}: empty file, not a GGUF file")
    _check_counts(path, size)
    try:
        return _SafeReader(path, "r")
    except (TruncatedFileError, HeaderError, NotGGUFError):
        raise
    except (KeyError, ValueError, IndexError, UnicodeDecodeError, OverflowError) as e:
        raise HeaderError(f"{path}: malformed GGUF header: {e}") from None


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor's bytes are: metadata only."""

    path: Path
    name: str
    type_id: int             # raw GGML type id (may be one gguf does not know)
    shape: tuple[int, ...]   # ggml order: shape[0] = ne0, the contiguous row width
    data_offset: int         # absolute offset in `path`
    n_bytes: int


def tensor_infos(reader: GGUFReader, path: Path) -> dict[str, TensorInfo]:
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


def field_value(reader: GGUFReader, key: str, default=None):
    f = reader.get_field(key)
    return default if f is None else f.contents()


def find_tensor(path, name: str) -> tuple[TensorInfo, GGUFReader, GGUFReader]:
    """(tensor info, reader of the shard holding it, reader of the first shard: the model's metadata)."""
    shards = shard_paths(path)
    first = None
    for p in shards:
        reader = read_gguf(p)
        first = first or reader
        infos = tensor_infos(reader, p)
        if name in infos:
            return infos[name], reader, first
        del reader
    where = f"{len(shards)} shards of {shards[0].name}" if len(shards) > 1 else str(shards[0])
    names = []
    for p in shards:
        names += [t for t in tensor_infos(read_gguf(p), p)]
    hint = ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
    raise TableNotFoundError(f"no tensor {name!r} in {where}; it has: {hint or 'no tensors'}")
