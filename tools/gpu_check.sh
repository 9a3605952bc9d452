#!/usr/bin/env bash
# One-call check of the plugin on a lent GPU machine (README, "Checking on a GPU").
#
#   make gpu-wheels                       # here, once: .whl/ (wheels + mmcv sdist)
#   bash tools/gpu_check.sh [--dry-run] [--ops all | --ops "focal_loss nms roi_align"]
#
# On the device (python3 with torch + timm + nvcc, no network) it installs .whl/ into a
# target dir, builds mmcv with CUDA ops for the local GPU only, installs the plugin from the
# working tree, runs the functional checks and the CUDA benchmark, prints one table and
# writes it to $OUT/gpu_check.md when OUT is set. --dry-run prints every step's commands.
#
#   GPU_CHECK_WHEELS  wheel folder      (default: .whl in the repository)
#   GPU_CHECK_WORK    scratch folder    (default: /tmp/gpu_check)
#   GPU_CHECK_BUDGET  seconds for the whole run; later steps get what is left (default 570)
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=tools/mmcv_sdist.sh
source "$ROOT/tools/mmcv_sdist.sh"
WHEELS="${GPU_CHECK_WHEELS:-$ROOT/.whl}"
WORK="${GPU_CHECK_WORK:-/tmp/gpu_check}"
BUDGET="${GPU_CHECK_BUDGET:-570}"
# seconds kept back from the budget for the report
REPORT_RESERVE=20
SITE="$WORK/site"
PY=python3
OPS=""          # empty: the ops the checked detectors need (gpu_check_kit.mmcv_ops)
DRY=0

usage() { sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --ops) [ $# -ge 2 ] || { echo "--ops needs a value: all, or op names" >&2; exit 2; }
               OPS="$2"; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

STEPS=(environment install-wheels build-mmcv install-plugin checks benchmark-swin
       benchmark-vit report)
say() { printf '[gpu_check] %s\n' "$*"; }
run() {  # print a command, then run it unless --dry-run
    printf '  $'; printf ' %q' "$@"; printf '\n'
    [ "$DRY" = 1 ] || "$@"
}
left() { echo $(( BUDGET - SECONDS - REPORT_RESERVE )); }
limited() {  # run a command within the budget left
    local t; t=$(left)
    if [ "$DRY" = 0 ] && [ "$t" -le 0 ]; then echo "no time left in the budget" >&2; return 124; fi
    run timeout "$t" "$@"
}

step_environment() {
    run mkdir -p "$WORK"
    if [ "$DRY" = 1 ]; then
        ARCH='<major.minor of torch.cuda.get_device_capability()>'
    else
        command -v nvcc >/dev/null || { echo "nvcc not found: the mmcv CUDA build needs the CUDA toolkit" >&2; return 1; }
        ARCH="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')" \
            || { echo "no CUDA device visible to torch" >&2; return 1; }
        "$PY" -c 'from torch.utils.cpp_extension import is_ninja_available as n; assert n()' \
            || { echo "ninja not found: without it the mmcv build is serial (too slow)" >&2; return 1; }
        "$PY" -c 'import torch; print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} CUDA {torch.version.cuda}")' \
            > "$WORK/env.txt"
        echo "$(cat "$WORK/env.txt") | $(date -u +%Y-%m-%d) | $(nproc) cores" > "$WORK/env.txt"
        cat "$WORK/env.txt"
    fi
    export TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS="$(nproc)"
    say "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS"
}

step_install_wheels() {
    [ "$DRY" = 1 ] || [ -f "$WHEELS/mmcv-$MMCV_VERSION.tar.gz" ] || {
        echo "$WHEELS/mmcv-$MMCV_VERSION.tar.gz missing: run 'make gpu-wheels' here and name" \
             ".whl in the device call's carry" >&2; return 1; }
    run "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$WHEELS"/*.whl || return
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    say "PYTHONPATH=$PYTHONPATH"
}

step_build_mmcv() {
    local src="$WORK/mmcv-$MMCV_VERSION"
    run rm -rf "$src" && run tar -xzf "$WHEELS/mmcv-$MMCV_VERSION.tar.gz" -C "$WORK" \
        && run mmcv_patch_cxx20 "$src" || return
    if [ "$OPS" != all ]; then
        # shellcheck disable=SC2086  # OPS is a list of op names
        run "$PY" "$ROOT/tools/gpu_check.py" prune-mmcv "$src" ${OPS:+--ops $OPS} || return
    fi
    say "building mmcv with CUDA ops (log: $WORK/mmcv_build.log)"
    local build=(env MMCV_WITH_OPS=1 FORCE_CUDA=1 "$PY" -m pip install -q --no-index --no-deps
                 --no-build-isolation --no-cache-dir --target "$SITE" "$src")
    if [ "$DRY" = 1 ]; then limited "${build[@]}"; return; fi
    limited "${build[@]}" > "$WORK/mmcv_build.log" 2>&1 || {
        tail -n 40 "$WORK/mmcv_build.log"; return 1; }
    "$PY" -c 'import mmcv.ops; print("mmcv.ops CUDA", mmcv.ops.get_compiling_cuda_version())'
}

step_install_plugin() {
    run "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
        --target "$SITE" "$ROOT" || return
    run "$PY" -c 'import vitdet_plugin, mmcv, mmdet, mmengine; print("mmcv", mmcv.__version__, "mmdet", mmdet.__version__, "mmengine", mmengine.__version__)'
}

step_checks() { limited "$PY" "$ROOT/tools/gpu_check.py" checks --json "$WORK/checks.json"; }
step_benchmark_swin() {
    limited "$PY" "$ROOT/tools/benchmark.py" --model swin --device cuda \
        --json "$WORK/bench_swin.json"
}
step_benchmark_vit() {
    limited "$PY" "$ROOT/tools/benchmark.py" --model vit --device cuda \
        --json "$WORK/bench_vit.json"
}
step_report() {
    run "$PY" "$ROOT/tools/gpu_check.py" report --work "$WORK" ${OUT:+--out "$OUT/gpu_check.md"}
    if [ -n "${OUT:-}" ]; then
        run cp "$WORK/mmcv_build.log" "$WORK/checks.json" "$OUT/" 2>/dev/null || true
    fi
}

[ "$DRY" = 1 ] && say "dry run: the commands of each step, none run" || rm -f "$WORK/steps.tsv"
status=0
for i in "${!STEPS[@]}"; do
    name="${STEPS[$i]}"
    say "step $((i + 1))/${#STEPS[@]}: $name"
    start=$SECONDS
    "step_${name//-/_}"
    rc=$?
    [ "$rc" = 0 ] || { say "step $name failed (exit $rc)"; status=1; }
    [ "$DRY" = 1 ] || printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >> "$WORK/steps.tsv"
done
exit "$status"
