"""The model's own tokenizer, read from its GGUF metadata (`tokenizer.ggml.*`), for prefill prompts.

`GGUFTokenizer.from_reader(reader)` returns None for a file without `tokenizer.ggml.tokens` (the synthetic
models: text.py's word-level mapping is used then). Supported `tokenizer.ggml.model` values, each run the way
llama.cpp runs it (src/llama-vocab.cpp):

- ``gpt2``: byte-level BPE (Qwen, qwen4exp, Llama 3, ...). The text is pre-tokenized with the regexes llama.cpp
  keeps for `tokenizer.ggml.pre` (qwen2, qwen35, llama3/llama-bpe, gpt-2, mpt, starcoder, refact, command-r,
  falcon, default, ...; see `pretokenizer.PRE`: a name not there is refused with a TokenizerError naming the
  supported ones, as llama.cpp refuses an unknown one; deepseek-coder/deepseek-llm are among the refused), each piece's
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
does. Token attributes follow llama.cpp's load, which re-marks tokens by their text (`GGUFTokenizer._llama_attrs`):
end-of-generation texts such as phi-3's `</s>` or gemma-4's `<|tool_response>` become control even when the file
says user-defined, so plain text never yields them. `safe_cut` tells where a text may be cut so that a stream
encoded chunk by chunk (`encode(chunk, continued=True)`) gets the ids of one read (text.py's prompt files).
Checked exactly against llama.cpp's test-tokenizer-0 vectors (tests/data/llama-vocab). `decode(ids)` inverts
`encode` (minus the `llama` space prefix).

Where this differs from llama.cpp, exactly:

1. Unicode classes: the pre-tokenizer regexes' \\p{..} and \\s classes are built from Python's unicodedata
   (gds_gather.prefill.pretokenizer), exact up to the Unicode version.
2. Byte fallback in `gpt2`: a merged symbol missing from the vocabulary (never the case for a real vocabulary,
   whose merges produce tokens and which holds all 256 byte symbols) becomes one byte-symbol token per byte;
   llama.cpp looks up the symbol's UTF-8 bytes one by one as strings, which drops every non-ASCII byte.
3. Speed-only splitting, exact: `llama` and `gemma4` merge over a whole fragment (no word boundaries). Here a
   fragment is cut before each U+2581 that follows a character X, X not U+2581, when no token (llama) or no merge
   (gemma4) could join X to a following U+2581; no merge can cross such a cut, so the ids are the same, and the
   pieces are cached like gpt2's.
"""
from __future__ import annotations

import re

import numpy as np

from ..errors import TokenizerError
from .merges import bpe_merge, spm_merge
from .pretokenizer import PRE, WS_CHARS, bytes_to_unicode, compiled, regex_split

SUPPORTED_MODELS = ("gpt2", "llama", "gemma4")

# llama_token_type (GGUF tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# llama_token_attr bit flags (what llama.cpp works with after load); a type maps to one flag, 0 = undefined
A_UNKNOWN, A_UNUSED, A_NORMAL, A_CONTROL, A_USER_DEFINED, A_BYTE = 1, 2, 4, 8, 16, 32
_TYPE_ATTR = {UNKNOWN: A_UNKNOWN, UNUSED: A_UNUSED, NORMAL: A_NORMAL, CONTROL: A_CONTROL,
              USER_DEFINED: A_USER_DEFINED, BYTE: A_BYTE}

# Token texts llama.cpp's load (llama_vocab::impl::load, llama.cpp as vendored in llama-cpp-python 0.3.36) re-marks:
# each FIM kind whose tokenizer.ggml.fim_*_token_id is absent: the token with one of these texts becomes control
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# end-of-generation texts: always control (this list holds every EOT/EOM text llama.cpp detects, too)
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~["))
_ALWAYS_USER = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")    # gpt-oss: user-defined
_DEFAULT_EOS = {"llama": 2, "gpt2": 11}       # llama.cpp's defaults when tokenizer.ggml.eos_token_id is absent

SPACE = "\u2581"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>\Z")


# ---- reading GGUF fields ---------------------------------------------------------------------------------------

def _field(reader, key: str):
    """A metadata value; a tokenizer key of the wrong kind (llama.cpp's typed getters refuse it) is a
    TokenizerError, not a TypeError deep inside the tokenizer."""
    f = reader.get_field(key)
    if f is None:
        return None
    v = f.contents()
    if key.endswith(("_id", "_token_id")):
        ok, kind = isinstance(v, int), "an integer"
    elif key.endswith((".model", ".pre")):
        ok, kind = isinstance(v, str), "a string"
    elif key.endswith(".token_type"):
        ok, kind = isinstance(v, list) and all(isinstance(x, int) for x in v), "an array of integers"
    elif key.endswith(".scores"):
        ok, kind = isinstance(v, list) and all(isinstance(x, (int, float)) for x in v), "an array of numbers"
    else:
        ok, kind = True, ""
    if not ok:
        raise TokenizerError(f"{key} is not {kind}: {str(v)[:60]}")
    return v


def _strings(reader, key: str) -> list[str] | None:
    """A string array, decoding invalid UTF-8 with replacement rather than failing."""
    f = reader.get_field(key)
    if f is None:
        return None
    if len(f.types) != 2 or f.types[0] != 9 or f.types[1] != 8:     # GGUFValueType ARRAY of STRING
        raise TokenizerError(f"{key} is not an array of strings")
    # gds_gather's reader hands the items over as bytes (no per-item numpy views: 10^5 tokens)
    raw = f.raw_strings() if hasattr(f, "raw_strings") else (bytes(f.parts[i]) for i in f.data)
    return [b.decode("utf-8", errors="replace") for b in raw]


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
                 add_space_prefix: bool | None = None, pre: str | None = None, special: dict | None = None):
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
        self._joiners: frozenset[str] = frozenset()
        if model == "gpt2":
            key = pre if pre is not None else "default"
            if key not in PRE:
                raise TokenizerError(f"pre-tokenizer (tokenizer.ggml.pre) {pre!r} is not supported; supported: "
                                     f"{', '.join(sorted(PRE))}")
            self.pre_used = key
            self._exprs, self.ignore_merges = PRE[key]
            self._b2u = bytes_to_unicode()
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
            self._joiners = frozenset(joiners)
        else:   # gemma4
            self.add_space_prefix = False
            joiners = {a[-1] for a, b in self.ranks if b.startswith(SPACE) and a and a[-1] != SPACE}
            self._cut = self._cut_re(joiners)
            self._joiners = frozenset(joiners)

        self._byte_ids = [self._byte_id(b) for b in range(256)]
        special = dict(special or {})
        if special.get("eos") is None:
            special["eos"] = eos_id if eos_id is not None else _DEFAULT_EOS.get(model)
        self.attrs = self._llama_attrs(special)
        # user-defined tokens are matched as whole pieces of the text first, longest first (llama.cpp); a token
        # llama.cpp re-marks as control is not (parse_special=false)
        matched = [i for i in range(n) if self.attrs[i] & A_USER_DEFINED
                   and not self.attrs[i] & (A_CONTROL | A_UNKNOWN)]
        self._user = sorted(((self.tokens[i], i) for i in matched), key=lambda x: (-len(x[0].encode()), x[1]))
        self._user_maxlen = max((len(t) for t, _ in self._user), default=0)

    def _llama_attrs(self, special: dict) -> list[int]:
        """Token attribute flags after llama.cpp's load: the file's types, then its re-marking by text.

        llama.cpp makes control: each FIM kind's token found by text when the file names no id for that kind
        (_FIM_TEXTS; if several texts of one kind are present llama.cpp marks one of them in hash-map order, here
        all of them), and every end-of-generation text (_EOG_TEXTS). Then the gpt-oss texts become user-defined;
        '<|end|>' becomes user-defined when '<|return|>' and '<|call|>' (or '<|calls|>' and '<|flush|>') are
        end-of-generation too; and '</s>' becomes normal when '<|tool_response>' or '<|plamo:eos|>' is
        end-of-generation (gemma4, plamo). The end-of-generation set also holds the FIM pad/repo/sep ids and the
        EOS (`special['eos']`, default llama.cpp's per-model one), EOT and EOM ids.
        """
        n = len(self.tokens)
        attrs = [_TYPE_ATTR.get(int(t), 0) for t in self.types[:n]]
        ids = self.ids
        valid = {k: int(v) for k, v in special.items() if v is not None and 0 <= int(v) < n}
        eog: set[int] = set()
        for kind, texts in _FIM_TEXTS.items():
            found = valid.get(kind)
            if found is None:
                for text in texts:
                    if text in ids:
                        attrs[ids[text]] |= A_CONTROL
                        found = ids[text]
            if found is not None and kind in ("fim_pad", "fim_rep", "fim_sep"):
                eog.add(found)
        for text in _EOG_TEXTS:
            if text in ids:
                eog.add(ids[text])
                attrs[ids[text]] |= A_CONTROL
        for text in _ALWAYS_USER:
            if text in ids:
                attrs[ids[text]] = A_USER_DEFINED
        eog.update(valid[k] for k in ("eos", "eot", "eom") if k in valid)
        texts = {self.tokens[i]: i for i in sorted(eog)}
        has_call = "<|call|>" in texts or "<|calls|>" in texts
        if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
            attrs[texts["<|end|>"]] = A_USER_DEFINED
            eog.discard(texts["<|end|>"])
        if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            attrs[texts["</s>"]] = A_NORMAL
        return attrs

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
                   pre=_field(reader, "tokenizer.ggml.pre"),
                   special={k: _field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom", *_FIM_TEXTS)}
                   | {k: _field(reader, f"tokenizer.ggml.{old}_token_id")     # deprecated names llama.cpp reads
                      for k, old in (("fim_pre", "prefix"), ("fim_suf", "suffix"), ("fim_mid", "middle"))
                      if _field(reader, f"tokenizer.ggml.{k}_token_id") is None})

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"GGUFTokenizer({self.model!r}, {self.n_vocab} tokens)"

    # -- encoding ---------------------------------------------------------------------------------------------
    def encode(self, text: str, continued: bool = False) -> np.ndarray:
        """Token ids (int64) of `text`: no BOS/EOS, no control tokens parsed.

        continued=True: `text` continues text already encoded, cut where safe_cut allowed (no space prefix)."""
        out: list[int] = []
        prev_special = not continued   # llama.cpp: a space prefix goes before the first fragment and after a token
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

    def safe_cut(self, text: str, lo: int = 0) -> int:
        """The last k (0 if none) where `text` may be cut: encode(text[:k]) + encode(rest, continued=True) equals
        encode(text + rest) for ANY rest, so a stream can be encoded chunk by chunk with the ids of one read.

        A cut goes before a space (text[k] == " ") whose predecessor X is not whitespace, with no user-defined token
        occurrence touching text[k-1:k+1]. No pre-tokenizer regex match spans "X ": after a non-space, every
        alternative continues only with letters, digits, marks, non-space symbols or [\\r\\n], and whitespace
        runs hold no X. For llama and gemma4, X must also be no "joiner" (no token/merge holds "X\u2581"), the
        condition `_cut` already uses. Candidates are looked for in [lo - margin, len(text) - margin), the margin
        being the longest user-defined token: what follows a cut must be known.
        """
        margin = self._user_maxlen + 1
        hi = len(text) - margin
        k = hi
        floor = max(lo - margin - 1, 1)
        while True:
            k = text.rfind(" ", floor, k + 1) if k >= floor else -1
            if k < floor:
                return 0
            x = text[k - 1]
            if not (x in WS_CHARS or x == SPACE or x in self._joiners) and not self._user_touches(text, k):
                return k
            k -= 1

    def _user_touches(self, text: str, k: int) -> bool:
        """True when an occurrence of a user-defined token in `text` covers position k-1 or k."""
        if not self._user:
            return False
        m = self._user_maxlen
        lo = max(k - m, 0)
        window = text[lo:k + m + 1]
        for tok, _ in self._user:
            start = window.find(tok)
            while start >= 0:
                s = lo + start
                if s <= k and s + len(tok) > k - 1:
                    return True
                start = window.find(tok, start + 1)
        return False

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
        for word in regex_split(text, compiled(self._exprs)):
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
        for piece in bpe_merge(sym, self.ranks):
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
                pieces = (spm_merge(seg, self.ids, self.scores) if self.model == "llama" else
                          bpe_merge(seg, self.ranks))
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
            tid = self.ids.get(bytes_to_unicode()[b])
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
            t, ty, attr = self.tokens[i], self.types[i], self.attrs[i]
            if attr & A_CONTROL:
                continue
            if self.model == "gpt2":
                if attr & A_USER_DEFINED:
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
