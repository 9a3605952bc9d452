#!/usr/bin/env bash
# Build the vitdet_plugin environment in .venv (idempotent; `make env`).
#
#   torch 2.14.1 / torchvision 0.29.1, mmengine 0.10.7, mmdet 3.3.0, the plugin (editable) with
#   its test and deploy extras, and mmcv 2.1.0 in one of two forms:
#
#   MMCV=lite (default)  mmcv-lite 2.1.0: mmcv's Python code without its compiled extension.
#                        The plugin's compile-free ops (vitdet_plugin/ops) stand in for the
#                        extension. Wheels only: no compiler, no Python headers, minutes.
#   MMCV=compiled        mmcv 2.1.0 *with ops* built from the PyPI sdist (patched for C++20,
#                        cached as a wheel; CUDA ops too when nvcc and a GPU are present).
#                        Needs g++ >= 10 and the Python headers; 20-40 minutes on 2 cores.
#
#   STACK=onedl builds .venv-onedl on the maintained OpenMMLab fork instead (tools/env/onedl.sh):
#   onedl-mmengine, onedl-mmdetection and onedl-mmcv built without its extension (pure Python:
#   the compile-free ops stand in), the plugin (editable, --no-deps) with its test extra.
#
# Environment variables:
#   STACK               openmmlab | onedl                  (default: openmmlab)
#   MMCV                lite | compiled                    (default: lite; onedl: lite only)
#   VITDET_VENV         venv directory                     (default: .venv; onedl: .venv-onedl)
#   VITDET_PYTHON       interpreter used to create it      (default: python3.11)
#   VITDET_WHEEL_CACHE  where the built mmcv wheel is kept (default: ~/.cache/vitdet_plugin/wheels;
#                       CUDA builds in its cudaXX.Y/ subdirectory; one wheel per Python version)
#   MAX_JOBS            parallel compile jobs for mmcv     (default: number of cores)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
STACK="${STACK:-openmmlab}"
case "$STACK" in
    openmmlab) VENV="${VITDET_VENV:-$ROOT/.venv}" ;;
    onedl) VENV="${VITDET_VENV:-$ROOT/.venv-onedl}" ;;
    *) echo "STACK=$STACK: choose STACK=openmmlab (default: mmdet 3.3.0, mmengine 0.10.7, mmcv" \
            "2.1.0) or STACK=onedl (the maintained fork: onedl-mmdetection, onedl-mmengine," \
            "onedl-mmcv)" >&2; exit 2 ;;
esac
PY_BOOT="${VITDET_PYTHON:-python3.11}"
WHEELS="${VITDET_WHEEL_CACHE:-$HOME/.cache/vitdet_plugin/wheels}"
MMCV="${MMCV:-lite}"
TORCH_SPEC=(torch==2.14.1 torchvision==0.29.1)
# MMCV_VERSION and the compiled-mmcv build steps
# shellcheck source=tools/env/mmcv_sdist.sh
source "$ROOT/tools/env/mmcv_sdist.sh"
# ONEDL_*: the fork's pins and install steps (STACK=onedl)
# shellcheck source=tools/env/onedl.sh
source "$ROOT/tools/env/onedl.sh"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
START=$SECONDS

say() { printf '\033[1m[make env]\033[0m %s\n' "$*"; }
case "$MMCV" in
    lite|compiled) ;;
    *) echo "MMCV=$MMCV: choose MMCV=lite (default: mmcv-lite + the plugin's compile-free ops)" \
            "or MMCV=compiled (mmcv $MMCV_VERSION built with ops from its sdist)" >&2; exit 2 ;;
esac
if [ "$STACK/$MMCV" = onedl/compiled ]; then
    echo "STACK=onedl runs on the plugin's compile-free ops only (onedl-mmcv is built without" \
         "its extension): drop MMCV=compiled, or use the default STACK for compiled mmcv" >&2
    exit 2
fi

if [ ! -x "$VENV/bin/python" ]; then
    say "creating virtualenv $VENV with $PY_BOOT"
    "$PY_BOOT" -m venv "$VENV"
else
    say "virtualenv $VENV exists"
fi
PY="$VENV/bin/python"
# Wheels only, everywhere but the plugin itself (pure Python) and the compiled-mmcv build:
# nothing here may need a C++ compiler or the Python headers.
PIP=("$PY" -m pip --disable-pip-version-check)
BIN=(--only-binary :all:)

have() {  # have <distribution> <version-prefix>: is it installed at that version?
    "$PY" - "$1" "$2" <<'PYEOF' >/dev/null 2>&1
import importlib.metadata as md, sys
name, want = sys.argv[1], sys.argv[2]
sys.exit(0 if md.version(name).startswith(want) else 1)
PYEOF
}

if have torch 2.14.1 && have torchvision 0.29.1; then
    say "torch 2.14.1 / torchvision 0.29.1 already installed"
else
    say "installing ${TORCH_SPEC[*]}"
    "${PIP[@]}" install -q "${BIN[@]}" "${TORCH_SPEC[@]}"
fi

# Runtime setuptools: torch 2.14 wants >=77, and mmengine resolves `mmdet::` base configs
# through pkg_resources, which setuptools dropped in 81.
if have setuptools 80.; then
    say "setuptools $("$PY" -c 'import setuptools; print(setuptools.__version__)') already installed"
else
    say "installing setuptools>=77,<81 (torch needs >=77, mmengine needs pkg_resources)"
    "${PIP[@]}" install -q "${BIN[@]}" "setuptools>=77,<81"
fi

# Which backend answers `import mmcv._ext`: mmcv's compiled extension or the plugin's ops.
mmcv_backend() {
    "$PY" - "$MMCV_VERSION" 2>/dev/null <<'PYEOF'
import sys
import mmcv
assert mmcv.__version__ == sys.argv[1], mmcv.__version__
import mmcv.ops, mmcv._ext
print(getattr(mmcv._ext, 'BACKEND', 'compiled'))
PYEOF
}

install_lite() {
    if have mmcv-lite "$MMCV_VERSION"; then
        say "mmcv-lite $MMCV_VERSION already installed"
        return
    fi
    if have mmcv ''; then  # both distributions install the `mmcv` package: keep one
        say "removing compiled mmcv $("$PY" -c 'import importlib.metadata as m; print(m.version("mmcv"))')"
        "${PIP[@]}" uninstall -q -y mmcv
    fi
    say "installing mmcv-lite $MMCV_VERSION (mmcv without its compiled extension)"
    "${PIP[@]}" install -q "${BIN[@]}" "mmcv-lite==$MMCV_VERSION"
}

need_build_tools() {  # fail early, with the fix, instead of deep inside the C++ build
    local cxx="${CXX:-c++}"
    command -v "$cxx" >/dev/null 2>&1 || {
        echo "MMCV=compiled builds mmcv with a C++20 compiler ($cxx not found): install g++ >= 10" \
             "(e.g. apt-get install g++) or set CXX; or use the default MMCV=lite" >&2; exit 1; }
    "$PY" -c "import os, sysconfig, sys; sys.exit(0 if os.path.isfile(os.path.join(sysconfig.get_paths()['include'], 'Python.h')) else 1)" || {
        echo "MMCV=compiled needs the Python headers (Python.h) of $PY: install" \
             "python3.x-dev (e.g. apt-get install python3.11-dev); or use the default MMCV=lite" >&2
        exit 1; }
}

install_compiled() {
    # A GPU build needs nvcc and a visible GPU; its wheel is cached apart from the CPU-only
    # one (same file name).
    local want_cuda=0 wheels="$WHEELS" pytag wheel build src
    if command -v nvcc >/dev/null 2>&1 && \
            "$PY" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        want_cuda=1
        wheels="$WHEELS/cuda$("$PY" -c 'import torch; print(torch.version.cuda)')"
    fi
    if [ "$(mmcv_backend || true)" = compiled ] && have mmcv "$MMCV_VERSION" && \
            { [ "$want_cuda" = 0 ] || "$PY" -c "import sys; from mmcv.ops import get_compiling_cuda_version as v; sys.exit(v() == 'not available')"; }; then
        say "mmcv $MMCV_VERSION with compiled ops already installed"
        return
    fi
    pytag="$("$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')"
    mkdir -p "$wheels"
    wheel="$(ls "$wheels"/mmcv-"$MMCV_VERSION"-"$pytag"-*.whl 2>/dev/null | head -n1 || true)"
    if [ -z "$wheel" ]; then
        need_build_tools
        say "no cached mmcv wheel in $wheels: building mmcv $MMCV_VERSION with ops from the sdist"
        say "(this compiles ~77 C++ files; 20-40 minutes on 2 cores, MAX_JOBS=$MAX_JOBS)"
        build="$(mktemp -d)"
        # mmcv 2.1.0's setup.py needs setuptools<70; keep that out of the venv (build only).
        mmcv_build_tools "$PY" "$build/buildtools"
        mmcv_download_sdist_with_tools "$build"
        tar -xzf "$build"/mmcv-"$MMCV_VERSION".tar.gz -C "$build"
        src="$build/mmcv-$MMCV_VERSION"
        mmcv_patch_cxx20 "$src" || exit 1
        if [ "$want_cuda" = 1 ]; then
            say "nvcc and a GPU found: CUDA ops will be built too"
            export FORCE_CUDA=1
        fi
        (cd "$src" && PYTHONPATH="$build/buildtools" PATH="$build/buildtools/bin:$PATH" \
            MMCV_WITH_OPS=1 "${PIP[@]}" wheel --no-build-isolation --no-deps -w "$wheels" .)
        rm -rf "$build"
        wheel="$(ls "$wheels"/mmcv-"$MMCV_VERSION"-"$pytag"-*.whl | head -n1)"
        say "cached $wheel"
    else
        say "reusing cached wheel $wheel"
    fi
    if have mmcv-lite ''; then
        say "removing mmcv-lite (the compiled wheel installs the same mmcv package)"
        "${PIP[@]}" uninstall -q -y mmcv-lite
    fi
    "${PIP[@]}" install -q --force-reinstall --no-deps "$wheel"
    "${PIP[@]}" install -q "${BIN[@]}" "$wheel"  # its dependencies
}

mmcv_download_sdist_with_tools() {
    PYTHONPATH="$1/buildtools${PYTHONPATH:+:$PYTHONPATH}" mmcv_download_sdist "$PY" "$1"
}

# The plugin (editable) with mmengine, mmdet, the test and deploy (onnx, onnxscript,
# onnxruntime) extras, and panopticapi (mmdet's CocoPanopticDataset / CocoPanopticMetric, the
# shapes panoptic tests); skipped when setup.py and PANOPTICAPI are unchanged since the last
# successful install. panopticapi-lite declares numpy<2, which would make pip downgrade numpy
# (and opencv-python, ml_dtypes) below what torch 2.14 and opencv 5 use; its code needs only
# numpy (1 or 2), so it is installed on its own with --no-deps instead of in setup.py's extras.
# The dependencies come as wheels; the plugin itself is pure Python (its build compiles nothing).
PANOPTICAPI="panopticapi-lite==0.2.0"
install_plugin() {
    local STAMP WANT
    STAMP="$VENV/.vitdet_plugin_setup.sha256"
    WANT="$( (cat "$ROOT/setup.py"; echo "$PANOPTICAPI") | sha256sum | cut -d' ' -f1)"
    if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && \
            "$PY" -c "import mmengine, mmdet, pytest, timm, onnxruntime, onnxscript, vitdet_plugin
import panopticapi.evaluation" >/dev/null 2>&1; then
        say "plugin (editable), mmengine, mmdet, test and deploy extras, panopticapi already installed"
    else
        say "installing the plugin (editable) with mmengine 0.10.7, mmdet 3.3.0, test and deploy extras"
        "${PIP[@]}" install -q --only-binary :all: --no-binary vitdet_plugin -e "$ROOT[tests,deploy]"
        say "installing $PANOPTICAPI (--no-deps: it pins numpy<2, its code runs on numpy 2)"
        "${PIP[@]}" install -q "${BIN[@]}" --no-deps "$PANOPTICAPI"
        echo "$WANT" > "$STAMP"
    fi
}

if [ "$STACK" = onedl ]; then
    install_onedl  # tools/env/onedl.sh: the fork, then the plugin
    MMCV_VERSION="$ONEDL_MMCV_VERSION"  # the mmcv the checks below expect
else
    "install_$MMCV"
    install_plugin
fi

# The check a new interpreter makes: `import mmdet.models` (mmcv.ops, before any import of
# ours) must find an extension, compiled or compile-free, through the plugin's .pth hook.
backend="$(mmcv_backend)" || { echo "import mmcv.ops fails in $VENV after the install" >&2; exit 1; }
case "$MMCV/$backend" in
    lite/vitdet_plugin.ops|compiled/compiled) ;;
    *) echo "mmcv.ops runs on '$backend' after MMCV=$MMCV: expected" \
            "$([ "$MMCV" = lite ] && echo "vitdet_plugin.ops (is the plugin's .pth hook installed?)" || echo "mmcv's compiled extension")" >&2
       exit 1 ;;
esac
"$PY" -c "import mmdet.models" || { echo "import mmdet.models fails in $VENV" >&2; exit 1; }
say "done in $((SECONDS - START)) s: $("$PY" -c 'import torch, mmcv, mmdet, mmengine, mmcv._ext as e; ops = getattr(e, "BACKEND", "compiled"); print(f"torch {torch.__version__}, mmcv {mmcv.__version__} (ops: {ops}), mmengine {mmengine.__version__}, mmdet {mmdet.__version__}")')"
