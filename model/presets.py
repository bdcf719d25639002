"""The real shapes of the models whose PLE table gds_gather reads.

Table shapes, types and the qwen4exp hash constants are the published models' (their GGUF metadata and
llama.cpp's loaders). The trunk dimensions (n_head, n_head_kv,
head_dim, n_ff, n_ctx, and n_layer for qwen4exp) are plausible public values, approximate:
nothing in gds_gather reads them yet, they only size a later synthetic trunk.
"""
from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType as Q


@dataclass(frozen=True)
class Preset:
    """One model's PLE table and trunk shape.

    n_embd_per_layer is the per-layer slice of a table row for Gemma (row width =
    n_embd_per_layer * n_layer) and the row width itself (the head dim, 160) for qwen4exp.
    n_rows is the table's row count (GGUF ne1); n_vocab is the tokenizer's vocabulary.
    """

    name: str
    arch: str
    n_layer: int
    n_embd: int
    n_embd_per_layer: int
    n_vocab: int
    n_rows: int
    qtype: Q
    # trunk (approximate)
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_ctx: int
    # qwen4exp n-gram hash (0 / () / None for the Gemma presets)
    ngram_size: int = 0
    heads_per_ngram: int = 0
    multipliers: tuple[int, ...] = ()
    eos_token_id: int | None = None
    image_token_id: int | None = None
    ple_layer: int | None = None
    conv_kernel: int = 0

    @property
    def row_width(self) -> int:
        """Elements per table row (GGUF ne0)."""
        if self.arch == "qwen4exp":
            return self.n_embd_per_layer
        return self.n_embd_per_layer * self.n_layer

    @property
    def is_ngram(self) -> bool:
        """True when rows are found by hashing n-grams (qwen4exp), not by token id (Gemma)."""
        return self.ngram_size > 0


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("gemma4-e2b", "gemma4", n_layer=35, n_embd=1536, n_embd_per_layer=256, n_vocab=262144,
           n_rows=262144, qtype=Q.Q6_K, n_head=8, n_head_kv=1, head_dim=256, n_ff=6144, n_ctx=131072),
    Preset("gemma4-e4b", "gemma4", n_layer=42, n_embd=2560, n_embd_per_layer=256, n_vocab=262144,
           n_rows=262144, qtype=Q.Q5_K, n_head=8, n_head_kv=2, head_dim=256, n_ff=10240, n_ctx=131072),
    # the converter pads the table rows 262144 -> 262400 (vision/audio special tokens)
    Preset("gemma3n-e2b", "gemma3n", n_layer=30, n_embd=2048, n_embd_per_layer=256, n_vocab=262144,
           n_rows=262400, qtype=Q.Q6_K, n_head=8, n_head_kv=2, head_dim=256, n_ff=8192, n_ctx=32768),
    Preset("qwen4exp", "qwen4exp", n_layer=48, n_embd=2560, n_embd_per_layer=160, n_vocab=248320,
           n_rows=320001536, qtype=Q.IQ4_NL, n_head=16, n_head_kv=2, head_dim=256, n_ff=9216, n_ctx=262144,
           ngram_size=3, heads_per_ngram=8,
           multipliers=(11400714819323198485, 14029467366897019727, 1609587929392839161),
           eos_token_id=248044, image_token_id=248056, ple_layer=1, conv_kernel=4),
)}


def get_preset(name: str | Preset) -> Preset:
    """The preset called `name` (a Preset passes through); KeyError lists the known names."""
    if isinstance(name, Preset):
        return name
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
