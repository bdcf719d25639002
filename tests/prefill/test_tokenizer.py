"""The GGUF tokenizer: tiny vocabularies written with gguf.GGUFWriter, ids checked against hand computation.

Expected ids are worked out in the comments from llama.cpp's algorithms (src/llama-vocab.cpp): byte-level BPE
merges by lowest rank, SentencePiece merges by highest score, leftmost first on ties.
"""
from __future__ import annotations

import lzma
import random
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from gds_gather.errors import GatherError
from gds_gather.formats.gguf_file import read_gguf
from gds_gather.prefill.prompts import default_text, prompt_tokens
from gds_gather.prefill.merges import bpe_merge, spm_merge
from gds_gather.prefill.pretokenizer import QWEN2, bytes_to_unicode, compiled, regex_split
from gds_gather.prefill.tokenizer import (BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED, GGUFTokenizer, TokenizerError,
                                          tokenizer_name)

SP = "\u2581"
B2U = bytes_to_unicode()


def write_tokenizer_gguf(path, model=None, tokens=None, *, types=None, scores=None, merges=None, pre=None,
                         add_space_prefix=None, bos=None, eos=None, unk=None, arch="llama", extra=None):
    """A GGUF holding tokenizer metadata (and `extra(w)`'s tensors/keys), read back with gds_gather's reader."""
    w = GGUFWriter(str(path), arch)
    if model is not None:
        w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    if tokens is not None:
        w.add_token_list(tokens)
    if types is not None:
        w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    for fn, v in ((w.add_bos_token_id, bos), (w.add_eos_token_id, eos), (w.add_unk_token_id, unk)):
        if v is not None:
            fn(v)
    if extra is not None:
        extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load(path):
    return GGUFTokenizer.from_reader(read_gguf(path))


# ---- gpt2: byte-level BPE ---------------------------------------------------------------------------------------
# ids 0..255: the byte symbols in byte order (id b is byte b, e.g. 't' = 116, space 'Ġ' = 32); then:
GPT2_EXTRA = ["Ġt", "Ġth", "he", "Ġthe", "in", "ing", "<|endoftext|>", "<think>"]
#              256   257    258   259     260   261    262 (control)     263 (user-defined)
GPT2_MERGES = ["Ġ t", "Ġt h", "h e", "Ġth e", "i n", "in g", "Ã ©"]   # rank 0..6; 'Ã©' (é) is no token
GPT2_TYPES = [NORMAL] * 262 + [CONTROL, USER_DEFINED]


@pytest.fixture(scope="module")
def gpt2_path(tmp_path_factory):
    return write_tokenizer_gguf(tmp_path_factory.mktemp("tok") / "gpt2.gguf", "gpt2", list(B2U) + GPT2_EXTRA,
                                types=GPT2_TYPES, merges=GPT2_MERGES, pre="qwen2", bos=262, eos=262)


@pytest.fixture(scope="module")
def gpt2(gpt2_path):
    return load(gpt2_path)


def test_gpt2_reads_the_file(gpt2):
    assert gpt2.model == "gpt2" and gpt2.name == "gguf-gpt2" and gpt2.n_vocab == 264
    assert gpt2.pre_used == "qwen2" and gpt2.bos_id == 262 and gpt2.eos_id == 262
    assert gpt2.types[262] == CONTROL and gpt2.ranks[("Ġt", "h")] == 1


@pytest.mark.parametrize("text, want", [
    # "the": t h e; only (h,e) has a rank -> t, he
    ("the", [116, 258]),
    # " the": Ġ t h e; ranks (Ġ,t)=0 (h,e)=2 -> Ġt; then (Ġt,h)=1 beats (h,e)=2 -> Ġth; (h,e) is stale; (Ġth,e)=3
    (" the", [259]),
    # "the theme" pre-tokenizes to "the", " theme": [t, he], [Ġthe, m, e]
    ("the theme", [116, 258, 259, 109, 101]),
    # i n g: (i,n)=4 -> in; (in,g)=5 -> ing
    ("sing", [115, 261]),
    # qwen2 splits digits one by one; the space before a digit is its own piece
    ("x 42", [120, 32, 52, 50]),
    # contractions: "don" "'t"
    ("don't", [100, 111, 110, 39, 116]),
    # "  the": \s+(?!\S) takes one space, " the" the rest
    ("  the", [32, 259]),
])
def test_gpt2_hand_computed_ids(gpt2, text, want):
    assert gpt2.encode(text).tolist() == want
    assert gpt2.encode(text).dtype == np.int64


def test_gpt2_byte_fallback(gpt2):
    # é = C3 A9 -> symbols Ã ©; the merge (Ã,©) has rank 6 but 'Ã©' is not a token: its bytes' tokens
    assert bpe_merge("Ã©", gpt2.ranks) == ["Ã©"]
    assert gpt2.encode("é").tolist() == [0xC3, 0xA9]
    # characters with no merges at all are their byte symbols: 日 = E6 97 A5
    assert gpt2.encode("日").tolist() == [0xE6, 0x97, 0xA5]


def test_gpt2_special_tokens(gpt2):
    # user-defined tokens are whole pieces; control tokens in the text are not parsed (plain text)
    assert gpt2.encode("a<think>b").tolist() == [97, 263, 98]
    ids = gpt2.encode("<|endoftext|>").tolist()
    assert 262 not in ids and gpt2.decode(ids) == "<|endoftext|>"


@pytest.mark.parametrize("text", [
    "the theme", "  The café costs 42 € — naïve 日本語!\n\n\tx = f(y) # don't\r\n", "", " ", "\n",
    "a<think>b<think>"])
def test_gpt2_decode_round_trips(gpt2, text):
    assert gpt2.decode(gpt2.encode(text)) == text


def test_gpt2_keeps_repetition(gpt2):
    one = gpt2.encode(" the thing sings").tolist()
    assert gpt2.encode(" the thing sings" * 3).tolist() == one * 3
    ids = gpt2.encode("sing, sing; sing.").tolist()
    assert ids.count(261) == 3 and ids.count(115) == 3


def test_unicode_classes_follow_llama_cpp():
    pat = compiled((QWEN2,))
    # \p{N} includes No/Nl (one piece each, like a digit); letters after a non-letter join it
    assert regex_split("x½Ⅻ 7é", pat) == ["x", "½", "Ⅻ", " ", "7", "é"]
    # U+001C is not whitespace for llama.cpp (Python's \s would say it is): " \x1c" is one punctuation piece
    assert regex_split(" \x1cb", pat) == [" \x1c", "b"]
    # U+00A0 is whitespace, and a non-letter before letters joins them
    assert regex_split("a\u00a0b", pat) == ["a", "\u00a0b"]


def test_pre_tokenizers(tmp_path):
    toks = list(B2U)
    llama3 = load(write_tokenizer_gguf(tmp_path / "l3.gguf", "gpt2", toks, merges=["1 2"], pre="llama-bpe"))
    # \p{N}{1,3}: digits in threes; ignore_merges does not matter here (no multi-byte tokens)
    assert llama3.encode("12345").tolist() == [49, 50, 51, 52, 53] and llama3.ignore_merges
    # llama.cpp stops on a pre-tokenizer it does not know; so does this module, naming the supported ones
    for name in ("no-such-pre", "deepseek-coder", "deepseek-llm", "tekken"):
        with pytest.raises(TokenizerError, match=f"'{name}' is not supported; supported: .*falcon.*qwen35"):
            load(write_tokenizer_gguf(tmp_path / "odd.gguf", "gpt2", toks, merges=["1 2"], pre=name))
    assert not issubclass(TokenizerError, UserWarning) and issubclass(TokenizerError, GatherError)
    missing = load(write_tokenizer_gguf(tmp_path / "np.gguf", "gpt2", toks, merges=["1 2"]))
    assert missing.pre_used == "default"


# ---- llama: SentencePiece BPE -----------------------------------------------------------------------------------
# ids: 0 <unk>, 1 <s>, 2 </s>, 3..258 <0x00>..<0xFF>, then the pieces below (id 259 + index)
SPM_PIECES = [("▁", -1.0), ("a", -2.0), ("b", -2.0), ("c", -2.0), ("t", -2.0), ("h", -2.0), ("e", -2.0),
              #  259          260         261         262         263         264         265
              ("ab", -3.0), ("bc", -2.5), ("abc", -4.0), ("▁t", -1.5), ("he", -1.8), ("▁the", -1.2),
              #  266            267           268             269            270           271
              ("x", -2.0), ("y", -2.0), ("xy", -5.0), ("yx", -5.0)]
#              272          273          274            275


def spm_vocab(byte_tokens=True):
    toks = ["<unk>", "<s>", "</s>"] + ([f"<0x{b:02X}>" for b in range(256)] if byte_tokens else [])
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * (len(toks) - 3)
    scores = [0.0] * len(toks)
    toks += [p for p, _ in SPM_PIECES]
    scores += [s for _, s in SPM_PIECES]
    types += [NORMAL] * len(SPM_PIECES)
    return toks, types, scores


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    toks, types, scores = spm_vocab()
    return load(write_tokenizer_gguf(tmp_path_factory.mktemp("tok") / "spm.gguf", "llama", toks, types=types,
                                     scores=scores, bos=1, eos=2, unk=0))


@pytest.mark.parametrize("text, want", [
    # "▁the": bigrams ▁t(-1.5), th(no token), he(-1.8): ▁t first; (▁t,h) no token; he; then ▁the (-1.2)
    ("the", [271]),
    # "▁abc": ab(-3) bc(-2.5): bc first -> ▁ a bc; (a,bc)=abc(-4) -> ▁ abc; '▁abc' is no token
    ("abc", [259, 268]),
    # "▁xyx": xy and yx tie at -5: the leftmost (xy) wins -> ▁ xy x
    ("xyx", [259, 274, 272]),
    # "▁the▁the": the same piece twice
    ("the the", [271, 271]),
    # é (C3 A9) and 日 (E6 97 A5) are no tokens: their <0xXX> byte tokens (id 3 + byte)
    ("té", [269, 3 + 0xC3, 3 + 0xA9]),
    ("日", [259, 3 + 0xE6, 3 + 0x97, 3 + 0xA5]),
])
def test_spm_hand_computed_ids(spm, text, want):
    assert spm.add_space_prefix is True
    assert spm.encode(text).tolist() == want


def test_spm_without_byte_tokens_uses_unk(tmp_path):
    toks, types, scores = spm_vocab(byte_tokens=False)
    tok = load(write_tokenizer_gguf(tmp_path / "nb.gguf", "llama", toks, types=types, scores=scores, unk=0))
    # piece ids shift down by the 256 missing byte tokens: ▁t is 13; é's two bytes have no token: <unk> twice
    assert tok.encode("té").tolist() == [269 - 256, 0, 0]


def test_spm_no_space_prefix(tmp_path):
    toks, types, scores = spm_vocab()
    tok = load(write_tokenizer_gguf(tmp_path / "np.gguf", "llama", toks, types=types, scores=scores,
                                    add_space_prefix=False))
    # "the": t h e -> he(-1.8) -> t he;  " the" -> ▁the
    assert tok.encode("the").tolist() == [263, 270]
    assert tok.encode(" the").tolist() == [271]
    assert tok.decode(tok.encode(" the abc")) == " the abc"


@pytest.mark.parametrize("text", ["the abc", "  the\n\nxyx té 日本", "x", ""])
def test_spm_decode_round_trips(spm, text):
    assert spm.decode(spm.encode(text)) == text


def test_spm_keeps_repetition(spm):
    one = spm.encode("the abc").tolist()
    assert spm.encode("the abc the abc the abc").tolist() == one * 3


# ---- gemma4: SentencePiece-style BPE ----------------------------------------------------------------------------
def gemma4_vocab():
    toks = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]   # bytes: 4 + b
    extra = ["\n", "\n\n", "▁", "t", "h", "e", "▁t", "▁th", "▁the", "th"]
    #         260   261     262  263  264  265  266   267    268     269
    toks += extra
    types = [CONTROL, CONTROL, CONTROL, UNKNOWN] + [BYTE] * 256 + [NORMAL] * len(extra)
    merges = ["▁ t", "t h", "▁t h", "▁th e"]      # ranks 0..3
    return toks, types, merges


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    toks, types, merges = gemma4_vocab()
    return load(write_tokenizer_gguf(tmp_path_factory.mktemp("tok") / "g4.gguf", "gemma4", toks, types=types,
                                     merges=merges, bos=2, eos=1, unk=3))


@pytest.mark.parametrize("text, want", [
    # no space prefix: "the" -> (t,h)=1 -> th e
    ("the", [269, 265]),
    # "▁the": (▁,t)=0 -> ▁t; (▁t,h)=2 -> ▁th; (▁th,e)=3 -> ▁the
    (" the", [268]),
    # newline runs split the text; "\n\n" is a token and stays whole, "\n\n\n" is not: three "\n"
    ("the\n\n the", [269, 265, 261, 268]),
    ("\n\n\n", [260, 260, 260]),
    # no token for é: <0xC3> <0xA9>
    ("é", [4 + 0xC3, 4 + 0xA9]),
])
def test_gemma4_hand_computed_ids(gemma4, text, want):
    assert gemma4.encode(text).tolist() == want


@pytest.mark.parametrize("text", ["the the", " the\n\n\nthé 日", ""])
def test_gemma4_decode_round_trips(gemma4, text):
    assert gemma4.decode(gemma4.encode(text)) == text


# ---- the merge loops against a plain reference ------------------------------------------------------------------
def _ref_bpe(word, ranks):
    sym = list(word)
    while True:
        best = None
        for i in range(len(sym) - 1):
            r = ranks.get((sym[i], sym[i + 1]))
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            return sym
        i = best[1]
        sym[i:i + 2] = [sym[i] + sym[i + 1]]


def _ref_spm(text, ids, scores):
    sym = list(text)
    while True:
        best = None
        for i in range(len(sym) - 1):
            t = ids.get(sym[i] + sym[i + 1])
            if t is not None and (best is None or scores[t] > best[0]):
                best = (scores[t], i)
        if best is None:
            return sym
        i = best[1]
        sym[i:i + 2] = [sym[i] + sym[i + 1]]


def test_merge_loops_match_the_reference():
    rng = random.Random(5)
    alphabet = "ab▁c"
    for _ in range(150):
        pieces = {"".join(rng.choice(alphabet) for _ in range(rng.randint(2, 4))) for _ in range(rng.randint(1, 25))}
        ids = {p: i for i, p in enumerate(sorted(pieces))}
        scores = [float(rng.randint(-3, 0)) for _ in ids]          # small range: many ties
        ranks = {}
        for p in sorted(pieces):
            k = rng.randint(1, len(p) - 1)
            ranks.setdefault((p[:k], p[k:]), len(ranks))
        for _ in range(10):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
            assert spm_merge(text, ids, scores) == _ref_spm(text, ids, scores)
            assert bpe_merge(text, ranks) == _ref_bpe(text, ranks)


def test_cuts_do_not_change_ids():
    # a token (llama) or merge (gemma4) joining 'a' to a following ▁ forbids the cut after 'a', not after 'b'
    rng = random.Random(7)
    toks = ["<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁", "a", "b", "a▁", "a▁b", "▁b", "ab", "▁a"]
    scores = [0.0] * 257 + [-1.0, -1.0, -1.0, -3.0, -0.5, -2.0, -1.5, -2.5]
    tok = GGUFTokenizer("llama", toks, scores=scores, unk_id=0)
    assert tok._cut.split("a▁b▁a") == ["a▁b", "▁a"]
    for _ in range(200):
        text = "".join(rng.choice("ab  ") for _ in range(rng.randint(0, 25)))
        want = [tok.ids[p] for p in _ref_spm((" " + text).replace(" ", SP), tok.ids, tok.scores)] if text else []
        assert tok.encode(text).tolist() == want
    g4 = GGUFTokenizer("gemma4", toks, merges=["▁ b", "a ▁", "a b", "a▁ b", "▁ a"])
    assert g4._cut.split("a▁b▁a") == ["a▁b", "▁a"]
    for _ in range(200):
        text = "".join(rng.choice("ab ") for _ in range(rng.randint(0, 25)))
        want = [g4.ids[p] for p in _ref_bpe(text.replace(" ", SP), g4.ranks)]
        assert g4.encode(text).tolist() == want


# ---- files without a tokenizer, unsupported ones ------------------------------------------------------------------
def test_no_tokenizer_gives_none(tmp_path):
    r = read_gguf(write_tokenizer_gguf(tmp_path / "none.gguf"))
    assert GGUFTokenizer.from_reader(r) is None and tokenizer_name(r) == "word-level"


def test_unsupported_model_raises(tmp_path):
    r = read_gguf(write_tokenizer_gguf(tmp_path / "bert.gguf", "bert", ["[PAD]", "a"]))
    assert tokenizer_name(r) == "gguf-bert"
    with pytest.raises(TokenizerError, match="'bert' is not supported; supported: gpt2, llama, gemma4"):
        GGUFTokenizer.from_reader(r)
    with pytest.raises(TokenizerError, match="needs tokenizer.ggml.merges"):
        load(write_tokenizer_gguf(tmp_path / "nm.gguf", "gpt2", list(B2U)))


# ---- prompts ------------------------------------------------------------------------------------------------------
def test_default_text_encodes_fast_and_exactly(gpt2, spm, gemma4):
    text = default_text()
    for tok in (gpt2, spm, gemma4):
        tok._cache.clear()
        t0 = time.perf_counter()
        ids = tok.encode(text)
        took = time.perf_counter() - t0
        assert took < 5.0, f"{tok.model}: {took:.2f} s"
        assert tok.decode(ids) == text
    assert ids.size > 100_000


def test_prompt_tokens_use_the_tokenizer(gpt2, tmp_path):
    p = tmp_path / "p.txt"
    p.write_text("the thing sings")
    ids = gpt2.encode("the thing sings")
    assert np.array_equal(prompt_tokens(10, (), p, tokenizer=gpt2), ids)
    assert np.array_equal(prompt_tokens(10, (), p, n_tokens=ids.size * 2 + 1, tokenizer=gpt2),
                          np.concatenate([ids, ids, ids[:1]]))


def _qwen4exp_model(path, ggufs, with_tokenizer: bool, rows: int = 3000):
    """A small qwen4exp-layout model (IQ4_NL table of width 160), optionally carrying the gpt2 tokenizer above."""
    from gds_gather.model.qwen4exp import Qwen4expHParams
    from gds_gather.model.presets import get_preset
    hp = Qwen4expHParams.from_preset(get_preset("qwen4exp"), rows=rows)

    def extra(w):
        w.add_block_count(2)
        w.add_embedding_length(64)
        for key, val, vtype, sub in hp.gguf_kv():
            w.add_key_value(key, val, vtype, sub)
        w.add_tensor(ggufs.PLE, ggufs.rows(GGMLQuantizationType.IQ4_NL, rows, 160),
                     raw_dtype=GGMLQuantizationType.IQ4_NL)

    if with_tokenizer:
        return write_tokenizer_gguf(path, "gpt2", list(B2U) + GPT2_EXTRA, types=GPT2_TYPES, merges=GPT2_MERGES,
                                    pre="qwen2", eos=262, arch="qwen4exp", extra=extra)
    return write_tokenizer_gguf(path, arch="qwen4exp", extra=extra)


def test_prefill_uses_the_models_tokenizer(tmp_path, ggufs, gpt2):
    pytest.importorskip("torch")
    import torch
    from gds_gather.prefill.run import run_prefill
    model = _qwen4exp_model(tmp_path / "q.gguf", ggufs, with_tokenizer=True)
    prompt = tmp_path / "prompt.txt"
    text = "The thing sings; the theme sings. " * 20 + "Naïve café 42 — 日本."
    prompt.write_text(text)
    lines = []
    kw = dict(n_tokens=None, ubatch=64, progress=False, trunk="none", collect=True)
    res = run_prefill(model, prompt=prompt, log=lines.append, **kw)
    want = gpt2.encode(text)
    assert res["tokenizer"] == "gguf-gpt2" and res["tokens"] == want.size
    assert any(line.startswith("prompt") and "tokenizer gguf-gpt2" in line for line in lines)
    ref = run_prefill(model, tokens_override=want, log=None, **kw)   # the same PLE rows as the tokenizer's ids
    assert len(res["outputs"]) == len(ref["outputs"])
    assert all(torch.equal(a[0], b[0]) for a, b in zip(res["outputs"], ref["outputs"]))

    plain = _qwen4exp_model(tmp_path / "plain.gguf", ggufs, with_tokenizer=False)
    res = run_prefill(plain, prompt=prompt, log=lines.append, **kw)
    assert res["tokenizer"] == "word-level" and any("tokenizer word-level" in line for line in lines)
    assert res["tokens"] != want.size        # the word-level mapping: a different stream


# ---- llama.cpp's own vectors (tests/data/llama-vocab: test-tokenizer-0's .inp/.out, MIT) ---------------------------
VOCAB_DIR = Path(__file__).parents[1] / "data" / "llama-vocab"
VOCABS = ("gpt-2", "llama-bpe", "qwen2", "qwen35", "mpt", "llama-spm", "phi-3", "gemma-4",
          "starcoder", "refact", "falcon", "command-r")


@pytest.fixture(scope="module")
def llama_vocab(tmp_path_factory):
    """name -> GGUFTokenizer of llama.cpp's vocabulary file (decompressed once per module)."""
    cache: dict = {}

    def get(name):
        if name not in cache:
            path = tmp_path_factory.mktemp("vocab") / f"ggml-vocab-{name}.gguf"
            path.write_bytes(lzma.decompress((VOCAB_DIR / f"ggml-vocab-{name}.gguf.xz").read_bytes()))
            cache[name] = load(path)
        return cache[name]
    return get


def vocab_cases(name):
    """(text, ids) pairs as llama.cpp's test-tokenizer-0 reads them: texts split on the separator line, one .out
    line of ids per text (a last text without a trailing separator counts when the .out has its line)."""
    texts = (VOCAB_DIR / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    lines = (VOCAB_DIR / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if texts[-1] == "" or len(lines) < len(texts):
        texts.pop()
    assert len(lines) == len(texts) >= 40, (name, len(lines), len(texts))
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]


def test_vocab_files_are_all_here():
    assert sorted(p.name for p in VOCAB_DIR.glob("*.xz")) == sorted(f"ggml-vocab-{v}.gguf.xz" for v in VOCABS)
    assert (VOCAB_DIR / "LICENSE").read_text().startswith("MIT License")
    assert sum(p.stat().st_size for p in VOCAB_DIR.iterdir()) < 25e6


@pytest.mark.parametrize("name", VOCABS)
def test_llama_cpp_vectors(llama_vocab, name):
    tok = llama_vocab(name)
    cases = vocab_cases(name)
    bad = [(text, tok.encode(text).tolist(), want) for text, want in cases if tok.encode(text).tolist() != want]
    assert not bad, f"{name}: {len(bad)} of {len(cases)} differ from llama.cpp, first: {bad[0]}"


def test_control_looking_tokens_follow_llama_cpp(llama_vocab):
    """llama.cpp re-marks end-of-generation texts as control at load, so plain text never yields them."""
    phi3 = llama_vocab("phi-3")
    s = phi3.ids["</s>"]
    assert phi3.types[s] == USER_DEFINED and phi3.attrs[s] & 8      # user-defined in the file, control after load
    ids = phi3.encode("x</s>y").tolist()
    assert s not in ids and phi3.decode(ids) == "x</s>y"
    g4 = llama_vocab("gemma-4")
    tr = g4.ids["<|tool_response>"]
    assert g4.types[tr] == USER_DEFINED
    ids = g4.encode("a<|tool_response>b").tolist()
    assert tr not in ids and g4.decode(ids) == "a<|tool_response>b"
    # other user-defined tokens are still whole pieces
    assert g4.encode("<tool_response|>").tolist() == [g4.ids["<tool_response|>"]]


def test_llama_attrs_rules():
    extra = ["<|fim_prefix|>", "<|end|>", "<|return|>", "<|call|>", "<|channel|>", "</s>", "<|tool_response>", "hi"]
    types = [NORMAL] * 256 + [USER_DEFINED] * 7 + [NORMAL]
    tok = GGUFTokenizer("gpt2", list(B2U) + extra, merges=["h i"], types=types)
    a = {t: tok.attrs[tok.ids[t]] for t in extra}
    assert a["<|fim_prefix|>"] == 16 | 8                    # FIM text, no fim id in the file: control
    assert a["<|end|>"] == 16 and a["<|channel|>"] == 16    # o200k_harmony's <|end|>, gpt-oss's channel: user-defined
    assert a["<|return|>"] == a["<|call|>"] == 16 | 8 and a["<|tool_response>"] == 16 | 8
    assert a["</s>"] == 4                                   # normal when <|tool_response> ends generation
    assert tok.encode("<|end|><|call|>").tolist() == [256 + 1, *tok.encode("<|call|>").tolist()]
    named = GGUFTokenizer("gpt2", list(B2U) + extra, merges=["h i"], types=types, special={"fim_pre": 5})
    assert named.attrs[named.ids["<|fim_prefix|>"]] == 16   # the file names its FIM id: no re-marking by text
    assert named.encode("<|fim_prefix|>").tolist() == [named.ids["<|fim_prefix|>"]]


# ---- streaming: a prompt read chunk by chunk gives the ids of one read --------------------------------------------
@pytest.mark.parametrize("name", ["qwen2", "llama-bpe", "llama-spm", "phi-3", "gemma-4", "falcon"])
def test_streamed_prompt_equals_one_read(llama_vocab, name, tmp_path, monkeypatch):
    import gds_gather.prefill.prompts as text_mod
    tok = llama_vocab(name)
    text = "".join(t + "\n" for t, _ in vocab_cases(name)) * 2 + "<|tool_response> x</s> <tool_response|> end"
    p = tmp_path / "p.txt"
    p.write_text(text, encoding="utf-8")
    want = tok.encode(text)
    for chunk in (7, 61, 4096):
        monkeypatch.setattr(text_mod, "CHUNK_BYTES", chunk)
        got = prompt_tokens(0, (), p, tokenizer=tok)
        assert got.tolist() == want.tolist(), chunk
        n = want.size // 3
        assert prompt_tokens(0, (), p, n_tokens=n, tokenizer=tok).tolist() == want[:n].tolist()


def test_safe_cut_with_user_tokens(gpt2, spm, gemma4):
    rng = random.Random(11)
    for tok in (gpt2, spm, gemma4):
        for _ in range(300):
            text = "".join(rng.choice(["a", " ", "the", "<think>", " <think>", "\n", "é", "!", "  ", "x "])
                           for _ in range(rng.randint(0, 30)))
            k = tok.safe_cut(text)
            if k:
                assert text[k] == " "
                joined = tok.encode(text[:k]).tolist() + tok.encode(text[k:], continued=True).tolist()
                assert joined == tok.encode(text).tolist(), (tok.model, text, k)
