"""The row cache's frequency estimate: a count-min sketch (4 rows of uint8) of how often each row was asked for,
halved every `period` counts (aging); TinyLFU admission compares a newcomer's estimate with a victim's."""
from __future__ import annotations

import numpy as np

SKETCH_SEEDS = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93],
                        np.uint64)


class FreqSketch:
    """Count-min sketch of access frequencies (4 rows of uint8), halved every `period` counts (aging)."""

    def __init__(self, width_hint: int, period: int, lib=None):
        bits = max(10, int(max(width_hint, 1) - 1).bit_length())
        self.width = 1 << bits
        self._shift = np.uint64(64 - bits)
        self.table = np.full((4, self.width), 0, np.uint8)    # touched now (np.zeros: the first counts fault it in)
        self.period = max(1, period)     # the owner halves the counters every `period` accesses
        self.lib = lib          # native.library()'s: add and estimate in C (numpy's fancy indexing: ~35 ns a key
        #                         and row, 15% of a new process's warm pass on qwen4exp;
        #                         docs/decisions/row-cache-policy.md)

    @staticmethod
    def nbytes_for(width_hint: int) -> int:
        return 4 * (1 << max(10, int(max(width_hint, 1) - 1).bit_length()))

    def _idx(self, k: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return ((k.astype(np.uint64)[None, :] * SKETCH_SEEDS[:, None]) >> self._shift).astype(np.int64)

    def add(self, k: np.ndarray) -> None:
        """Count each (distinct) key once (without the native helpers, colliding keys of one batch may lose a
        count: an estimate anyway)."""
        if not k.size:
            return
        if self.lib is not None:
            k = np.ascontiguousarray(k, np.int64)
            self.lib.gg_sketch_add(self.table.ctypes.data, self.width, int(self._shift), SKETCH_SEEDS.ctypes.data,
                                   k.ctypes.data, k.shape[0])
            return
        idx = self._idx(k)
        for d in range(4):
            row = self.table[d]
            row[idx[d]] = np.minimum(row[idx[d]].astype(np.uint16) + 1, 255).astype(np.uint8)

    def estimate(self, k: np.ndarray) -> np.ndarray:
        if not k.size:
            return np.zeros(0, np.uint8)
        if self.lib is not None:
            k = np.ascontiguousarray(k, np.int64)
            out = np.empty(k.shape[0], np.uint8)
            self.lib.gg_sketch_min(self.table.ctypes.data, self.width, int(self._shift), SKETCH_SEEDS.ctypes.data,
                                   k.ctypes.data, k.shape[0], out.ctypes.data)
            return out
        return self.table[np.arange(4)[:, None], self._idx(k)].min(axis=0)

