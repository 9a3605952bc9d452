#!/usr/bin/env bash
# make gpu-wheels: download, into .whl/ (ignored by git), the wheels of tools/dev/gpu_wheels.txt
# for the lent GPU machine (CPython 3.12 / manylinux x86_64): what it lacks to run
# tools/dev/gpu_check.sh. Wheels only (no sdist: nothing is built there). Needs PyPI; idempotent;
# in the default folder, files the list no longer names are removed.
#
#   WHEEL_DIR   where to put them  (default: .whl in the repository)
#   PYTHON      the interpreter whose pip downloads (default: python3)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEFAULT_DEST="$ROOT/.whl"
DEST="${WHEEL_DIR:-$DEFAULT_DEST}"
PY="${PYTHON:-python3}"
LIST="$ROOT/tools/dev/gpu_wheels.txt"
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

prefixes=()  # wheel file name prefixes of the list: name_version-
while read -r spec kind _; do
    case "$spec" in ''|'#'*) continue ;; esac
    name="${spec%%==*}"
    prefix="$(printf '%s' "$name" | tr 'A-Z.-' 'a-z__')-${spec##*==}-"
    prefixes+=("$prefix")
    if compgen -G "$DEST/$prefix*.whl" >/dev/null; then
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

for f in "$DEST"/*; do
    [ -e "$f" ] || continue
    base="$(basename "$f")"
    keep=0
    for p in "${prefixes[@]}"; do
        case "$(printf '%s' "$base" | tr 'A-Z' 'a-z')" in "$p"*.whl) keep=1 ;; esac
    done
    [ "$keep" = 1 ] && continue
    if [ "$DEST" = "$DEFAULT_DEST" ]; then
        say "removing $base (not in tools/dev/gpu_wheels.txt)"
        rm -rf "$f"
    else
        say "warning: $base is not in tools/dev/gpu_wheels.txt (remove it: pip installs every wheel)"
    fi
done

size_kib=$(du -sk "$DEST" | cut -f1)
say "$(ls "$DEST" | wc -l) files, $((size_kib / 1024)) MiB ($size_kib KiB) in $DEST, $((SECONDS - start)) s"
if [ $((size_kib / 1024)) -gt "$MAX_MIB" ]; then
    echo "$DEST holds $((size_kib / 1024)) MiB, over the $MAX_MIB MiB kept for the device" \
         "tool's 64 MiB carry limit: remove files not in tools/dev/gpu_wheels.txt" >&2
    exit 1
fi
