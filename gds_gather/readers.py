"""Readers: execute a ReadPlan against a file and return the unique rows' raw bytes, uint8 [U, row_bytes].

Host readers here need no GPU. Each is a context manager holding its file resources; `read(plan)` is the
whole hot path and never loops over rows in Python.
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

from .errors import ReadError
from .planner import ReadPlan


class Reader:
    name = "?"

    def __init__(self, path: Path, data_offset: int, n_bytes: int):
        self.path = Path(path)
        self.data_offset = int(data_offset)
        self.n_bytes = int(n_bytes)

    def read(self, plan: ReadPlan) -> np.ndarray:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class MmapReader(Reader):
    """llama.cpp's lazy mode: the table mapped with MADV_RANDOM, rows gathered by page faults (numpy fancy index)."""

    name = "mmap"

    def __init__(self, path, data_offset, n_bytes):
        super().__init__(path, data_offset, n_bytes)
        self._mm = None
        self._view = None

    def _map(self, row_bytes: int) -> np.ndarray:
        if self._mm is None:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            if self._mm.size() < self.data_offset + self.n_bytes:
                size = self._mm.size()
                self.close()
                raise ReadError(f"{self.path}: file shrank to {size} bytes, table ends at "
                                f"{self.data_offset + self.n_bytes}")
            if hasattr(mmap, "MADV_RANDOM"):
                self._mm.madvise(mmap.MADV_RANDOM)
            self._view = np.frombuffer(self._mm, np.uint8, count=self.n_bytes, offset=self.data_offset)
        return self._view.reshape(-1, row_bytes)

    def read(self, plan: ReadPlan) -> np.ndarray:
        rows = self._map(plan.row_bytes)
        try:
            return rows[plan.unique_rows]
        except (OSError, ValueError) as e:
            raise ReadError(f"{self.path}: reading rows failed near offset {plan.data_offset}: {e}") from e

    def close(self) -> None:
        self._view = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:   # a caller still holds a view of the mapping: let GC unmap it
                pass
            self._mm = None


class ResidentReader(Reader):
    """The whole table loaded into host RAM once (the upper bound a resident table gives)."""

    name = "resident"

    def __init__(self, path, data_offset, n_bytes):
        super().__init__(path, data_offset, n_bytes)
        self._data = None

    def read(self, plan: ReadPlan) -> np.ndarray:
        if self._data is None:
            data = np.empty(self.n_bytes, np.uint8)
            with open(self.path, "rb", buffering=0) as f:
                f.seek(self.data_offset)
                got = f.readinto(memoryview(data))
                while got is not None and got < self.n_bytes:
                    more = f.readinto(memoryview(data)[got:])
                    if not more:
                        raise ReadError(f"{self.path}: unexpected end of file at offset "
                                        f"{self.data_offset + got} while loading the table")
                    got += more
            self._data = data
        return self._data.reshape(-1, plan.row_bytes)[plan.unique_rows]

    def close(self) -> None:
        self._data = None


HOST_READERS = {cls.name: cls for cls in (MmapReader, ResidentReader)}
