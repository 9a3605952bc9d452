# CPU demo: RetinaNet with a small Swin + FPN on the embedded shapes dataset (256 px, 5 classes),
# trained from random init for a fixed wall-clock budget (TimeBudgetHook) and evaluated with
# COCO bbox mAP. `make demo` runs it.
#
# Recipe for from-scratch training on 2 CPU cores:
# * a Swin with 8 x 8 patches and three stages (embed 64, depths 2-2-2, window 8): RetinaNet
#   reads strides 8/16/32 only, so the stride-4 stage of the standard layout (64 x 64 tokens at
#   256 px, ~60% of the backbone's time) is skipped; 3.4x less CPU time per iteration than
#   embed 48 / depths 2-2-2-2 / patch 4 with the same pyramid strides;
# * GroupNorm in the FPN and the head (from-scratch training without BN statistics), 64 ch;
# * anchors 16-101 px on P3-P5 for the 20-100 px objects, GIoU loss on decoded boxes;
# * no resizing (256 px), horizontal/vertical/diagonal flips, batch 8;
# * AdamW 1e-3, 50-iteration warm-up, cosine decay to the end of the time budget.
_base_ = [
    '../_base_/models/retinanet_swin-t_fpn.py',
    '../_base_/datasets/shapes_detection.py',
    '../_base_/schedules/cpu_time_budget.py',
    '../_base_/iter_runtime.py',
]
num_classes = 5
embed_dims = 64
fpn_channels = 64
norm_cfg = dict(type='GN', num_groups=16, requires_grad=True)

model = dict(
    backbone=dict(
        patch_size=8,           # strides 8, 16, 32
        embed_dims=embed_dims,  # overrides the Swin-T preset
        depths=[2, 2, 2],
        num_heads=[2, 4, 8],
        window_size=8,          # 256 px input: 32/16/8 token maps, no window padding
        drop_path_rate=0.1,
        out_indices=(0, 1, 2)),
    neck=dict(
        in_channels=[embed_dims, embed_dims * 2, embed_dims * 4],
        out_channels=fpn_channels,
        num_outs=3,
        norm_cfg=norm_cfg),
    bbox_head=dict(
        num_classes=num_classes,
        in_channels=fpn_channels,
        feat_channels=fpn_channels,
        stacked_convs=2,
        norm_cfg=norm_cfg,
        # anchors 16-101 px on P3-P5 for 20-100 px objects (3 scales x 3 ratios per level)
        anchor_generator=dict(octave_base_scale=2, strides=[8, 16, 32]),
        # regress decoded boxes with GIoU: better localisation at the high IoUs of mAP@.5:.95
        reg_decoded_bbox=True,
        loss_bbox=dict(_delete_=True, type='GIoULoss', loss_weight=2.0)))

budget_minutes = 9.5
custom_hooks = [
    dict(type='TimeBudgetHook', minutes=budget_minutes),
    dict(type='RNGStateHook'),
    dict(type='NonFiniteCheckHook'),
]
