"""Fixtures of the kernel tests: `lib`, the kernels' host build (gpu/host_kernels.py), skipped without a compiler."""
from __future__ import annotations

import pytest

from gds_gather.gpu import host_kernels as hk


@pytest.fixture(scope="module")
def lib():
    if not hk.host_compiler_available():
        pytest.skip("no C++ compiler (g++/clang++) or nvcc: the host build of the kernels cannot be checked")
    return hk.host_library()
