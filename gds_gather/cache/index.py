"""The row cache's index: int64 keys -> int64 values in an open-addressing hash table of numpy arrays (linear
probing), every operation vectorized over a batch; probed by C loops where the native helpers build."""
from __future__ import annotations

import numpy as np

_GOLD = np.uint64(0x9E3779B97F4A7C15)
EMPTY, TOMB = -1, -2
_GOLD_INT, _M64 = int(_GOLD), (1 << 64) - 1
SCALAR_MAX = 8          # HashIndex.get answers up to this many keys without numpy (see _get_few)


class HashIndex:
    """int64 keys -> int64 values; open addressing, linear probing, every operation vectorized over a batch."""

    def __init__(self, capacity: int, lib=None):
        bits = max(4, int(2 * max(capacity, 1) - 1).bit_length())     # >= 2x the live keys: short probes
        self.size = 1 << bits
        self._shift = np.uint64(64 - bits)
        self._mask = self.size - 1
        self.keys = np.full(self.size, EMPTY, np.int64)
        self.vals = np.zeros(self.size, np.int32)
        self.live = self.tombs = 0
        self.lib = lib          # native.library()'s: get and insert in C (None: numpy)

    @staticmethod
    def nbytes_for(capacity: int) -> int:
        return (1 << max(4, int(2 * max(capacity, 1) - 1).bit_length())) * 12

    def _home(self, k: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return ((k.astype(np.uint64) * _GOLD) >> self._shift).astype(np.int64)

    def find(self, k: np.ndarray) -> np.ndarray:
        """Table position of each key, -1 where absent."""
        out = np.full(k.shape[0], -1, np.int64)
        pos = self._home(k)
        act = np.arange(k.shape[0])
        while act.size:
            p = pos[act]
            kk = self.keys[p]
            hit = kk == k[act]
            out[act[hit]] = p[hit]
            go = ~hit & (kk != EMPTY)
            act = act[go]
            pos[act] = (p[go] + 1) & self._mask
        return out

    def get(self, k: np.ndarray) -> np.ndarray:
        if k.shape[0] <= SCALAR_MAX:
            return self._get_few(k)
        if self.lib is not None:
            k = np.ascontiguousarray(k, np.int64)
            out = np.empty(k.shape[0], np.int64)
            self.lib.gg_hash_get(self.keys.ctypes.data, self.vals.ctypes.data, self._mask, int(self._shift),
                                 k.ctypes.data, k.shape[0], out.ctypes.data)
            return out
        p = self.find(k)
        return np.where(p >= 0, self.vals[np.maximum(p, 0)], -1).astype(np.int64)

    def _get_few(self, k: np.ndarray) -> np.ndarray:
        """get for a decode step's few keys: the same probe sequence as find, one key at a time in Python. Between
        a transformers decode step's matmuls every numpy call runs on cold caches, so find's ~15 numpy calls for one
        key cost several times these few scalar reads (docs/decisions/row-cache-policy.md, "Decode steps")."""
        keys, vals, mask, shift = self.keys, self.vals, self._mask, int(self._shift)
        out = []
        for key in k.tolist():
            p = ((key * _GOLD_INT) & _M64) >> shift
            while True:
                kk = int(keys[p])
                if kk == key:
                    out.append(int(vals[p]))
                    break
                if kk == EMPTY:
                    out.append(-1)
                    break
                p = (p + 1) & mask
        return np.array(out, np.int64)

    def insert(self, k: np.ndarray, v: np.ndarray) -> None:
        """Insert distinct keys that are absent."""
        if self.live + self.tombs + k.shape[0] > self.size * 3 // 4:
            self._rebuild()
        if self.lib is not None:
            k, v = np.ascontiguousarray(k, np.int64), np.ascontiguousarray(v, np.int64)
            self.tombs -= self.lib.gg_hash_insert(self.keys.ctypes.data, self.vals.ctypes.data, self._mask,
                                                  int(self._shift), k.ctypes.data, v.ctypes.data, k.shape[0])
            self.live += k.shape[0]
            return
        pos = self._home(k)
        act = np.arange(k.shape[0])
        while act.size:
            p = pos[act]
            free = np.flatnonzero(self.keys[p] < 0)
            fp = p[free]
            self.vals[fp] = free                       # claim: the last writer of a position wins
            win = free[self.vals[fp] == free]
            wp = p[win]
            self.tombs -= int((self.keys[wp] == TOMB).sum())
            self.keys[wp] = k[act[win]]
            self.vals[wp] = v[act[win]]
            keep = np.ones(act.shape[0], bool)
            keep[win] = False
            act = act[keep]
            pos[act] = (pos[act] + 1) & self._mask
        self.live += k.shape[0]

    def clear(self) -> None:
        """Forget every key, in place (memory already touched: a new table's first touch of its pages costs more
        than the fill, and sometimes tens of ms on a virtual machine)."""
        self.keys.fill(EMPTY)
        self.live = self.tombs = 0

    def delete(self, k: np.ndarray) -> None:
        p = self.find(k)
        p = p[p >= 0]
        self.keys[p] = TOMB
        self.live -= p.shape[0]
        self.tombs += p.shape[0]

    def _rebuild(self) -> None:
        live = self.keys >= 0
        k, v = self.keys[live], self.vals[live]
        self.keys.fill(EMPTY)
        self.live = self.tombs = 0
        if k.size:
            self.insert(k, v.astype(np.int64))

