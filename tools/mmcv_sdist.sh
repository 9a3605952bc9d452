# shellcheck shell=bash
# mmcv source build steps shared by tools/setup_env.sh (make env), tools/gpu_wheels.sh
# (make gpu-wheels) and tools/gpu_check.sh (the lent GPU machine). Source it; it defines:
#
#   MMCV_VERSION                       the mmcv that mmdet 3.3.0 accepts and we build
#   mmcv_build_tools PY DIR            pip-install the build's own tools into DIR (not the venv)
#   mmcv_download_sdist PY DEST        download the PyPI sdist into DEST (build tools on
#                                      PYTHONPATH: pip reads its metadata through setup.py)
#   mmcv_patch_cxx20 SRC               switch the unpacked sdist's setup.py to C++20

MMCV_VERSION="2.1.0"
# mmcv 2.1.0's setup.py needs setuptools<70 (and the separate wheel package).
MMCV_BUILD_SETUPTOOLS="setuptools<70"

mmcv_build_tools() {
    "$1" -m pip --disable-pip-version-check install -q --target "$2" \
        "$MMCV_BUILD_SETUPTOOLS" wheel ninja
}

mmcv_download_sdist() {
    "$1" -m pip --disable-pip-version-check download -q --no-deps --no-binary :all: \
        --no-build-isolation "mmcv==$MMCV_VERSION" -d "$2"
}

mmcv_patch_cxx20() {
    # torch >= 2.10 headers need C++20; mmcv 2.1.0 hard-codes -std=c++17 (g++ and nvcc).
    sed -i 's/-std=c++17/-std=c++20/g' "$1/setup.py"
    if ! grep -q 'c++20' "$1/setup.py" || grep -q 'c++17' "$1/setup.py"; then
        echo "patching $1/setup.py for C++20 failed: is it the mmcv $MMCV_VERSION sdist?" >&2
        return 1
    fi
}
