# shellcheck shell=bash
# The compiled-mmcv build (`make env MMCV=compiled`, tools/env/setup_env.sh), shared with
# tests/ops/test_mmcv_sdist.py, which runs these steps on the real PyPI sdist short of compiling.
# Source it; it defines:
#
#   MMCV_VERSION                       the mmcv that mmdet 3.3.0 accepts (mmdet refuses >= 2.2)
#   mmcv_build_tools PY DIR            pip-install the build's own tools into DIR (not the venv)
#   mmcv_download_sdist PY DEST        download the PyPI sdist into DEST (build tools on
#                                      PYTHONPATH: pip reads its metadata through setup.py)
#   mmcv_patch_cxx20 SRC               switch the unpacked sdist's g++ / nvcc flags to C++20

MMCV_VERSION="2.1.0"
# mmcv 2.1.0's setup.py needs setuptools<70 (and the separate wheel package).
MMCV_BUILD_SETUPTOOLS="setuptools<70"
# The quoted flag the sdist passes to g++ and nvcc on Linux for torch > 1.12 (three places in
# mmcv 2.1.0's setup.py: the pytorch extension's cxx flags, the MPS branch, the nvcc flags).
# Windows' '/std:c++17' and the parrots / torch <= 1.12 branches' c++14 are left as they are.
MMCV_CXX17_FLAG="'-std=c++17'"
MMCV_CXX20_FLAG="'-std=c++20'"

mmcv_build_tools() {
    "$1" -m pip --disable-pip-version-check install -q --only-binary :all: --target "$2" \
        "$MMCV_BUILD_SETUPTOOLS" wheel ninja
}

mmcv_download_sdist() {
    "$1" -m pip --disable-pip-version-check download -q --no-deps --no-binary :all: \
        --no-build-isolation "mmcv==$MMCV_VERSION" -d "$2"
}

mmcv_patch_cxx20() {
    # torch >= 2.10 headers need C++20; mmcv 2.1.0 hard-codes -std=c++17 for g++ and nvcc.
    # Idempotent.
    local setup="$1/setup.py" before after
    [ -f "$setup" ] || { echo "$setup not found: is $1 the unpacked mmcv $MMCV_VERSION sdist?" >&2
                         return 1; }
    before=$(grep -c -F -- "$MMCV_CXX17_FLAG" "$setup" || true)
    sed -i "s/$MMCV_CXX17_FLAG/$MMCV_CXX20_FLAG/g" "$setup"
    after=$(grep -c -F -- "$MMCV_CXX20_FLAG" "$setup" || true)
    # a fresh sdist: every c++17 flag became c++20; an already patched one has c++20 flags only
    if [ "$after" = 0 ] || grep -q -F -- "$MMCV_CXX17_FLAG" "$setup"; then
        echo "patching $setup for C++20 failed ($before $MMCV_CXX17_FLAG flags found, $after" \
             "$MMCV_CXX20_FLAG after the edit): is it the mmcv $MMCV_VERSION sdist?" >&2
        return 1
    fi
}
