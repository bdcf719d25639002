"""The CUDA C++ sources in the checkout's top-level ``kernels/`` folder, read as package data.

``kernels/`` is installed as the data-only package ``gds_gather.kernels`` and has no ``__init__.py``: a top-level
importable ``kernels`` would shadow Hugging Face's ``kernels`` distribution (transformers imports it) whenever the
checkout's root is on ``sys.path``.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path


def source(name: str) -> str:
    """Text of a kernel source file, e.g. ``source('dequant.cuh')``."""
    return resources.files("gds_gather.kernels").joinpath(name).read_text(encoding="utf-8")


def write_sources(directory, names) -> None:
    """Write the named kernel sources into `directory` (compile checks build them there)."""
    for name in names:
        (Path(directory) / name).write_text(source(name), encoding="utf-8")
