# D-FINE on COCO (Peterande/D-FINE configs/dfine/include/*.yml, the L size); the sizes
# (dfine_{n,s,m,l,x}.py) state only what differs. HGNetV2 -> HybridEncoder -> DFineHead;
# data: the recipe's transforms (vitdet_plugin.datasets.deim_transforms) until stop_epoch, then
# resize + flip alone (PipelineSwitchHook), multi-scale batches (DEIMBatchScale) until then;
# AdamW, the backbone at its own lr, no decay on norms; EMA 0.9999 with 1000 warm-up steps.
# Train: tools/train.py configs/dfine/dfine_l.py --cfg-options data_root=/path/to/coco/
# transformers' weights: init_cfg=dict(type='Pretrained', checkpoint=FOLDER) on the model.
_base_ = ['../../_base_/datasets/coco_detection.py', '../../_base_/default_runtime.py']

num_classes = 80
input_size = 640
#: training epochs; the strong augmentations and the multi-scale stop at stop_epoch
max_epochs = 80
stop_epoch = 72
#: how often the base size is among the multi-scale sides
base_size_repeat = 3
batch_size = 4  # per GPU: the recipe's 32 on 8 GPUs
base_lr = 2.5e-4
backbone_lr = 1.25e-5
weight_decay = 1.25e-4
warmup_iters = 500
clip_max_norm = 0.1
#: 1 - the recipe's EMA decay 0.9999; its warm-up (1 - exp(-steps / 1000))
ema_momentum = 1e-4
ema_warmup = 1000

model = dict(
    type='SingleStageDetector',
    data_preprocessor=dict(
        type='DetDataPreprocessor', mean=[0.0, 0.0, 0.0], std=[255.0, 255.0, 255.0],
        bgr_to_rgb=True, pad_size_divisor=32,
        batch_augments=[dict(type='DEIMBatchScale', base_size=input_size,
                             base_size_repeat=base_size_repeat, stop_epoch=stop_epoch)]),
    backbone=dict(type='HGNetV2Backbone', arch='B4', out_indices=(1, 2, 3), use_lab=False,
                  frozen_stages=0, norm_eval=True),
    neck=dict(type='HybridEncoder', in_channels=(512, 1024, 2048), in_strides=(8, 16, 32),
              hidden_dim=256, num_heads=8, ffn_dim=1024, expansion=1.0, depth_mult=1.0,
              fuse_op='cat', version='dfine', csp_type='csp'),
    bbox_head=dict(type='DFineHead', num_classes=num_classes, in_channels=(256, 256, 256),
                   embed_dims=256, num_queries=300, num_heads=8, ffn_dims=1024, num_layers=6,
                   num_points=(3, 6, 3), style='dfine', reg_max=32, reg_scale=4.0,
                   num_denoising=100, label_noise_ratio=0.5, box_noise_scale=1.0,
                   class_loss='vfl'),
    test_cfg=dict(max_per_img=300))

_resize = [dict(type='DEIMSanitizeBoxes', min_size=1),
           dict(type='RandomFlip', prob=0.5),
           dict(type='Resize', scale=(input_size, input_size), keep_ratio=False,
                backend='pillow'),
           dict(type='DEIMSanitizeBoxes', min_size=1),
           dict(type='PackDetInputs')]
_load = [dict(type='LoadImageFromFile', backend_args=_base_.backend_args),
         dict(type='LoadAnnotations', with_bbox=True),
         dict(type='DEIMClipBoxes')]
train_pipeline = _load + [
    dict(type='DEIMPhotometricDistort', p=0.5),
    dict(type='Expand', mean=(0, 0, 0), to_rgb=False, ratio_range=(1, 4), prob=0.5),
    dict(type='DEIMRandomIoUCrop', p=0.8)] + _resize
plain_pipeline = _load + _resize
test_pipeline = [
    dict(type='LoadImageFromFile', backend_args=_base_.backend_args),
    dict(type='Resize', scale=(input_size, input_size), keep_ratio=False, backend='pillow'),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='PackDetInputs',
         meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor'))]
train_dataloader = dict(batch_size=batch_size, num_workers=4, batch_sampler=None,
                        dataset=dict(pipeline=train_pipeline))
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader

optim_wrapper = dict(
    type='AmpOptimWrapper', dtype='bfloat16',
    optimizer=dict(type='AdamW', lr=base_lr, betas=(0.9, 0.999), weight_decay=weight_decay),
    clip_grad=dict(max_norm=clip_max_norm, norm_type=2),
    paramwise_cfg=dict(norm_decay_mult=0.0, bypass_duplicate=True,
                       custom_keys={'backbone': dict(lr_mult=backbone_lr / base_lr)}))
train_cfg = dict(type='EpochBasedTrainLoop', max_epochs=max_epochs, val_interval=1)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')
param_scheduler = [dict(type='LinearLR', start_factor=1.0 / warmup_iters, by_epoch=False,
                        begin=0, end=warmup_iters)]
custom_hooks = [
    dict(type='EMAHook', ema_type='ExpMomentumEMA', momentum=ema_momentum, gamma=ema_warmup,
         update_buffers=True, priority=49),
    dict(type='PipelineSwitchHook', switch_epoch=stop_epoch, switch_pipeline=plain_pipeline)]
auto_scale_lr = dict(enable=False, base_batch_size=32)
