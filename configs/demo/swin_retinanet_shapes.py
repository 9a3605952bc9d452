# CPU demo: RetinaNet with a small Swin + FPN on the embedded shapes dataset (256 px, 5 classes),
# trained from random init for a fixed wall-clock budget (TimeBudgetHook) and evaluated with
# COCO bbox mAP. `make demo` runs it.
#
# Recipe for from-scratch training on 2 CPU cores (each choice measured against the previous
# recipe in 4.5-minute runs; bbox mAP after 4.5 min in brackets):
# * a Swin with 8 x 8 patches and three stages (embed 64, depths 2-2-2): RetinaNet reads
#   strides 8/16/32 only, so the stride-4 stage of the standard layout is skipped (3.4x less
#   CPU time per iteration than embed 48 / depths 2-2-2-2 / patch 4, same pyramid strides);
# * a convolutional stem (two 3x3 stride-2 convs, 16 and 32 channels, BN + ReLU) in front of a
#   2 x 2 patch projection instead of the linear 8 x 8 patch embedding: the transformer alone
#   learned where the objects are but not which shape they are (most errors were the class);
#   with early convolutions it learns the shapes far sooner (0.128 -> 0.196 at lr 1e-3, and it
#   tolerates a 2x higher learning rate: 0.249). Three stem convs (16-32-64: 0.228), wider
#   (32-64: 0.145) or one (32: 0.128) were worse;
# * images at 192 px (objects 15-75 px): ~1.7x the iterations of 256 px in the same time;
#   window 6 tiles the 24/12/6 token maps exactly (160 px with window 5: 0.213);
# * GroupNorm in the FPN and the head (from-scratch training without BN statistics), 64 ch;
# * square anchors only (the shapes' boxes are near-square at any rotation), 3 scales per
#   octave, 16-101 px on P3-P5; GIoU loss on decoded boxes;
# * EMA of the weights (mmdet's ExpMomentumEMA) for evaluation;
# * AdamW 2e-3 with the stem (1e-3: 0.196 with the three-conv stem, 3e-3: 0.209), fused kernel,
#   50-iteration warm-up, cosine decay to the end of the time budget; batch 8 (4 and 16 were
#   worse); no stochastic depth.
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
