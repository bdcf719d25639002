"""Synthetic PLE models and the qwen4exp n-gram row index.

Installed as ``gds_gather.model`` (the top-level ``model/`` folder).
"""
from .gemma import gemma_row_ids, per_layer_inputs, per_layer_inputs_np, ple_scales
from .presets import PRESETS, Preset, get_preset
from .qwen4exp import Qwen4expHParams, hashed_tokens, next_prev, ple_rows
from .synth import iter_table_chunks, random_blocks, write_model

__all__ = [
    "PRESETS", "Preset", "get_preset",
    "Qwen4expHParams", "hashed_tokens", "next_prev", "ple_rows",
    "iter_table_chunks", "random_blocks", "write_model",
    "gemma_row_ids", "per_layer_inputs", "per_layer_inputs_np", "ple_scales",
    "Trunk", "TrunkConfig",
]

_LAZY = {"Trunk": "trunk", "TrunkConfig": "trunk"}   # need torch: imported on first use


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
