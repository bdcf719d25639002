"""family.per_layer_layout when a GGUF carries only one of {arch}.block_count and
{arch}.embedding_length_per_layer_input (issue 17): the other comes from the row width, and the rows read
split as the file's bytes do."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFWriter

import gds_gather as gg
from gds_gather.errors import TableLayoutError
from gds_gather.prefill.family import per_layer_layout

VOCAB, N_LAYER, PER = 8, 3, 16


def _gguf(path, *, block_count=None, per_layer=None):
    rows = np.arange(VOCAB * N_LAYER * PER, dtype=np.float32).reshape(VOCAB, N_LAYER * PER)
    w = GGUFWriter(str(path), "gemma4")
    if block_count is not None:
        w.add_uint32("gemma4.block_count", block_count)
    if per_layer is not None:
        w.add_uint32("gemma4.embedding_length_per_layer_input", per_layer)
    w.add_tensor("per_layer_token_embd.weight", rows)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return rows


@pytest.mark.parametrize("given", ["block_count", "per_layer"])
def test_one_key_is_enough_when_it_divides_the_row(tmp_path, given):
    path = tmp_path / f"{given}.gguf"
    rows = _gguf(path, **({given: N_LAYER if given == "block_count" else PER}))
    with gg.open_table(path) as t:
        assert t.field("gemma4.block_count" if given == "per_layer" else
                       "gemma4.embedding_length_per_layer_input") is None
        n_layer, per = per_layer_layout(t)
        assert (int(n_layer), int(per)) == (N_LAYER, PER)
        got = t.read_rows([5, 0]).view(np.float32).reshape(2, n_layer, per)   # F32: the raw row bytes
        np.testing.assert_array_equal(got[0, 2], rows[5, 2 * PER:3 * PER])


def test_a_key_that_does_not_divide_the_row_leaves_no_layout(tmp_path):
    path = tmp_path / "odd.gguf"
    _gguf(path, per_layer=PER * N_LAYER + 1)
    with gg.open_table(path) as t, pytest.raises(TableLayoutError, match=r"no per-layer layout for its 48-element "
                                                                         r"rows \(arch 'gemma4' has no"):
        per_layer_layout(t)
