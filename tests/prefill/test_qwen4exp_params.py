"""Qwen4expHParams' refusals of impossible hash parameters, from_fields' missing / multi-layer keys, a preset
without n-gram PLE, and next_prev for a 1-gram (issue 17). Each refusal names the parameter and its value."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gds_gather.model.presets import PRESETS

from gds_gather.model.qwen4exp import Qwen4expHParams, next_prev
from gds_gather.model import qwen4exp as q

GOOD = dict(ngram_size=3, heads_per_ngram=2, multipliers=(3, 5, 7), head_offsets=(0, 10, 20, 30),
            head_vocab_sizes=(10, 10, 10, 10), eos_token_id=1, image_token_id=None)


def test_good_parameters_hold():
    h = Qwen4expHParams(**GOOD)
    assert (h.n_heads, h.n_rows) == (4, 40)


@pytest.mark.parametrize("change, message", [
    (dict(ngram_size=1), r"^ngram_size must be >= 2, got 1$"),
    (dict(heads_per_ngram=0), r"^heads_per_ngram must be >= 1, got 0$"),
    (dict(multipliers=(3, 5, 1 << 64)), r"^multipliers must be unsigned 64-bit integers$"),
    (dict(multipliers=(3, -5, 7)), r"^multipliers must be unsigned 64-bit integers$"),
    (dict(head_vocab_sizes=(10, 0, 10, 10)), r"^head vocab sizes must be >= 1 and offsets >= 0$"),
    (dict(head_offsets=(0, -1, 20, 30)), r"^head vocab sizes must be >= 1 and offsets >= 0$"),
    (dict(eos_token_id=-1), r"^token ids must be >= 0$"),
    (dict(image_token_id=-2), r"^token ids must be >= 0$"),
])
def test_impossible_parameters_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        Qwen4expHParams(**{**GOOD, **change})


def _fields(h, **over):
    kv = {q.KEY_PLE_LAYERS: [h.ple_layer], q.KEY_NGRAM_SIZE: h.ngram_size, q.KEY_HEADS_PER_NGRAM: h.heads_per_ngram,
          q.KEY_MULTIPLIERS: list(h.multipliers), q.KEY_HEAD_OFFSETS: list(h.head_offsets),
          q.KEY_HEAD_VOCAB_SIZES: list(h.head_vocab_sizes), q.KEY_EOS: h.eos_token_id, q.KEY_HEAD_DIM: h.head_dim}
    kv.update(over)
    return kv


def test_from_fields_round_trips_and_names_what_is_wrong():
    h = Qwen4expHParams(**GOOD)
    assert Qwen4expHParams.from_fields(_fields(h).get) == dataclasses.replace(h, conv_kernel=4)
    kv = _fields(h)
    del kv[q.KEY_MULTIPLIERS]
    with pytest.raises(KeyError, match=rf"GGUF key '{q.KEY_MULTIPLIERS}' is missing"):
        Qwen4expHParams.from_fields(kv.get)
    with pytest.raises(ValueError, match=rf"^{q.KEY_PLE_LAYERS} must hold exactly one layer, got \[1, 2\]$"):
        Qwen4expHParams.from_fields(_fields(h, **{q.KEY_PLE_LAYERS: [1, 2]}).get)


def test_a_preset_without_ngram_ple_has_no_hash_parameters():
    with pytest.raises(ValueError, match=r"^preset 'gemma4-e2b' has no n-gram PLE$"):
        Qwen4expHParams.from_preset(PRESETS["gemma4-e2b"])


def test_next_prev_of_a_1_gram_keeps_nothing():
    got = next_prev(np.array([4, 5, 6]), np.array([1, 2]), 1)
    assert got.dtype == np.int64 and got.shape == (0,)
    np.testing.assert_array_equal(next_prev(np.array([4, 5, 6]), np.array([1, 2]), 3), [5, 6])
