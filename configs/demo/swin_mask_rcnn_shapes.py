# CPU demo: a lean Mask R-CNN on the small stem Swin of swin_retinanet_shapes.py (embed 64,
# depths 2-2-2, 8 x 8 patches with a 16-32 conv stem, window 6, strides 8/16/32) on the embedded
# shapes dataset at 192 px, trained from random init for a fixed wall-clock budget; COCO bbox +
# segm mAP. swin_panoptic_fpn_shapes.py (`make demo-seg`) adds the stuff head and explains the
# recipe. Measured (2 cores, another job on the machine for part of the run, before the GIoU /
# 32-RoI change): 1195 iterations in 9.5 minutes, segm mAP 0.444, bbox mAP 0.457.
#   DEMO_CONFIG=configs/demo/swin_mask_rcnn_shapes.py make demo
_base_ = [
    '../_base_/models/mask-rcnn_swin-t_fpn.py',
    '../_base_/datasets/shapes_instance.py',
    '../_base_/schedules/cpu_time_budget.py',
    '../_base_/iter_runtime.py',
]
num_classes = 5
image_size = 192
embed_dims = 64
fpn_channels = 64
strides = [8, 16, 32]
norm_cfg = dict(type='GN', num_groups=16, requires_grad=True)

model = dict(
    backbone=dict(
        patch_size=8,            # strides 8, 16, 32
        stem_channels=(16, 32),  # 3x3 stride-2 convs; the projection covers the last 2 x 2
        embed_dims=embed_dims,   # overrides the Swin-T preset
        depths=[2, 2, 2],
        num_heads=[2, 4, 8],
        window_size=6,           # 192 px input: 24/12/6 token maps, no window padding
        drop_path_rate=0.0,
        out_indices=(0, 1, 2)),
    neck=dict(
        in_channels=[embed_dims, embed_dims * 2, embed_dims * 4],
        out_channels=fpn_channels,
        num_outs=4,              # P3-P6
        norm_cfg=norm_cfg),
    rpn_head=dict(
        in_channels=fpn_channels,
        feat_channels=fpn_channels,
        # square anchors 16-128 px on P3-P6 for the 15-75 px near-square objects
        anchor_generator=dict(scales=[2], ratios=[1.0], strides=strides + [64])),
    roi_head=dict(
        bbox_roi_extractor=dict(out_channels=fpn_channels, featmap_strides=strides),
        bbox_head=dict(in_channels=fpn_channels, fc_out_channels=256, num_classes=num_classes,
                       # regress decoded boxes with GIoU (mmdet's faster-rcnn giou recipe)
                       reg_decoded_bbox=True,
                       loss_bbox=dict(_delete_=True, type='GIoULoss', loss_weight=10.0)),
        mask_roi_extractor=dict(out_channels=fpn_channels, featmap_strides=strides),
        mask_head=dict(num_convs=2, in_channels=fpn_channels, conv_out_channels=fpn_channels,
                       num_classes=num_classes)),
    train_cfg=dict(
        rpn_proposal=dict(nms_pre=500, max_per_img=100),
        rcnn=dict(sampler=dict(num=32, pos_fraction=0.5))),
    test_cfg=dict(rpn=dict(nms_pre=300, max_per_img=100), rcnn=dict(max_per_img=20)))

backend_args = None
train_pipeline = [
    dict(type='LoadImageFromFile', backend_args=backend_args),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='Resize', scale=(image_size, image_size), keep_ratio=True),
    dict(type='RandomFlip', prob=[0.25, 0.25, 0.25],
         direction=['horizontal', 'vertical', 'diagonal']),
    dict(type='PackDetInputs')
]
test_pipeline = [
    dict(type='LoadImageFromFile', backend_args=backend_args),
    dict(type='Resize', scale=(image_size, image_size), keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='PackDetInputs',
         meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor'))
]
train_dataloader = dict(dataset=dict(pipeline=train_pipeline))
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader

optim_wrapper = dict(optimizer=dict(lr=2e-3, fused=True))

budget_minutes = 9.5
custom_hooks = [
    dict(type='TimeBudgetHook', minutes=budget_minutes),
    dict(type='RNGStateHook'),
    dict(type='NonFiniteCheckHook'),
    # evaluation (and the saved checkpoint's state_dict) use the EMA weights
    dict(type='EMAHook', ema_type='ExpMomentumEMA', momentum=0.002, update_buffers=True,
         priority=49),
]
