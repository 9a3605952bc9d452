# CPU demo (`make demo-detr`, after `make demo`): SdpaDETR (our DETR-style head) on the stem
# Swin + GN FPN of `make demo`, both loaded from that demo's checkpoint (init_cfg Pretrained with
# a prefix: strict, reported) and frozen; only the head trains, for the 9.5-minute budget:
# 1647 iterations, bbox mAP 0.381 (mAP_50 0.533, mAP_75 0.449).
# tools/demo.sh (DEMO_PRETRAINED) sets the checkpoint file; the model, data and head are
# swin_detr_shapes.py's (the same detector from scratch). The runs behind lr 1e-3 and the
# frozen parts: tools/dev/experiments.md.
_base_ = ['./swin_detr_shapes.py']
# replaced by tools/demo.sh DEMO_PRETRAINED (`make demo-detr`: make demo's last checkpoint)
pretrained = 'work_dirs/demo_swin_retinanet/CHECKPOINT.pth'

model = dict(
    backbone=dict(init_cfg=dict(type='Pretrained', checkpoint=pretrained, prefix='backbone.')),
    neck=dict(init_cfg=dict(type='Pretrained', checkpoint=pretrained, prefix='neck.')),
    # DINO's Hungarian matching of the selected proposals (one-to-many cost 0.04 here, above)
    bbox_head=dict(enc_one_to_many=None),
    frozen_parts=('backbone', 'neck'))

