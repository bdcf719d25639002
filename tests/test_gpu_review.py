"""CPU tests of the GPU-code review's findings (issue 17), against stand-ins for cupy and the CUDA streams.

There is no GPU in CI: each test below shows one finding's behaviour where it can be shown without a device (which
stream each queued operation runs on, the order of synchronizations and unpins, what is registered). The same
findings on a real GPU are covered by `gpu`-marked tests in test_device_gpu.py.
"""
from __future__ import annotations

import ast
import contextlib
import io
from pathlib import Path

import numpy as np


def _script(name: str) -> str:
    """A module-level string constant of tests/test_device_gpu.py (a subprocess script), without importing it."""
    tree = ast.parse((Path(__file__).parent / "test_device_gpu.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise KeyError(name)


# -- finding 2: the prefill fault script's "OK" line under numpy 2 ----------------------------------------------------
def test_fault_script_prints_plain_ints_for_the_flags():
    """numpy 2 prints list(np.int32 array) as [np.int32(0), ...]: the gpu test's "OK 6 [0, 0]" must still match."""
    line = next(ln for ln in _script("_INJECT").splitlines() if ln.strip().startswith('print("OK"'))

    class Pipe:
        class flags:
            host = np.zeros(2, np.int32)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(line.strip(), {"res": {"outputs": [0] * 6}, "pipe": Pipe})
    assert out.getvalue().strip() == "OK 6 [0, 0]"
