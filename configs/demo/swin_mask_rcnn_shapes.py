# CPU demo: Mask R-CNN with a small Swin (embed 48, depths 2-2-2-2, window 8) + FPN on the
# embedded shapes dataset (boxes + polygon masks), time-bounded training from random init,
# COCO bbox + segm mAP.
_base_ = [
    '../_base_/models/mask-rcnn_swin-t_fpn.py',
    '../_base_/datasets/shapes_instance.py',
    '../_base_/schedules/cpu_time_budget.py',
    '../_base_/iter_runtime.py',
]
num_classes = 5
fpn_channels = 96
norm_cfg = dict(type='GN', num_groups=16, requires_grad=True)

model = dict(
    backbone=dict(
        embed_dims=48,  # overrides the Swin-T preset
        depths=[2, 2, 2, 2],
        num_heads=[3, 6, 12, 24],
        window_size=8,
        drop_path_rate=0.1,
        out_indices=(0, 1, 2, 3)),
    neck=dict(
        in_channels=[48, 96, 192, 384],  # embed 48 x 2^i at out_indices (0, 1, 2, 3)
        out_channels=fpn_channels,
        num_outs=4,
        norm_cfg=norm_cfg),
    rpn_head=dict(
        in_channels=fpn_channels,
        feat_channels=fpn_channels,
        anchor_generator=dict(scales=[4], strides=[4, 8, 16, 32])),
    roi_head=dict(
        bbox_roi_extractor=dict(out_channels=fpn_channels),
        bbox_head=dict(in_channels=fpn_channels, fc_out_channels=256, num_classes=num_classes),
        mask_roi_extractor=dict(out_channels=fpn_channels),
        mask_head=dict(num_convs=2, in_channels=fpn_channels, conv_out_channels=fpn_channels,
                       num_classes=num_classes)),
    train_cfg=dict(
        rpn_proposal=dict(nms_pre=1000, max_per_img=300),
        rcnn=dict(sampler=dict(num=128))),
    test_cfg=dict(rpn=dict(nms_pre=500, max_per_img=100)))

budget_minutes = 9.5
custom_hooks = [
    dict(type='TimeBudgetHook', minutes=budget_minutes),
    dict(type='RNGStateHook'),
    dict(type='NonFiniteCheckHook'),
]
