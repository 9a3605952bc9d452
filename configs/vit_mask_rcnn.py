# ViTDet Mask R-CNN: plain ViT-B backbone (vitdet_plugin ViTBackbone: 14x14 window attention,
# global attention in blocks 2, 5, 8, 11, decomposed relative positions, drop path 0.1) with
# ViTDet's simple feature pyramid (strides 4-32 from the stride-16 map, + a stride-64 max-pool
# level), LSJ 1024 augmentation, AdamW lr 1e-4 wd 0.1 with layer-wise lr decay 0.7, 100 epochs
# at batch 64 (184375 iterations), as detectron2's / mmdet's ViTDet-B recipe (51.6 box / 45.9
# mask AP with MAE weights). The conv heads use GroupNorm where ViTDet uses LayerNorm.
# Starts from the MAE ViT-B, as ViTDet (configs/_base_/pretrained.py; ViTDet / SAM files load too).
_base_ = [
    './_base_/models/mask-rcnn_swin-t_fpn.py',
    './_base_/datasets/coco_instance_lsj.py',
    './_base_/default_runtime.py',
    './_base_/pretrained.py',
]
image_size = (1024, 1024)
head_norm_cfg = dict(type='GN', num_groups=32, requires_grad=True)

model = dict(
    data_preprocessor=dict(
        batch_augments=[dict(type='BatchFixedSizePad', size=image_size, pad_mask=True)]),
    backbone=dict(
        _delete_=True,
        type='ViTBackbone',
        arch='base',  # embed 768, depth 12, heads 12, global blocks [2, 5, 8, 11]
        drop_path_rate=0.1,
        window_size=14,
        img_size=1024,
        use_rel_pos=True,
        out_indices=(-1,),
        init_cfg=dict(type='Pretrained', checkpoint=_base_.mae_vit_b),
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
        bbox_head=dict(
            type='Shared4Conv1FCBBoxHead',
            conv_out_channels=256,
            norm_cfg=head_norm_cfg),
        mask_head=dict(norm_cfg=head_norm_cfg)))

max_iters = 184375
train_cfg = dict(type='IterBasedTrainLoop', max_iters=max_iters, val_interval=5000)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')
param_scheduler = [
    dict(type='LinearLR', start_factor=0.001, by_epoch=False, begin=0, end=250),
    dict(type='MultiStepLR', begin=0, end=max_iters, by_epoch=False,
         milestones=[163889, 177546], gamma=0.1)
]
optim_wrapper = dict(
    type='OptimWrapper',
    constructor='LayerDecayOptimWrapperConstructor',
    paramwise_cfg=dict(layer_decay_rate=0.7),
    optimizer=dict(type='AdamW', lr=0.0001, betas=(0.9, 0.999), weight_decay=0.1))
# lr above is for 64 images per iteration (16 GPUs x 4); `tools/train.py --auto-scale-lr`
auto_scale_lr = dict(enable=False, base_batch_size=64)

default_hooks = dict(
    logger=dict(type='LoggerHook', interval=50),
    checkpoint=dict(type='AtomicCheckpointHook', by_epoch=False, interval=5000, max_keep_ckpts=3))
log_processor = dict(type='LogProcessor', window_size=50, by_epoch=False)
