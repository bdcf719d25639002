#!/usr/bin/env bash
# One-command GPU check: install offline, run the `gpu` tests and a short version of the three benches, and write
# the log, the JSON files and the plots to OUTDIR. Sized for under 6 minutes on an H200.
#
#     bash bench/gpu_check.sh OUTDIR
#
# Made for a GPU machine with no network: KvikIO and gguf travel as wheels in the repo's .whl/ folder (ignored by
# git), fetched beforehand on a machine with PyPI for the target's Python (3.12 on the device machine):
#
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#         --platform manylinux2014_x86_64 -d .whl kvikio-cu13 libkvikio-cu13 rapids-logger gguf
#
# They are installed into /tmp/site (PYTHONPATH); without .whl/ whatever is installed is used. The package is
# installed without build isolation (pip -e, offline; PYTHONPATH=repo if that fails). Every step runs under
# `timeout` within an overall budget (GPU_CHECK_BUDGET seconds, default 345); a failed step does not stop the
# next, and a summary ends the log. Exit status: 0 when every step passed, 1 otherwise.
#
# OUTDIR receives 7 files: gpu_check.log (everything, summary last) and bench_{storage,gather,prefill}.{json,png}.
# Made files (the storage test file, the gather tables) go to GPU_CHECK_WORK (default /tmp/gds-gather-gpu-check).
set -euo pipefail

OUT=${1:?usage: bash bench/gpu_check.sh OUTDIR}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${GPU_CHECK_WORK:-/tmp/gds-gather-gpu-check}
BUDGET=${GPU_CHECK_BUDGET:-345}
mkdir -p "$OUT" "$WORK"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/gpu_check.log"
cd "$REPO"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
T0=$(date +%s)
NAMES=() RCS=() SECS=()

step() {   # step NAME CAP_SECONDS COMMAND...: run COMMAND under timeout, record its exit status and duration
    local name=$1 cap=$2
    shift 2
    local left=$((BUDGET - ($(date +%s) - T0)))
    local limit=$((cap < left ? cap : left))
    if ((limit < 5)); then
        echo "== $name: not run, the ${BUDGET} s budget is spent"
        NAMES+=("$name") RCS+=(skipped) SECS+=(0)
        return 0
    fi
    echo
    echo "== $name (limit ${limit} s): $*"
    local start rc=0
    start=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" || rc=$?
    NAMES+=("$name") RCS+=("$rc") SECS+=($(($(date +%s) - start)))
    echo "== $name: exit $rc after $(($(date +%s) - start)) s"
    return 0
}

last_ok() { [[ ${RCS[${#RCS[@]}-1]} == 0 ]]; }

main() {
    echo "gds-gather GPU check: repo $REPO, out $OUT, work $WORK, budget ${BUDGET} s, $(date -u +%FT%TZ)"
    echo "git: $(git -C "$REPO" log -1 --format='%h %s' 2>/dev/null || echo '?')$(git -C "$REPO" diff --quiet 2>/dev/null || echo ' (+ uncommitted changes)')"
    if command -v nvidia-smi >/dev/null; then
        step nvidia-smi 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    else
        echo "nvidia-smi: not found (no NVIDIA driver on this machine: the GPU steps will skip)"
    fi

    # -- install: wheels (offline) into /tmp/site, then the package without build isolation ------------------------------
    if compgen -G ".whl/*.whl" >/dev/null; then
        step wheels 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl
        if last_ok; then export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}; fi
    else
        echo "wheels: no .whl/*.whl in $REPO: using the installed kvikio/gguf (if any)"
    fi
    step install 120 "$PY" -m pip install -q --no-index --no-build-isolation --no-deps -e .
    if ! last_ok; then
        echo "install: pip failed; running from the checkout instead (PYTHONPATH=$REPO)"
    fi
    export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}   # this checkout's code either way
    step facts 60 "$PY" - <<'EOF'
import importlib.util, sys
import gds_gather as gg
from gds_gather.backends import gds_state
from gds_gather.platform import detect
print("python", sys.version.split()[0], "| gds_gather from", gg.__file__)
for name in ("numpy", "torch", "cupy", "kvikio", "gguf", "matplotlib"):
    spec = importlib.util.find_spec(name)
    print(f"  {name:<10} {spec.origin if spec else 'MISSING'}")
p = detect()
print("platform:", p.kind, "|", p.reason, "|", p.device)
if p.kind != "cpu":
    print("gds_state:", gds_state())
for b in gg.backends():
    print(f"  {b.name:<10} {'yes' if b.available else 'no '}  {b.reason}")
EOF

    # -- tests and benches -----------------------------------------------------------------------------------------------
    step gpu-tests 150 "$PY" -m pytest -m gpu -q -p no:cacheprovider
    if [[ ${RCS[${#RCS[@]}-1]} == 5 ]]; then RCS[${#RCS[@]}-1]=0; echo "gpu-tests: no test selected"; fi
    step bench-kernels 45 "$PY" bench/bench_kernels.py --quick    # dequant-scatter GB/s vs a D2D copy (log only)
    BENCH=("$PY" -m gds_gather.cli bench)
    step bench-storage 40 "${BENCH[@]}" storage --quick --dir "$WORK" --out "$OUT" --json --plot "$OUT/bench_storage.png"
    step bench-gather 70 "${BENCH[@]}" gather --quick --dir "$WORK" --out "$OUT" --json --plot "$OUT/bench_gather.png"
    step bench-prefill 100 "${BENCH[@]}" prefill --quick --targets --trunk tiny --no-warm --repeat 1 --dir "$WORK" \
        --out "$OUT" --json --plot "$OUT/bench_prefill.png"

    # -- summary ---------------------------------------------------------------------------------------------------------
    echo
    echo "== summary ($(($(date +%s) - T0)) s in all; budget ${BUDGET} s)"
    failed=0
    for i in "${!NAMES[@]}"; do
        case ${RCS[$i]} in
            0) state=ok ;;
            124 | 137) state="TIMEOUT"; failed=1 ;;
            skipped) state="NOT RUN (budget)"; failed=1 ;;
            *) state="FAILED (exit ${RCS[$i]})"; failed=1 ;;
        esac
        printf '  %-14s %-18s %4s s\n' "${NAMES[$i]}" "$state" "${SECS[$i]}"
    done
    grep -h -E '^(=+ .*(passed|failed|skipped|error).* =+|[0-9]+ (passed|failed|skipped).*)$' "$LOG" | tail -1 | sed 's/^/  gpu tests: /' || true
    grep -h -E '^(IoType:|XferType:|WARNING: cuFile)' "$LOG" | sed 's/^/  /' || true
    echo "  files in $OUT:"
    find "$OUT" -maxdepth 1 -type f -printf '    %f  %s B\n' | sort
    return $failed
}

main 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
