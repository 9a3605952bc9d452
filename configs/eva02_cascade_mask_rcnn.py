# EVA-02-B Cascade Mask R-CNN on COCO, the EVA-02 detection recipe (baaivision/EVA, EVA-02/det
# eva2_coco_cascade_mask_rcnn_vitdet_b_4attn_1024_lrd0p7). Published (EVA-02 paper, MIM in21k ->
# COCO): 55.5 box / 47.1 mask AP. EVA02Backbone (2-D RoPE, SwiGLU with sub-LN, patch 16 from
# EVA-02's 14x14 kernel, 16x16 windows with global blocks 2, 5, 8, 11, drop path 0.1), ViTDet's
# simple feature pyramid, three cascade stages, LSJ 1024; AdamW lr 5e-5 wd 0.1, layer decay 0.7,
# 60k iterations at batch 128. The conv heads use GroupNorm where EVA-02 / ViTDet use LayerNorm.
# Starts from the official MIM file eva02_B_pt_in21k_p14.pt (configs/_base_/pretrained.py; an
# EVA-02/det detector's file or timm's eva02_base_patch14_224.mim_in22k load too).
# Train: tools/train.py configs/eva02_cascade_mask_rcnn.py --cfg-options data_root=/path/to/coco/
_base_ = [
    'mmdet::_base_/models/cascade-mask-rcnn_r50_fpn.py',
    './_base_/datasets/coco_instance_lsj.py',
    './_base_/default_runtime.py',
    './_base_/pretrained.py',
]
# Notes: the backbone also has q / v biases and an absolute position embedding from the 16x16
# pretraining grid; the pyramid adds a stride-64 max-pool level to strides 4-32; the three
# cascade stages are 4conv1fc box heads (IoU 0.5 / 0.6 / 0.7, class-agnostic regression); the
# lr steps at 80 % and 90 % of the 60k iterations after 1000 warm-up iterations.
custom_imports = dict(imports=['vitdet_plugin'], allow_failed_imports=False)
image_size = (1024, 1024)
head_norm_cfg = dict(type='GN', num_groups=32, requires_grad=True)
# box-delta normalisation of the three stages (detectron2's weights (10, 5), (20, 10), (30, 15))
stage_stds = ([0.1, 0.1, 0.2, 0.2], [0.05, 0.05, 0.1, 0.1], [0.033, 0.033, 0.067, 0.067])


def _box_head(stds):
    return dict(
        type='Shared4Conv1FCBBoxHead',
        in_channels=256,
        conv_out_channels=256,
        fc_out_channels=1024,
        norm_cfg=head_norm_cfg,
        roi_feat_size=7,
        num_classes=80,
        bbox_coder=dict(type='DeltaXYWHBBoxCoder', target_means=[0., 0., 0., 0.],
                        target_stds=stds),
        reg_class_agnostic=True,
        loss_cls=dict(type='CrossEntropyLoss', use_sigmoid=False, loss_weight=1.0),
        loss_bbox=dict(type='SmoothL1Loss', beta=1.0, loss_weight=1.0))


model = dict(
    data_preprocessor=dict(
        batch_augments=[dict(type='BatchFixedSizePad', size=image_size, pad_mask=True)]),
    backbone=dict(
        _delete_=True,
        type='EVA02Backbone',
        arch='base',  # embed 768, depth 12, heads 12, SwiGLU (mlp ratio 4 * 2 / 3) with sub-LN,
        # window 16, global blocks [2, 5, 8, 11], drop path 0.1
        patch_size=16,
        prefix_tokens='drop',  # EVA-02-det drops the cls token (its detector files have none)
        init_cfg=dict(type='Pretrained', checkpoint=_base_.eva02_b_in21k_p14),
    ),
    neck=dict(
        _delete_=True,
        type='ViTSimpleFPN',
        in_channels=768,
        out_channels=256,
        scale_factors=(4.0, 2.0, 1.0, 0.5),  # strides 4, 8, 16, 32
        in_stride=16,
        num_outs=5),  # + stride 64
    rpn_head=dict(num_convs=2),
    roi_head=dict(
        bbox_head=[_box_head(stds) for stds in stage_stds],
        mask_head=dict(norm_cfg=head_norm_cfg)))

max_iters = 60000
train_cfg = dict(type='IterBasedTrainLoop', max_iters=max_iters, val_interval=5000)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')
param_scheduler = [
    dict(type='LinearLR', start_factor=0.001, by_epoch=False, begin=0, end=1000),
    dict(type='MultiStepLR', begin=0, end=max_iters, by_epoch=False,
         milestones=[max_iters * 8 // 10, max_iters * 9 // 10], gamma=0.1)
]
optim_wrapper = dict(
    type='OptimWrapper',
    constructor='LayerDecayOptimWrapperConstructor',
    paramwise_cfg=dict(layer_decay_rate=0.7),
    optimizer=dict(type='AdamW', lr=5e-5, betas=(0.9, 0.999), weight_decay=0.1))
# lr above is for 128 images per iteration; `tools/train.py --auto-scale-lr`
auto_scale_lr = dict(enable=False, base_batch_size=128)

default_hooks = dict(
    logger=dict(type='LoggerHook', interval=50),
    checkpoint=dict(type='AtomicCheckpointHook', by_epoch=False, interval=5000, max_keep_ckpts=3))
log_processor = dict(type='LogProcessor', window_size=50, by_epoch=False)
