"""The model's own tokenizer, read from its GGUF metadata (`tokenizer.ggml.*`), for prefill prompts.

`GGUFTokenizer.from_reader(reader)` returns None for a file without `tokenizer.ggml.tokens` (the synthetic
models: text.py's word-level mapping is used then). Supported `tokenizer.ggml.model` values, each run the way
llama.cpp runs it (src/llama-vocab.cpp):

- ``gpt2``: byte-level BPE (Qwen, qwen4exp, Llama 3, ...). The text is pre-tokenized with the regexes llama.cpp
  keeps for `tokenizer.ggml.pre` (qwen2, qwen35, llama3/llama-bpe, gpt-2, default; see `_PRE`), each piece's
  UTF-8 bytes are mapped to the GPT-2 byte-to-unicode alphabet and merged by `tokenizer.ggml.merges` rank (lowest
  rank first, leftmost first on ties: llama.cpp's bigram queue). Results are cached per piece.
- ``llama``: SentencePiece BPE (Gemma 3n, Llama 2, ...), llama.cpp's llm_tokenizer_spm: spaces become U+2581,
  one U+2581 is prepended (`tokenizer.ggml.add_space_prefix`, default true), then starting from single characters
  the adjacent pair whose concatenation is in the vocabulary with the highest `tokenizer.ggml.scores` score is
  merged (leftmost first on ties) until none is; a character with no token becomes its `<0xXX>` byte tokens
  (else the unknown token, `tokenizer.ggml.unknown_token_id`, default 0 as in llama.cpp).
- ``gemma4``: Gemma 4's SentencePiece-style BPE: spaces become U+2581 (no prefix), the text splits into runs of
  newlines and runs of anything else (a newline run that is a token stays whole), merges by rank over characters,
  `<0xXX>` byte fallback.

No BOS/EOS is added (a prefill prompt is plain text) and control tokens are not parsed from the text (llama.cpp's
parse_special=false); user-defined tokens (type 4) are matched as whole pieces first, longest first, as llama.cpp
does. `decode(ids)` inverts `encode` (minus the `llama` space prefix).

Where this differs from llama.cpp, exactly:

1. Unicode classes. The pre-tokenizer regexes use \\p{L}, \\p{N}, \\p{M}, \\p{P}, which the stdlib `re` lacks
   (and `regex` is not a dependency). They are built once per process (~0.2 s) as explicit character classes from
   `unicodedata` general categories (L*, N*, M*, P*); \\s is llama.cpp's whitespace set (U+0009-000D, U+0020,
   U+0085, U+00A0, U+1680, U+2000-200A, U+2028, U+2029, U+202F, U+205F, U+3000; Python's own \\s would add
   U+001C-001F). So classification is exact up to the Unicode version: Python 3.11's unicodedata is Unicode 14.0,
   llama.cpp's table is newer (characters assigned since 14.0 count as unassigned here). The patterns themselves
   are llama.cpp's, evaluated with the usual leftmost-first backtracking semantics (llama.cpp runs them through its
   own splitters or std::regex over category-collapsed text).
2. Byte fallback in `gpt2`: a merged symbol missing from the vocabulary (never the case for a real vocabulary,
   whose merges produce tokens and which holds all 256 byte symbols) becomes one byte-symbol token per byte;
   llama.cpp looks up the symbol's UTF-8 bytes one by one as strings, which drops every non-ASCII byte.
3. Speed-only splitting, exact: `llama` and `gemma4` merge over a whole fragment (no word boundaries). Here a
   fragment is cut before each U+2581 that follows a character X, X not U+2581, when no token (llama) or no merge
   (gemma4) could join X to a following U+2581; no merge can cross such a cut, so the ids are the same, and the
   pieces are cached like gpt2's.
"""
from __future__ import annotations

import functools
import heapq
import re
import unicodedata
import warnings

import numpy as np

SUPPORTED_MODELS = ("gpt2", "llama", "gemma4")

# llama_token_type (GGUF tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPACE = "\u2581"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>\Z")

# llama.cpp unicode_set_whitespace (White_Space property), as a character-class body
_WS = r"\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"

# Pre-tokenizer regexes, verbatim from llama.cpp's llm_tokenizer_bpe (tokenizer.ggml.pre -> regex_exprs).
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")

# tokenizer.ggml.pre -> (regexes, ignore_merges)
_PRE: dict[str, tuple[tuple[str, ...], bool]] = {
    "default": (_DEFAULT, False),
    **{k: ((_GPT2,), False) for k in ("gpt-2", "mpt", "olmo", "jais")},
    **{k: ((_QWEN2,), False) for k in ("qwen2", "stablelm2", "hunyuan")},
    "qwen35": ((_QWEN35,), False),
    **{k: ((_LLAMA3,), True) for k in ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx")},
}


class TokenizerError(ValueError):
    """The file's tokenizer metadata is of a kind this module does not run, or is inconsistent."""


# ---- Unicode classes ------------------------------------------------------------------------------------------

@functools.cache
def _unicode_classes() -> dict[str, str]:
    """Character-class bodies for \\p{L}, \\p{N}, \\p{M}, \\p{P} from unicodedata (built once, ~0.2 s)."""
    majors = "".join(c[0] for c in map(unicodedata.category, map(chr, range(0x110000))))
    out = {}
    for name in "LNMP":
        parts = []
        for m in re.finditer(name + "+", majors):
            a, b = m.start(), m.end() - 1
            parts.append(f"\\U{a:08x}" if a == b else f"\\U{a:08x}-\\U{b:08x}")
        out[name] = "".join(parts)
    return out


def _translate(expr: str) -> str:
    """A llama.cpp regex in stdlib `re` syntax: \\p{X} and \\s, \\S become explicit classes (inside or outside [])."""
    cls = _unicode_classes()
    out, i, in_class = [], 0, False
    while i < len(expr):
        c = expr[i]
        if c == "\\":
            nxt = expr[i + 1]
            if nxt == "p":
                j = expr.index("}", i)
                body = cls[expr[i + 3:j]]
                out.append(body if in_class else f"[{body}]")
                i = j + 1
                continue
            if nxt == "s":
                out.append(_WS if in_class else f"[{_WS}]")
            elif nxt == "S":
                if in_class:
                    raise AssertionError(f"\\S inside a class in {expr!r}")
                out.append(f"[^{_WS}]")
            else:
                out.append(expr[i:i + 2])
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
        elif c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


@functools.cache
def _compiled(exprs: tuple[str, ...]) -> tuple[re.Pattern, ...]:
    return tuple(re.compile(_translate(e)) for e in exprs)


def _regex_split(text: str, patterns) -> list[str]:
    """llama.cpp's unicode_regex_split: each regex splits every piece of the previous one into its matches and
    the unmatched stretches between them (which stay pieces)."""
    pieces = [text]
    for pat in patterns:
        out = []
        for p in pieces:
            pos = 0
            for m in pat.finditer(p):
                s, e = m.span()
                if s == e:
                    continue
                if s > pos:
                    out.append(p[pos:s])
                out.append(p[s:e])
                pos = e
            if pos < len(p):
                out.append(p[pos:])
        pieces = out
    return pieces


@functools.cache
def _bytes_to_unicode() -> tuple[str, ...]:
    """GPT-2's byte -> printable character map (byte b -> the symbol at index b)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return tuple(chr(table[b]) for b in range(256))


# ---- reading GGUF fields ---------------------------------------------------------------------------------------

def _field(reader, key: str):
    f = reader.get_field(key)
    return None if f is None else f.contents()


def _strings(reader, key: str) -> list[str] | None:
    """A string array, decoding invalid UTF-8 with replacement rather than failing."""
    f = reader.get_field(key)
    if f is None:
        return None
    return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]


def tokenizer_name(reader) -> str:
    """'gguf-<tokenizer.ggml.model>' when the file carries a token list, else 'word-level' (reads no arrays)."""
    if reader.get_field("tokenizer.ggml.tokens") is None:
        return "word-level"
    return f"gguf-{_field(reader, 'tokenizer.ggml.model') or '?'}"


# ---- the tokenizer ---------------------------------------------------------------------------------------------

class GGUFTokenizer:
    """Encode text to token ids (and back) with a GGUF file's own tokenizer; see the module docstring."""

    def __init__(self, model: str, tokens: list[str], *, types=None, scores=None, merges=None,
                 bos_id: int | None = None, eos_id: int | None = None, unk_id: int | None = None,
                 add_space_prefix: bool | None = None, pre: str | None = None):
        if model not in SUPPORTED_MODELS:
            raise TokenizerError(f"tokenizer model {model!r} is not supported; supported: "
                                 f"{', '.join(SUPPORTED_MODELS)} (and files without a tokenizer)")
        if not tokens:
            raise TokenizerError("the tokenizer has no tokens")
        n = len(tokens)
        # llama.cpp renames empty tokens and keeps the later id of a duplicated text
        self.tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.types = list(types) if types is not None else [NORMAL] * n
        if len(self.types) < n:
            raise TokenizerError(f"{len(self.types)} token types for {n} tokens")
        self.model = model
        self.name = f"gguf-{model}"
        self.bos_id, self.eos_id = bos_id, eos_id
        if unk_id is None and model == "llama":
            unk_id = 0           # llama.cpp's SPM default
        self.unk_id = unk_id if unk_id is not None and 0 <= unk_id < n else None
        self.pre = pre
        self._cache: dict[str, tuple[int, ...]] = {}

        if model in ("gpt2", "gemma4"):
            if merges is None:
                raise TokenizerError(f"a {model!r} tokenizer needs tokenizer.ggml.merges")
            self.ranks: dict[tuple[str, str], int] = {}
            for r, m in enumerate(merges):
                pos = m.find(" ", 1)
                if pos > 0:
                    self.ranks.setdefault((m[:pos], m[pos + 1:]), r)      # first rank wins, as llama.cpp
        if model == "gpt2":
            key = pre if pre is not None else "default"
            if key not in _PRE:
                warnings.warn(f"pre-tokenizer {pre!r} is not one this module knows "
                              f"({', '.join(sorted(_PRE))}); using llama.cpp's default regexes", stacklevel=2)
                key = "default"
            self.pre_used = key
            self._exprs, self.ignore_merges = _PRE[key]
            self._b2u = _bytes_to_unicode()
            self._u2b = {c: b for b, c in enumerate(self._b2u)}
        elif model == "llama":
            if scores is not None and len(scores) < n:
                raise TokenizerError(f"{len(scores)} token scores for {n} tokens")
            self.scores = [float(s) for s in scores[:n]] if scores is not None else [0.0] * n
            self.add_space_prefix = True if add_space_prefix is None else bool(add_space_prefix)
            # characters X (not U+2581) that some token joins to a following U+2581
            joiners = {t[i - 1] for t in self.tokens if SPACE in t[1:]
                       for i in range(1, len(t)) if t[i] == SPACE and t[i - 1] != SPACE}
            self._cut = self._cut_re(joiners)
        else:   # gemma4
            self.add_space_prefix = False
            joiners = {a[-1] for a, b in self.ranks if b.startswith(SPACE) and a and a[-1] != SPACE}
            self._cut = self._cut_re(joiners)

        self._byte_ids = [self._byte_id(b) for b in range(256)]
        # user-defined tokens are matched as whole pieces of the text first, longest first (llama.cpp)
        self._user = sorted(((t, i) for i, t in enumerate(self.tokens) if self.types[i] == USER_DEFINED),
                            key=lambda x: (-len(x[0].encode()), x[1]))

    @classmethod
    def from_reader(cls, reader) -> "GGUFTokenizer | None":
        """The tokenizer of an open gguf.GGUFReader (a model's first shard); None without tokenizer.ggml.tokens."""
        tokens = _strings(reader, "tokenizer.ggml.tokens")
        if tokens is None:
            return None
        model = _field(reader, "tokenizer.ggml.model")
        if model is None:
            raise TokenizerError("the file has tokenizer.ggml.tokens but no tokenizer.ggml.model")
        if model not in SUPPORTED_MODELS:
            raise TokenizerError(f"tokenizer model {model!r} is not supported; supported: "
                                 f"{', '.join(SUPPORTED_MODELS)} (and files without a tokenizer)")
        return cls(model, tokens,
                   types=_field(reader, "tokenizer.ggml.token_type"),
                   scores=_field(reader, "tokenizer.ggml.scores"),
                   merges=_strings(reader, "tokenizer.ggml.merges"),
                   bos_id=_field(reader, "tokenizer.ggml.bos_token_id"),
                   eos_id=_field(reader, "tokenizer.ggml.eos_token_id"),
                   unk_id=_field(reader, "tokenizer.ggml.unknown_token_id"),
                   add_space_prefix=_field(reader, "tokenizer.ggml.add_space_prefix"),
                   pre=_field(reader, "tokenizer.ggml.pre"))

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"GGUFTokenizer({self.model!r}, {self.n_vocab} tokens)"

    # -- encoding ---------------------------------------------------------------------------------------------
    def encode(self, text: str) -> np.ndarray:
        """Token ids (int64) of `text`: no BOS/EOS, no control tokens parsed."""
        out: list[int] = []
        prev_special = True      # llama.cpp: a space prefix goes before the first fragment and after a token
        for frag in self._partition(text):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if self.model == "gpt2":
                self._encode_gpt2(frag, out)
            elif self.model == "llama":
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                self._encode_pieces(frag.replace(" ", SPACE), out)
            else:
                for run in re.findall(r"[^\n]+|\n+", frag.replace(" ", SPACE)):
                    if run[0] == "\n" and run in self.ids:     # a newline run that is a token stays whole
                        out.append(self.ids[run])
                    else:
                        self._encode_pieces(run, out)
            prev_special = False
        return np.array(out, dtype=np.int64)

    def _partition(self, text: str) -> list:
        """The text cut around user-defined tokens: str fragments and int token ids."""
        frags: list = [text] if text else []
        for tok, tid in self._user:
            if tok not in text:
                continue
            new = []
            for f in frags:
                if isinstance(f, int) or tok not in f:
                    new.append(f)
                    continue
                for k, part in enumerate(f.split(tok)):
                    if k:
                        new.append(tid)
                    if part:
                        new.append(part)
            frags = new
        return frags

    def _encode_gpt2(self, text: str, out: list[int]) -> None:
        cache = self._cache
        for word in _regex_split(text, _compiled(self._exprs)):
            ids = cache.get(word)
            if ids is None:
                ids = cache[word] = self._gpt2_word(word)
            out.extend(ids)

    def _gpt2_word(self, word: str) -> tuple[int, ...]:
        raw = word.encode("utf-8")
        sym = "".join(self._b2u[b] for b in raw)
        if self.ignore_merges and sym in self.ids:
            return (self.ids[sym],)
        ids = []
        for piece in _bpe_merge(sym, self.ranks):
            tid = self.ids.get(piece)
            if tid is not None:
                ids.append(tid)
            else:      # one token per byte symbol (each symbol character is one byte)
                ids.extend(b for b in (self._byte_ids[self._u2b[c]] for c in piece) if b is not None)
        return tuple(ids)

    def _encode_pieces(self, text: str, out: list[int]) -> None:
        """llama / gemma4: merge within each cut of `text` (see the module docstring, 3.), cached per cut."""
        cache = self._cache
        for seg in self._cut.split(text):
            if not seg:
                continue
            ids = cache.get(seg)
            if ids is None:
                pieces = (_spm_merge(seg, self.ids, self.scores) if self.model == "llama" else
                          _bpe_merge(seg, self.ranks))
                ids = []
                for piece in pieces:
                    tid = self.ids.get(piece)
                    if tid is not None:
                        ids.append(tid)
                    else:
                        ids.extend(b for b in (self._byte_ids[x] for x in piece.encode("utf-8")) if b is not None)
                ids = cache[seg] = tuple(ids)
            out.extend(ids)

    @staticmethod
    def _cut_re(joiners: set[str]) -> re.Pattern:
        body = "".join(f"\\U{ord(c):08x}" for c in sorted(joiners | {SPACE}))
        return re.compile(f"(?<=[^{body}])(?={SPACE})")

    def _byte_id(self, b: int) -> int | None:
        """The token of one byte: the byte symbol (gpt2) or <0xXX> (llama.cpp byte_to_token), else unk, else None."""
        if self.model == "gpt2":
            tid = self.ids.get(_bytes_to_unicode()[b])
        else:
            tid = self.ids.get(f"<0x{b:02X}>")
            if tid is None and b < 0x80:
                tid = self.ids.get(chr(b))
        return tid if tid is not None else self.unk_id

    # -- decoding ---------------------------------------------------------------------------------------------
    def decode(self, ids) -> str:
        """Text of token ids; control tokens are skipped, byte tokens give their bytes (invalid UTF-8: U+FFFD)."""
        buf = bytearray()
        for i in np.asarray(ids, dtype=np.int64).ravel().tolist():
            if not 0 <= i < len(self.tokens):
                raise ValueError(f"token id {i} is out of range [0, {len(self.tokens)})")
            t, ty = self.tokens[i], self.types[i]
            if ty == CONTROL:
                continue
            if self.model == "gpt2":
                if ty == USER_DEFINED:
                    buf += t.encode()
                else:
                    u2b = self._u2b
                    buf += b"".join(bytes((u2b[c],)) if c in u2b else c.encode() for c in t)
                continue
            m = _BYTE_TOKEN.match(t)
            if m and ty in (BYTE, NORMAL):
                buf.append(int(m.group(1), 16))
            else:
                buf += t.replace(SPACE, " ").encode()
        text = buf.decode("utf-8", errors="replace")
        if self.model == "llama" and self.add_space_prefix and text.startswith(" "):
            text = text[1:]
        return text


# ---- the merge loops -------------------------------------------------------------------------------------------

def _merge(word: str, priority) -> list[str]:
    """From single characters, repeatedly merge the adjacent pair with the lowest priority(a, b) (leftmost on ties)
    until no adjacent pair has one (priority returns None). A heap over bigrams, as llama.cpp's sessions do."""
    n = len(word)
    if n < 2:
        return [word] if n else []
    sym = list(word)
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    prv = list(range(-1, n - 1))
    heap = []
    for i in range(n - 1):
        k = priority(sym[i], sym[i + 1])
        if k is not None:
            heap.append((k, i, i + 1, sym[i] + sym[i + 1]))
    if not heap:
        return sym
    heapq.heapify(heap)
    pop, push = heapq.heappop, heapq.heappush
    while heap:
        _, left, right, text = pop(heap)
        a, b = sym[left], sym[right]
        if not a or not b or a + b != text:
            continue            # outdated: one side has merged since
        sym[left], sym[right] = text, ""
        nr = nxt[right]
        nxt[left] = nr
        if nr >= 0:
            prv[nr] = left
        p = prv[left]
        if p >= 0:
            k = priority(sym[p], text)
            if k is not None:
                push(heap, (k, p, left, sym[p] + text))
        if nr >= 0:
            k = priority(text, sym[nr])
            if k is not None:
                push(heap, (k, left, nr, text + sym[nr]))
    return [s for s in sym if s]


def _bpe_merge(word: str, ranks: dict) -> list[str]:
    """llama.cpp's llm_tokenizer_bpe_session: merges by lowest merge rank."""
    get = ranks.get
    return _merge(word, lambda a, b: get((a, b)))


def _spm_merge(text: str, ids: dict, scores: list[float]) -> list[str]:
    """llama.cpp's llm_tokenizer_spm: merges the pair whose concatenation is the token of highest score."""
    get = ids.get

    def priority(a, b):
        t = get(a + b)
        return None if t is None else -scores[t]
    return _merge(text, priority)
