#!/usr/bin/env bash
# shellcheck disable=SC2317   # functions run through `step` (timeout + bash -c), not called directly
# One-command GPU check on an offline GPU machine (the first run on a GPU: one call, at most 600 s, of which the
# steps below may take 540): install, compile everything once, run the part of the `gpu` tests only a GPU can
# show and one line each of the storage and prefill benches, and end with ONE JSON summary plus the logs.
#
#     bash bench/fetch_wheels.sh            # beforehand, on a machine with PyPI: wheels the image lacks -> .whl/
#     bash bench/gpu_check.sh OUTDIR        # on the GPU machine (carry .whl with the checkout)
#
# Steps, each under its own `timeout` (its cap, in seconds, below), each run even if an earlier one failed, within
# GPU_CHECK_BUDGET seconds (default 540; a step the budget cannot fit is "not run: budget"). The caps sum to 495 s,
# under 540 with a margin, so the budget never cuts a step short. GPU_CHECK_ONLY=a,b runs only the steps named
# (the others are "skipped: not selected").
#   nvidia-smi   10  the GPU, driver and memory (only where nvidia-smi exists)
#   wheels       30  .whl/*.whl -> pip install --no-index --no-deps --target $WORK/site (works where PEP 668 refuses
#                    a system install); that directory goes first on PYTHONPATH
#   package      10  this checkout's gds_gather/ is the whole package (gds_gather.model and gds_gather.kernels are
#                    symlinks to model/ and kernels/): PYTHONPATH=$REPO, nothing installed; checks it imports from
#                    here, with the kernel sources and the model modules (child Pythons inherit the PYTHONPATH)
#   imports      25  every module the run needs (cupy: where an NVIDIA driver answers); what is missing is printed
#   facts        15  python, where each module comes from, platform detection, backends
#   compile      70  once, so that compile errors show here and later steps find the results cached: the host build
#                    of kernels/host_check.cu (g++; host_kernels.host_library, cached under $TMPDIR), the native
#                    helpers (native.build into $XDG_CACHE_HOME/gds-gather), and with a GPU every NVRTC module:
#                    dequant_gpu's one module per row type (all kernels of each; GPU_CHECK_COMPILE_THREADS
#                    at a time, default 4; a type that fails is compiled again alone before it counts as an error)
#                    and devcache's copy.cu (CuPy's cache: CUPY_CACHE_DIR=$WORK/cupy-cache); then a new process
#                    loads one of each and says whether CuPy's disk cache spared it the compile (CuPy reuses it for
#                    modules with name_expressions only in its newer releases). Without a GPU: NVRTC "skipped: no
#                    GPU", the host build and native helpers still built. Its parts: $WORK/compile.json -> summary.
#   test-kernels 55  tests/gpu/test_kernels_gpu.py, test_fp8_kernels.py and test_fp4_kernels.py: every kernel exact
#                    against the reference on the device (the float8 and NVFP4 ones, scaled or not, against the
#                    bit-level oracles)
#   test-device  50  tests/gpu/test_device_gpu.py but the fault tests and the per-type Table sweep: every backend and
#                    destination (eager) with values, streams, close, refusals
#   test-faults  45  the read-error-mid-prefill (fault path) tests
#   test-prefill 85  tests/prefill/test_prefill.py: graph vs eager-resident for each destination and the device row cache
#                    (graph and eager), on qwen4exp; per-layer inputs against the CPU for every model family
#   bench-storage 25  one line: gpu-direct (KvikIO/cuFile into GPU memory), 1 MiB random reads
#   bench-prefill 45  one line: direct, cold, CUDA graph, the tiny trunk (with the untimed warm-up and carried run)
#   gpu-list     30  every `gpu` test, collected once: the summary lists those no step ran ("not in the first run")
# Each test step runs pytest -m gpu -v on its part, its output streamed (tee) into OUTDIR/STEP.log as it goes and a
# junit XML written at the end: a step killed by its cap still has a line per test it finished and names the
# test it was in; the summary reads the junit, else that log. Without a GPU (no nvidia-smi -L, or cupy sees no
# device) the test steps still run: conftest.py marks every gpu test skipped, so each step lists its tests
# ("skipped: no GPU (N collected)"); the benches are "skipped: no GPU".
#
# Environment for every step: HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 (no network), XDG_CACHE_HOME=$WORK/cache,
# CUPY_CACHE_DIR=$WORK/cupy-cache, PYTHONPATH=$WORK/site:$REPO. $WORK: GPU_CHECK_WORK, default
# /tmp/gds-gather-gpu-check.
#
# OUTDIR receives summary.json (every step's status, seconds, cap; the compile step's parts; each test step's
# per-test lines and counts; the tests no step ran; missing imports; the bench lines; caps_sum_s),
# gpu_check.log (everything), STEP.log per test step, gpu_tests.xml (the test steps' junit XMLs in one file) and
# bench_{storage,prefill}.json.
# Exit status: 0 when every step is ok or skipped; 1 when any failed, timed out or was not run; 2 for bad usage.
set -uo pipefail

OUT=${1:?usage: bash bench/gpu_check.sh OUTDIR}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${GPU_CHECK_WORK:-/tmp/gds-gather-gpu-check}
BUDGET=${GPU_CHECK_BUDGET:-540}
mkdir -p "$OUT" "$WORK" || exit 2
OUT=$(cd "$OUT" && pwd)
WORK=$(cd "$WORK" && pwd)
SITE=$WORK/site
LOG="$OUT/gpu_check.log"
STEPS="$WORK/steps.tsv"
CAPS_TSV="$WORK/caps.tsv"
: >"$STEPS"
cd "$REPO" || exit 2
PY=${PYTHON:-python3}
PYP=("$PY" -P)          # -P: nothing but PYTHONPATH decides where gds_gather comes from
T0=$(date +%s)
GPU=0

export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export XDG_CACHE_HOME=$WORK/cache CUPY_CACHE_DIR=$WORK/cupy-cache
mkdir -p "$XDG_CACHE_HOME" "$CUPY_CACHE_DIR" || exit 2
export PY OUT REPO SITE WORK

JUNIT="$WORK/junit"
rm -rf "$JUNIT" && mkdir -p "$JUNIT" || exit 2
export JUNIT

# The caps of every step, in the order they run (the summary sums them: caps_sum_s).
CAPS="nvidia-smi 10
wheels 30
package 10
imports 25
facts 15
compile 70
test-kernels 55
test-device 50
test-faults 45
test-prefill 85
bench-storage 25
bench-prefill 45
gpu-list 30"
tr ' ' '\t' <<<"$CAPS" >"$CAPS_TSV"
cap() { awk -v n="$1" '$1 == n {print $2}' <<<"$CAPS"; }

# The test steps, one a line: NAME|pytest arguments separated by ';' (files, and -k where a file is split). The
# first run's matrix: what only a GPU can show. Gpu tests in none of them are listed in the summary, not run.
TEST_STEPS="test-kernels|tests/gpu/test_kernels_gpu.py;tests/gpu/test_fp8_kernels.py;tests/gpu/test_fp4_kernels.py
test-device|tests/gpu/test_device_gpu.py;-k;not read_error and not every_type
test-faults|tests/gpu/test_device_gpu.py;-k;read_error
test-prefill|tests/prefill/test_prefill.py;-k;(qwen4exp and not evicting) or per_layer_inputs"
export TEST_STEPS

record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4:-}" >>"$STEPS"; }   # NAME STATUS SECONDS LIMIT

selected() {   # is step NAME in GPU_CHECK_ONLY (or is there no selection)?
    [[ -z ${GPU_CHECK_ONLY:-} || ,$GPU_CHECK_ONLY, == *,$1,* ]]
}

step() {   # step NAME COMMAND...: run under timeout (the step's cap); record ok / failed (exit N) / timeout
    local name=$1 cap
    shift
    cap=$(cap "$name")
    if ! selected "$name"; then
        echo "== $name: skipped: not selected (GPU_CHECK_ONLY=$GPU_CHECK_ONLY)"
        record "$name" "skipped: not selected" 0 "$cap"
        return 0
    fi
    local left=$((BUDGET - 15 - ($(date +%s) - T0)))     # 15 s kept for the summary
    local limit=$((cap < left ? cap : left))
    if ((limit < 5)); then
        echo "== $name: not run, the ${BUDGET} s budget is spent"
        record "$name" "not run: budget" 0 "$cap"
        return 0
    fi
    echo
    echo "== $name (limit ${limit} s): $*"
    local start rc=0
    start=$(date +%s)
    timeout --kill-after=5 "$limit" bash -c '"$@"' _ "$@" || rc=$?     # bash: the steps may be functions
    local secs=$(($(date +%s) - start)) status
    case $rc in
        0) status=ok ;;
        124 | 137) status="timeout after ${limit} s" ;;
        *) status="failed (exit $rc)" ;;
    esac
    record "$name" "$status" "$secs" "$limit"
    echo "== $name: $status after $secs s"
    return 0
}

gpu_step() {   # like step, but "skipped: no GPU" without one
    if ((GPU)); then
        step "$@"
    else
        echo "== $1: skipped: no GPU"
        record "$1" "skipped: no GPU" 0 "$(cap "$1")"
    fi
}

check_package() {   # the checkout is the package: gds_gather, its model modules and kernel sources, from $REPO
    "$PY" -P - <<'EOF'
import os
import gds_gather, gds_gather.model.synth, gds_gather.model.trunk
from gds_gather.gpu import kernel_sources
repo = os.path.realpath(os.environ["REPO"])
where = os.path.realpath(gds_gather.__file__)
assert where.startswith(repo + os.sep), f"gds_gather comes from {where}, not the checkout {repo}"
n = {name: len(kernel_sources.source(name))
     for name in ("copy.cu", "gather.cu", "dequant.cuh", "float8.cuh", "host_check.cu")}
print("gds_gather from", where, "| gds_gather.model from", os.path.dirname(gds_gather.model.synth.__file__))
print("kernel sources (chars):", n)
EOF
}

check_imports() {
    "$PY" -P - "$@" <<'EOF'
import importlib, json, sys
import os
required = ["numpy", "gguf", "tqdm", "yaml", "torch", "pytest", "hypothesis", "gds_gather",
            "gds_gather.model.synth", "gds_gather.gpu.kernel_sources"]
wanted = ["kvikio", "matplotlib", "ml_dtypes", "safetensors", "transformers"]
# cupy: required where an NVIDIA driver answers (the GPU machine), optional on a dry run without one
(required if os.environ.get("DRIVER") == "1" else wanted).insert(0, "cupy")
missing, found = [], {}
for name in required + wanted:
    try:
        m = importlib.import_module(name)
        found[name] = getattr(m, "__version__", "") or getattr(m, "__file__", "")
    except Exception as e:
        missing.append(name)
        found[name] = f"MISSING ({type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''})"
for name in required + wanted:
    print(f"  {name:<24} {found[name]}")
bad = [m for m in missing if m in required]
print("missing (required):", ", ".join(bad) or "none")
print("missing (optional: the tests that need them skip):", ", ".join(m for m in missing if m in wanted) or "none")
with open(sys.argv[1], "w") as f:
    json.dump({"required": bad, "optional": [m for m in missing if m in wanted]}, f)
sys.exit(1 if bad else 0)
EOF
}

compile_all() {   # the compile step: every build the later steps need, once; its parts into $WORK/compile.json
    "$PY" -P - "$WORK/compile.json" <<'EOF'
import json, os, subprocess, sys, time, traceback
from concurrent.futures import ThreadPoolExecutor

gpu = os.environ.get("GPU") == "1"
parts, failed, compile_s = {}, [], {}


def part(name, fn):
    t0 = time.time()
    try:
        status, detail = fn()
    except Exception as e:
        status, detail = "failed", f"{type(e).__name__}: {e}"[-3000:]
        traceback.print_exc()
    parts[name] = {"status": status, "seconds": round(time.time() - t0, 2), "detail": detail}
    if status == "failed":
        failed.append(name)
    print(f"  {name:<14} {status} ({parts[name]['seconds']} s): {detail}", flush=True)


def host_build():
    from gds_gather.gpu import host_kernels as hk
    if not hk.host_compiler_available():
        return "skipped: no host C++ compiler", "g++, c++, clang++ and nvcc not found"
    lib = hk.host_library()
    return "ok", f"{hk.host_compiler()[0]} -> {lib._name}"


def native_helpers():
    from gds_gather.io import native
    from gds_gather.config import Config
    so, why = native.build(Config().cache_dir)
    if so is None:
        return ("skipped: no C compiler" if "no C compiler" in why else "failed"), why
    return "ok", f"{native.compiler()} -> {so}"


def nvrtc_dequant():
    if not gpu:
        return "skipped: no GPU", ""
    import cupy as cp
    from gds_gather.gpu import dequant as dg
    from gds_gather.formats.quants import row_types
    types = list(row_types())       # GGML, float8 and float4 types (the modules of the scaled ones hold those kernels)
    threads = max(1, int(os.environ.get("GPU_CHECK_COMPILE_THREADS", "4")))
    errors, times = {}, compile_s

    def one(qt):
        t0 = time.time()
        with cp.cuda.Device(0):
            dg.warmup(qt)           # compiles and loads the type's module: every dtype x index kernel
        times[qt.name] = round(time.time() - t0, 2)

    def guarded(qt):
        try:
            one(qt)
        except Exception as e:
            return qt, e
        return qt, None

    with ThreadPoolExecutor(threads) as pool:
        retry = [qt for qt, e in pool.map(guarded, types) if e is not None]
    for qt in retry:                # again alone: an error here is the compiler's, not the threads'
        _, e = guarded(qt)
        if e is not None:
            errors[qt.name] = f"{type(e).__name__}: {e}"[-3000:]
    for name, err in errors.items():
        print(f"NVRTC error in the module of {name}:\n{err}\n", flush=True)
    slow = sorted(times.items(), key=lambda kv: -kv[1])[:3]
    detail = (f"{len(types) - len(errors)}/{len(types)} type modules in {threads} threads; slowest "
              + ", ".join(f"{k} {v} s" for k, v in slow))
    if errors:
        return "failed", detail + "; FAILED: " + ", ".join(errors)
    return "ok", detail


def nvrtc_copy():
    if not gpu:
        return "skipped: no GPU", ""
    from gds_gather.gpu import devcache
    names = ("gg_copy_words", "gg_copy_rows")
    for name in names:
        devcache._function(0, name)
    return "ok", "copy.cu: " + ", ".join(names)


def disk_cache():
    """A new process loads one dequant module and copy.cu: seconds, against this process's compile of them."""
    if not gpu or "nvrtc-dequant" in failed or "nvrtc-copy" in failed:
        return "skipped: " + ("no GPU" if not gpu else "a compile failed"), ""
    probe = ("import time; from gds_gather.gpu import dequant as dg, devcache; dg._device_state(0); "   # context
             "t = time.time(); dg.warmup('IQ4_NL'); a = time.time() - t; "
             "t = time.time(); devcache._function(0, 'gg_copy_words'); print(round(a, 3), round(time.time() - t, 3))")
    r = subprocess.run([sys.executable, "-P", "-c", probe], capture_output=True, text=True, timeout=60)
    if r.returncode:
        return "failed", r.stderr[-1500:]
    dq, cp_ = (float(x) for x in r.stdout.split()[-2:])
    first = compile_s.get("IQ4_NL", 1.0)
    reused = dq < max(0.2, first / 4)
    return "ok", (f"a new process: IQ4_NL module {dq} s (compiled here in {first} s), copy.cu {cp_} s: "
                  + ("CuPy's disk cache serves the dequant modules, later steps skip NVRTC" if reused else
                     "the dequant modules are COMPILED AGAIN in each process (CuPy does not reuse its disk cache "
                     "for RawModules with name_expressions): later steps pay NVRTC per type they use"))


part("host-build", host_build)
part("native", native_helpers)
part("nvrtc-dequant", nvrtc_dequant)
part("nvrtc-copy", nvrtc_copy)
part("disk-cache", disk_cache)
with open(sys.argv[1], "w") as f:
    json.dump(parts, f, indent=1)
sys.exit(1 if failed else 0)
EOF
}

have_gpu() {
    command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 &&
        "${PYP[@]}" -c "import cupy; assert cupy.cuda.runtime.getDeviceCount() > 0" >/dev/null 2>&1
}

gpu_tests() {   # gpu_tests NAME ARGS...: one test step, verbose, its output streamed into $OUT/NAME.log
    local name=$1
    shift
    local log="$OUT/$name.log"
    COLUMNS=200 "$PY" -P -m pytest -m gpu -v -o console_output_style=classic -p no:cacheprovider --durations=8 \
        --junitxml="$JUNIT/$name.xml" -o junit_family=xunit2 -o junit_suite_name="$name" "$@" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]} n
    n=$(grep -cE '^tests/[^ ]+::[^ ]+ (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)' "$log")
    echo "$n" >"$JUNIT/$name.collected"
    if [[ $n == 0 ]]; then
        echo "FAILED: 0 gpu tests ran in $name: it tested nothing (see the collection errors above)"
        return 3
    fi
    return "$rc"
}

gpu_list() {   # every gpu test, one node id a line, into $JUNIT/all.ids
    "$PY" -P -m pytest -m gpu --collect-only -q -p no:cacheprovider >"$JUNIT/all.out" 2>&1
    grep -E '^tests/.*::' "$JUNIT/all.out" >"$JUNIT/all.ids"
    local n
    n=$(grep -c . "$JUNIT/all.ids")
    echo "$n gpu tests in all"
    echo "$n" >"$JUNIT/all.collected"
    ((n > 0)) || { tail -20 "$JUNIT/all.out"; return 3; }
}

export -f check_package check_imports compile_all gpu_tests gpu_list

main() {
    echo "gds-gather GPU check: repo $REPO, out $OUT, work $WORK, budget ${BUDGET} s, $(date -u +%FT%TZ)"
    echo "git: $(git -C "$REPO" log -1 --format='%h %s' 2>/dev/null || echo '?')$(git -C "$REPO" diff --quiet 2>/dev/null || echo ' (+ uncommitted changes)')"
    echo "step caps (s): $(tr '\n' ' ' <<<"$CAPS")= $(awk '{s += $2} END {print s}' <<<"$CAPS") s in all"
    DRIVER=0
    command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 && DRIVER=1
    export DRIVER
    if command -v nvidia-smi >/dev/null; then
        step nvidia-smi nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    else
        echo "nvidia-smi: not found (no NVIDIA driver here)"
    fi

    # -- install: wheels (offline) into $SITE, then this checkout on PYTHONPATH -------------------------------------
    local pp=$REPO
    if compgen -G ".whl/*.whl" >/dev/null; then
        step wheels "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
            --no-cache-dir --upgrade --find-links .whl --target "$SITE" .whl/*.whl
        pp=$SITE:$pp
    else
        echo "wheels: no .whl/*.whl in $REPO (bash bench/fetch_wheels.sh fetches them): using what is installed"
        record wheels "skipped: no .whl/" 0 "$(cap wheels)"
    fi
    export PYTHONPATH=$pp${PYTHONPATH:+:$PYTHONPATH}
    step package check_package
    step imports check_imports "$WORK/missing.json"
    if have_gpu; then GPU=1; else GPU=0; echo "GPU: none usable here: NVRTC, the gpu tests and the benches skip"; fi
    export GPU
    step facts "${PYP[@]}" - <<'EOF'
import sys
import gds_gather as gg
from gds_gather.backends import gds_state
from gds_gather.platform import detect
print("python", sys.version.split()[0], "| gds_gather from", gg.__file__)
p = detect()
print("platform:", p.kind, "|", p.reason, "|", p.device)
print("GPU path:", p.path)
if p.kind != "cpu":
    print("gds_state:", gds_state())
for b in gg.backends():
    print(f"  {b.name:<10} {'yes' if b.available else 'no '}  {b.reason}")
EOF
    step compile compile_all

    # -- tests and benches -----------------------------------------------------------------------------------------
    local name sel args
    while IFS='|' read -r name sel; do
        IFS=';' read -ra args <<<"$sel"
        step "$name" gpu_tests "$name" "${args[@]}" </dev/null
        if ((!GPU)) && [[ -f $JUNIT/$name.collected ]] && tail -1 "$STEPS" | grep -q $'\tok\t'; then
            # every test listed, each skipped by conftest.py: the tests themselves need a GPU
            sed -i "\$ s/\tok\t/\tskipped: no GPU ($(cat "$JUNIT/$name.collected") collected)\t/" "$STEPS"
        fi
    done <<<"$TEST_STEPS"
    BENCH=("${PYP[@]}" -m gds_gather.cli bench)
    gpu_step bench-storage "${BENCH[@]}" storage --quick --path gpu-direct --io-size 1M --repeat 1 --dir "$WORK" \
        --out "$OUT"
    gpu_step bench-prefill "${BENCH[@]}" prefill --quick --backends direct --no-warm --trunk tiny --repeat 1 \
        --dir "$WORK" --out "$OUT"
    step gpu-list gpu_list </dev/null

    # -- the one JSON summary ----------------------------------------------------------------------------------------
    echo
    echo "== summary ($(($(date +%s) - T0)) s in all; budget ${BUDGET} s)"
    "${PYP[@]}" "$REPO/bench/gpu_check_summary.py" "$OUT" "$STEPS" "$WORK/missing.json" "$GPU" "$JUNIT" \
        "$CAPS_TSV" "$WORK/compile.json"
}

main 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
