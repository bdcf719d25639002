"""CUDA C++ sources of the dequant-scatter kernels, shipped as package data (read with importlib.resources)."""
from importlib import resources


def source(name: str) -> str:
    """Text of a kernel source file in this folder, e.g. source('dequant.cuh')."""
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")


def write_sources(directory, names) -> None:
    """Write the named kernel sources into `directory` (compile checks build them there)."""
    from pathlib import Path
    for name in names:
        (Path(directory) / name).write_text(source(name), encoding="utf-8")
