"""The gpt2 tokenizer's pre-tokenizer: llama.cpp's regexes for each `tokenizer.ggml.pre` (PRE), run with the
stdlib `re` (regex_split), and GPT-2's byte-to-unicode alphabet. Imports nothing of gds_gather.

The regexes use \\p{L}, \\p{N}, \\p{M}, \\p{P}, which the stdlib `re` lacks (and `regex` is not a dependency). They are
built once per process (~0.2 s) as explicit character classes from `unicodedata` general categories (L*, N*, M*,
P*); \\s is llama.cpp's whitespace set (U+0009-000D, U+0020, U+0085, U+00A0, U+1680, U+2000-200A, U+2028, U+2029,
U+202F, U+205F, U+3000; Python's own \\s would add U+001C-001F). So classification is exact up to the Unicode
version: Python 3.11's unicodedata is Unicode 14.0, llama.cpp's table is newer (characters assigned since 14.0 count
as unassigned here). The patterns themselves are llama.cpp's, evaluated with the usual leftmost-first backtracking
semantics (llama.cpp runs them through its own splitters or std::regex over category-collapsed text).
"""
from __future__ import annotations

import functools
import re
import unicodedata

# llama.cpp unicode_set_whitespace (White_Space property), as a character-class body
_WS = r"\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
WS_CHARS = frozenset("\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000"
                     + "".join(map(chr, range(0x2000, 0x200B))))

# Pre-tokenizer regexes, verbatim from llama.cpp's llm_tokenizer_bpe (tokenizer.ggml.pre -> regex_exprs).
CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
QWEN2 = CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = (CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
LLAMA3 = CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")

STARCODER = (r"\p{N}", GPT2)
FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]")

# tokenizer.ggml.pre -> (regexes, ignore_merges), as llama.cpp's load and llm_tokenizer_bpe map them. A name
# not here is refused (TokenizerError), as llama.cpp refuses an unknown one; a missing name means "default".
PRE: dict[str, tuple[tuple[str, ...], bool]] = {
    "default": (DEFAULT, False),
    **{k: ((GPT2,), False) for k in ("gpt-2", "mpt", "olmo", "jais")},
    **{k: ((QWEN2,), False) for k in ("qwen2", "stablelm2", "hunyuan")},
    "qwen35": ((QWEN35,), False),
    **{k: ((LLAMA3,), True) for k in ("llama3", "llama-v3", "llama-bpe", "falcon3")},
    **{k: ((LLAMA3,), False) for k in ("smaug-bpe", "dbrx")},       # llama3's regex without ignore_merges
    **{k: (STARCODER, False) for k in ("starcoder", "refact", "command-r")},
    "falcon": (FALCON, False),
}


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
def compiled(exprs: tuple[str, ...]) -> tuple[re.Pattern, ...]:
    """llama.cpp regexes compiled for the stdlib `re` (once per process each)."""
    return tuple(re.compile(_translate(e)) for e in exprs)


def regex_split(text: str, patterns) -> list[str]:
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
def bytes_to_unicode() -> tuple[str, ...]:
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
