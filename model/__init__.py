"""Synthetic PLE models and the qwen4exp n-gram row index.

Installed as ``gds_gather.model`` (the top-level ``model/`` folder).
"""
from .presets import PRESETS, Preset, get_preset
from .qwen4exp import Qwen4expHParams, hashed_tokens, next_prev, ple_rows
from .synth import iter_table_chunks, random_blocks, write_model

__all__ = [
    "PRESETS", "Preset", "get_preset",
    "Qwen4expHParams", "hashed_tokens", "next_prev", "ple_rows",
    "iter_table_chunks", "random_blocks", "write_model",
]
