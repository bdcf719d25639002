"""family.py: each model family's row ids, kernel layout and trunk rows, against the kernel's documented contract
(dequant_gpu.dequant_scatter: flat [N, row_elems]; per_layer out[l, i, j] = row_i[l * per_layer + j] x scale)."""
from __future__ import annotations

import numpy as np
import pytest

from gds_gather import open_table
from gds_gather.prefill.family import Qwen4exp, TokenRows, family_of
from gds_gather.model.presets import PRESETS
from gds_gather.model.qwen4exp import ple_rows
from gds_gather.model.synth import write_model


@pytest.mark.parametrize("preset", ["qwen4exp", "gemma4-e2b", "gemma3n-e2b"])
def test_family_rows_follow_the_kernel_layout(tmp_path, preset):
    torch = pytest.importorskip("torch")
    p = PRESETS[preset]
    path = write_model(tmp_path / "m.gguf", preset, rows=64, progress=False)
    tokens = np.array([3, 1, 4, 1, 5, 9, 2, 6], np.int64)
    n = tokens.size
    with open_table(path) as t:
        f = family_of(t)
        ids, prev = f.row_ids(tokens, None)
        rows = t.gather(ids).reshape(n * f.rows_per_token, -1)  # gguf's dequantization, float32 [n * R, width]
        out = f.trunk_rows(f.kernel_rows(torch.from_numpy(rows.copy()), n), n)
        args = f.kernel_args()
        if p.is_ngram:
            assert isinstance(f, Qwen4exp) and not f.split_per_layer and f.layout_note() == ""
            assert f.rows_per_token == f.hp.n_heads > 1 and ids.shape == (n, f.hp.n_heads)
            np.testing.assert_array_equal(ids, ple_rows(tokens, f.hp))
            assert prev is not None                            # the n-gram history goes on to the next ubatch
            assert args == {"layout": "flat"}
            want = rows.reshape(n, -1)                         # [T, n_heads x width], unscaled
        else:
            assert isinstance(f, TokenRows) and f.split_per_layer
            assert (f.n_layer, f.per_layer) == (p.n_layer, p.n_embd_per_layer)
            np.testing.assert_array_equal(ids, tokens)         # one row per token, the token id itself
            assert prev is None
            assert args == {"layout": "per_layer", "n_layer": p.n_layer, "scale": float(np.sqrt(p.n_embd_per_layer))}
            assert f.layout_note() == f"; {p.n_layer} layers x {p.n_embd_per_layer} per layer"
            want = (rows.reshape(n, p.n_layer, p.n_embd_per_layer) * args["scale"]).transpose(1, 0, 2)
        assert tuple(out.shape) == want.shape and f.ple_width == p.row_width * f.rows_per_token
        np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=0)
        preset_for_trunk, layout = f.trunk_preset()
        assert preset_for_trunk.arch == p.arch
        if not p.is_ngram:
            assert layout == {"n_layer": p.n_layer, "n_embd_per_layer": p.n_embd_per_layer}
