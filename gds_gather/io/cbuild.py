"""Run-time builds of small shared libraries (the native helpers, the host build of the CUDA kernels), cached.

A library is named by a hash of its sources and compile flags, so a process that finds it in the cache loads it
without running a compiler (the compiler's path is not in the name: a library found is used whichever compiler
would build it now). It is compiled in a temporary folder inside the cache folder and renamed into place: the
rename is atomic, so concurrent first uses each publish a whole file and nobody loads a half-written one.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..errors import CompileError

_LOCK = threading.Lock()        # one build at a time in a process (builds are rare and short)


def library_path(cache_dir, prefix: str, sources: Mapping[str, bytes | str], flags: Sequence[str],
                 digits: int = 16) -> Path:
    """Where the build of `sources` (file name -> text) with `flags` lives: cache_dir/<prefix><hash>.so."""
    h = hashlib.sha256()
    for part in (*flags, "\0", *sorted(sources)):
        h.update(part.encode() + b"\0")
    for name in sorted(sources):
        text = sources[name]
        h.update(text.encode("utf-8") if isinstance(text, str) else bytes(text))
        h.update(b"\0")
    return Path(cache_dir) / f"{prefix}{h.hexdigest()[:digits]}.so"


def build_shared(compiler: Sequence[str], sources: Mapping[str, bytes | str], main: str, flags: Sequence[str],
                 cache_dir, prefix: str, digits: int = 16) -> Path:
    """The shared library built from `sources` (written side by side, so they include each other) by
    `compiler` + `flags` + ``-o <lib> <main>``, at library_path(...); compiled only if it is not there yet.
    CompileError (with the compiler's output) when the compiler fails; nothing is left in the cache then."""
    lib = library_path(cache_dir, prefix, sources, flags, digits)
    with _LOCK:
        if lib.exists():
            return lib
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
            for name, text in sources.items():
                if isinstance(text, str):
                    Path(tmp, name).write_text(text, encoding="utf-8")
                else:
                    Path(tmp, name).write_bytes(bytes(text))
            out = Path(tmp, lib.name)
            res = subprocess.run([*compiler, *flags, "-o", str(out), str(Path(tmp, main))],
                                 capture_output=True, text=True, cwd=tmp)
            if res.returncode:
                raise CompileError(f"{compiler[0]} failed with exit status {res.returncode}", res.stderr)
            os.replace(out, lib)
    return lib
