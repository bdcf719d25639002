"""The synthetic trunk (model/trunk.py): configs, real shapes on 'meta', determinism, causality, tolerances.

Tolerances: a float32 forward is bitwise reproducible (same seed, same input, same machine). bfloat16 weights and
activations (norms, softmax and RoPE in float32) stay within 5e-2 of float32 in relative Frobenius norm over
the final hidden states; measured ~1.2e-2 (gemma) and ~1.6e-2 (qwen4exp) on the tiny configs: bf16 keeps 8
mantissa bits (4e-3 per rounding) and the error grows over a few layers, so 5e-2 leaves ~3x margin.
"""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gds_gather.model.presets import PRESETS  # noqa: E402

from gds_gather.model.trunk import Trunk, TrunkConfig  # noqa: E402

from gds_gather.model.gemma import per_layer_inputs_np  # noqa: E402

ARCHS = ("gemma4", "gemma3n", "qwen4exp")
BF16_RTOL = 5e-2
T = 24


def make_inputs(cfg, seed=0, T=T):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 262144, (T,), generator=g)
    rows = torch.randn(T, cfg.ple_width, generator=g) * 0.1
    return tokens, rows


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


# ---- configs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(PRESETS))
def test_from_preset_real_shapes(name):
    p = PRESETS[name]
    c = TrunkConfig.from_preset(name)
    assert (c.arch, c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.head_dim, c.n_ff) == \
        (p.arch, p.n_layer, p.n_embd, p.n_head, p.n_head_kv, p.head_dim, p.n_ff)
    if p.is_ngram:
        assert (c.ple_layer, c.n_ple_heads, c.conv_kernel, c.conv_dilation) == (1, 16, 4, 3)
        assert c.ple_width == 16 * 160 == p.row_width * 16
    else:
        assert c.ple_layer is None and c.ple_width == p.row_width == p.n_layer * 256
    small = TrunkConfig.from_preset(p, n_layer=2, ple_layer=None)
    assert small.n_layer == 2 and small.ple_width == (2 * 256 if not p.is_ngram else 16 * 160)


def test_config_validation():
    for arch in ARCHS:
        assert TrunkConfig.tiny(arch).arch == arch
    assert TrunkConfig.tiny("gemma4").ple_width == 3 * 32
    assert TrunkConfig.tiny("qwen4exp").ple_width == 16 * 160
    # ple_width fits a table's rows (what a prefill over a real-layout table needs)
    g = TrunkConfig.tiny("gemma4", n_layer=35, ple_width=8960)
    assert (g.n_layer, g.n_embd_per_layer, g.ple_width) == (35, 256, 8960)
    q = TrunkConfig.tiny("qwen4exp", n_layer=None, ple_width=8 * 160)
    assert (q.n_layer, q.n_ple_heads, q.ple_width) == (3, 8, 1280)
    with pytest.raises(ValueError, match="multiple"):
        TrunkConfig.tiny("gemma4", ple_width=100)
    with pytest.raises(ValueError, match="arch"):
        TrunkConfig.tiny("llama")
    with pytest.raises(ValueError, match="n_head_kv"):
        TrunkConfig.tiny("gemma4", n_head_kv=3)
    with pytest.raises(ValueError, match="ple_layer"):
        TrunkConfig.tiny("qwen4exp", ple_layer=3)


def expected_params(c):
    """Parameter count from the config, written out independently of Trunk."""
    D, P, Dh = c.n_embd, c.n_embd_per_layer, c.head_dim
    layer = 2 * D + D * c.n_head * Dh * 2 + 2 * D * c.n_head_kv * Dh + 3 * D * c.n_ff
    total = c.vocab_hash * D + D + c.n_layer * layer
    if c.is_gemma:
        total += c.n_layer * (2 * P * D + D) + c.n_layer * P * D + P
    else:
        C = c.n_ple_heads * P
        total += D + C * D + 2 * c.n_ple_heads * P * P + 2 * P + C * c.conv_kernel + D * C
    return total


@pytest.mark.parametrize("name", list(PRESETS))
def test_meta_trunk_has_the_real_shapes(name):
    c = TrunkConfig.from_preset(name)
    m = Trunk(c, device="meta", dtype=torch.bfloat16)
    assert all(p.device.type == "meta" for p in m.parameters())
    n = sum(p.numel() for p in m.parameters())
    assert n == expected_params(c)
    assert m.param_bytes() == 2 * n
    D, L0 = c.n_embd, m.layers[0]
    assert L0.wq.shape == (c.n_head * c.head_dim, D) and L0.wk.shape == (c.n_head_kv * c.head_dim, D)
    assert L0.w_down.shape == (D, c.n_ff)
    if c.is_gemma:
        assert m.per_layer_model_proj.shape == (c.n_layer * 256, D) and m.per_layer_proj_norm.shape == (256,)
        assert L0.inp_gate.shape == (256, D) and L0.proj.shape == (D, 256) and L0.post_norm.shape == (D,)
    else:
        L = m.layers[c.ple_layer]
        assert L.ple_key.shape == (16, 160, 160) and L.ple_out.shape == (D, 16 * 160)
        assert not hasattr(m.layers[0], "ple_key")
    f = m.flops_per_token(4096)
    assert f > 2 * (n - c.vocab_hash * D) > 0 and m.flops_per_token(8192) > f


# ---- determinism and shapes ---------------------------------------------------------------------

def test_weights_are_deterministic_by_seed():
    c = TrunkConfig.tiny("gemma4")
    a, b, other = Trunk(c, seed=7), Trunk(c, seed=7), Trunk(c, seed=8)
    for (na, pa), (_, pb), (_, po) in zip(a.named_parameters(), b.named_parameters(), other.named_parameters()):
        assert torch.equal(pa, pb), na
        assert not torch.equal(pa, po), na
    w = Trunk(TrunkConfig.tiny("gemma4", n_embd=256), seed=1).layers[0].w_gate   # [128, 256]: std 1/16
    assert abs(float(w.mean())) < 2e-3 and abs(float(w.std()) - 1 / 16) < 2e-3
    assert float(w.abs().max()) <= math.sqrt(3) / 16
    bf = Trunk(c, seed=7, dtype=torch.bfloat16)
    assert torch.equal(bf.layers[1].wo, a.layers[1].wo.bfloat16())          # bf16 = the rounded f32 weights


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_shapes_finite_and_bitwise_repeatable(arch):
    c = TrunkConfig.tiny(arch)
    m = Trunk(c, seed=1)
    tokens, rows = make_inputs(c)
    h0 = m.embed(tokens)
    assert h0.shape == (T, c.n_embd)
    ple = m.ple_inputs(rows, h0)
    assert ple.shape == ((c.n_layer, T, c.n_embd_per_layer) if c.is_gemma else (T, c.ple_width))
    h = m(tokens, ple)
    assert h.shape == (T, c.n_embd) and h.dtype == torch.float32 and bool(torch.isfinite(h).all())
    assert torch.equal(h, m(tokens, m.ple_inputs(rows, m.embed(tokens))))
    assert torch.equal(h, Trunk(c, seed=1).prefill(tokens, rows))
    assert not torch.equal(h, Trunk(c, seed=2).prefill(tokens, rows))


def test_gemma_ple_inputs_use_the_trunks_weights():
    c = TrunkConfig.tiny("gemma4", n_embd_per_layer=256)
    m = Trunk(c, seed=3)
    tokens, rows = make_inputs(c)
    h0 = m.embed(tokens)
    assert torch.equal(h0, m.tok_embd[tokens % c.vocab_hash] * math.sqrt(c.n_embd))
    got = m.ple_inputs(rows, h0).numpy()
    want = per_layer_inputs_np(rows.numpy(), h0.numpy(), m.per_layer_model_proj.numpy(),
                               m.per_layer_proj_norm.numpy(), n_layer=c.n_layer, n_embd_per_layer=256)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * float(np.abs(want).max()))
    ref = m.prefill(tokens, rows)
    assert torch.equal(m.prefill(tokens, rows * 16, rows_prescaled=True), ref)
    kernel_layout = (rows.view(T, c.n_layer, 256) * 16).permute(1, 0, 2).contiguous()    # [L, T, 256] x16
    assert torch.equal(m.prefill(tokens, kernel_layout), ref)


def test_qwen4exp_rows_are_taken_unscaled_head_major():
    c = TrunkConfig.tiny("qwen4exp")
    m = Trunk(c, seed=4)
    tokens, rows = make_inputs(c)
    h0 = m.embed(tokens)
    assert torch.equal(h0, m.tok_embd[tokens % c.vocab_hash])               # no sqrt(n_embd) for qwen4exp
    assert torch.equal(m.ple_inputs(rows, h0), rows)
    assert torch.equal(m.ple_inputs(rows.view(T, 16, 160), h0), rows)      # a [T, 16, 160] gather
    with pytest.raises(ValueError, match="qwen4exp rows"):
        m.ple_inputs(rows[:, :-160], h0)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_ple_row_changes_its_position_and_later_only(arch):
    c = TrunkConfig.tiny(arch)
    m = Trunk(c, seed=5)
    tokens, rows = make_inputs(c)
    base = m.prefill(tokens, rows)
    p = 9
    bumped = rows.clone()
    bumped[p] += 0.5
    h = m.prefill(tokens, bumped)
    assert torch.equal(h[:p], base[:p])
    assert not torch.equal(h[p], base[p])
    assert all(not torch.equal(h[t], base[t]) for t in range(p + 1, T))


@pytest.mark.parametrize("arch", ["gemma4", "qwen4exp"])
def test_bf16_forward_within_tolerance_of_float32(arch):
    c = TrunkConfig.tiny(arch)
    tokens, rows = make_inputs(c)
    h32 = Trunk(c, seed=6).prefill(tokens, rows)
    h16 = Trunk(c, seed=6, dtype=torch.bfloat16).prefill(tokens, rows.bfloat16())
    assert h16.dtype == torch.bfloat16 and h16.shape == h32.shape
    assert rel(h16, h32) < BF16_RTOL


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_graph_replay_equals_eager(arch):
    if not torch.cuda.is_available():
        pytest.skip("gpu: torch has no CUDA device")
    c = TrunkConfig.tiny(arch)
    m = Trunk(c, seed=7, dtype=torch.bfloat16, device="cuda")
    tokens, rows = (x.cuda() for x in make_inputs(c, T=64))
    rows = rows.bfloat16()
    eager = m.prefill(tokens, rows)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):                                              # warm up outside the graph
        m.prefill(tokens, rows)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = m.prefill(tokens, rows)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    tokens2, rows2 = (x.cuda() for x in make_inputs(c, seed=1, T=64))
    tokens.copy_(tokens2)
    rows.copy_(rows2.bfloat16())
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, m.prefill(tokens, rows))
