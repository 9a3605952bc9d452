#!/usr/bin/env bash
# make gpu-wheels: download, into .whl/ (ignored by git), what the lent GPU machine lacks to
# run tools/gpu_check.sh: the wheels of tools/gpu_wheels.txt for CPython 3.12 / manylinux
# x86_64 and the mmcv sdist (built there with CUDA ops). Needs PyPI; idempotent.
#
#   WHEEL_DIR   where to put them  (default: .whl in the repository)
#   PYTHON      the interpreter whose pip downloads (default: python3)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=tools/mmcv_sdist.sh
source "$ROOT/tools/mmcv_sdist.sh"
DEST="${WHEEL_DIR:-$ROOT/.whl}"
PY="${PYTHON:-python3}"
LIST="$ROOT/tools/gpu_wheels.txt"
# The device tool carries at most 64 MiB with the working tree; keep the wheels well under it.
MAX_MIB=40
# The GPU machine's interpreter and platform (pip matches manylinux_2_N exactly).
TARGET=(--python-version 3.12 --implementation cp --abi cp312
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
PIP=("$PY" -m pip --disable-pip-version-check)

say() { printf '[gpu-wheels] %s\n' "$*"; }
start=$SECONDS
mkdir -p "$DEST"

while read -r spec kind _; do
    case "$spec" in ''|'#'*) continue ;; esac
    name="${spec%%==*}"
    if ls "$DEST"/*.whl 2>/dev/null | grep -qi "/${name//-/_}-${spec##*==}-"; then
        say "have $spec"
        continue
    fi
    say "downloading $spec${kind:+ ($kind)}"
    if [ "$kind" = binary ]; then
        "${PIP[@]}" download -q --no-deps --only-binary=:all: "${TARGET[@]}" -d "$DEST" "$spec"
    else
        "${PIP[@]}" download -q --no-deps --only-binary=:all: --python-version 3.12 \
            -d "$DEST" "$spec"
    fi
done < "$LIST"

SDIST="$DEST/mmcv-$MMCV_VERSION.tar.gz"
if [ -f "$SDIST" ]; then
    say "have mmcv $MMCV_VERSION sdist"
else
    say "downloading the mmcv $MMCV_VERSION sdist"
    TOOLS="$(mktemp -d)"
    trap 'rm -rf "$TOOLS"' EXIT
    mmcv_build_tools "$PY" "$TOOLS"
    PYTHONPATH="$TOOLS${PYTHONPATH:+:$PYTHONPATH}" mmcv_download_sdist "$PY" "$DEST"
fi

size_kib=$(du -sk "$DEST" | cut -f1)
say "$(ls "$DEST" | wc -l) files, $((size_kib / 1024)) MiB in $DEST, $((SECONDS - start)) s"
if [ $((size_kib / 1024)) -gt "$MAX_MIB" ]; then
    echo "$DEST holds $((size_kib / 1024)) MiB, over the $MAX_MIB MiB kept for the device" \
         "tool's 64 MiB carry limit: remove files not in tools/gpu_wheels.txt" >&2
    exit 1
fi
