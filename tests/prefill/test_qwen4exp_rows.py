"""qwen4exp n-gram row index: the vectorized ple_rows against a plain per-token reference."""
import numpy as np
import pytest

from gds_gather.model.presets import PRESETS

from gds_gather.model.qwen4exp import Qwen4expHParams, hashed_tokens, next_prev, ple_rows

U64 = 2 ** 64


def reference_rows(stream, hp, prev=(), image=None):
    """Straight from llama.cpp's llm_graph_input_ple::set_input, plain Python ints, one token at a time."""
    img = hp.image_token_id if hp.image_token_id is not None else hp.eos_token_id
    toks = [img if (image is not None and image[i]) else int(t) for i, t in enumerate(stream)]
    full = [int(t) for t in prev] + toks
    base = len(prev)
    N, eos, hpn = hp.ngram_size, hp.eos_token_id, hp.heads_per_ngram
    out = []
    for i in range(len(toks)):
        pos = base + i
        ctx = [full[pos]]
        cut = False
        for s in range(1, N):
            t = full[pos - s] if pos - s >= 0 else -1
            cut = cut or t < 0 or t == eos
            ctx.append(eos if cut else t)
        row = []
        for n in range(2, N + 1):
            mixed = 0
            for j in range(n):
                mixed ^= (ctx[j] * hp.multipliers[j]) % U64
            for g in range(hpn):
                h = (n - 2) * hpn + g
                row.append(mixed % hp.head_vocab_sizes[h] + hp.head_offsets[h])
        out.append(row)
    return np.array(out, dtype=np.int64).reshape(len(toks), hp.n_heads)


def synthetic_hparams(ngram_size, heads_per_ngram=3, seed=0, image=True):
    rng = np.random.default_rng(seed)
    n_heads = (ngram_size - 1) * heads_per_ngram
    mult = [int(x) for x in rng.integers(0, U64 - 1, ngram_size + 1, dtype=np.uint64, endpoint=True)]
    mult[0] |= 1 << 63            # force products past 2**64
    vocab = [int(v) for v in rng.integers(5, 1000, n_heads)]
    offsets = np.concatenate([[0], np.cumsum(vocab)[:-1]]).tolist()
    return Qwen4expHParams(ngram_size=ngram_size, heads_per_ngram=heads_per_ngram, multipliers=mult,
                           head_offsets=offsets, head_vocab_sizes=vocab, eos_token_id=7,
                           image_token_id=9 if image else None, head_dim=32, ple_layer=1)


def token_stream(n, seed, vocab=40, eos=7, p_eos=0.08):
    rng = np.random.default_rng(seed)
    t = rng.integers(0, vocab, n)
    t[rng.random(n) < p_eos] = eos
    return t


REAL = Qwen4expHParams.from_preset(PRESETS["qwen4exp"])


@pytest.mark.parametrize("ngram_size", [2, 3, 4])
def test_matches_reference(ngram_size):
    hp = synthetic_hparams(ngram_size, seed=ngram_size)
    toks = token_stream(400, seed=ngram_size)
    got = ple_rows(toks, hp)
    assert got.dtype == np.int64 and got.shape == (400, hp.n_heads)
    np.testing.assert_array_equal(got, reference_rows(toks, hp))


def test_real_preset_multipliers():
    rng = np.random.default_rng(1)
    toks = rng.integers(0, PRESETS["qwen4exp"].n_vocab, 300)
    toks[::17] = REAL.eos_token_id
    got = ple_rows(toks, REAL)
    np.testing.assert_array_equal(got, reference_rows(toks, REAL))
    assert REAL.n_heads == 16
    assert got.min() >= 0 and got.max() < PRESETS["qwen4exp"].n_rows
    for h in range(16):   # each head stays in its own slice of the table
        assert np.all((got[:, h] >= REAL.head_offsets[h])
                      & (got[:, h] < REAL.head_offsets[h] + REAL.head_vocab_sizes[h]))


@pytest.mark.parametrize("ngram_size", [2, 3, 4])
def test_chunks_with_carried_prev_equal_whole_stream(ngram_size):
    hp = synthetic_hparams(ngram_size, seed=10 + ngram_size)
    toks = token_stream(500, seed=20 + ngram_size)
    image = np.random.default_rng(3).random(500) < 0.1
    whole = ple_rows(toks, hp, image_mask=image)
    np.testing.assert_array_equal(whole, reference_rows(toks, hp, image=image))
    cuts = [0, 1, 2, 3, 50, 51, 200, 333, 499, 500]   # includes 0- and 1-token chunks
    prev, parts = None, []
    for a, b in zip(cuts[:-1], cuts[1:]):
        parts.append(ple_rows(toks[a:b], hp, prev=prev, image_mask=image[a:b]))
        prev = next_prev(hashed_tokens(toks[a:b], hp, image[a:b]), prev, ngram_size)
        assert len(prev) == min(ngram_size - 1, b)
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_prev_none_is_sequence_start_and_partial_prev():
    hp = synthetic_hparams(4, seed=5)
    toks = token_stream(30, seed=6, p_eos=0.0)
    # prev=None and an empty prev are both the sequence start
    np.testing.assert_array_equal(ple_rows(toks, hp), ple_rows(toks, hp, prev=[]))
    # a prev shorter than ngram_size-1 means the sequence started just before it
    np.testing.assert_array_equal(ple_rows(toks[1:], hp, prev=toks[:1]), ple_rows(toks, hp)[1:])
    # a longer prev is cut to its last ngram_size-1 tokens
    np.testing.assert_array_equal(ple_rows(toks[10:], hp, prev=toks[:10]), ple_rows(toks, hp)[10:])
    # at the sequence start every predecessor reads as EOS
    first = ple_rows(toks[:1], hp)
    assert first.shape == (1, hp.n_heads)
    np.testing.assert_array_equal(first, reference_rows([toks[0]], hp))


def test_eos_cuts_predecessors_but_not_itself():
    hp = synthetic_hparams(3, seed=8)
    eos = hp.eos_token_id
    # [a, b, EOS, c, d]: c sees (c, EOS, EOS) like a sequence start; EOS itself keeps its context
    toks = np.array([11, 12, eos, 13, 14])
    rows = ple_rows(toks, hp)
    np.testing.assert_array_equal(rows[3], ple_rows([13], hp)[0])
    np.testing.assert_array_equal(rows[4], ple_rows([13, 14], hp)[1])
    np.testing.assert_array_equal(rows, reference_rows(toks, hp))


def test_image_positions():
    hp = synthetic_hparams(3, seed=9)
    toks = token_stream(60, seed=9)
    mask = np.zeros(60, bool)
    mask[10:20] = True
    subst = toks.copy()
    subst[mask] = hp.image_token_id
    np.testing.assert_array_equal(ple_rows(toks, hp, image_mask=mask), ple_rows(subst, hp))
    # without an image token id, image positions hash EOS (and so cut what follows)
    hp2 = synthetic_hparams(3, seed=9, image=False)
    subst2 = toks.copy()
    subst2[mask] = hp2.eos_token_id
    np.testing.assert_array_equal(ple_rows(toks, hp2, image_mask=mask), ple_rows(subst2, hp2))
    np.testing.assert_array_equal(ple_rows(toks, hp2, image_mask=mask), reference_rows(toks, hp2, image=mask))


def test_bad_input():
    hp = synthetic_hparams(3)
    with pytest.raises(ValueError):
        ple_rows([1, -2, 3], hp)
    with pytest.raises(ValueError):
        ple_rows(np.array([[1, 2]]), hp)
    with pytest.raises(ValueError):
        ple_rows(np.array([1.0, 2.0]), hp)
    with pytest.raises(ValueError):
        ple_rows([1, 2], hp, image_mask=[True])
    assert ple_rows(np.array([], np.int64), hp).shape == (0, hp.n_heads)


def test_hparams_validation_and_helpers():
    hp = synthetic_hparams(3)
    assert hp.n_heads == 6 and hp.n_rows == sum(hp.head_vocab_sizes)
    with pytest.raises(ValueError):
        Qwen4expHParams(3, 2, (1, 2), (0, 1, 2, 3), (1, 1, 1, 1), eos_token_id=0)   # too few multipliers
    with pytest.raises(ValueError):
        Qwen4expHParams(3, 2, (1, 2, 3), (0, 1), (1, 1), eos_token_id=0)            # wrong head count
    assert next_prev([1, 2, 3, 4], None, 3).tolist() == [3, 4]
    assert next_prev([5], [3, 4], 3).tolist() == [4, 5]
    assert next_prev([5], None, 3).tolist() == [5]
    assert next_prev([5], [1], 2).tolist() == [5]


@pytest.mark.parametrize("rows", [16, 300, 3000, 320001536])
def test_from_preset_fits_rows(rows):
    hp = Qwen4expHParams.from_preset(PRESETS["qwen4exp"], rows)
    assert hp.n_heads == 16 and hp.head_dim == 160 and hp.ple_layer == 1
    assert hp.multipliers == PRESETS["qwen4exp"].multipliers
    assert hp.eos_token_id == 248044 and hp.image_token_id == 248056
    assert all(v >= 1 for v in hp.head_vocab_sizes)
    assert hp.n_rows <= rows
    ends = np.array(hp.head_offsets) + np.array(hp.head_vocab_sizes)
    assert np.all(ends[:-1] == np.array(hp.head_offsets[1:]))   # cumulative, no overlap
    with pytest.raises(ValueError):
        Qwen4expHParams.from_preset(PRESETS["qwen4exp"], 15)
