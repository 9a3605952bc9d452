# CPU demo (`make demo-detr`, after `make demo`): SdpaDETR (our DETR-style head) on the stem
# Swin + GN FPN of `make demo`, both loaded from that demo's checkpoint (init_cfg Pretrained with
# a prefix: strict, reported) and frozen; only the head trains, for the 9.5-minute budget.
# tools/demo.sh (DEMO_PRETRAINED) sets the checkpoint file; the model, data and head are
# swin_detr_shapes.py's (the same detector from scratch).
_base_ = ['./swin_detr_shapes.py']
# replaced by tools/demo.sh DEMO_PRETRAINED (`make demo-detr`: make demo's last checkpoint)
pretrained = 'work_dirs/demo_swin_retinanet/CHECKPOINT.pth'

model = dict(
    backbone=dict(init_cfg=dict(type='Pretrained', checkpoint=pretrained, prefix='backbone.')),
    neck=dict(init_cfg=dict(type='Pretrained', checkpoint=pretrained, prefix='neck.')),
    frozen_parts=('backbone', 'neck'))
