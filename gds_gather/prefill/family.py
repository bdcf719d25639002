"""What differs between the model families whose PLE tables the prefill serves, in one place.

qwen4exp: rows found by hashing token n-grams (n_heads rows per token), used flat and unscaled.
Token rows (Gemma 4, Gemma 3n, any table with one row per token): the token id is the row, and each row splits
into n_layer slices of per_layer elements scaled by sqrt(per_layer).
`family_of(table)` picks one; the prefill's row mapper, its trunk and its kernel layout ask it instead of
branching on the architecture.
"""
from __future__ import annotations

import numpy as np

from ..errors import TableLayoutError


def per_layer_layout(table) -> tuple[int, int]:
    """(layers, elements per layer) of a token-indexed table's rows, from the model's metadata:
    {arch}.block_count and {arch}.embedding_length_per_layer_input (GGUF models, `convert` outputs, and the
    config.json of a transformers checkpoint); either one is enough when it divides the row."""
    arch, width = table.arch or "?", table.row_elems
    n_layer = table.field(f"{arch}.block_count")
    per = table.field(f"{arch}.embedding_length_per_layer_input")
    if per is None and n_layer and width % int(n_layer) == 0:
        per = width // int(n_layer)
    if n_layer is None and per and width % int(per) == 0:
        n_layer = width // int(per)
    if not n_layer or not per:
        raise TableLayoutError(f"{table.model_path}: no per-layer layout for its {width}-element rows (arch "
                               f"{arch!r} has no {arch}.block_count or {arch}.embedding_length_per_layer_input); "
                               "prefill needs the layer count")
    n_layer, per = int(n_layer), int(per)
    if n_layer * per != width:
        raise TableLayoutError(f"{table.model_path}: {n_layer} layers x {per} elements per layer != its rows' "
                               f"{width} elements")
    return n_layer, per


class Family:
    """One table's model family. Attributes: arch, n_rows, row_elems, n_vocab (token ids the prompt may use),
    reserved (token ids it must not), rows_per_token, n_layer (None: rows used flat), per_layer, row_scale."""

    name = "?"
    split_per_layer = False     # rows split into n_layer slices (the kernel's per_layer layout)

    def __init__(self, table):
        self.arch, self.n_rows, self.row_elems = table.arch, table.n_rows, table.row_elems

    @property
    def ple_width(self) -> int:
        """Elements of PLE input per token."""
        return self.row_elems * self.rows_per_token

    def row_ids(self, tokens: np.ndarray, prev):
        """(row ids of this ubatch's tokens, the history the next ubatch starts from)."""
        raise NotImplementedError

    def kernel_args(self) -> dict:
        """The dequant-scatter kernel's layout keywords (dequant_gpu.dequant_scatter's layout, n_layer, scale)."""
        raise NotImplementedError

    def kernel_rows(self, rows, n: int):
        """Host equivalent of the kernel's output: float32 torch rows [n * rows_per_token, row_elems] in the
        layout kernel_args asks for."""
        raise NotImplementedError

    def trunk_rows(self, out, n: int):
        """The kernel's output (or kernel_rows') as the trunk's per-layer rows for n tokens."""
        raise NotImplementedError

    def trunk_preset(self):
        """(the model preset whose shapes the synthetic trunk takes, the table's layout overrides)."""
        raise NotImplementedError

    def layout_note(self) -> str:
        """The table's per-layer layout for the prefill's output ('' where rows are used flat)."""
        return ""


class Qwen4exp(Family):
    name = "qwen4exp"

    def __init__(self, table):
        super().__init__(table)
        from ..model.presets import PRESETS
        from ..model.qwen4exp import Qwen4expHParams
        self.hp = Qwen4expHParams.from_reader(table.reader)
        n_tok = table.field("tokenizer.ggml.tokens")
        self.n_vocab = len(n_tok) if n_tok else PRESETS["qwen4exp"].n_vocab
        self.reserved = tuple(x for x in (self.hp.eos_token_id, self.hp.image_token_id) if x is not None)
        self.rows_per_token = self.hp.n_heads
        self.n_layer, self.per_layer, self.row_scale = None, table.row_elems, 1.0

    def row_ids(self, tokens, prev):
        from ..model.qwen4exp import next_prev, ple_rows
        return ple_rows(tokens, self.hp, prev=prev), next_prev(tokens, prev, self.hp.ngram_size)

    def kernel_args(self) -> dict:
        return dict(layout="flat")

    def kernel_rows(self, rows, n: int):
        return rows

    def trunk_rows(self, out, n: int):
        return out.view(n, -1)          # [T * n_heads, width] -> [T, n_heads * width]

    def trunk_preset(self):
        from ..model.presets import PRESETS
        return PRESETS["qwen4exp"], {}


class TokenRows(Family):
    name = "token-rows"
    split_per_layer = True

    def __init__(self, table):
        super().__init__(table)
        from ..model.gemma import ple_scales
        self.n_vocab = table.n_rows
        self.reserved = ()
        self.rows_per_token = 1
        self.n_layer, self.per_layer = per_layer_layout(table)
        self.row_scale = ple_scales(1, self.per_layer)[0]        # sqrt(per_layer) as llama.cpp computes it

    def row_ids(self, tokens, prev):
        from ..model.gemma import gemma_row_ids
        return gemma_row_ids(tokens, self.n_rows), None     # one row per token; clear error past the table's end

    def kernel_args(self) -> dict:
        return dict(layout="per_layer", n_layer=self.n_layer, scale=self.row_scale)

    def kernel_rows(self, rows, n: int):
        return (rows.view(n, self.n_layer, self.per_layer) * self.row_scale).permute(1, 0, 2).contiguous()

    def trunk_rows(self, out, n: int):
        return out                      # already [n_layer, T, per_layer]

    def trunk_preset(self):
        from ..model.presets import PRESETS
        same = [p for p in PRESETS.values() if p.arch == self.arch and p.n_layer == self.n_layer
                and p.n_embd_per_layer == self.per_layer]
        preset = same[0] if same else next(p for p in PRESETS.values()
                                           if p.arch == (self.arch if self.arch == "gemma3n" else "gemma4"))
        return preset, dict(n_layer=self.n_layer, n_embd_per_layer=self.per_layer)   # the table's, always

    def layout_note(self) -> str:
        return f"; {self.n_layer} layers x {self.per_layer} per layer"


def family_of(table) -> Family:
    """qwen4exp for its architecture, token rows for every other (gemma4, gemma3n, any token-indexed table)."""
    return Qwen4exp(table) if table.arch == "qwen4exp" else TokenRows(table)
