"""A synthetic transformer trunk that consumes the per-layer inputs, so a prefill carries realistic compute.

Random weights (from a seed) in the real model's shapes (model/presets.py); not a trained model. Per layer:

    h = h + attn(rms_norm(h))              causal GQA self-attention, RoPE, scaled_dot_product_attention
    h = h + mlp(rms_norm(h))               gated MLP: down(act(gate(x)) * up(x)), act = gelu-tanh (silu: qwen4exp)
    gemma:    h = h + post_norm(proj(gelu(inp_gate(h)) * ple[il]))      llama.cpp's per-layer input block
    qwen4exp: before the attention of layer ple_layer only, h = h + ple_block(h, ple)   (a stand-in, see below)

and a final rms_norm. Gemma 3n runs like Gemma 4 (no altup, no laurel); qwen4exp's hybrid token mixers are plain
attention here. ``forward`` has static shapes, no data-dependent Python control flow and no host sync, so
``ple_inputs`` + ``forward`` can be captured in a CUDA graph. Each call is a self-contained sequence (no KV cache).

Weights come from a counter-based integer hash of (seed, parameter name, element index) computed with torch int64
ops: the same bits on CPU and GPU, fast on a GPU, and free on the 'meta' device (real shapes, no memory).
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .gemma import per_layer_inputs, rms_scale
from .presets import Preset, get_preset

__all__ = ["TrunkConfig", "Trunk"]

ARCHS = ("gemma4", "gemma3n", "qwen4exp")


@dataclass(frozen=True)
class TrunkConfig:
    """The trunk's shapes. ``ple_width`` (per-token PLE elements) is derived; tiny/from_preset accept it."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_embd_per_layer: int          # gemma: the per-layer slice (256); qwen4exp: the table row width (160)
    ple_layer: int | None = None   # qwen4exp: the one layer that reads the PLE rows
    n_ple_heads: int = 0           # qwen4exp: rows per token, (ngram_size-1)*heads_per_ngram = 16
    conv_kernel: int = 0           # qwen4exp: depthwise causal conv kernel
    conv_dilation: int = 1         # qwen4exp: ngram_size
    vocab_hash: int = 8192         # a hashed token embedding: tokens % vocab_hash (no 262k-row table)
    eps: float = 1e-6
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        if self.n_head % self.n_head_kv or self.head_dim % 2:
            raise ValueError("n_head must be a multiple of n_head_kv and head_dim even")
        if self.is_gemma:
            return
        if self.ple_layer is None or not 0 <= self.ple_layer < self.n_layer:
            raise ValueError(f"qwen4exp needs 0 <= ple_layer < n_layer, got {self.ple_layer}")
        if self.n_ple_heads < 1 or self.conv_kernel < 1 or self.conv_dilation < 1:
            raise ValueError("qwen4exp needs n_ple_heads, conv_kernel and conv_dilation >= 1")

    @property
    def is_gemma(self) -> bool:
        return self.arch != "qwen4exp"

    @property
    def ple_width(self) -> int:
        """Elements of PLE input per token: gemma n_layer*n_embd_per_layer; qwen4exp n_ple_heads*row width."""
        return self.n_embd_per_layer * (self.n_layer if self.is_gemma else self.n_ple_heads)

    @classmethod
    def from_preset(cls, preset: str | Preset, **overrides) -> "TrunkConfig":
        """The real trunk shapes of a preset (model/presets.py); overrides as for `tiny`."""
        p = get_preset(preset)
        return cls._build(dict(arch=p.arch, n_layer=p.n_layer, n_embd=p.n_embd, n_head=p.n_head,
                               n_head_kv=p.n_head_kv, head_dim=p.head_dim, n_ff=p.n_ff,
                               n_embd_per_layer=p.n_embd_per_layer, ple_layer=p.ple_layer,
                               n_ple_heads=(p.ngram_size - 1) * p.heads_per_ngram if p.is_ngram else 0,
                               conv_kernel=p.conv_kernel, conv_dilation=max(p.ngram_size, 1)), overrides)

    @classmethod
    def tiny(cls, arch: str, **overrides) -> "TrunkConfig":
        """A small config for CPU tests: 3 layers, n_embd 64, 4 heads (2 kv) of 16, n_ff 128, vocab_hash 512.

        gemma: 32 per layer; qwen4exp keeps the real row layout (16 heads x 160) with ple_layer 1.
        Overrides replace fields (None keeps the default); ``ple_width=W`` fits a table's rows: gemma
        n_embd_per_layer = W / n_layer, qwen4exp n_ple_heads = W / n_embd_per_layer.
        """
        base = dict(arch=arch, n_layer=3, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=128,
                    n_embd_per_layer=32, vocab_hash=512)
        if arch == "qwen4exp":
            base.update(n_embd_per_layer=160, ple_layer=1, n_ple_heads=16, conv_kernel=4, conv_dilation=3)
        return cls._build(base, overrides)

    @classmethod
    def _build(cls, base: dict, overrides: dict) -> "TrunkConfig":
        base.update({k: v for k, v in overrides.items() if v is not None and k != "ple_width"})
        width = overrides.get("ple_width")
        if width is not None:
            key, div = ("n_embd_per_layer", base["n_layer"]) if base["arch"] != "qwen4exp" else \
                ("n_ple_heads", base["n_embd_per_layer"])
            if width % div:
                raise ValueError(f"ple_width {width} is not a multiple of {div} for {base['arch']}")
            base[key] = width // div
        return cls(**base)


def _hash_uniform(shape, seed: int, name: str, *, std: float, mean: float, device, dtype) -> Tensor:
    """Deterministic pseudo-random values, uniform with the given mean and std: the same bits on every device."""
    n = math.prod(shape)
    s1 = (seed * 0x9E3779B1 + zlib.crc32(name.encode())) & 0xFFFFFFFF
    s2 = zlib.crc32(f"{seed}:{name}".encode())

    def mix(x: Tensor) -> Tensor:          # a 32-bit integer hash in int64 (products stay below 2**63)
        x = x ^ (x >> 16)
        x = (x * 0x45D9F3B) & 0xFFFFFFFF
        x = x ^ (x >> 16)
        x = (x * 0x45D9F3B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    x = torch.arange(n, dtype=torch.int64, device=device) & 0xFFFFFFFF
    x = mix(mix(x ^ s1) ^ s2)
    u = (x >> 8).to(torch.float32) * (2.0 ** -24)                       # [0, 1), exact
    return ((u * 2.0 - 1.0) * (std * math.sqrt(3.0)) + mean).to(dtype).view(shape)


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """ggml's rms_norm then the weight multiply (float32 inside): x * (1/sqrt(mean(x^2) + eps)) * w."""
    x32 = x.float()
    y = x32 * rms_scale((x32 * x32).mean(dim=-1, keepdim=True), eps)
    return (y * w.float()).to(x.dtype)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [H, T, Dh], cos/sin: [T, Dh/2]; NeoX style (rotate the two halves)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Trunk(nn.Module):
    """The synthetic trunk of `cfg`. ``device='meta'`` builds the real shapes without allocating anything."""

    def __init__(self, cfg: TrunkConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.cfg, self.seed = cfg, seed
        c, D, Dh = cfg, cfg.n_embd, cfg.head_dim
        H, Hkv, P = cfg.n_head, cfg.n_head_kv, cfg.n_embd_per_layer

        def param(name: str, *shape: int, fan_in: int | None = None, norm: bool = False) -> nn.Parameter:
            std, mean = (0.1, 1.0) if norm else (1.0 / math.sqrt(fan_in or shape[-1]), 0.0)
            return nn.Parameter(_hash_uniform(shape, seed, name, std=std, mean=mean, device=device, dtype=dtype),
                                requires_grad=False)

        self.tok_embd = param("tok_embd", c.vocab_hash, D, fan_in=D)
        self.layers = nn.ModuleList()
        for il in range(c.n_layer):
            L = nn.Module()
            pre = f"blk.{il}."
            L.attn_norm = param(pre + "attn_norm", D, norm=True)
            L.wq = param(pre + "wq", H * Dh, D)
            L.wk = param(pre + "wk", Hkv * Dh, D)
            L.wv = param(pre + "wv", Hkv * Dh, D)
            L.wo = param(pre + "wo", D, H * Dh)
            L.ffn_norm = param(pre + "ffn_norm", D, norm=True)
            L.w_gate = param(pre + "w_gate", c.n_ff, D)
            L.w_up = param(pre + "w_up", c.n_ff, D)
            L.w_down = param(pre + "w_down", D, c.n_ff)
            if c.is_gemma:                                  # llama.cpp: blk.N.inp_gate / proj / post_norm
                L.inp_gate = param(pre + "inp_gate", P, D)
                L.proj = param(pre + "proj", D, P)
                L.post_norm = param(pre + "post_norm", D, norm=True)
            elif il == c.ple_layer:                         # the qwen4exp PLE block (synthetic stand-in)
                Hp, C = c.n_ple_heads, c.n_ple_heads * P
                L.ple_norm = param(pre + "ple_norm", D, norm=True)
                L.ple_query = param(pre + "ple_query", C, D)
                L.ple_key = param(pre + "ple_key", Hp, P, P, fan_in=P)      # per head, in x out
                L.ple_value = param(pre + "ple_value", Hp, P, P, fan_in=P)
                L.ple_k_norm = param(pre + "ple_k_norm", P, norm=True)
                L.ple_v_norm = param(pre + "ple_v_norm", P, norm=True)
                L.ple_conv = param(pre + "ple_conv", C, 1, c.conv_kernel, fan_in=c.conv_kernel)
                L.ple_out = param(pre + "ple_out", D, C)
            self.layers.append(L)
        self.output_norm = param("output_norm", D, norm=True)
        if c.is_gemma:                                      # per_layer_model_proj, per_layer_proj_norm
            self.per_layer_model_proj = param("per_layer_model_proj", c.n_layer * P, D)
            self.per_layer_proj_norm = param("per_layer_proj_norm", P, norm=True)
        freqs = c.rope_theta ** (-torch.arange(0, Dh, 2, dtype=torch.float32, device=device) / Dh)
        self.register_buffer("rope_freqs", freqs, persistent=False)           # [Dh/2]
        self.embd_scale = math.sqrt(D) if c.is_gemma else 1.0

    # ---- inputs ---------------------------------------------------------------------------------

    def embed(self, tokens: Tensor) -> Tensor:
        """h0 [T, n_embd]: the hashed token embedding (tokens % vocab_hash), x sqrt(n_embd) for Gemma."""
        h = F.embedding(tokens.long() % self.cfg.vocab_hash, self.tok_embd)     # [T, D]
        return h * self.embd_scale if self.cfg.is_gemma else h

    def ple_inputs(self, rows: Tensor, h0: Tensor, *, rows_prescaled: bool | None = None) -> Tensor:
        """The per-layer inputs `forward` takes.

        gemma: per_layer_inputs(rows, h0, ...) with this trunk's per_layer_model_proj and per_layer_proj_norm,
            [n_layer, T, n_embd_per_layer]; rows [T, ple_width] unscaled (a gather) or [n_layer, T, P] x sqrt(P)
            (the dequant kernel's output), see per_layer_inputs for rows_prescaled.
        qwen4exp: the rows unscaled, [T, n_ple_heads*row width] (a [T, 16, 160] gather is flattened head-major),
            in the trunk's dtype.
        """
        c = self.cfg
        if c.is_gemma:
            return per_layer_inputs(rows, h0, self.per_layer_model_proj, self.per_layer_proj_norm,
                                    n_layer=c.n_layer, n_embd_per_layer=c.n_embd_per_layer, eps=c.eps,
                                    rows_prescaled=rows_prescaled)
        if rows.shape[-1] * math.prod(rows.shape[1:-1]) != c.ple_width or rows.shape[0] != h0.shape[0]:
            raise ValueError(f"qwen4exp rows must be [T, {c.ple_width}] or [T, {c.n_ple_heads}, "
                             f"{c.n_embd_per_layer}] with T={h0.shape[0]}, got {tuple(rows.shape)}")
        return rows.reshape(rows.shape[0], c.ple_width).to(self.tok_embd.dtype)

    # ---- the trunk ------------------------------------------------------------------------------

    def attention(self, L: nn.Module, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        c, T = self.cfg, x.shape[0]
        H, Hkv, Dh = c.n_head, c.n_head_kv, c.head_dim
        q = F.linear(x, L.wq).view(T, H, Dh).transpose(0, 1)                    # [H, T, Dh]
        k = F.linear(x, L.wk).view(T, Hkv, Dh).transpose(0, 1)                  # [Hkv, T, Dh]
        v = F.linear(x, L.wv).view(T, Hkv, Dh).transpose(0, 1)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        k = k[:, None].expand(Hkv, H // Hkv, T, Dh).reshape(H, T, Dh)          # GQA: share kv heads
        v = v[:, None].expand(Hkv, H // Hkv, T, Dh).reshape(H, T, Dh)
        y = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]   # [H, T, Dh]
        return F.linear(y.transpose(0, 1).reshape(T, H * Dh), L.wo)            # [T, D]

    def mlp(self, L: nn.Module, x: Tensor) -> Tensor:
        gate = F.linear(x, L.w_gate)                                            # [T, n_ff]
        act = F.gelu(gate, approximate="tanh") if self.cfg.is_gemma else F.silu(gate)
        return F.linear(act * F.linear(x, L.w_up), L.w_down)                    # [T, D]

    def gemma_ple(self, L: nn.Module, h: Tensor, ple_l: Tensor) -> Tensor:
        """llama.cpp's per-layer input block: post_norm(proj(gelu(inp_gate @ h) * ple[il]))."""
        cur = F.gelu(F.linear(h, L.inp_gate), approximate="tanh") * ple_l        # [T, P]
        return rms_norm(F.linear(cur, L.proj), L.post_norm, self.cfg.eps)       # [T, D]

    def qwen_ple(self, L: nn.Module, h: Tensor, ple: Tensor) -> Tensor:
        """A synthetic stand-in for qwen4exp's build_ple with the real shapes: per-head key/value from the rows,
        grouped RMS norms, a sigmoid gate from a signed sqrt of query.key, a depthwise causal conv over time
        (kernel conv_kernel, dilation ngram_size; no history across calls), a projection to n_embd."""
        c, T = self.cfg, h.shape[0]
        Hp, P = c.n_ple_heads, c.n_embd_per_layer
        e = ple.view(T, Hp, P)                                                  # [T, Hp, P] head-major rows
        k = rms_norm(torch.einsum("thi,hio->tho", e, L.ple_key), L.ple_k_norm, c.eps)
        v = rms_norm(torch.einsum("thi,hio->tho", e, L.ple_value), L.ple_v_norm, c.eps)
        q = F.linear(rms_norm(h, L.ple_norm, c.eps), L.ple_query).view(T, Hp, P)
        s = (q * k).sum(dim=-1, keepdim=True) / math.sqrt(P)                    # [T, Hp, 1]
        u = torch.sigmoid(torch.sign(s) * torch.sqrt(s.abs())) * v              # [T, Hp, P]
        u = u.reshape(T, Hp * P).t()[None]                                      # [1, C, T]
        pad = (c.conv_kernel - 1) * c.conv_dilation
        u = F.conv1d(F.pad(u, (pad, 0)), L.ple_conv, dilation=c.conv_dilation, groups=Hp * P)  # causal
        return F.linear(F.silu(u[0].t()), L.ple_out)                            # [T, D]

    def layers_forward(self, h: Tensor, ple: Tensor, positions: Tensor | None = None) -> Tensor:
        """The layers and the final norm from h0 [T, D] and ple (from ple_inputs); returns [T, D]."""
        c, T = self.cfg, h.shape[0]
        pos = torch.arange(T, device=h.device) if positions is None else positions
        ang = pos.to(torch.float32)[:, None] * self.rope_freqs[None]            # [T, Dh/2]
        cos, sin = torch.cos(ang), torch.sin(ang)
        for il, L in enumerate(self.layers):
            if not c.is_gemma and il == c.ple_layer:
                h = h + self.qwen_ple(L, h, ple)
            h = h + self.attention(L, rms_norm(h, L.attn_norm, c.eps), cos, sin)
            h = h + self.mlp(L, rms_norm(h, L.ffn_norm, c.eps))
            if c.is_gemma:
                h = h + self.gemma_ple(L, h, ple[il])
        return rms_norm(h, self.output_norm, c.eps)

    def forward(self, tokens: Tensor, ple: Tensor, positions: Tensor | None = None) -> Tensor:
        """Final hidden states [T, n_embd] of tokens [T] with per-layer inputs `ple` (from ple_inputs)."""
        return self.layers_forward(self.embed(tokens), ple, positions)

    def prefill(self, tokens: Tensor, rows: Tensor, *, rows_prescaled: bool | None = None) -> Tensor:
        """embed -> ple_inputs -> layers: the hidden states [T, n_embd] from tokens and their gathered rows."""
        h0 = self.embed(tokens)
        return self.layers_forward(h0, self.ple_inputs(rows, h0, rows_prescaled=rows_prescaled))

    # ---- reporting ------------------------------------------------------------------------------

    def param_bytes(self) -> int:
        """Bytes of all weights (works on 'meta')."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def flops_per_token(self, n_ctx: int = 0) -> int:
        """Approximate FLOPs per token of a prefill of n_ctx tokens: 2 x matmul weights (all but the embedding
        and norms) plus causal attention, 4 * n_layer * n_head * head_dim * (n_ctx+1)/2."""
        c = self.cfg
        mm = sum(p.numel() for n, p in self.named_parameters() if p.dim() >= 2 and n != "tok_embd")
        return int(2 * mm + 4 * c.n_layer * c.n_head * c.head_dim * (n_ctx + 1) / 2)
