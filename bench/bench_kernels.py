#!/usr/bin/env python3
"""Benchmark the CUDA dequant-scatter kernels (gds_gather.gpu.dequant.gather_rows) on a GPU.

    python3 bench/bench_kernels.py [--quick] [--types Q4_0,IQ4_NL] [--dtypes float32,bfloat16] [--gb 1.0] [--json]

1. Per type and output dtype: a gather of >= --gb GB of quantized rows (every staged row once, in random
   order, int32 inverse), timed with CUDA events (median of --repeat). GB/s = (bytes read + bytes written) /
   time, where read = staging rows + inverse + row offsets and written = output. The reference is a
   device-to-device copy measured in the same run (cupy memcpy, also read + written); target ratio >= 0.70.
   Rows are qwen4exp-like (160 elements) for 32-element types, 192 for NVFP4, gemma4-e4b-like (10752) for
   256-element types, 160 for float types. A few output rows are checked against gguf on the host.
2. Latency of one qwen4exp ubatch: 2048 tokens x 16 heads = 32768 rows of 160 IQ4_NL elements (90 B), flat.
3. Latency of one gemma4-e4b ubatch: 2048 rows of 10752 Q5_K elements (7392 B), per-layer [42, 2048, 256], x16.
   Latencies are GPU time per launch (a CUDA graph of back-to-back launches, so Python's launch overhead is not
   counted) plus the host wall time of one gather_rows call.

Without a usable GPU (or without cupy) it prints why and exits 0. Importable: main(argv=None) -> dict.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
from gguf import GGML_QUANT_SIZES

from gds_gather.gpu import arrays
from gds_gather.gpu import dequant as dg
from gds_gather.gpu import host_kernels as hk
from gds_gather.gpu import nvrtc
from gds_gather.formats import quants

TARGET_RATIO = 0.70
ESIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
POOL_BYTES = 16 << 20          # valid blocks made on the host, then tiled on the device up to --gb


def gpu_or_reason():
    """(cupy, None) when a CUDA device is usable, else (None, why)."""
    try:
        import cupy as cp
    except ImportError as e:
        return None, f"cupy is not installed ({e})"
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, no device
        return None, f"no usable CUDA device ({type(e).__name__}: {str(e).splitlines()[0]})"
    if n < 1:
        return None, "no CUDA device"
    return cp, None


def width_for(qt) -> int:
    block = GGML_QUANT_SIZES[qt][0]
    if block == 256:
        return 10752
    return 192 if block == 64 else 160


def time_events(cp, fn, repeat: int, warmup: int = 2) -> dict:
    """Median / min milliseconds of fn() on the current stream, each run between two CUDA events."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeat):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b))
    return {"median_ms": statistics.median(ts), "min_ms": min(ts), "runs_ms": ts}


def d2d_copy(cp, nbytes: int, repeat: int) -> dict:
    src = cp.ones(nbytes // 4, cp.float32)
    dst = cp.empty_like(src)
    t = time_events(cp, lambda: dst.data.copy_from_device_async(src.data, src.nbytes), repeat)
    t["bytes"] = 2 * src.nbytes
    t["GBps"] = t["bytes"] / (t["median_ms"] * 1e-3) / 1e9
    del src, dst
    cp.get_default_memory_pool().free_all_blocks()
    return t


def staged_rows(cp, qt, width: int, min_bytes: float, seed: int):
    """(device staging of >= min_bytes of valid rows, row_bytes, n_rows, host pool of the first rows)."""
    from gds_gather.model.synth import random_blocks
    block, size = GGML_QUANT_SIZES[qt]
    rb = width // block * size
    pool_rows = max(1, POOL_BYTES // rb)
    pool = random_blocks(qt, pool_rows * (width // block), np.random.default_rng(seed)).reshape(pool_rows, rb)
    n_rows = max(pool_rows, -(-int(min_bytes) // rb))
    n_rows = -(-n_rows // pool_rows) * pool_rows
    staging = cp.empty(n_rows * rb, cp.uint8)
    d_pool = cp.asarray(pool.reshape(-1))
    for i in range(n_rows // pool_rows):
        staging[i * d_pool.size:(i + 1) * d_pool.size] = d_pool
    return staging, rb, n_rows, pool


def check_rows(cp, out, pool, perm_head, qt, width, dtype, scale=None, layout="flat", n_layer=None) -> bool:
    """Output rows 0..k-1 against gguf on the host (staged row r is pool row r % len(pool))."""
    k = len(perm_head)
    src = pool[np.asarray(perm_head) % len(pool)]
    ref = hk.reference_gather(src.reshape(-1), np.arange(k, dtype=np.int64) * src.shape[1], np.arange(k),
                              qt, width, dtype=dtype, scale=scale, layout=layout, n_layer=n_layer)
    got = cp.asnumpy(out[:k] if layout == "flat" else out[:, :k])
    return bool(np.array_equal(np.ascontiguousarray(got).view(np.uint8), ref.view(np.uint8)))


def bench_type(cp, qt, dtypes, gb: float, repeat: int, copy_GBps: float, seed: int) -> list[dict]:
    width = width_for(qt)
    staging, rb, n_rows, pool = staged_rows(cp, qt, width, gb * 1e9, seed)
    offsets = cp.arange(n_rows, dtype=cp.int64) * rb
    perm = cp.random.RandomState(seed).permutation(n_rows).astype(cp.int32)
    head = cp.asnumpy(perm[:8])
    res = []
    for dtype in dtypes:
        out = cp.empty((n_rows, width), np.uint16 if dtype == "bfloat16" else dtype)
        dg.warmup(qt, dtypes=(dtype,), index_dtypes=("int32",))

        def run():
            dg.gather_rows(staging, offsets, perm, qt, width, out=out, dtype=dtype)

        t = time_events(cp, run, repeat)
        read = staging.nbytes + perm.nbytes + offsets.nbytes
        written = out.nbytes
        gbps = (read + written) / (t["median_ms"] * 1e-3) / 1e9
        res.append({"type": qt.name, "dtype": dtype, "width": width, "row_bytes": rb, "rows": n_rows,
                    "read_bytes": read, "written_bytes": written, "median_ms": t["median_ms"],
                    "min_ms": t["min_ms"], "GBps": gbps, "ratio_to_copy": gbps / copy_GBps,
                    "pass": gbps / copy_GBps >= TARGET_RATIO,
                    "exact": check_rows(cp, out, pool, head, qt, width, dtype)})
        del out
        cp.get_default_memory_pool().free_all_blocks()
    del staging, offsets, perm
    cp.get_default_memory_pool().free_all_blocks()
    return res


def latency(cp, name, qt, width, n_out, dtype, *, scale=None, layout="flat", n_layer=None, graph_launches=20,
            repeat=20, seed=0) -> dict:
    """GPU time per launch (captured graph of `graph_launches` gathers) and host wall time per gather_rows call."""
    staging, rb, n_rows, pool = staged_rows(cp, qt, width, n_out * quants.row_bytes(qt, width), seed)
    offsets = cp.arange(n_rows, dtype=cp.int64) * rb
    inv = cp.random.RandomState(seed).permutation(n_rows)[:n_out].astype(cp.int32)
    seg = width if layout == "flat" else width // n_layer
    shape = (n_out, width) if layout == "flat" else (n_layer, n_out, seg)
    out = cp.empty(shape, np.uint16 if dtype == "bfloat16" else dtype)
    dg.warmup(qt, dtypes=(dtype,), index_dtypes=("int32",))
    s = cp.cuda.Stream(non_blocking=True)
    kw = dict(out=out, dtype=dtype, scale=scale, layout=layout, n_layer=n_layer)
    with s:
        for _ in range(3):
            dg.gather_rows(staging, offsets, inv, qt, width, stream=s, **kw)
        s.synchronize()
        wall = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            dg.gather_rows(staging, offsets, inv, qt, width, stream=s, **kw)
            wall.append((time.perf_counter() - t0) * 1e6)
            s.synchronize()
        s.begin_capture()
        for _ in range(graph_launches):
            dg.gather_rows(staging, offsets, inv, qt, width, stream=s, **kw)
        graph = s.end_capture()
        graph.upload(s)
        t = time_events(cp, lambda: graph.launch(s), repeat=max(5, repeat // 4))
    gpu_us = t["median_ms"] * 1e3 / graph_launches
    head = cp.asnumpy(inv[:8])
    moved = n_out * rb + out.nbytes
    return {"name": name, "type": qt.name, "dtype": dtype, "rows": n_out, "width": width, "row_bytes": rb,
            "layout": layout, "scale": scale, "gpu_us": gpu_us, "host_call_us": statistics.median(wall),
            "GBps": moved / (gpu_us * 1e-6) / 1e9,
            "exact": check_rows(cp, out, pool, head, qt, width, dtype, scale, layout, n_layer)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="all", help="comma-separated GGML types (default: every supported type)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="output dtypes (float32, float16, bfloat16)")
    ap.add_argument("--gb", type=float, default=1.0, help="GB of quantized rows per type (default 1.0)")
    ap.add_argument("--repeat", type=int, default=10, help="timed runs per measurement (after warm-up)")
    ap.add_argument("--quick", action="store_true", help="0.25 GB, 3 runs, a handful of types: a smoke run")
    ap.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.quick:
        a.gb, a.repeat = min(a.gb, 0.25), min(a.repeat, 3)
        if a.types == "all":
            a.types = "F16,Q4_0,Q8_0,Q5_K,IQ2_XXS,IQ4_NL,MXFP4,NVFP4"
    dtypes = [arrays.dtype_name(d.strip()) for d in a.dtypes.split(",") if d.strip()]
    types = quants.supported_types() if a.types == "all" else [quants.check_supported(t.strip())
                                                                  for t in a.types.split(",") if t.strip()]

    cp, why = gpu_or_reason()
    if cp is None:
        msg = f"bench_kernels: no GPU, nothing measured: {why}"
        if a.json:
            print(json.dumps({"skipped": msg}))
        else:
            print(msg)
        return {"skipped": msg}

    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    res: dict = {"device": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
                 "sms": dev.attributes["MultiProcessorCount"], "cupy": cp.__version__, "gb": a.gb,
                 "repeat": a.repeat, "nvrtc_options": list(nvrtc.NVRTC_OPTIONS)}
    t0 = time.perf_counter()
    dg.warmup(types[0], dtypes=dtypes, index_dtypes=("int32",))
    res["first_compile_s"] = time.perf_counter() - t0
    copy = d2d_copy(cp, max(256 << 20, int(a.gb * 1e9)), a.repeat)
    res["d2d_copy"] = {k: v for k, v in copy.items() if k != "runs_ms"}
    if not a.json:
        print(f"# bench_kernels  {res['device']}  SMs {res['sms']}  cupy {res['cupy']}  "
              f"first compile {res['first_compile_s']:.2f} s")
        print(f"device-to-device copy: {copy['GBps']:,.0f} GB/s (read + written, {copy['bytes'] / 1e9:.2f} GB)")
        print(f"{'type':<8} {'dtype':<9} {'width':>6} {'rows':>10} {'GB moved':>9} {'ms':>8} {'GB/s':>8} "
              f"{'/copy':>6}  verdict")
    res["gathers"] = []
    for i, qt in enumerate(types):
        for r in bench_type(cp, qt, dtypes, a.gb, a.repeat, copy["GBps"], a.seed + i):
            res["gathers"].append(r)
            if not a.json:
                verdict = ("PASS" if r["pass"] else "FAIL") + ("" if r["exact"] else "  MISMATCH")
                print(f"{r['type']:<8} {r['dtype']:<9} {r['width']:>6} {r['rows']:>10,} "
                      f"{(r['read_bytes'] + r['written_bytes']) / 1e9:>9.2f} {r['median_ms']:>8.3f} "
                      f"{r['GBps']:>8,.0f} {r['ratio_to_copy']:>6.2f}  {verdict}")
    res["ubatch"] = []
    for dtype in dtypes:
        res["ubatch"].append(latency(cp, "qwen4exp", quants.qtype_of("IQ4_NL"), 160, 2048 * 16, dtype,
                                     repeat=a.repeat * 2, seed=a.seed))
        res["ubatch"].append(latency(cp, "gemma4-e4b", quants.qtype_of("Q5_K"), 10752, 2048, dtype, scale=16.0,
                                     layout="per_layer", n_layer=42, repeat=a.repeat * 2, seed=a.seed))
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        for r in res["ubatch"]:
            print(f"{r['name']:<11} ubatch {r['rows']:>6,} rows x {r['width']} {r['type']} -> {r['dtype']:<8} "
                  f"({r['layout']}{', x%g' % r['scale'] if r['scale'] else ''}): GPU {r['gpu_us']:8.1f} us "
                  f"({r['GBps']:,.0f} GB/s), host call {r['host_call_us']:6.1f} us"
                  f"{'' if r['exact'] else '  MISMATCH'}")
        fails = [f"{r['type']}/{r['dtype']}" for r in res["gathers"] if not r["pass"]]
        bad = [f"{r['type']}/{r['dtype']}" for r in res["gathers"] + res["ubatch"] if not r["exact"]]
        print(f"target >= {TARGET_RATIO:.0%} of copy bandwidth: "
              + ("PASS (all)" if not fails else f"FAIL for {', '.join(fails)}")
              + ("" if not bad else f"; MISMATCH for {', '.join(bad)}"))
    return res


if __name__ == "__main__":
    main()
    sys.exit(0)
