#!/usr/bin/env bash
# Build the vitdet_plugin environment in .venv (idempotent).
#
#   torch 2.14.1 / torchvision 0.29.1, mmengine 0.10.7, mmdet 3.3.0,
#   mmcv 2.1.0 *with compiled ops* built from the PyPI sdist (cached as a wheel).
#
# Environment variables:
#   VITDET_VENV         venv directory                     (default: .venv)
#   VITDET_PYTHON       interpreter used to create it      (default: python3.11)
#   VITDET_WHEEL_CACHE  where the built mmcv wheel is kept (default: ~/.cache/vitdet_plugin/wheels;
#                       CUDA builds in its cudaXX.Y/ subdirectory; one wheel per Python version)
#   MAX_JOBS            parallel compile jobs for mmcv     (default: number of cores)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VITDET_VENV:-$ROOT/.venv}"
PY_BOOT="${VITDET_PYTHON:-python3.11}"
WHEELS="${VITDET_WHEEL_CACHE:-$HOME/.cache/vitdet_plugin/wheels}"
TORCH_SPEC="torch==2.14.1 torchvision==0.29.1"
# MMCV_VERSION and the mmcv build steps shared with tools/gpu_check.sh
# shellcheck source=tools/mmcv_sdist.sh
source "$ROOT/tools/mmcv_sdist.sh"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"

say() { printf '\033[1m[make env]\033[0m %s\n' "$*"; }

if [ ! -x "$VENV/bin/python" ]; then
    say "creating virtualenv $VENV with $PY_BOOT"
    "$PY_BOOT" -m venv "$VENV"
else
    say "virtualenv $VENV exists"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)

have() {  # have <module> <version-prefix>: is an importable module at that version present?
    "$PY" - "$1" "$2" <<'PYEOF' >/dev/null 2>&1
import importlib.metadata as md, sys
name, want = sys.argv[1], sys.argv[2]
sys.exit(0 if md.version(name).startswith(want) else 1)
PYEOF
}

if have torch 2.14.1 && have torchvision 0.29.1; then
    say "torch 2.14.1 / torchvision 0.29.1 already installed"
else
    say "installing $TORCH_SPEC"
    "${PIP[@]}" install $TORCH_SPEC
fi

# Runtime setuptools: torch 2.14 wants >=77, and mmengine resolves `mmdet::` base configs
# through pkg_resources, which setuptools dropped in 81.
if have setuptools 80.; then
    say "setuptools $("$PY" -c 'import setuptools; print(setuptools.__version__)') already installed"
else
    say "installing setuptools>=77,<81 (torch needs >=77, mmengine needs pkg_resources)"
    "${PIP[@]}" install -q "setuptools>=77,<81"
fi

# A GPU build needs nvcc and a visible GPU; its wheel is cached apart from the CPU-only one
# (same file name), and an installed CPU-only mmcv does not count as "with ops" there.
WANT_CUDA=0
if command -v nvcc >/dev/null 2>&1 && \
        "$PY" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    WANT_CUDA=1
    WHEELS="$WHEELS/cuda$("$PY" -c 'import torch; print(torch.version.cuda)')"
fi
PYTAG="$("$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')"

mmcv_has_ops() {
    "$PY" - "$MMCV_VERSION" "$WANT_CUDA" >/dev/null 2>&1 <<'PYEOF'
import sys
import mmcv, mmcv.ops
from mmcv.ops import get_compiling_cuda_version
assert mmcv.__version__ == sys.argv[1]
assert sys.argv[2] == '0' or get_compiling_cuda_version() != 'not available'
PYEOF
}

need_build_tools() {  # fail early, with the fix, instead of deep inside the C++ build
    local cxx="${CXX:-c++}"
    command -v "$cxx" >/dev/null 2>&1 || {
        echo "building mmcv needs a C++20 compiler ($cxx not found): install g++ >= 10" \
             "(e.g. apt-get install g++) or set CXX" >&2; exit 1; }
    "$PY" -c "import os, sysconfig, sys; sys.exit(0 if os.path.isfile(os.path.join(sysconfig.get_paths()['include'], 'Python.h')) else 1)" || {
        echo "building mmcv needs the Python headers (Python.h) of $PY: install" \
             "python3.x-dev (e.g. apt-get install python3.11-dev)" >&2; exit 1; }
}

if mmcv_has_ops; then
    say "mmcv $MMCV_VERSION with ops already installed"
else
    mkdir -p "$WHEELS"
    WHEEL="$(ls "$WHEELS"/mmcv-"$MMCV_VERSION"-"$PYTAG"-*.whl 2>/dev/null | head -n1 || true)"
    if [ -z "$WHEEL" ]; then
        need_build_tools
        say "no cached mmcv wheel in $WHEELS: building mmcv $MMCV_VERSION with ops from the sdist"
        say "(this compiles ~77 C++ files; about 12-30 minutes on 2 cores, MAX_JOBS=$MAX_JOBS)"
        BUILD="$(mktemp -d)"
        # mmcv 2.1.0's setup.py needs setuptools<70; keep that out of the venv (build only).
        mmcv_build_tools "$PY" "$BUILD/buildtools"
        export PYTHONPATH="$BUILD/buildtools${PYTHONPATH:+:$PYTHONPATH}"
        export PATH="$BUILD/buildtools/bin:$PATH"
        mmcv_download_sdist "$PY" "$BUILD"
        tar -xzf "$BUILD"/mmcv-"$MMCV_VERSION".tar.gz -C "$BUILD"
        SRC="$BUILD/mmcv-$MMCV_VERSION"
        mmcv_patch_cxx20 "$SRC" || exit 1
        if [ "$WANT_CUDA" = 1 ]; then
            say "nvcc and a GPU found: CUDA ops will be built too"
            export FORCE_CUDA=1
        fi
        (cd "$SRC" && MMCV_WITH_OPS=1 "${PIP[@]}" wheel --no-build-isolation --no-deps -w "$WHEELS" .)
        rm -rf "$BUILD"
        unset PYTHONPATH
        WHEEL="$(ls "$WHEELS"/mmcv-"$MMCV_VERSION"-"$PYTAG"-*.whl | head -n1)"
        say "cached $WHEEL"
    else
        say "reusing cached wheel $WHEEL"
    fi
    if "$PY" -c "import mmcv" >/dev/null 2>&1; then  # e.g. a CPU-only build on a GPU machine
        "${PIP[@]}" install --force-reinstall --no-deps "$WHEEL"
    else
        "${PIP[@]}" install "$WHEEL"
    fi
fi

# The plugin (editable) with mmengine, mmdet, the test and deploy (onnx, onnxscript,
# onnxruntime) extras, and panopticapi (mmdet's CocoPanopticDataset / CocoPanopticMetric, the
# shapes panoptic tests); skipped when setup.py and PANOPTICAPI are unchanged since the last
# successful install. panopticapi-lite declares numpy<2, which would make pip downgrade numpy
# (and opencv-python, ml_dtypes) below what torch 2.14 and opencv 5 use; its code needs only
# numpy (1 or 2), so it is installed on its own with --no-deps instead of in setup.py's extras.
PANOPTICAPI="panopticapi-lite==0.2.0"
STAMP="$VENV/.vitdet_plugin_setup.sha256"
WANT="$( (cat "$ROOT/setup.py"; echo "$PANOPTICAPI") | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && \
        "$PY" -c "import mmengine, mmdet, pytest, timm, onnxruntime, onnxscript, vitdet_plugin
import panopticapi.evaluation" >/dev/null 2>&1; then
    say "plugin (editable), mmengine, mmdet, test and deploy extras, panopticapi already installed"
else
    say "installing the plugin (editable) with mmengine 0.10.7, mmdet 3.3.0, test and deploy extras"
    "${PIP[@]}" install -q -e "$ROOT[tests,deploy]"
    say "installing $PANOPTICAPI (--no-deps: it pins numpy<2, its code runs on numpy 2)"
    "${PIP[@]}" install -q --no-deps "$PANOPTICAPI"
    echo "$WANT" > "$STAMP"
fi
mmcv_has_ops || { echo "mmcv.ops is not importable after install" >&2; exit 1; }
say "done: $("$PY" -c 'import torch, mmcv, mmdet, mmengine; print(f"torch {torch.__version__}, mmcv {mmcv.__version__}, mmengine {mmengine.__version__}, mmdet {mmdet.__version__}")')"
