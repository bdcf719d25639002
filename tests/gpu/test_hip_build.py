"""ROCm: the kernels build with HIP, and HIP's multiply path is bit-exact.

hipcc (Debian's 5.2, clang 15; `.ci/run` installs it) compiles kernels/gather.cu for two AMD targets with the
package's defines, and the object's offload bundle must hold a code object per target with every instantiated
kernel. HIP has no inline PTX and cupy compiles HIP kernels with -fcuda-flush-denormals-to-zero, so gg_mul on
HIP uses the hardware multiply only where every value is normal and an integer IEEE multiply otherwise: the host
build with -DGG_SOFT_MUL runs that very code and is checked bit for bit against numpy and gguf here.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from gds_gather.gpu import host_kernels as hk
from gds_gather.gpu import tables
from gds_gather.model.synth import random_blocks
from gds_gather.formats.quants import row_types, supported_types

Q = GGMLQuantizationType
TYPES = supported_types()
TARGETS = ("gfx90a", "gfx1030")      # Debian's clang 15 does not know gfx942


def _bundler() -> str | None:
    found = shutil.which("clang-offload-bundler")
    if found:
        return found
    cands = sorted(glob.glob("/usr/lib/llvm-*/bin/clang-offload-bundler")) + \
        sorted(glob.glob("/opt/rocm*/llvm/bin/clang-offload-bundler"))
    return cands[-1] if cands else None


def test_hipcc_builds_every_type_for_two_amd_targets(tmp_path):
    hipcc = shutil.which("hipcc")
    if hipcc is None:
        pytest.skip("hipcc not found (apt-get install hipcc): the ROCm compile check of kernels/ cannot run")
    from gds_gather.gpu.kernel_sources import write_sources
    write_sources(tmp_path, tables.KERNEL_SOURCES)
    obj = tmp_path / "gather.o"
    cmd = [hipcc, *(f"--offload-arch={t}" for t in TARGETS), "-std=c++17", "-ffp-contract=off",
           "-DGG_INSTANTIATE_EACH_TYPE", *(f"-D{k}={v}" for k, v in tables.defines().items()),
           "-x", "hip", "-c", str(tmp_path / "gather.cu"), "-o", str(obj)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "HIP_PLATFORM": "amd"})
    assert res.returncode == 0, res.stderr[-4000:]
    assert "warning" not in res.stderr.lower(), res.stderr[-4000:]
    want = len(row_types()) + 5           # one per row type, plus Q4_0's five other dtype/index combinations
    blob = obj.read_bytes()
    kernels = set(re.findall(rb"_Z9gg_gather\w+\.kd", blob))     # kernel descriptors exist only in device code
    assert len(kernels) == want, sorted(kernels)[:5]
    scaled = set(re.findall(rb"_Z16gg_gather_scaled\w+\.kd", blob))
    assert len(scaled) == 12, sorted(scaled)   # one per (scaled type, scale type) pair
    kernels |= scaled
    for t in TARGETS:
        assert f"amdgcn-amd-amdhsa--{t}".encode() in blob, t
    bundler = _bundler()
    if bundler is None:
        return
    fat = tmp_path / "fat.bin"
    subprocess.run(["objcopy", "-O", "binary", "--only-section=.hip_fatbin", str(obj), str(fat)], check=True)
    listed = subprocess.run([bundler, "--list", "--type=o", f"--input={fat}"], capture_output=True, text=True,
                            check=True).stdout.split()
    for t in TARGETS:
        entry = next(e for e in listed if e.endswith(f"--{t}"))
        co = tmp_path / f"{t}.co"
        subprocess.run([bundler, "--unbundle", "--type=o", f"--input={fat}", f"--targets={entry}",
                        f"--output={co}"], check=True)
        per_target = set(re.findall(rb"_Z(?:9gg_gather|16gg_gather_scaled)\w+\.kd", co.read_bytes()))
        assert per_target == kernels, t


def test_hip_preprocessor_paths():
    """The HIP paths in the sources: kernels compiled under __HIP__, no PTX outside __CUDA_ARCH__."""
    from gds_gather.gpu.kernel_sources import source
    gather, dequant = source("gather.cu"), source("dequant.cuh")
    assert "#if defined(__CUDACC__) || defined(__HIP__)" in gather
    assert "#if !defined(__CUDACC__) && !defined(__HIP__)" in dequant
    for text in (gather, dequant, source("float8.cuh")):
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if "asm(" in line:   # every inline PTX line sits right under an __CUDA_ARCH__-only guard
                guard = next(ln for ln in reversed(lines[:i]) if ln.startswith("#if"))
                assert "__CUDA_ARCH__" in guard and "HIP" not in guard, (line, guard)


@pytest.fixture(scope="module")
def soft():
    if not hk.host_compiler_available():
        pytest.skip("no C++ compiler: the host build of HIP's multiply path cannot be checked")
    return hk.host_library(soft_mul=True)


def _special_floats() -> np.ndarray:
    mant = np.array([0, 1, 2, 3, 0x3fffff, 0x400000, 0x400001, 0x7ffffe, 0x7fffff], np.uint32)
    exps = np.array([0, 1, 2, 24, 25, 100, 126, 127, 128, 200, 253, 254, 255], np.uint32) << 23
    bits = (exps[:, None] | mant).ravel()
    return np.concatenate([bits, bits | 0x80000000]).view(np.float32)


def test_soft_multiply_is_ieee(soft):
    """gg_mul as HIP runs it equals numpy float32 a * b bit for bit (NaN where numpy has NaN)."""
    rng = np.random.default_rng(11)
    n = 1 << 19
    a = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    a[: n // 2] = (a[: n // 2] & 0x80000000) | (a[: n // 2] & 0x1fffffff)     # small: subnormal products
    s = _special_floats()
    af = np.concatenate([a.view(np.float32), np.repeat(s, s.size)])
    bf = np.concatenate([b.view(np.float32), np.tile(s, s.size)])
    with np.errstate(all="ignore"):
        ref = af * bf
    got = hk.host_mul(af, bf, soft_mul=True)
    tiny = (ref != 0) & (np.abs(ref) < np.finfo(np.float32).tiny)
    assert tiny.sum() > 10_000                                 # the subnormal results really are exercised
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got.view(np.uint32)[~nan], ref.view(np.uint32)[~nan])


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_soft_mul_build_dequant_exact(soft, qtype):
    rng = np.random.default_rng(3000 + int(qtype))
    blocks = random_blocks(qtype, 500, rng)
    got = hk.host_dequantize(blocks, qtype, soft_mul=True)
    ref = np.asarray(gq.dequantize(blocks, qtype), np.float32).reshape(got.shape)
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


def test_soft_mul_build_mxfp4_every_exponent_and_scaled_gather(soft):
    """MXFP4's e8m0 exponents 0 and 1 give subnormal products; the output scale meets F32 subnormals."""
    _, size = GGML_QUANT_SIZES[Q.MXFP4]
    blocks = np.random.default_rng(7).integers(0, 256, (256, size), dtype=np.uint8)
    blocks[:, 0] = np.arange(256, dtype=np.uint8)
    with np.errstate(over="ignore"):
        ref = np.asarray(gq.dequantize(blocks, Q.MXFP4), np.float32)
    got = hk.host_dequantize(blocks, Q.MXFP4, soft_mul=True)
    np.testing.assert_array_equal(got.view(np.uint32), ref.reshape(got.shape).view(np.uint32))
    x = np.concatenate([_special_floats(), np.random.default_rng(2).standard_normal(46).astype(np.float32) * 1e-38])
    x = x[: x.size // 16 * 16]
    staging = x.view(np.uint8)
    n = x.size // 16
    offs, inv = np.arange(n, dtype=np.int64) * 64, np.arange(n, dtype=np.int32)
    for scale in (16.0, 0.1, 3e-39):
        kw = dict(scale=scale)
        got = hk.host_gather(staging, offs, inv, Q.F32, 16, soft_mul=True, **kw)
        with np.errstate(over="ignore", invalid="ignore"):
            want = hk.reference_gather(staging, offs, inv, Q.F32, 16, **kw)
        nan = np.isnan(want)
        np.testing.assert_array_equal(np.isnan(got), nan)
        np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
