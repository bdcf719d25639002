"""RecentRows: the rows a disk-backed embedding gave lately, kept as torch rows in its output dtype, so that a decode
step whose ids are all among them is one copy of those rows and no table read.

Between a decode step's matmuls every call runs on caches the trunk has just evicted, so the step's cost is the
number of distinct operations it runs, far more than the bytes it copies (docs/decisions/transformers-offload.md):
a hit here is the ids read out (one torch call), a dict look-up per id (a decode step has a few), and one torch
call that copies the rows into a new tensor of the output's shape (`clone` for one id, `cat` for several). The
rows are held as the caller returns them, multiplied by its scale already. A miss (any id not held) returns None;
the caller reads all of that call's rows from its Table and put()s them, as it puts a prompt's (as many as fit),
so a decode step on a prompt's token hits too. The rows are exactly those the caller computed, so a hit equals a
read.

Bounded: at most `budget` bytes of rows, first in, first out. Emptied when the process's row caches may have been
emptied or dropped (rowcache.generation), so a benchmark's cold pass stays cold. Rows held here are the model's
values as they were read, as a resident table's are: the file is checked on every read of the table (a miss), not
on a hit.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from ..cache import rowcache

BUDGET = 16 << 20       # bytes of rows per module: a few hundred rows of a real per-layer table
MAX_IDS = 64            # ids per call looked up here (one dict look-up each): decode steps


class RecentRows:
    """Rows of `width` elements in `dtype` on the CPU by id; get / put / clear, thread-safe (a get never copies a
    slot that a put is rewriting)."""

    def __init__(self, width: int, dtype: torch.dtype, budget: int = BUDGET):
        self.capacity = int(budget // max(1, width * dtype.itemsize))
        self.width, self.dtype = int(width), dtype
        self.rows = None                # [capacity, width], allocated by the first put (never decoding: none)
        self.row2 = self.row3 = []      # slot -> a view of its row, [1, width] / [1, 1, width] (no call to pick one)
        self.scale = None               # what the rows held were multiplied by (put's scale)
        self.slot = {}                  # id -> slot
        self.id_of = np.full(self.capacity, -1, np.int64)    # slot -> the id held there
        self.hand = 0                   # the next slot put() overwrites
        self.gen = rowcache.generation()
        self.hits = 0                   # ids answered here
        self.lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return 0 if self.rows is None else self.rows.nbytes

    def get(self, ids: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, int] | None:
        """(the rows of 1 to MAX_IDS CPU `ids`: a new tensor of ids.shape + (width,); how many distinct ids) where
        every id is held, put with this `scale` (the same object); else None (the caller reads them, and says which
        id is out of range if one is)."""
        n = ids.numel()
        if not 0 < n <= MAX_IDS or ids.is_cuda or scale is not self.scale:
            return None
        d = ids.dim()
        if n == 1:
            keys = [ids.item()]
        elif d == 2:                                        # transformers' [batch, 1]: no reshape call
            keys = [k for r in ids.tolist() for k in r]
        else:
            keys = ids.reshape(-1).tolist()                 # (vLLM's 1-D ids: a view, no copy)
        with self.lock:
            if self.gen != rowcache.generation():
                self._clear()
            slot = self.slot
            slots = [slot.get(k) for k in keys]
            if None in slots:
                return None
            row = self.row3 if d == 2 else self.row2
            if n == 1:
                out = row[slots[0]].clone()
            else:                                           # [b, 1] and [1, k] ids: cat gives their shape
                out = torch.cat([row[s] for s in slots], 1 if d == 2 and ids.shape[0] == 1 else 0)
            self.hits += n
        if d != 1 and not (d == 2 and 1 in ids.shape):
            out = out.view(*ids.shape, self.width)
        return out, len(set(slots))

    def put(self, ids: np.ndarray, rows: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        """Hold rows[i] (CPU, `dtype`) as the row of unique ids[i], evicting the oldest rows (of more ids than fit:
        the last ones). scale: what the rows were multiplied by (an object get is then given; rows put with another
        scale are dropped first). A decode step's fresh rows land in consecutive slots: one slice copy."""
        n = min(ids.shape[0], self.capacity)
        if n == 0:
            return
        keys, rows = ids[-n:].tolist(), rows[-n:]
        with self.lock:
            if self.gen != rowcache.generation() or scale is not self.scale:
                self._clear()
                self.scale = scale
            if self.rows is None:
                self._allocate()
            slot = self.slot
            fresh = [i for i, k in enumerate(keys) if k not in slot]
            m = len(fresh)
            if not m:
                return
            h = self.hand
            self.hand = (h + m) % self.capacity
            if h + m <= self.capacity:      # the slots in a run: numpy and torch take them as one slice
                sl, at = range(h, h + m), slice(h, h + m)
            else:
                sl = at = ((h + np.arange(m)) % self.capacity).tolist()
            new = keys if m == n else [keys[i] for i in fresh]
            for k in self.id_of[at].tolist():
                slot.pop(k, None)
            self.id_of[at] = new
            slot.update(zip(new, sl))
            self.rows[at] = rows if m == n else rows[torch.tensor(fresh)]

    def _allocate(self) -> None:
        with torch.inference_mode(False), torch.no_grad():     # a plain tensor: written in and out of inference mode
            self.rows = torch.empty(self.capacity, self.width, dtype=self.dtype, device="cpu")
            self.row2 = list(self.rows.split(1))                       # [1, width] views
            self.row3 = [r.view(1, 1, self.width) for r in self.row2]  # [1, 1, width] views

    def clear(self) -> None:
        """Forget every row (keeping the memory) and take the current row-cache generation."""
        with self.lock:
            self._clear()

    def _clear(self) -> None:
        self.slot.clear()
        self.id_of[:] = -1
        self.hand = 0
        self.gen = rowcache.generation()
