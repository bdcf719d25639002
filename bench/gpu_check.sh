#!/usr/bin/env bash
# shellcheck disable=SC2317   # functions run through `step` (timeout + bash -c), not called directly
# One-command GPU check on an offline GPU machine: check the imports, install, run the `gpu` tests and short
# versions of the benches, and end with ONE JSON summary plus the log.
#
#     bash bench/fetch_wheels.sh            # beforehand, on a machine with PyPI: wheels the image lacks -> .whl/
#     bash bench/gpu_check.sh OUTDIR        # on the GPU machine (carry .whl with the checkout)
#
# Steps, each under its own `timeout`, each run even if an earlier one failed, within GPU_CHECK_BUDGET seconds
# (default 540, the H200 allowance; a step the budget cannot fit is "not run: budget"). GPU_CHECK_ONLY=a,b runs
# only the steps named (the others are "skipped: not selected"), to split the check over two device calls:
#   imports   every module the run needs, checked on this machine first; what is missing is printed
#   wheels    .whl/*.whl -> pip install --no-index --no-deps --target $SITE (works where PEP 668 refuses a
#             system install); $SITE goes first on PYTHONPATH
#   package   this checkout as a tiny site dir ($SITE_PKG/gds_gather: symlinks to gds_gather/*, plus model/ and
#             kernels/ as gds_gather.model and gds_gather.kernels); every Python runs with -P, so the
#             checkout's own gds_gather/ (which lacks those two) never shadows it
#   facts     python, where each module comes from, platform detection, backends
#   gpu-selection  every `gpu` test belongs to exactly one of the test steps below (else it fails, naming them),
#             from one collection; the summary also compares that count with the test steps' junit XMLs
#   test-kernels, test-device, test-faults, test-prefill, test-other: pytest -m gpu on a part of the suite, each
#             with its own limit and its own junit XML, so a slow part cannot hide the others' results; zero
#             collected tests is a failure
#   bench-kernels, bench-storage, bench-gather, bench-prefill (--targets: graph vs no-graph, ratios)
# Without a GPU (no nvidia-smi -L, or cupy sees no device) every GPU step is "skipped: no GPU"; the test steps then
# only collect their part, to prove it is not empty ("skipped: no GPU (N collected)").
#
# OUTDIR receives at most 8 files: summary.json (the one summary: every step's status and seconds, missing
# imports, tests passed/failed/skipped per step and per file from the junit XMLs, kernel GB/s per type vs the D2D
# copy, graph vs eager prefill, prefill ratios and targets), gpu_check.log (everything), gpu_tests.xml (the test
# steps' junit XMLs in one file) and bench_{kernels,storage,gather,prefill}.json. GPU_CHECK_PLOTS=1 adds the
# bench plots (3 more files).
# Exit status: 0 when every step is ok or "skipped: no GPU"; 1 when any failed, timed out or was not run;
# 2 for bad usage.
set -uo pipefail

OUT=${1:?usage: bash bench/gpu_check.sh OUTDIR}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${GPU_CHECK_WORK:-/tmp/gds-gather-gpu-check}
BUDGET=${GPU_CHECK_BUDGET:-540}
SITE=${GPU_CHECK_SITE:-/tmp/gds-gather-site}
mkdir -p "$OUT" "$WORK" || exit 2
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/gpu_check.log"
STEPS="$WORK/steps.tsv"
: >"$STEPS"
cd "$REPO" || exit 2
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
PY=${PYTHON:-python3}
PYP=("$PY" -P)          # -P: the checkout's directory is never put first on sys.path
export PY OUT REPO SITE WORK
T0=$(date +%s)
GPU=0

JUNIT="$WORK/junit"
rm -rf "$JUNIT" && mkdir -p "$JUNIT" || exit 2
export JUNIT

record() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$STEPS"; }   # NAME STATUS SECONDS

selected() {   # is step NAME in GPU_CHECK_ONLY (or is there no selection)?
    [[ -z ${GPU_CHECK_ONLY:-} || ,$GPU_CHECK_ONLY, == *,$1,* ]]
}

step() {   # step NAME CAP_SECONDS COMMAND...: run under timeout; record ok / failed (exit N) / timeout
    local name=$1 cap=$2
    shift 2
    if ! selected "$name"; then
        echo "== $name: skipped: not selected (GPU_CHECK_ONLY=$GPU_CHECK_ONLY)"
        record "$name" "skipped: not selected" 0
        return 0
    fi
    local left=$((BUDGET - 15 - ($(date +%s) - T0)))     # 15 s kept for the summary
    local limit=$((cap < left ? cap : left))
    if ((limit < 5)); then
        echo "== $name: not run, the ${BUDGET} s budget is spent"
        record "$name" "not run: budget" 0
        return 0
    fi
    echo
    echo "== $name (limit ${limit} s): $*"
    local start rc=0
    start=$(date +%s)
    timeout --kill-after=10 "$limit" bash -c '"$@"' _ "$@" || rc=$?     # bash: the steps may be functions
    local secs=$(($(date +%s) - start)) status
    case $rc in
        0) status=ok ;;
        124 | 137) status="timeout after ${limit} s" ;;
        *) status="failed (exit $rc)" ;;
    esac
    record "$name" "$status" "$secs"
    echo "== $name: $status after $secs s"
    return 0
}

gpu_step() {   # like step, but "skipped: no GPU" without one
    if ((GPU)); then
        step "$@"
    else
        echo "== $1: skipped: no GPU"
        record "$1" "skipped: no GPU" 0
    fi
}

check_imports() {
    "$PY" -P - "$@" <<'EOF'
import importlib, json, sys
required = ["numpy", "gguf", "tqdm", "yaml", "torch", "cupy", "pytest", "hypothesis", "gds_gather",
            "gds_gather.model", "gds_gather.kernels"]
wanted = ["kvikio", "matplotlib", "ml_dtypes", "safetensors", "transformers"]
missing, found = [], {}
for name in required + wanted:
    try:
        m = importlib.import_module(name)
        found[name] = getattr(m, "__version__", "") or getattr(m, "__file__", "")
    except Exception as e:
        missing.append(name)
        found[name] = f"MISSING ({type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''})"
for name in required + wanted:
    print(f"  {name:<20} {found[name]}")
bad = [m for m in missing if m in required]
print("missing (required):", ", ".join(bad) or "none")
print("missing (optional: the tests that need them skip):", ", ".join(m for m in missing if m in wanted) or "none")
with open(sys.argv[1], "w") as f:
    json.dump({"required": bad, "optional": [m for m in missing if m in wanted]}, f)
sys.exit(1 if bad else 0)
EOF
}

make_site() {   # this checkout as gds_gather + gds_gather.model + gds_gather.kernels, by symlinks
    local pkg=$SITE/pkg
    rm -rf "$pkg" && mkdir -p "$pkg/gds_gather" || return 1
    local f
    for f in "$REPO"/gds_gather/*; do
        [[ $(basename "$f") == __pycache__ ]] || ln -s "$f" "$pkg/gds_gather/" || return 1
    done
    ln -s "$REPO/model" "$pkg/gds_gather/model" && ln -s "$REPO/kernels" "$pkg/gds_gather/kernels" || return 1
    PYTHONPATH=$pkg${PYTHONPATH:+:$PYTHONPATH} "$PY" -P -c "import gds_gather, gds_gather.model, gds_gather.kernels, sys
assert gds_gather.__file__.startswith('$pkg'), gds_gather.__file__
print('gds_gather from', gds_gather.__file__, '| model', gds_gather.model.__file__)"
}

have_gpu() {
    command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 &&
        "${PYP[@]}" -c "import cupy; assert cupy.cuda.runtime.getDeviceCount() > 0" >/dev/null 2>&1
}

# The test steps, one a line: NAME|limit in seconds|pytest arguments separated by ';' (files, and -k where a file
# is split). Every `gpu` test must fall in exactly one (gpu-selection checks it).
TEST_STEPS="test-kernels|90|tests/test_kernels_gpu.py
test-device|90|tests/test_device_gpu.py;-k;not read_error_mid_prefill
test-faults|120|tests/test_device_gpu.py;-k;read_error_mid_prefill
test-prefill|120|tests/test_prefill.py
test-other|60|tests/test_hf.py;tests/test_rowcache.py;tests/test_trunk.py;tests/test_gpu_review.py;tests/test_vllm.py"
export TEST_STEPS

collect() {   # collect ARGS...: the node ids of the gpu tests ARGS select, one a line
    "$PY" -P -m pytest -m gpu --collect-only -q -p no:cacheprovider "$@" 2>/dev/null | grep -E '^tests/.*::'
}

gpu_tests() {   # gpu_tests NAME ARGS...: one test step (with a GPU: run, junit into $JUNIT/NAME.xml)
    local name=$1
    shift
    if ((GPU)); then
        "$PY" -P -m pytest -m gpu -q -p no:cacheprovider --junitxml="$JUNIT/$name.xml" -o junit_family=xunit2 \
            -o junit_suite_name="$name" "$@"
        local rc=$?
        local n
        n=$("$PY" -P -c "import xml.etree.ElementTree as E; r=E.parse('$JUNIT/$name.xml').getroot(); \
print(sum(int(s.get('tests', 0)) for s in ([r] if r.tag == 'testsuite' else r.iter('testsuite'))))" 2>/dev/null || echo 0)
        if [[ $n == 0 ]]; then
            echo "FAILED: 0 gpu tests collected in $name: it tested nothing (see the collection errors above)"
            return 3
        fi
        return "$rc"
    fi
    local n
    if [[ -f $JUNIT/$name.ids ]]; then n=$(grep -c . "$JUNIT/$name.ids"); else n=$(collect "$@" | wc -l); fi
    echo "no GPU: $name collected $n gpu tests (not run)"
    echo "$n" >"$JUNIT/$name.collected"
    if [[ $n == 0 ]]; then
        echo "FAILED: 0 gpu tests collected in $name"
        return 3
    fi
    return 0
}

gpu_selection() {   # every gpu test in exactly one test step: one collection, split here by the steps' selections
    collect >"$JUNIT/all.ids" || { echo "FAILED: no gpu test collected"; return 3; }
    "$PY" -P - "$JUNIT" <<'PYEOF'
import os, sys
from pathlib import Path
junit = Path(sys.argv[1])
ids = junit.joinpath("all.ids").read_text().split()
(junit / "all.collected").write_text(f"{len(ids)}\n")
owners = {i: [] for i in ids}
for line in os.environ["TEST_STEPS"].splitlines():
    name, _, sel = line.split("|")
    args = sel.split(";")
    files = [a for a in args if a.endswith(".py")]
    k = args[args.index("-k") + 1] if "-k" in args else None       # the forms used: "WORD" or "not WORD"
    if k is not None and not (k.split()[-1].isidentifier() and k.split()[:-1] in ([], ["not"])):
        sys.exit(f"gpu-selection: step {name}: -k {k!r} is not of the form WORD or 'not WORD'")
    mine = [i for i in ids if i.split("::")[0] in files and
            (k is None or (k.split()[-1] in i.split("::", 1)[1]) != k.startswith("not "))]
    (junit / f"{name}.ids").write_text("".join(f"{i}\n" for i in mine))
    for i in mine:
        owners[i].append(name)
none = [i for i, o in owners.items() if not o]
two = [f"{i} ({', '.join(o)})" for i, o in owners.items() if len(o) > 1]
print(f"gpu tests: {len(ids)} in all; in no test step: {len(none)}; in two: {len(two)}")
for what, bad in (("in no test step", none), ("in two test steps", two)):
    if bad:
        print(f"FAILED: gpu tests {what}:", *bad, sep="\n  ")
sys.exit(1 if none or two or not ids else 0)
PYEOF
}

export -f check_imports make_site collect gpu_tests gpu_selection

main() {
    echo "gds-gather GPU check: repo $REPO, out $OUT, work $WORK, budget ${BUDGET} s, $(date -u +%FT%TZ)"
    echo "git: $(git -C "$REPO" log -1 --format='%h %s' 2>/dev/null || echo '?')$(git -C "$REPO" diff --quiet 2>/dev/null || echo ' (+ uncommitted changes)')"
    if command -v nvidia-smi >/dev/null; then
        step nvidia-smi 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    else
        echo "nvidia-smi: not found (no NVIDIA driver here)"
    fi

    # -- install: wheels (offline) into $SITE, then this checkout as a site dir ----------------------------------
    mkdir -p "$SITE"
    if compgen -G ".whl/*.whl" >/dev/null; then
        step wheels 90 "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
            --no-cache-dir --upgrade --find-links .whl --target "$SITE/wheels" .whl/*.whl
        export PYTHONPATH=$SITE/wheels${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "wheels: no .whl/*.whl in $REPO (bash bench/fetch_wheels.sh fetches them): using what is installed"
        record wheels "skipped: no .whl/" 0
    fi
    step package 30 make_site
    export PYTHONPATH=$SITE/pkg${PYTHONPATH:+:$PYTHONPATH}
    step imports 60 check_imports "$WORK/missing.json"
    if have_gpu; then GPU=1; else GPU=0; echo "GPU: none usable here: every GPU step is skipped: no GPU"; fi
    export GPU
    step facts 60 "${PYP[@]}" - <<'EOF'
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

    # -- tests and benches -----------------------------------------------------------------------------------------
    step gpu-selection 60 gpu_selection
    local name cap sel args
    while IFS='|' read -r name cap sel; do
        IFS=';' read -ra args <<<"$sel"
        step "$name" "$cap" gpu_tests "$name" "${args[@]}" </dev/null
        if ((!GPU)) && [[ -f $JUNIT/$name.collected ]] && tail -1 "$STEPS" | grep -q $'\tok\t'; then
            # the collection proved the part is not empty; the tests themselves need a GPU
            sed -i "\$ s/\tok\t/\tskipped: no GPU ($(cat "$JUNIT/$name.collected") collected)\t/" "$STEPS"
        fi
    done <<<"$TEST_STEPS"
    gpu_step bench-kernels 60 bash -c "\"\$@\" bench/bench_kernels.py --quick --json >'$OUT/bench_kernels.json'" _ \
        "${PYP[@]}"
    local plot=()
    BENCH=("${PYP[@]}" -m gds_gather.cli bench)
    [[ ${GPU_CHECK_PLOTS:-0} == 1 ]] && plot=(--plot "$OUT/bench_storage.png")
    gpu_step bench-storage 40 "${BENCH[@]}" storage --quick --dir "$WORK" --out "$OUT" "${plot[@]}"
    [[ ${GPU_CHECK_PLOTS:-0} == 1 ]] && plot=(--plot "$OUT/bench_gather.png")
    gpu_step bench-gather 70 "${BENCH[@]}" gather --quick --dir "$WORK" --out "$OUT" "${plot[@]}"
    [[ ${GPU_CHECK_PLOTS:-0} == 1 ]] && plot=(--plot "$OUT/bench_prefill.png")
    gpu_step bench-prefill 110 "${BENCH[@]}" prefill --quick --targets --trunk tiny --no-warm --repeat 1 \
        --dir "$WORK" --out "$OUT" "${plot[@]}"

    # -- the one JSON summary ----------------------------------------------------------------------------------------
    echo
    echo "== summary ($(($(date +%s) - T0)) s in all; budget ${BUDGET} s)"
    "${PYP[@]}" "$REPO/bench/gpu_check_summary.py" "$OUT" "$STEPS" "$WORK/missing.json" "$GPU" "$JUNIT"
}

main 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
