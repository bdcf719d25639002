"""Fuzz the GGUF reader through the public API: seeded mutants of small GGUFs written by gguf.GGUFWriter.

Every mutant either opens, and then its rows equal gguf's own dequantization of the bytes the file holds (and gguf's
reader, where it can parse the file, agrees on the table's place, type and shape), its metadata reads and its
tokenizer loads or fails cleanly; or it raises a GatherError. Nothing else, within a per-case time and memory limit:
cases run in forked workers (RLIMIT_AS, SIGALRM), many per worker.

Mutant classes: flip (random bytes of the header), truncate (at and around every structural boundary), count
(array and header counts), strlen (key, value, item and tensor-name lengths), dims, offset (tensor data offsets),
vtype (metadata value and item types), ttype (tensor types), nesting (values replaced by nested arrays, 2 to 3,000
deep), endian (byte-swapped header fields), utf8 (invalid bytes in keys, values, items and names).

CI runs GDS_GATHER_FUZZ_CASES (default 500) cases from GDS_GATHER_FUZZ_SEED (default 0); a long manual run:
    GDS_GATHER_FUZZ_CASES=5000 GDS_GATHER_FUZZ_SEED=7 python3 -m pytest -q -s tests/formats/test_gguf_fuzz.py
"""
from __future__ import annotations

import json
import os
import random
import resource
import signal
import struct
import time
import traceback
import warnings
from collections import Counter

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter, GGMLQuantizationType as Q
from gguf import quants as gq

import gds_gather as gg
from gds_gather.formats.gguf_file import read_gguf
from gds_gather.errors import TokenizerError
from gds_gather.prefill.tokenizer import GGUFTokenizer

CASES = int(os.environ.get("GDS_GATHER_FUZZ_CASES", "500"))
SEED = int(os.environ.get("GDS_GATHER_FUZZ_SEED", "0"))
CASE_SECONDS = 3             # per case, on a loaded 2-core machine (a case takes milliseconds)
EXTRA_MEMORY = 1 << 30       # address space a worker may add to what the test process maps
PER_WORKER = 60
CLASSES = ("flip", "truncate", "count", "strlen", "dims", "offset", "vtype", "ttype", "nesting", "endian", "utf8")
U64 = struct.Struct("<Q")
PLE = "per_layer_token_embd.weight"


# ---- base files and their structure ----------------------------------------------------------------------------

def _spm_vocab() -> tuple[list[str], list[float], list[int]]:
    words = ["\u2581the", "\u2581a", "\u2581of", "th", "he", "\u2581t", "e", "h", "t", "a", "o", "f", "\u2581"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + words
    types = [2, 3, 3] + [6] * 256 + [1] * len(words)
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(words))]
    return tokens, scores, types


def _write_base(path, rows, qtype, *, first: bool, alignment: int | None, nested: bool, tokenizer: bool):
    w = GGUFWriter(str(path), "qwen4exp")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_block_count(2)
    w.add_uint32("qwen4exp.embedding_length_per_layer_input", 160)
    w.add_string("general.name", "fuzz base \u00e9")
    w.add_array("qwen4exp.ple.head_offsets", [0, 7, 9])
    w.add_array("general.tags", ["a", "bc", "", "d\u00e9f"])
    if nested:
        w.add_array("general.pairs", [[1, 2], [3]])
    if tokenizer:
        tokens, scores, types = _spm_vocab()
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
    extra = np.arange(3 * 40, dtype=np.float16).reshape(3, 40)
    if not first:
        w.add_tensor("token_embd.weight", extra)
    w.add_tensor(PLE, rows, raw_dtype=qtype)
    if first:
        w.add_tensor("output.weight", extra.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _structure(path) -> dict:
    """Byte positions of every header element of a valid file, by role (found with gguf's own reader)."""
    r = GGUFReader(str(path))
    base = r.data.ctypes.data
    roles: dict[str, list] = {k: [] for k in ("strlen", "strdata", "count", "vtype", "itype", "value",
                                              "name_len", "name", "n_dims", "dims", "ttype", "toffset")}

    def pos(part) -> int:
        return part.ctypes.data - base

    def value(parts, i, vtype) -> int:      # classify a value's parts from parts[i]; return the next index
        if vtype == 8:
            roles["strlen"].append(pos(parts[i]))
            roles["strdata"].append((pos(parts[i + 1]), int(parts[i + 1].nbytes)))
            return i + 2
        if vtype == 9:
            itype, n = int(parts[i][0]), int(parts[i + 1][0])
            roles["itype"].append(pos(parts[i]))
            roles["count"].append(pos(parts[i + 1]))
            i += 2
            for _ in range(n):
                if itype == 9:
                    i = value(parts, i, 9)
                else:
                    i = value(parts, i, itype)
            return i
        roles["value"].append((pos(parts[i]), int(parts[i].nbytes)))
        return i + 1

    for key, f in r.fields.items():
        if key.startswith("GGUF."):
            continue
        roles["strlen"].append(pos(f.parts[0]))
        roles["strdata"].append((pos(f.parts[1]), int(f.parts[1].nbytes)))
        roles["vtype"].append(pos(f.parts[2]))
        end = value(f.parts, 3, int(f.parts[2][0]))
        assert end == len(f.parts), key
    for t in r.tensors:
        name_len, name, n_dims, dims, ttype, toff = t.field.parts
        roles["name_len"].append(pos(name_len))
        roles["name"].append((pos(name), int(name.nbytes)))
        roles["n_dims"].append(pos(n_dims))
        roles["dims"] += [pos(dims) + 8 * j for j in range(len(dims))]
        roles["ttype"].append(pos(ttype))
        roles["toffset"].append(pos(toff))
    bounds = sorted({0, 4, 8, 16, 24, int(r.data_offset), os.path.getsize(path)}
                    | {p for k in ("strlen", "count", "vtype", "itype", "name_len", "n_dims", "dims", "ttype",
                                   "toffset") for p in roles[k]}
                    | {p for k in ("strdata", "value", "name") for p, _ in roles[k]}
                    | {p + n for k in ("strdata", "value", "name") for p, n in roles[k]}
                    | {t.data_offset for t in r.tensors} | {t.data_offset + t.n_bytes for t in r.tensors})
    return {"roles": roles, "bounds": [int(x) for x in bounds], "data_offset": r.data_offset,
            "kv": [(f.parts[2].ctypes.data - base, f.parts[-1].ctypes.data - base + int(f.parts[-1].nbytes))
                   for k, f in r.fields.items() if not k.startswith("GGUF.")]}


# ---- mutations ----------------------------------------------------------------------------------------------------

def _big(rng: random.Random, old: int, room: int) -> int:
    return rng.choice([0, 1, old + 1, old * 2 + 1, max(room - 1, 0), room, room + 1, room // 8, room // 8 + 1,
                       room // 12, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**63 + 5, 2**64 - 1,
                       rng.getrandbits(64), rng.getrandbits(20)])


def _nested(depth: int, pad: int = 0) -> bytes:
    """An array value nested `depth` deep (uint8 leaves); the innermost holds `pad` bytes."""
    out = struct.pack("<I", 9)       # the value's type: ARRAY (the caller replaces the old type field too)
    for _ in range(depth - 1):
        out += struct.pack("<IQ", 9, 1)
    return out + struct.pack("<IQ", 0, pad) + bytes(pad)


def mutate(data: bytes, st: dict, cls: str, rng: random.Random) -> bytes:
    b = bytearray(data)
    roles, size = st["roles"], len(b)

    def put64(at, v):
        struct.pack_into("<Q", b, at, v & (2**64 - 1))

    def put32(at, v):
        struct.pack_into("<I", b, at, v & (2**32 - 1))

    if cls == "flip":
        hi = st["data_offset"] if rng.random() < 0.9 else size
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(hi)] ^= 1 << rng.randrange(8)
    elif cls == "truncate":
        cut = rng.choice(st["bounds"]) + rng.choice([0, 0, 0, -1, 1, -4, 4, -8])
        del b[max(0, min(cut, size - 1)):]
    elif cls == "count":
        at = rng.choice(roles["count"] + [8, 16])
        put64(at, _big(rng, U64.unpack_from(b, at)[0], size - at))
    elif cls == "strlen":
        at = rng.choice(roles["strlen"] + roles["name_len"])
        put64(at, _big(rng, U64.unpack_from(b, at)[0], size - at))
    elif cls == "dims":
        for _ in range(rng.randint(1, 2)):
            at = rng.choice(roles["dims"])
            put64(at, _big(rng, U64.unpack_from(b, at)[0], size))
        if rng.random() < 0.2:
            put32(rng.choice(roles["n_dims"]), rng.choice([0, 1, 3, 4, 5, 2**31, 2**32 - 1]))
    elif cls == "offset":
        at = rng.choice(roles["toffset"])
        old = U64.unpack_from(b, at)[0]
        put64(at, rng.choice([0, old + 1, old - 1, old + 32, old - 32, old + 64, old * 2, size, 2**63,
                              2**64 - 1, 2**64 - 32, U64.unpack_from(b, rng.choice(roles["toffset"]))[0]]))
    elif cls == "vtype":
        put32(rng.choice(roles["vtype"] + roles["itype"]), rng.choice(list(range(14)) + [255, 2**31, 2**32 - 1]))
    elif cls == "ttype":
        put32(rng.choice(roles["ttype"]), rng.choice([int(q) for q in Q] + [4, 5, 31, 32, 33, 36, 37, 38, 42, 99,
                                                                              2**31, 2**32 - 1]))
    elif cls == "nesting":
        start, end = rng.choice(st["kv"])        # from the value-type field to the end of the value
        depth = rng.choice([2, 2, 3, 4, 50, 3000])
        new = _nested(depth)
        pad = (-(len(new) - (end - start))) % 32      # keep the data section where it was (a valid file)
        del b[start:end]
        b[start:start] = _nested(depth, pad)
    elif cls == "endian":
        b[4:8] = b[4:8][::-1]
        if rng.random() < 0.5:
            b[8:16], b[16:24] = b[8:16][::-1], b[16:24][::-1]
    elif cls == "utf8":
        at, n = rng.choice([x for x in roles["strdata"] + roles["name"] if x[1]])
        b[at + rng.randrange(n)] = rng.choice([0x80, 0xC0, 0xFE, 0xFF, 0xED])
    else:
        raise AssertionError(cls)
    return bytes(b)


# ---- one case ------------------------------------------------------------------------------------------------------

def _rows_from_file(path, t) -> np.ndarray:
    """gguf's dequantization of the bytes the file holds where the table says its rows are."""
    raw = np.fromfile(path, np.uint8, t.n_rows * t.row_bytes, offset=t.data_offset).reshape(t.n_rows, t.row_bytes)
    if t.n_rows == 0:          # (gguf's dequantize cannot reshape an empty array)
        return np.empty((0, t.row_elems), np.float32)
    return gq.dequantize(raw, t.qtype).reshape(t.n_rows, t.row_elems)


def check_case(path) -> str:
    """'opened' or the GatherError's class name; anything else raises."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")            # the reader itself never warns
            t = gg.open_table(path)
    except gg.GatherError as e:
        return type(e).__name__
    with t:
        with warnings.catch_warnings(), np.errstate(all="ignore"):   # garbage blocks may overflow in dequantization
            warnings.simplefilter("ignore", RuntimeWarning)
            got = t.gather(np.arange(t.n_rows))
            want = _rows_from_file(path, t)
        assert got.shape == want.shape and np.array_equal(got, want, equal_nan=True), "rows differ from the file"
        try:
            ref = GGUFReader(str(path))
        except (ValueError, KeyError):
            ref = None     # gguf refuses what gds_gather tolerates: an unknown type of another tensor
        if ref is not None:
            rt = next(x for x in ref.tensors if x.name == PLE)
            assert (rt.data_offset, int(rt.tensor_type), [int(d) for d in rt.shape]) == \
                (t.data_offset, int(t.qtype), [t.row_elems, t.n_rows]), "gguf's reader disagrees on the table"
            assert [(x.name, int(x.tensor_type), tuple(int(d) for d in x.shape), x.data_offset) for x in ref.tensors] \
                == [i[:4] for i in t.reader.tensor_infos], "gguf's reader disagrees on the tensors"
        for key, f in t.reader.fields.items():
            try:
                t.field(key)
                [bytes(f.parts[i]) for i in list(f.data)[:3]]      # gguf.ReaderField's layout, as tokenizer.py reads
            except gg.GatherError:
                pass
        try:
            GGUFTokenizer.from_reader(t.reader)
        except (gg.GatherError, TokenizerError):
            pass
    return "opened"


# ---- the worker pool -------------------------------------------------------------------------------------------

def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _worker(cases, bases, tmpdir, wfd) -> None:
    """In a forked child: run `cases`, one JSON line per case to `wfd`; a case past its time exits the child."""
    limit = _vm_size() + EXTRA_MEMORY
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out = os.fdopen(wfd, "w", buffering=1)
    current = {}

    def on_alarm(signum, frame):
        out.write(json.dumps({**current, "outcome": "TIMEOUT"}) + "\n")
        out.flush()
        os._exit(3)
    signal.signal(signal.SIGALRM, on_alarm)
    path = os.path.join(tmpdir, f"mutant-{os.getpid()}.gguf")
    for i in cases:
        rng = random.Random(SEED * 1_000_003 + i)
        cls = CLASSES[i % len(CLASSES)]
        base = bases[rng.randrange(len(bases))]
        current = {"case": i, "class": cls}
        t0 = time.perf_counter()
        signal.alarm(CASE_SECONDS)
        try:
            with open(path, "wb") as f:
                f.write(mutate(base["data"], base["st"], cls, rng))
            outcome = check_case(path)
        except BaseException as e:   # noqa: B036 -- report everything, including MemoryError and RecursionError
            outcome = "FAIL " + "".join(traceback.format_exception_only(type(e), e)).strip()[:400]
            outcome += " | " + "".join(traceback.format_tb(e.__traceback__)[-3:])[-1200:]
        signal.alarm(0)
        out.write(json.dumps({**current, "outcome": outcome, "seconds": time.perf_counter() - t0}) + "\n")
    out.flush()
    os._exit(0)


def run_fuzz(bases, tmpdir, n_cases: int) -> list[dict]:
    results = []
    for lo in range(0, n_cases, PER_WORKER):
        cases = list(range(lo, min(lo + PER_WORKER, n_cases)))
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:        # pragma: no cover - the child
            os.close(r)
            try:
                _worker(cases, bases, tmpdir, w)
            finally:
                os._exit(4)
        os.close(w)
        with os.fdopen(r) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        _, status = os.waitpid(pid, 0)
        done = {x["case"] for x in lines}
        results += lines
        if os.WEXITSTATUS(status) != 0 or not os.WIFEXITED(status):
            missing = [i for i in cases if i not in done]
            if missing and not any(x["outcome"] == "TIMEOUT" for x in lines):
                results.append({"case": missing[0], "class": CLASSES[missing[0] % len(CLASSES)],
                                "outcome": f"FAIL worker died (status {status})"})
            break
    return results


@pytest.fixture(scope="module")
def bases(tmp_path_factory, ggufs):
    d = tmp_path_factory.mktemp("fuzz-bases")
    specs = [
        ("a", ggufs.rows(Q.IQ4_NL, 24, 160, seed=3), Q.IQ4_NL, dict(first=False, alignment=None, nested=False,
                                                                     tokenizer=True)),
        ("b", ggufs.rows(Q.Q8_0, 16, 64, seed=4), Q.Q8_0, dict(first=True, alignment=64, nested=True,
                                                              tokenizer=False)),
        ("c", ggufs.rows(Q.Q4_K, 6, 256, seed=5), Q.Q4_K, dict(first=False, alignment=None, nested=True,
                                                              tokenizer=True)),
    ]
    out = []
    for name, rows, qtype, kw in specs:
        p = _write_base(d / f"{name}.gguf", rows, qtype, **kw)
        assert check_case(p) == "opened"
        out.append({"data": p.read_bytes(), "st": _structure(p)})
    return out


def test_bases_open_exactly(bases, tmp_path):
    """The unmutated files open, match gguf, carry their metadata and load their tokenizer."""
    for i, base in enumerate(bases):
        p = tmp_path / f"{i}.gguf"
        p.write_bytes(base["data"])
        with gg.open_table(p) as t:
            assert t.field("general.tags") == ["a", "bc", "", "d\u00e9f"]
            assert t.field("general.name") == "fuzz base \u00e9"
            assert t.field("qwen4exp.ple.head_offsets") == [0, 7, 9]
            ref = GGUFReader(str(p))
            assert list(t.reader.fields) == [k for k in ref.fields if not k.startswith("GGUF.")]
            for key, f in t.reader.fields.items():
                rf = ref.fields[key]
                assert f.types[:2] == rf.types[:2]
                if key != "general.pairs":       # gguf flattens nested arrays
                    assert t.field(key) == rf.contents(), key
                    assert [bytes(f.parts[i]) for i in f.data] == [bytes(rf.parts[i]) for i in rf.data], key
            if t.reader.get_field("general.pairs") is not None:
                assert t.field("general.pairs") == [[1, 2], [3]]
            tok = GGUFTokenizer.from_reader(t.reader)
            if tok is not None:
                assert tok.tokens == _spm_vocab()[0]
                # SPM: "th" (-3) beats "he" (-4) and "▁t" (-5); "▁th" and "the" are not tokens: [▁, th, e]
                assert list(tok.encode("the")) == [271, 262, 265]


def test_fuzz_reader(bases, tmp_path):
    t0 = time.perf_counter()
    results = run_fuzz(bases, str(tmp_path), CASES)
    per_class = Counter(x["class"] for x in results)
    outcomes = Counter((x["class"], x["outcome"]) for x in results if not x["outcome"].startswith("FAIL"))
    worst = max(results, key=lambda x: x.get("seconds", 0))
    print(f"\nfuzz: seed {SEED}, {len(results)} cases in {time.perf_counter() - t0:.1f} s; per class: "
          + ", ".join(f"{c} {per_class[c]}" for c in CLASSES))
    print("outcomes: " + ", ".join(f"{c}/{o} {n}" for (c, o), n in sorted(outcomes.items())))
    print(f"worst case: {worst.get('seconds', 0) * 1e3:.0f} ms (case {worst['case']}, {worst['class']})")
    bad = [x for x in results if x["outcome"].startswith("FAIL") or x["outcome"] == "TIMEOUT"]
    assert not bad, f"seed {SEED}: {bad[:3]}"
    assert len(results) == CASES
    assert set(per_class) == set(CLASSES) or CASES < len(CLASSES)
    opened = sum(n for (c, o), n in outcomes.items() if o == "opened")
    assert 0 < opened < CASES       # the mutants exercise both sides of the contract


def test_tokenizer_metadata_of_wrong_kinds(tmp_path):
    """Tokenizer keys holding values of the wrong kind (parseable files): a TokenizerError or GatherError, never a
    TypeError or ValueError from inside the tokenizer. 150 seeded combinations."""
    tokens, scores, types = _spm_vocab()
    n = len(tokens)
    choices = {
        "tokenizer.ggml.model": ["llama", "gpt2", "gemma4", "bert", 5],
        "tokenizer.ggml.tokens": [tokens, [], ["a"], [""] * 10, [1, 2]],
        "tokenizer.ggml.token_type": [types, [], [99] * n, ["x"] * n, [1.5] * n, types[:3]],
        "tokenizer.ggml.scores": [scores, [], [float("nan")] * n, ["s"] * n, [1] * n],
        "tokenizer.ggml.bos_token_id": [1, -1, 2**31, "x", 1.5, None],
        "tokenizer.ggml.unknown_token_id": [0, -5, 10**9, "u", None],
        "tokenizer.ggml.add_space_prefix": [True, 3, "y", None],
        "tokenizer.ggml.merges": [None, ["a b", "th e"], ["", " ", "a"], [1, 2]],
        "tokenizer.ggml.pre": [None, "default", "qwen2", "nope", 7],
    }
    rng = random.Random(SEED)
    outcomes = Counter()
    for i in range(150):
        w = GGUFWriter(str(tmp_path / f"{i}.gguf"), "llama")
        for key, options in choices.items():
            v = rng.choice(options)
            if v is None:
                continue
            add = (w.add_array if isinstance(v, list) else w.add_bool if isinstance(v, bool) else
                   w.add_string if isinstance(v, str) else w.add_float32 if isinstance(v, float) else
                   w.add_int32 if v < 0 else w.add_uint32)
            add(key, v)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")          # unknown pre-tokenizer names may warn
                tok = GGUFTokenizer.from_reader(read_gguf(tmp_path / f"{i}.gguf"))
                if tok is not None:
                    tok.encode("the th\u00e9 12 x")
            outcomes["loaded"] += 1
        except (gg.GatherError, TokenizerError) as e:
            outcomes[type(e).__name__] += 1
    assert outcomes["loaded"] and outcomes["TokenizerError"], outcomes
