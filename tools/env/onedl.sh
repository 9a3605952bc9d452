# shellcheck shell=bash
# STACK=onedl (`make env STACK=onedl`, tools/env/setup_env.sh): the maintained OpenMMLab fork
# (github.com/VBTI-development), whose distributions import as mmengine, mmcv and mmdet.
# Source it; install_onedl runs after setup_env.sh has defined PY, PIP, BIN, ROOT, VENV,
# PANOPTICAPI, say and have. It defines:
#
#   ONEDL_MMENGINE, ONEDL_MMCV_VERSION, ONEDL_MMDET   the pinned versions
#   install_onedl     the fork, the plugin (editable) with its test extra, neither pulling
#                     OpenMMLab's own mmengine / mmdet back in, and panopticapi (as make env)
#
# What PyPI has: onedl-mmengine as a wheel; onedl-mmcv and onedl-mmdetection as sdists only.
# onedl-mmdetection is pure Python. onedl-mmcv's setup.py compiles its extension (mmcv._ext) only
# when it can import torch, and pip builds it in an isolated environment holding just its
# build-system requirements (setuptools, wheel, packaging): the wheel pip builds is mmcv's Python
# code without the extension (what mmcv-lite is for mmcv 2.1), no compiler runs, and the
# plugin's compile-free ops stand in for the extension. The fork publishes no lite distribution
# and no switch for this (mmcv 2.1's MMCV_WITH_OPS is gone from its setup.py).

ONEDL_MMENGINE="0.10.12"
ONEDL_MMCV_VERSION="2.3.6"
ONEDL_MMDET="3.5.1"
# OpenMMLab's distributions that install the same packages (mmengine, mmcv, mmdet) as the fork's
ONEDL_REPLACES=(mmengine mmcv mmcv-lite mmdet)

install_onedl() {
    local dist stamp want reqs
    local pins="onedl-mmengine==$ONEDL_MMENGINE onedl-mmcv==$ONEDL_MMCV_VERSION"
    pins+=" onedl-mmdetection==$ONEDL_MMDET $PANOPTICAPI"
    # skipped when setup.py and the pins are unchanged since the last successful install
    stamp="$VENV/.vitdet_plugin_setup.sha256"
    want="$( (cat "$ROOT/setup.py"; echo "$pins") | sha256sum | cut -d' ' -f1)"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && have onedl-mmengine "$ONEDL_MMENGINE" \
            && have onedl-mmcv "$ONEDL_MMCV_VERSION" && have onedl-mmdetection "$ONEDL_MMDET" && \
            "$PY" -c "import mmengine, mmdet, pytest, timm, vitdet_plugin, panopticapi.evaluation" \
            >/dev/null 2>&1; then
        say "onedl-mmengine $ONEDL_MMENGINE, onedl-mmcv $ONEDL_MMCV_VERSION, onedl-mmdetection" \
            "$ONEDL_MMDET, the plugin (editable), its test extra, panopticapi already installed"
        return
    fi
    for dist in "${ONEDL_REPLACES[@]}"; do
        if have "$dist" ''; then
            say "removing $dist (the fork installs the same package)"
            "${PIP[@]}" uninstall -q -y "$dist"
        fi
    done
    # setup.py pins OpenMMLab's mmengine and mmdet, which would replace the fork's packages: the
    # plugin goes in without dependencies, and its other requirements (with the test extra) are
    # read back from its installed metadata, less those two.
    say "installing the plugin (editable, --no-deps: setup.py pins OpenMMLab's mmengine and mmdet)"
    "${PIP[@]}" install -q "${BIN[@]}" --no-binary vitdet_plugin --no-deps -e "$ROOT"
    mapfile -t reqs < <(onedl_plugin_requirements tests)
    say "installing onedl-mmengine $ONEDL_MMENGINE, onedl-mmcv $ONEDL_MMCV_VERSION (built from its" \
        "sdist without torch: no extension, no compiler), onedl-mmdetection $ONEDL_MMDET and the" \
        "plugin's requirements but mmengine / mmdet: ${reqs[*]}"
    # sdists allowed for the fork's two only; build isolation (pip's default) is what keeps
    # torch, and with it the C++ build, away from onedl-mmcv's setup.py. --no-warn-conflicts:
    # pip would report the plugin's two OpenMMLab pins as an ERROR (what `pip check` says too).
    env -u PIP_NO_BUILD_ISOLATION "${PIP[@]}" install -q --no-warn-conflicts "${BIN[@]}" \
        --no-binary onedl-mmcv,onedl-mmdetection "onedl-mmengine==$ONEDL_MMENGINE" \
        "onedl-mmcv==$ONEDL_MMCV_VERSION" "onedl-mmdetection==$ONEDL_MMDET" "${reqs[@]}"
    say "installing $PANOPTICAPI (--no-deps: it pins numpy<2, its code runs on numpy 2)"
    "${PIP[@]}" install -q "${BIN[@]}" --no-deps "$PANOPTICAPI"
    echo "$want" > "$stamp"
}

onedl_plugin_requirements() {  # onedl_plugin_requirements EXTRA...: one requirement a line
    "$PY" - "$@" <<'PYEOF'
import importlib.metadata as md
import sys

try:
    from packaging.requirements import Requirement
except ImportError:  # not yet installed in a new venv: pip's own copy
    from pip._vendor.packaging.requirements import Requirement

extras = sys.argv[1:]
for line in md.requires('vitdet_plugin') or []:
    req = Requirement(line)
    if req.name in ('mmengine', 'mmdet'):
        continue  # the fork's onedl-mmengine / onedl-mmdetection provide them
    if req.marker is None or any(req.marker.evaluate({'extra': e}) for e in extras):
        req.marker = None
        print(req)
PYEOF
}
