#!/usr/bin/env bash
# One-call check of the plugin on a lent GPU machine (README, "Checking on a GPU").
#
#   make gpu-wheels                        # here, once: .whl/ (wheels only, nothing to build)
#   bash tools/dev/gpu_check.sh --dry-run      # every step's commands, none run
#   bash tools/dev/gpu_check.sh                # on the device: carry ['.whl'], timeout_s 330
#   bash tools/dev/gpu_check.sh --only benchmark-vit   # a rerun of some steps on a warm machine
#
# On the device (python3 with torch, torchvision, timm; no mmcv / mmengine / mmdet; no
# network) it records the versions, installs .whl/ into a target site (pip --no-index
# --no-deps), puts the working tree on PYTHONPATH (the plugin is not built; importing it puts
# the compile-free mmcv ops in place), runs the check groups and the two CUDA benchmarks, each
# step within what is left of one budget and skipped when a step it needs failed, and writes
# gpu_check.json, gpu_check.md and gpu_check.log to $OUT after every check, row and step.
# The steps: tools/dev/gpu_check_kit/steps.py; options and variables: --help.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${GPU_CHECK_PYTHON:-python3}"
export PYTHONUNBUFFERED=1
exec "$PY" "$ROOT/tools/dev/gpu_check.py" run "$@"
