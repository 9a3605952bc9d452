#!/usr/bin/env bash
# `make demo` / `make demo-seg` / `make demo-detr`: generate the shapes dataset (if absent), train
# a demo config on CPU for a fixed wall-clock budget (from random init, or from the parts of a
# DEMO_PRETRAINED checkpoint the config names), evaluate on the val split (COCO bbox mAP; segm
# mAP, PQ and mIoU when the config reports them), save a grid of val images with drawn
# predictions, the feature maps of one val image (tools/analysis/visualize.py features) and, for
# a DETR-style head, its decoder picture (visualize.py decoder), and print the metrics and where
# the files are.
#
# Environment variables (all optional):
#   DEMO_CONFIG    config to train       (default: configs/demo/swin_retinanet_shapes.py)
#   DEMO_DATA      dataset directory     (default: data/shapes/; generated when absent, used
#                                         as it is when present, whatever its seed and options)
#   DEMO_WORK_DIR  output directory      (default: work_dirs/demo_swin_retinanet)
#   DEMO_MINUTES   training budget, min  (default: the config's budget_minutes, 9.5)
#   DEMO_ITERS     train exactly this many iterations instead of a time budget (the demos are
#                  seeded, randomness.seed=0, deterministic: the same DEMO_ITERS on the same
#                  machine gives the same weights and mAP; a time budget gives a machine-load
#                  dependent number of iterations, printed at the end)
#   DEMO_SEED      dataset seed          (default: 0; for a dataset that is generated)
#   DEMO_PRETRAINED a checkpoint, or the work dir of a run (its last_checkpoint), whose backbone
#                  and neck the config loads (configs whose model.backbone and model.neck have a
#                  Pretrained init_cfg: the DETR head demo on `make demo`'s checkpoint)
#   PYTHON         interpreter           (default: .venv/bin/python)
set -euo pipefail

if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then  # the comment above, as the help
    sed -n '2,/^set -euo pipefail/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 0
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
CONFIG="${DEMO_CONFIG:-configs/demo/swin_retinanet_shapes.py}"
DATA="${DEMO_DATA:-data/shapes/}"
WORK="${DEMO_WORK_DIR:-work_dirs/demo_swin_retinanet}"
SEED="${DEMO_SEED:-0}"
case "$DATA" in */) ;; *) DATA="$DATA/" ;; esac

say() { printf '\033[1m[demo]\033[0m %s\n' "$*"; }

# the pretrained checkpoint first: a missing one stops before anything runs
PRE_OPTS=()
if [ -n "${DEMO_PRETRAINED:-}" ]; then
    PRE="$DEMO_PRETRAINED"
    if [ -d "$PRE" ]; then
        if [ ! -f "$PRE/last_checkpoint" ]; then
            echo "[demo] DEMO_PRETRAINED=$PRE is a directory without last_checkpoint: run the" \
                 "demo that writes it first (make demo for work_dirs/demo_swin_retinanet)" >&2
            exit 2
        fi
        PRE="$(cat "$PRE/last_checkpoint")"
    fi
    if [ ! -f "$PRE" ]; then
        echo "[demo] pretrained checkpoint $PRE does not exist: run make demo first" >&2
        exit 2
    fi
    say "pretrained backbone and neck: $PRE"
    PRE_OPTS=(model.backbone.init_cfg.checkpoint="$PRE" model.neck.init_cfg.checkpoint="$PRE")
fi
say "1/4 dataset: $DATA (seed $SEED)"
# --reuse: a shapes set already under DEMO_DATA is used as it was made (any seed / options)
"$PY" tools/make_shapes.py --out "$DATA" --seed "$SEED" --reuse

OPTS=(data_root="$DATA" "${PRE_OPTS[@]}")
if [ -n "${DEMO_ITERS:-}" ] && [ -n "${DEMO_MINUTES:-}" ]; then
    echo "[demo] set DEMO_ITERS or DEMO_MINUTES, not both" >&2
    exit 2
fi
if [ -n "${DEMO_MINUTES:-}" ]; then
    OPTS+=(custom_hooks.0.minutes="$DEMO_MINUTES")
fi
if [ -n "${DEMO_ITERS:-}" ]; then
    # the iteration count is the cap; a budget no machine reaches leaves it in charge
    OPTS+=(train_cfg.max_iters="$DEMO_ITERS" custom_hooks.0.minutes=1000000)
fi
say "2/4 training $CONFIG on CPU -> $WORK"
t0=$(date +%s)
"$PY" tools/train.py "$CONFIG" --work-dir "$WORK" --cfg-options "${OPTS[@]}"
t1=$(date +%s)
CKPT="$(cat "$WORK/last_checkpoint")"

say "3/4 evaluating $CKPT on the val split"
"$PY" tools/test.py "$CONFIG" "$CKPT" --work-dir "$WORK/test" --cfg-options "${OPTS[@]}" \
    --show-dir "$(realpath -m "$WORK")/predictions" --grid 16 --metrics-out "$WORK/metrics.json"

FEATURES="$WORK/visualize/features_val_000000.png"
say "4/4 feature maps of ${DATA}val/000000.png with $CKPT"
# the neck's maps too when the model has one (the DETR demos feed the backbone to the head)
NECK=()
if "$PY" -c "import sys; from vitdet_plugin.config import load_config
sys.exit(0 if load_config(sys.argv[1]).model.get('neck') else 1)" "$CONFIG"; then
    NECK=(--neck)
fi
"$PY" tools/analysis/visualize.py features "$CONFIG" "$CKPT" --image "${DATA}val/000000.png" \
    "${NECK[@]}" --out "$FEATURES" --cfg-options "${OPTS[@]}"
# DETR-style heads: how the decoder refines its top queries' boxes and where one query looks
DECODER=""
if "$PY" -c "import sys; from vitdet_plugin.config import load_config
sys.exit(0 if load_config(sys.argv[1]).model.get('bbox_head', {}).get('type') == 'SdpaDETRHead'
         else 1)" "$CONFIG"; then
    DECODER="$WORK/visualize/decoder_val_000000.png"
    "$PY" tools/analysis/visualize.py decoder "$CONFIG" "$CKPT" --image "${DATA}val/000000.png" \
        --out "$DECODER" --cfg-options "${OPTS[@]}"
fi

"$PY" - "$WORK/metrics.json" "$t0" "$t1" "$CKPT" "$WORK" "$FEATURES" "$DECODER" <<'PYEOF'
import json, sys
metrics, t0, t1, ckpt, work = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
features, decoder = sys.argv[6], sys.argv[7]
m = json.load(open(metrics))
nan = float('nan')
print()
print('=' * 64)
print(f"demo result: COCO bbox mAP {m.get('coco/bbox_mAP', nan):.3f}   "
      f"mAP_50 {m.get('coco/bbox_mAP_50', nan):.3f}   "
      f"mAP_75 {m.get('coco/bbox_mAP_75', nan):.3f}")
if 'coco/segm_mAP' in m:
    print(f"             COCO segm mAP {m['coco/segm_mAP']:.3f}   "
          f"mAP_50 {m.get('coco/segm_mAP_50', nan):.3f}   "
          f"mAP_75 {m.get('coco/segm_mAP_75', nan):.3f}")
if 'coco_panoptic/PQ' in m:
    print(f"             PQ {m['coco_panoptic/PQ']:.1f}   SQ {m.get('coco_panoptic/SQ', nan):.1f}   "
          f"RQ {m.get('coco_panoptic/RQ', nan):.1f}   (things {m.get('coco_panoptic/PQ_th', nan):.1f}, "
          f"stuff {m.get('coco_panoptic/PQ_st', nan):.1f})")
if 'mIoU' in m:
    # not aAcc: mmdet 3.3's SemSegMetric averages per-class accuracies there (= its mAcc)
    print(f"             semantic mIoU {m['mIoU']:.1f}")
iters = ckpt.rsplit('iter_', 1)[-1].split('.')[0]
print(f'train time (incl. start-up and the final validation): {(t1 - t0) / 60:.1f} min, '
      f'{iters} iterations (DEMO_ITERS={iters} repeats this run exactly)')
print(f'checkpoint:  {ckpt}')
print(f'metrics:     {metrics}')
print(f'predictions: {work}/predictions/  (grid: {work}/predictions/grid.png)')
print(f'features:    {features}  (tools/analysis/visualize.py, docs/look_inside.md)')
if decoder:
    print(f'decoder:     {decoder}  (top queries\' boxes per decoder layer, one query\'s '
          'cross-attention)')
print(f'train log:   {work}/<timestamp>/<timestamp>.log')
print('=' * 64)
PYEOF
