# SdpaDETR: Swin-T (vitdet_plugin SwinBackbone) + our DETR-style head (SdpaDETRHead), COCO 2017,
# 12 epochs AdamW with DETR/DINO augmentation. No anchors, no NMS, no compiled ops: every
# attention is torch's scaled_dot_product_attention, so it trains in fp32, fp16 and bf16 AMP.
# Starts from the official ImageNet-1k Swin-T (configs/_base_/pretrained.py).
_base_ = [
    './_base_/models/swin-t.py',
    './_base_/datasets/coco_detection.py',
    './_base_/schedules/adamw_1x.py',
    './_base_/default_runtime.py',
    './_base_/pretrained.py',
]

num_classes = 80
embed_dims = 256
model = dict(
    type='SdpaDETR',
    data_preprocessor=dict(
        type='DetDataPreprocessor',
        mean=[123.675, 116.28, 103.53],
        std=[58.395, 57.12, 57.375],
        bgr_to_rgb=True,
        pad_size_divisor=32),
    # strides 8 / 16 / 32, channels 192 / 384 / 768
    backbone=dict(_base_.swin_t, out_indices=(1, 2, 3),
                  init_cfg=dict(type='Pretrained', checkpoint=_base_.swin_t_in1k)),
    neck=None,
    bbox_head=dict(
        type='SdpaDETRHead',
        num_classes=num_classes,
        in_channels=[192, 384, 768],
        num_extra_levels=1,  # + stride 64
        embed_dims=embed_dims,
        num_heads=8,
        ffn_dims=2048,
        dropout=0.0,
        num_encoder_layers=1,
        encoder_levels=(2, 3),  # strides 32 and 64: ~1.3k tokens at 800x1333
        num_decoder_layers=6,
        num_queries=300,
        two_stage=True,
        box_prior=True,
        loss_cls=dict(type='FocalLoss', use_sigmoid=True, gamma=2.0, alpha=0.25,
                      loss_weight=2.0),
        loss_bbox=dict(type='L1Loss', loss_weight=5.0),
        loss_iou=dict(type='GIoULoss', loss_weight=2.0)),
    train_cfg=dict(
        assigner=dict(
            type='HungarianAssigner',
            match_costs=[
                dict(type='FocalLossCost', weight=2.0),
                dict(type='BBoxL1Cost', weight=5.0, box_format='xywh'),
                dict(type='IoUCost', iou_mode='giou', weight=2.0)
            ])),
    test_cfg=dict(max_per_img=100))

# DETR / DINO augmentation: flip, then multi-scale resize or resize-crop-resize
backend_args = None
ms_scales = [(480, 1333), (512, 1333), (544, 1333), (576, 1333), (608, 1333), (640, 1333),
             (672, 1333), (704, 1333), (736, 1333), (768, 1333), (800, 1333)]
train_pipeline = [
    dict(type='LoadImageFromFile', backend_args=backend_args),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='RandomChoice',
         transforms=[
             [dict(type='RandomChoiceResize', scales=ms_scales, keep_ratio=True)],
             [dict(type='RandomChoiceResize', scales=[(400, 4200), (500, 4200), (600, 4200)],
                   keep_ratio=True),
              dict(type='RandomCrop', crop_type='absolute_range', crop_size=(384, 600),
                   allow_negative_crop=True),
              dict(type='RandomChoiceResize', scales=ms_scales, keep_ratio=True)],
         ]),
    dict(type='PackDetInputs')
]
train_dataloader = dict(
    dataset=dict(filter_cfg=dict(filter_empty_gt=False), pipeline=train_pipeline))

# DETR recipe: AdamW 1e-4 (backbone x0.1), wd 1e-4, tight gradient clipping, lr x0.1 at epoch 11.
# The 'backbone' key outranks norm_decay_mult, so NoDecayOptimWrapperConstructor keeps the
# backbone's no_weight_decay() parameters (norms, biases, position tables) free of decay.
max_epochs = 12
train_cfg = dict(type='EpochBasedTrainLoop', max_epochs=max_epochs, val_interval=1)
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    constructor='NoDecayOptimWrapperConstructor',
    optimizer=dict(type='AdamW', lr=1e-4, weight_decay=1e-4),
    clip_grad=dict(max_norm=0.1, norm_type=2),
    paramwise_cfg=dict(
        custom_keys={
            'backbone': dict(lr_mult=0.1),
            # the longest matching key wins, so backbone-only keys repeat the lr_mult
            'absolute_pos_embed': dict(lr_mult=0.1, decay_mult=0.),
            'relative_position_bias_table': dict(lr_mult=0.1, decay_mult=0.),
            'level_embed': dict(decay_mult=0.),
        },
        norm_decay_mult=0.))
param_scheduler = [
    dict(type='LinearLR', start_factor=0.001, by_epoch=False, begin=0, end=1000),
    dict(type='MultiStepLR', begin=0, end=max_epochs, by_epoch=True, milestones=[11],
         gamma=0.1)
]
# lr above is for 16 images per iteration (8 GPUs x 2); `tools/train.py --auto-scale-lr`
auto_scale_lr = dict(enable=False, base_batch_size=16)
