# CPU demo: RetinaNet with a small Swin + FPN on the embedded shapes dataset (5 classes, 192 px),
# trained from random init for a fixed wall-clock budget (TimeBudgetHook) and evaluated with
# COCO bbox mAP: 1588 iterations, bbox mAP 0.395 (docs/configs_and_demos.md). `make demo` runs it.
# Recipe for from-scratch training on 2 CPU cores: a Swin with 8 x 8 patches and three stages
# (embed 64, depths 2-2-2) behind a two-conv stem (16-32, BN + ReLU), window 6, GN FPN and head
# (64 ch), square anchors, GIoU, EMA, AdamW 2e-3 with warm-up and cosine, batch 8. Each choice
# measured against the previous recipe: tools/dev/experiments.md.
_base_ = [
    '../_base_/models/retinanet_swin-t_fpn.py',
    '../_base_/models/swin-stem_shapes.py',  # the small stem Swin (model.backbone below)
    '../_base_/datasets/shapes_detection.py',
    '../_base_/schedules/cpu_time_budget_ema.py',  # AdamW 2e-3, 9.5-minute budget, EMA
]
num_classes = 5
image_size = 192
fpn_channels = _base_.fpn_channels
norm_cfg = _base_.norm_cfg

model = dict(
    backbone=_base_.stem_swin,
    neck=dict(_base_.stem_fpn, num_outs=3),
    bbox_head=dict(
        num_classes=num_classes,
        in_channels=fpn_channels,
        feat_channels=fpn_channels,
        stacked_convs=2,
        norm_cfg=norm_cfg,
        # square anchors 16-101 px on P3-P5 (3 scales per octave) for the 15-75 px objects
        anchor_generator=dict(octave_base_scale=2, ratios=[1.0], strides=[8, 16, 32]),
        # regress decoded boxes with GIoU: better localisation at the high IoUs of mAP@.5:.95
        reg_decoded_bbox=True,
        loss_bbox=dict(_delete_=True, type='GIoULoss', loss_weight=2.0)))

# the dataset base's pipelines, resized to the demo's image size
train_pipeline = [dict(t, scale=(image_size, image_size)) if t['type'] == 'Resize' else t
                  for t in _base_.train_pipeline]
test_pipeline = [dict(t, scale=(image_size, image_size)) if t['type'] == 'Resize' else t
                 for t in _base_.test_pipeline]
train_dataloader = dict(dataset=dict(pipeline=train_pipeline))
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader
