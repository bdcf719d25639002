"""A strict, bounded GGUF header parser (metadata and tensor infos; tensor data is never read).

Every count and length is checked against the bytes left before anything is read or allocated, nesting is
capped, strings are walked without per-item allocation and decoded only when asked for, shapes use exact Python
integers, and the tensor layout gets the checks llama.cpp's loader makes (ggml/src/gguf.cpp
gguf_init_from_file_impl and llama_model_loader): tensors packed in order at aligned offsets, no overlaps, data
inside the file. Any malformed input raises NotGGUFError, HeaderError or TruncatedFileError, in time linear in
the header's size and memory proportional to the number of keys and tensors (both capped).

`GGUFHeader.get_field(key)` returns a `Field` with gguf.ReaderField's reading API (`types`, `parts`, `data`,
`contents()`); array items are materialized only when asked for, so parsing a file never builds per-item objects.
"""
from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

from ..errors import HeaderError, NotGGUFError, TruncatedFileError
from .quants import supported_types

T = GGUFValueType
# fixed-size value types: (struct format, numpy dtype); BOOL is a byte, true when non-zero (as llama.cpp)
_FIXED = {
    T.UINT8: ("<B", "<u1"), T.INT8: ("<b", "<i1"), T.UINT16: ("<H", "<u2"), T.INT16: ("<h", "<i2"),
    T.UINT32: ("<I", "<u4"), T.INT32: ("<i", "<i4"), T.FLOAT32: ("<f", "<f4"), T.BOOL: ("<B", "<u1"),
    T.UINT64: ("<Q", "<u8"), T.INT64: ("<q", "<i8"), T.FLOAT64: ("<d", "<f8"),
}
_SIZE = {t: struct.calcsize(f) for t, (f, _) in _FIXED.items()}
_TYPES = {int(t): t for t in T}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_QTYPES = {int(q) for q in GGMLQuantizationType if q in GGML_QUANT_SIZES}

MAX_NESTING = 2            # an array of arrays at most (llama.cpp refuses any nesting; gguf-py writes one level)
MAX_KV = 1 << 16           # real models carry < 1,000 keys
MAX_TENSORS = 1 << 18      # real models carry < 50,000 tensors
MAX_DIMS = 4               # GGML_MAX_DIMS
MAX_NAME = 64              # GGML_MAX_NAME: a tensor name is shorter
MAX_STRING = 1 << 30       # GGUF_MAX_STRING_LENGTH
INT64_MAX = (1 << 63) - 1
DEFAULT_ALIGNMENT = 32


def _type_name(t: int) -> str:
    return _TYPES[t].name if t in _TYPES else str(t)


class _Cursor:
    """Bounds-checked little-endian reads from the mapped file."""

    def __init__(self, mm, size: int, path: Path):
        self.mm, self.size, self.path = mm, size, path

    def need(self, p: int, n: int, what: str) -> None:
        if n < 0 or p + n > self.size:
            raise TruncatedFileError(f"{self.path}: file ends at byte {self.size} but {what} needs {n} bytes "
                                     f"at byte {p}")

    def u32(self, p: int, what: str) -> int:
        self.need(p, 4, what)
        return _U32.unpack_from(self.mm, p)[0]

    def u64(self, p: int, what: str) -> int:
        self.need(p, 8, what)
        return _U64.unpack_from(self.mm, p)[0]

    def string_end(self, p: int, what: str) -> int:
        n = self.u64(p, what)
        if n > MAX_STRING or p + 8 + n > self.size:
            raise TruncatedFileError(f"{self.path}: {what} at byte {p} claims {n} bytes; the file ends at byte "
                                     f"{self.size}")
        return p + 8 + n

    def string(self, p: int, what: str) -> tuple[bytes, int]:
        end = self.string_end(p, what)
        return self.mm[p + 8:end], end

    def text(self, p: int, what: str) -> tuple[str, int]:
        raw, end = self.string(p, what)
        try:
            return raw.decode("utf-8"), end
        except UnicodeDecodeError:
            raise HeaderError(f"{self.path}: {what} at byte {p} is not valid UTF-8: {raw[:40]!r}") from None

    # -- values: `skip` validates without building anything; `read` materializes ----------------------------------
    def skip(self, p: int, vtype: int, depth: int, key: str) -> int:
        """End offset of a value of type `vtype` at `p` (validated, nothing built)."""
        if vtype in _SIZE:
            self.need(p, _SIZE[vtype], f"the value of {key!r}")
            return p + _SIZE[vtype]
        if vtype == T.STRING:
            return self.string_end(p, f"the string value of {key!r}")
        if vtype != T.ARRAY:
            raise HeaderError(f"{self.path}: metadata {key!r} at byte {p} has unknown value type {vtype}")
        itype, n, p = self.array_head(p, depth, key)
        if itype in _SIZE:
            return p + n * _SIZE[itype]
        if itype == T.STRING:
            return self.walk_strings(p, n, key)
        for _ in range(n):
            p = self.skip(p, T.ARRAY, depth + 1, key)
        return p

    def array_head(self, p: int, depth: int, key: str) -> tuple[int, int, int]:
        """(item type, item count, offset of the first item) of an array at `p`, the count checked."""
        if depth + 1 > MAX_NESTING:
            raise HeaderError(f"{self.path}: metadata {key!r} nests arrays more than {MAX_NESTING} deep "
                              f"(at byte {p}); GGUF has no deeper nesting")
        itype = self.u32(p, f"the array type of {key!r}")
        n = self.u64(p + 4, f"the array length of {key!r}")
        if itype not in _TYPES:
            raise HeaderError(f"{self.path}: metadata array {key!r} at byte {p} has unknown item type {itype}")
        min_item = _SIZE.get(itype, 8 if itype == T.STRING else 12)
        if n * min_item > self.size - (p + 12):
            raise HeaderError(f"{self.path}: metadata array {key!r} at byte {p} claims {n} items of "
                              f"{_type_name(itype)}, more than the file holds")
        return itype, n, p + 12

    def walk_strings(self, p: int, n: int, key: str) -> int:
        """Walk `n` length-prefixed strings from `p`; return the end offset."""
        mm, size, unpack = self.mm, self.size, _U64.unpack_from
        try:
            for _ in range(n):
                p += 8 + unpack(mm, p)[0]
        except (struct.error, OverflowError):     # a length past the end: the next read is out of range
            p = size + 1
        if p > size:
            raise TruncatedFileError(f"{self.path}: the string array {key!r} runs past the end of the file "
                                     f"({size} bytes)")
        return p

    def strings(self, p: int, n: int, key: str) -> tuple[list[bytes], int]:
        """The `n` strings from `p` as bytes, and the end offset."""
        end = self.walk_strings(p, n, key)
        mm, unpack, out = self.mm, _U64.unpack_from, []
        append = out.append
        for _ in range(n):
            q = p + 8 + unpack(mm, p)[0]
            append(mm[p + 8:q])
            p = q
        return out, end

    def read(self, p: int, vtype: int, depth: int, key: str):
        """(value, end): a Python scalar or str, a numpy array (numeric arrays), a list of bytes (string arrays)
        or a list of such (nested arrays)."""
        if vtype in _FIXED:
            v = struct.unpack_from(_FIXED[vtype][0], self.mm, p)[0]
            return (v != 0 if vtype == T.BOOL else v), p + _SIZE[vtype]
        if vtype == T.STRING:
            return self.text(p, f"the string value of {key!r}")
        itype, n, p = self.array_head(p, depth, key)
        if itype in _FIXED:
            a = np.frombuffer(self.mm, _FIXED[itype][1], n, p).copy()
            return (a != 0 if itype == T.BOOL else a), p + n * _SIZE[itype]
        if itype == T.STRING:
            return self.strings(p, n, key)
        out = []
        for _ in range(n):
            v, p = self.read(p, T.ARRAY, depth + 1, key)
            out.append(v)
        return out, p


class _LazyParts:
    """gguf.ReaderField.parts for an array, built item by item on access (a vocabulary is 10^5 strings)."""

    def __init__(self, head: list, items, strings: bool):
        self._head, self._items, self._strings, self._h = head, items, strings, len(head)

    def __len__(self) -> int:
        return self._h + (2 if self._strings else 1) * len(self._items)

    def __getitem__(self, i):
        if not isinstance(i, int):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"parts index {i} out of range ({n} parts)")
        k = i - self._h
        if k < 0:
            return self._head[i]
        if not self._strings:
            return self._items[k:k + 1]
        s = self._items[k >> 1]
        return np.frombuffer(s, np.uint8) if k & 1 else np.array([len(s)], "<u8")


class Field:
    """One metadata key-value, with gguf.ReaderField's reading API (name, offset, types, parts, data,
    contents()). Values are read from the mapped file on first use; strings decode as strict UTF-8
    (HeaderError otherwise). `parts`/`data` follow gguf's layout for scalars, strings and flat arrays."""

    __slots__ = ("name", "offset", "types", "_cur", "_vat", "_vtype", "_cache", "_parts")

    def __init__(self, cur: _Cursor, name: str, offset: int, vat: int, vtype: int, itype: int | None):
        self._cur, self.name, self.offset, self._vat, self._vtype = cur, name, offset, vat, vtype
        self.types = [_TYPES[vtype]] if itype is None else [T.ARRAY, _TYPES[itype]]
        self._cache = self._parts = None

    def _value(self):
        if self._cache is None:
            self._cache = (self._cur.read(self._vat, self._vtype, 0, self.name)[0],)
        return self._cache[0]

    def _decode(self, raw) -> str:
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise HeaderError(f"{self._cur.path}: a string of metadata {self.name!r} is not valid UTF-8: "
                              f"{bytes(raw)[:40]!r}") from None

    def raw_strings(self) -> list[bytes] | None:
        """The items of a string array as undecoded bytes (None for any other value)."""
        return self._value() if self.types == [T.ARRAY, T.STRING] else None

    def contents(self, index_or_slice: int | slice = slice(None)):
        v = self._value()
        if self._vtype != T.ARRAY:
            return v
        return self._plain(v[index_or_slice])

    def _plain(self, v):
        if isinstance(v, (np.ndarray, np.generic)):
            return v.tolist()
        if isinstance(v, bytes):
            return self._decode(v)
        return [self._plain(x) for x in v] if isinstance(v, list) else v

    @property
    def parts(self):
        if self._parts is None:
            self._parts = self._make_parts()
        return self._parts

    def _make_parts(self):
        key = self.name.encode()
        head = [np.array([len(key)], "<u8"), np.frombuffer(key, np.uint8), np.array([int(self._vtype)], "<u4")]
        if self._vtype == T.STRING:
            raw = self._value().encode()
            return head + [np.array([len(raw)], "<u8"), np.frombuffer(raw, np.uint8)]
        if self._vtype != T.ARRAY:
            return head + [np.array([self._value()], _FIXED[self._vtype][1])]
        v = self._value()
        head += [np.array([int(self.types[-1])], "<u4"), np.array([len(v)], "<u8")]
        return _LazyParts(head, v, self.types[-1] == T.STRING)

    @property
    def data(self):
        if self._vtype == T.STRING:
            return [4]
        if self._vtype != T.ARRAY:
            return [3]
        n = len(self._value())
        if self.types[-1] == T.STRING:
            return range(6, 6 + 2 * n, 2)
        return range(5, 5 + n) if self.types[-1] != T.ARRAY else []

    def __repr__(self) -> str:
        return f"Field({self.name!r}, {[t.name for t in self.types]})"


class GGUFHeader:
    """A parsed GGUF header: `fields` (key -> Field), `tensor_infos` [(name, type id, shape in ggml order,
    absolute data offset, bytes or -1 when the type is unknown)], `alignment`, `data_offset`, `version`."""

    def __init__(self, path, table: str | None = None):
        self.path = path = Path(path)
        with open(path, "rb") as f:     # (gguf_file.read_gguf refused what is not a regular file)
            self.size = size = os.fstat(f.fileno()).st_size     # (/proc files say 0 and refuse a seek to their end)
            if size == 0:
                raise NotGGUFError(f"{path}: empty file, not a GGUF file")
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        cur = self._cur = _Cursor(self._mm, size, path)
        head = self._mm[:24]
        if len(head) < 4 or _U32.unpack_from(head)[0] != GGUF_MAGIC:
            raise NotGGUFError(f"{path}: not a GGUF file (bad magic {head[:4]!r})")
        if len(head) < 24:
            raise TruncatedFileError(f"{path}: file ends inside the GGUF header ({size} bytes)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
        if version & 0xFFFF == 0 and version:
            raise NotGGUFError(f"{path}: big-endian GGUF files are not supported (the version field reads "
                               f"{version}, i.e. {int.from_bytes(version.to_bytes(4, 'little'), 'big')} byte-swapped)")
        if version not in (2, 3):
            raise NotGGUFError(f"{path}: unsupported GGUF version {version}" +
                               (" (GGUFv1 is no longer supported)" if version == 1 else ""))
        self.version = version
        # smallest encodings: a tensor info is 24 bytes (name length, n_dims, type, offset), a key-value 13
        if n_tensors * 24 > size or n_kv * 13 > size:
            raise HeaderError(f"{path}: header claims {n_tensors} tensors and {n_kv} metadata keys, "
                              f"more than a {size}-byte file can hold")
        if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
            raise HeaderError(f"{path}: header claims {n_tensors} tensors and {n_kv} metadata keys; this reader "
                              f"accepts at most {MAX_TENSORS} tensors and {MAX_KV} keys")
        self.fields: dict[str, Field] = {}
        p = 24
        for i in range(n_kv):
            at = p
            key, p = cur.text(p, f"metadata key {i}")
            if not key:
                raise HeaderError(f"{path}: metadata key {i} at byte {at} is empty")
            if key in self.fields:
                raise HeaderError(f"{path}: duplicate metadata key {key!r} at byte {at}")
            vtype = cur.u32(p, f"the value type of {key!r}")
            if vtype not in _TYPES:
                raise HeaderError(f"{path}: metadata {key!r} at byte {p} has unknown value type {vtype}")
            end = cur.skip(p + 4, vtype, 0, key)
            itype = cur.u32(p + 4, f"the array type of {key!r}") if vtype == T.ARRAY else None
            self.fields[key] = Field(cur, key, at, p + 4, vtype, itype)
            p = end
        self.alignment = self._alignment()
        self.tensor_infos = self._tensor_infos(p, n_tensors, table)

    def _alignment(self) -> int:
        f = self.fields.get("general.alignment")
        if f is None:
            return DEFAULT_ALIGNMENT
        if f.types != [T.UINT32]:
            raise HeaderError(f"{self.path}: general.alignment must be a UINT32, not "
                              f"{'/'.join(t.name for t in f.types)}")
        a = f.contents()
        if a == 0 or a & (a - 1):
            raise HeaderError(f"{self.path}: general.alignment {a} is not a power of two")
        return a

    def _tensor_infos(self, p: int, n_tensors: int, table: str | None) -> list:
        cur, path, align = self._cur, self.path, self.alignment
        infos, names = [], set()
        expected, prev = 0, None    # where the next tensor must start (None after one of unknown size)
        for i in range(n_tensors):
            name, p = cur.text(p, f"the name of tensor {i}")
            if len(name.encode()) >= MAX_NAME:
                raise HeaderError(f"{path}: tensor {i} name {name[:80]!r} is {len(name.encode())} bytes; "
                                  f"GGUF (GGML_MAX_NAME) allows {MAX_NAME - 1}")
            if name in names:
                raise HeaderError(f"{path}: duplicate tensor name {name!r}")
            names.add(name)
            n_dims = cur.u32(p, f"the dimension count of tensor {name!r}")
            if n_dims > MAX_DIMS:
                raise HeaderError(f"{path}: tensor {name!r} has {n_dims} dimensions; GGUF allows {MAX_DIMS}")
            cur.need(p + 4, 8 * n_dims + 12, f"the info of tensor {name!r}")
            shape = struct.unpack_from(f"<{n_dims}Q", cur.mm, p + 4)
            type_id, rel = struct.unpack_from("<IQ", cur.mm, p + 4 + 8 * n_dims)
            p += 4 + 8 * n_dims + 12
            n_elems = 1
            for j, ne in enumerate(shape):
                if ne > INT64_MAX:
                    raise HeaderError(f"{path}: tensor {name!r} dimension {j} is {ne - (1 << 64)} (negative)")
                n_elems *= ne
            if n_elems >= INT64_MAX:
                raise HeaderError(f"{path}: tensor {name!r} of shape {list(shape)} has {n_elems} elements, "
                                  f"more than a GGUF tensor can hold (INT64_MAX)")
            n_bytes = -1            # unknown: a type gguf does not know, or the table's, left for Table to report
            qt = GGMLQuantizationType(type_id) if type_id in _QTYPES else None
            if qt is not None and (name != table or qt in supported_types()):
                block, tsize = GGML_QUANT_SIZES[qt]
                if shape and shape[0] % block:
                    if name != table:     # the table's own width gets its RowWidthError from Table
                        raise HeaderError(f"{path}: tensor {name!r} rows of {shape[0]} elements are not whole "
                                          f"{qt.name} blocks of {block}")
                else:
                    n_bytes = n_elems // block * tsize
            if rel % align:
                raise HeaderError(f"{path}: tensor {name!r} data offset {rel} is not a multiple of the "
                                  f"alignment {align}")
            if expected is not None and rel != expected:
                how = (f"overlaps the data of tensor {prev!r}, which ends at {expected}" if rel < expected else
                       f"leaves a gap after tensor {prev!r}")
                raise HeaderError(f"{path}: tensor {name!r} at data offset {rel} {how}; GGUF tensors are packed "
                                  f"in order (expected offset {expected})")
            if expected is None and infos and rel < infos[-1][3]:
                raise HeaderError(f"{path}: tensor {name!r} at data offset {rel} lies before tensor {prev!r}; "
                                  f"GGUF tensors are packed in order")
            expected = None if n_bytes < 0 else rel + -(-n_bytes // align) * align
            prev = name
            infos.append((name, type_id, tuple(shape), rel, n_bytes))
        data_offset = -(-p // align) * align
        self.data_offset = data_offset
        if n_tensors and data_offset > self.size:
            raise TruncatedFileError(f"{path}: the data section would start at byte {data_offset}, past the end "
                                     f"of the file ({self.size} bytes)")
        out = []
        for name, type_id, shape, rel, n_bytes in infos:
            start = data_offset + rel
            if n_bytes >= 0 and start + n_bytes > self.size:
                raise TruncatedFileError(f"{path}: tensor {name!r} data [{start}, {start + n_bytes}) runs past "
                                         f"the end of the file ({self.size} bytes)")
            out.append((name, type_id, shape, start, n_bytes))
        return out

    def get_field(self, key: str) -> Field | None:
        return self.fields.get(key)

    @property
    def tensor_names(self) -> list[str]:
        return [t[0] for t in self.tensor_infos]
