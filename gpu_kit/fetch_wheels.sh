#!/usr/bin/env bash
# Fetch the wheels of gpu_kit/wheels.txt into a folder (default: .whl/ at the repository root, which git ignores),
# for a GPU machine without network: carry the folder there and `python3 gpu_kit/run.py` installs them.
# Run it on any machine with network access to PyPI (a login node, a laptop):
#
#   bash gpu_kit/fetch_wheels.sh                 # .whl/, for Python 3.12 on x86-64 Linux
#   PY_VERSION=3.11 bash gpu_kit/fetch_wheels.sh /path/to/wheels
#   MEGATRON_CORE=0.16.1 bash gpu_kit/fetch_wheels.sh   # another supported megatron-core than wheels.txt's
#
# Only megatron-core has compiled code (one small extension), so the download names the target interpreter and
# platform; antlr4-python3-runtime 4.9.3 exists on PyPI as a source distribution only and is built here into its
# pure-Python wheel. Dependencies are not followed (--no-deps): the GPU machine already has torch, numpy,
# packaging, sympy and PyYAML.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DEST=${1:-$(cd "$HERE/.." && pwd)/.whl}
PY_VERSION=${PY_VERSION:-3.12}
PYTHON=${PYTHON:-python3}
MEGATRON_CORE=${MEGATRON_CORE:-}
mkdir -p "$DEST"
# One wheel per package in the folder (the kit refuses several): a megatron-core carried before goes.
rm -f "$DEST"/megatron_core-*.whl

download=()
build=()
while read -r spec module how _; do
    case "$how" in
        download)
            if [ -n "$MEGATRON_CORE" ] && [ "${spec%%==*}" = megatron-core ]; then spec="megatron-core==$MEGATRON_CORE"; fi
            download+=("$spec") ;;
        build) build+=("$spec") ;;
        *) echo "wheels.txt: '$spec $module $how': the third column must be download or build" >&2; exit 1 ;;
    esac
done < <(grep -v -E '^[[:space:]]*(#|$)' "$HERE/wheels.txt")

"$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DEST" "${download[@]}"
if [ "${#build[@]}" -gt 0 ]; then
    "$PYTHON" -m pip wheel --no-deps -w "$DEST" "${build[@]}"
fi
echo "wheels in $DEST:"
ls -l "$DEST"
du -sh "$DEST"
