# DEIMv2 on COCO (Intellindust-AI-Lab/DEIMv2 configs/base/deimv2.yml: the X size's numbers);
# sizes (deimv2_{atto,femto,pico,n,s,m,l,x}.py) state what differs. DINOv3 + STA ->
# HybridEncoder -> DFineHead(style='deimv2'); the 4-stage augmentation policy
# (PipelineSwitchHook), MixUp / Copy-Blend, multi-scale; MAL + boxes + FGL / DDF, IoU-order
# matching from matcher_change_epoch (DEIMMatcherSwitchHook); lr: quadratic warm-up, flat,
# cosine to lr_gamma x lr, flat; AdamW, the ViT at its own lr; EMA 0.9999 (1000 warm-up steps).
# Train: tools/train.py configs/deimv2/deimv2_x.py --cfg-options data_root=/path/to/coco/
# Official .pth: load_from=FILE or tools/test.py CONFIG FILE (strict; docs/deimv2.md).
# transformers' folders: a head with enc_output=True, decoder=dict(mlp_act='relu',
# query_pos_per_layer=True) (init_cfg=dict(type='Pretrained', checkpoint=FOLDER)).
_base_ = ['../../_base_/datasets/coco_detection.py', '../../_base_/default_runtime.py']

num_classes = 80
input_size = 640
max_epochs = 58
#: the lr schedule: quadratic warm-up (iterations), flat until flat_epoch, cosine down to
#: lr_gamma x lr at max_epochs - no_aug_epoch, flat after
warmup_iters = 2000
flat_epoch = 29
no_aug_epoch = 8
lr_gamma = 0.5
#: the augmentation policy's stage starts: Mosaic (or zoom-out + IoU crop), then zoom-out + IoU
#: crop alone, then none
policy_epochs = (4, 29, 50)
mosaic_prob = 0.5
mosaic_size = 320
min_box_size = 1
#: batch mixing (DEIMBatchMix) and the multi-scale (DEIMBatchScale, until stop_epoch)
mixup_prob = 0.5
mixup_epochs = (4, 29)
copyblend_prob = 0.5
copyblend_epochs = (4, 50)
stop_epoch = 50
base_size_repeat = 3
matcher_change_epoch = 45
batch_size = 4  # per GPU: the recipe's 32 on 8 GPUs
base_lr = 5e-4
backbone_lr = 1e-5
weight_decay = 1.25e-4
clip_max_norm = 0.1
#: 1 - the recipe's EMA decay 0.9999; its warm-up (1 - exp(-steps / 1000))
ema_momentum = 1e-4
ema_warmup = 1000

model = dict(
    type='SingleStageDetector',
    data_preprocessor=dict(
        type='DetDataPreprocessor', mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375],
        bgr_to_rgb=True, pad_size_divisor=32,
        batch_augments=[
            dict(type='DEIMBatchMix', mixup_prob=mixup_prob, mixup_epochs=mixup_epochs,
                 copyblend_prob=copyblend_prob, copyblend_epochs=copyblend_epochs,
                 area_threshold=100, num_objects=3, expand_ratios=(0.1, 0.25)),
            dict(type='DEIMBatchScale', base_size=input_size, base_size_repeat=base_size_repeat,
                 stop_epoch=stop_epoch)]),
    backbone=dict(type='DINOv3STABackbone', arch='X'),
    neck=dict(type='HybridEncoder', in_channels=(256, 256, 256), in_strides=(8, 16, 32),
              hidden_dim=256, num_heads=8, ffn_dim=1024, expansion=1.25, depth_mult=1.37,
              fuse_op='sum', version='deim', csp_type='csp2', input_proj=False),
    bbox_head=dict(
        type='DFineHead', num_classes=num_classes, in_channels=(256, 256, 256), embed_dims=256,
        num_queries=300, num_heads=8, ffn_dims=2048, num_layers=6, num_points=(3, 6, 3),
        style='deimv2', reg_max=32, reg_scale=4.0, enc_output=False,
        decoder=dict(use_gateway=True, share_reg_branch=False, query_pos_act='silu',
                     mlp_act='silu', query_pos_per_layer=False),
        num_denoising=100, label_noise_ratio=0.5, box_noise_scale=1.0, class_loss='mal',
        dense_one_to_one=True,
        criterion=dict(focal_alpha=0.75, focal_gamma=1.5, match_iou_order_alpha=4.0)),
    test_cfg=dict(max_per_img=300))

_load = [dict(type='LoadImageFromFile', backend_args=_base_.backend_args),
         dict(type='LoadAnnotations', with_bbox=True),
         dict(type='DEIMClipBoxes')]
_resize = [dict(type='DEIMSanitizeBoxes', min_size=min_box_size),
           dict(type='RandomFlip', prob=0.5),
           dict(type='Resize', scale=(input_size, input_size), keep_ratio=False,
                backend='pillow'),
           dict(type='DEIMSanitizeBoxes', min_size=min_box_size),
           dict(type='PackDetInputs')]
_distort = dict(type='DEIMPhotometricDistort', p=0.5)
_zoom_crop = [dict(type='Expand', mean=(0, 0, 0), to_rgb=False, ratio_range=(1, 4), prob=0.5),
              dict(type='DEIMRandomIoUCrop', p=0.8)]
_mosaic = dict(type='DEIMMosaic', output_size=mosaic_size, rotation_range=10,
               translation_range=(0.1, 0.1), scaling_range=(0.5, 1.5), fill_value=0,
               max_cached_images=50, random_pop=True)
plain_pipeline = _load + _resize
mosaic_pipeline = _load + [dict(type='RandomChoice',
                                transforms=[[_mosaic, _distort], [_distort] + _zoom_crop],
                                prob=[mosaic_prob, 1 - mosaic_prob])] + _resize
strong_pipeline = _load + [_distort] + _zoom_crop + _resize
test_pipeline = [
    dict(type='LoadImageFromFile', backend_args=_base_.backend_args),
    dict(type='Resize', scale=(input_size, input_size), keep_ratio=False, backend='pillow'),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='PackDetInputs',
         meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor'))]
train_dataloader = dict(batch_size=batch_size, num_workers=4, batch_sampler=None,
                        dataset=dict(pipeline=plain_pipeline))
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader

optim_wrapper = dict(
    type='AmpOptimWrapper', dtype='bfloat16',
    optimizer=dict(type='AdamW', lr=base_lr, betas=(0.9, 0.999), weight_decay=weight_decay),
    clip_grad=dict(max_norm=clip_max_norm, norm_type=2),
    paramwise_cfg=dict(norm_decay_mult=0.0, bias_decay_mult=0.0, bypass_duplicate=True,
                       custom_keys={'backbone.vit': dict(lr_mult=backbone_lr / base_lr)}))
train_cfg = dict(type='EpochBasedTrainLoop', max_epochs=max_epochs, val_interval=1)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')
param_scheduler = [
    dict(type='QuadraticWarmupLR', by_epoch=False, begin=0, end=warmup_iters),
    dict(type='CosineAnnealingLR', by_epoch=True, convert_to_iter_based=True, begin=flat_epoch,
         end=max_epochs - no_aug_epoch, eta_min_ratio=lr_gamma)]
custom_hooks = [
    dict(type='EMAHook', ema_type='ExpMomentumEMA', momentum=ema_momentum, gamma=ema_warmup,
         update_buffers=True, priority=49),
    dict(type='PipelineSwitchHook', switch_epoch=policy_epochs[0],
         switch_pipeline=mosaic_pipeline),
    dict(type='PipelineSwitchHook', switch_epoch=policy_epochs[1],
         switch_pipeline=strong_pipeline),
    dict(type='PipelineSwitchHook', switch_epoch=policy_epochs[2],
         switch_pipeline=plain_pipeline),
    dict(type='DEIMMatcherSwitchHook', switch_epoch=matcher_change_epoch)]
auto_scale_lr = dict(enable=False, base_batch_size=32)
