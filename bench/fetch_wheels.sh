#!/usr/bin/env bash
# Fetch, on a machine with PyPI, every wheel bench/gpu_check.sh needs that the offline GPU image lacks, into .whl/
# (ignored by git; carried to the GPU machine with the checkout).
#
#     bash bench/fetch_wheels.sh [KINDS.md]
#
# What the run needs: the project's requirements (pyproject: numpy, gguf, tqdm; extras cuda13: cupy-cuda13x,
# kvikio-cu13; torch; test: pytest, hypothesis, matplotlib) plus what those pull in that the image may lack
# (libkvikio-cu13, rapids-logger for kvikio; pyyaml for gguf) and what some tests import (ml-dtypes, safetensors,
# transformers). Each is compared with the image's package list in the device tool's KINDS.md ("Python packages
# already there", nvidia-h200); only the missing ones are downloaded, pinned to the versions measured to work
# there, for CPython 3.12 on manylinux x86-64, without dependencies (each needed
# dependency is named here). gpu_check.sh checks every import on the machine before the tests either way.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KINDS=${1:-/work/.library/device/KINDS.md}
DEST=${WHEEL_DIR:-$REPO/.whl}
PY=${PYTHON:-python3}

# pip name (as in KINDS.md) = pinned requirement to fetch when missing
NEEDED=(
    "numpy=numpy" "gguf=gguf==0.19.0" "tqdm=tqdm" "pyyaml=pyyaml" "torch=" "cupy-cuda13x="
    "kvikio-cu13=kvikio-cu13==26.10.0" "libkvikio-cu13=libkvikio-cu13==26.10.0" "rapids-logger=rapids-logger==0.3.0"
    "pytest=pytest" "hypothesis=hypothesis" "matplotlib=matplotlib" "ml-dtypes=ml-dtypes" "safetensors=safetensors"
    "transformers="
)
# torch, cupy and transformers are never fetched (GBs, or pinned to the image's CUDA): the image must have them.

if [[ ! -f $KINDS ]]; then
    echo "fetch_wheels: $KINDS not found: pass the device tool's KINDS.md" >&2
    exit 2
fi
present=$(awk '/^## Python packages already there/{f=1} f' "$KINDS" | grep -o 'Packages: .*' | head -1 |
    sed 's/^Packages: //; s/\.$//' | tr ',' '\n' | sed 's/^ *//; s/ *$//' | tr 'A-Z_' 'a-z-')
if [[ -z $present ]]; then
    echo "fetch_wheels: no package list found in $KINDS" >&2
    exit 2
fi

fetch=()
for item in "${NEEDED[@]}"; do
    name=${item%%=*} req=${item#*=}
    if grep -qx "$name" <<<"$present"; then
        echo "  in the image: $name"
    elif [[ -z $req ]]; then
        echo "  MISSING from the image and not fetchable here: $name (the GPU image must provide it)" >&2
    else
        echo "  missing from the image: $name -> fetching $req"
        fetch+=("$req")
    fi
done
if ((${#fetch[@]} == 0)); then
    echo "fetch_wheels: nothing to fetch"
    exit 0
fi
mkdir -p "$DEST"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --platform any -d "$DEST" "${fetch[@]}"
echo "fetch_wheels: $DEST now holds:"
ls -1 "$DEST"
