# CPU demo (`make demo-detr`, after `make demo`): SdpaDETR (our DETR-style head) on the stem
# Swin + GN FPN of `make demo`, both loaded from that demo's checkpoint (init_cfg Pretrained with
# a prefix: strict, reported) and frozen; only the head trains, for the 9.5-minute budget.
# tools/demo.sh (DEMO_PRETRAINED) sets the checkpoint file; the model, data and head are
# swin_detr_shapes.py's (the same detector from scratch).
#
# Measured runs (2 cores, 9.5-minute budget, make demo's checkpoint of 2026-12-01: RetinaNet bbox
# mAP 0.325, 1455 iterations; val split of data/shapes, seed 0; one line per run, in order):
# * frozen, lr 4e-4, batch 4: 953 iterations (cores shared with tests),
#   bbox mAP 0.229; on quiet cores 1384 iterations, 0.262 (mAP_50 0.407, mAP_75 0.288);
# * + one-to-many matching of the encoder tokens (enc_one_to_many=8): 1499 iterations, 0.224
#   (mAP_50 0.331): duplicate proposals crowd the 50 queries; not kept;
# * lr 1e-3 (this config; swin_detr_shapes.py's lr): 1647 iterations, bbox mAP 0.381 (mAP_50
#   0.533, mAP_75 0.449): the head alone is undertrained at 4e-4 in this budget;
# * the same on another shapes set (tools/make_shapes.py --seed 11 --objects 2 7 --object-size
#   24 80; `make demo-detr DEMO_DATA=data/shapes_b/`, same make demo checkpoint): 1702
#   iterations, bbox mAP 0.390 (mAP_50 0.541, mAP_75 0.455);
# * not frozen, backbone and neck at 0.1x the head's lr (1e-4; frozen_parts=()): 1067
#   iterations, bbox mAP 0.316 (mAP_50 0.467, mAP_75 0.368): freezing wins in this budget.
_base_ = ['./swin_detr_shapes.py']
# replaced by tools/demo.sh DEMO_PRETRAINED (`make demo-detr`: make demo's last checkpoint)
pretrained = 'work_dirs/demo_swin_retinanet/CHECKPOINT.pth'

model = dict(
    backbone=dict(init_cfg=dict(type='Pretrained', checkpoint=pretrained, prefix='backbone.')),
    neck=dict(init_cfg=dict(type='Pretrained', checkpoint=pretrained, prefix='neck.')),
    # DINO's Hungarian matching of the selected proposals (one-to-many cost 0.04 here, above)
    bbox_head=dict(enc_one_to_many=None),
    frozen_parts=('backbone', 'neck'))

