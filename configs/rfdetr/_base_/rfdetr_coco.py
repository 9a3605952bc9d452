# RF-DETR on COCO with RF-DETR's published recipe (the `rfdetr` package 1.11.2: config.py
# ModelConfig / TrainConfig, training/param_groups.py, datasets/coco.py; docs/rfdetr.md maps
# every option to the key below; RF-DETR-Seg: _base_/rfdetr_seg_coco.py on top). The sizes
# (configs/rfdetr/rfdetr_{nano,small,medium,large}.py) set `resolution`, `scales` and the
# decoder depth; everything else is shared:
# * model: mmdet's SingleStageDetector: DINOv2 ViT-S/16 (no registers) with RF-DETR's 2 x 2 window
#   tiling (taps after blocks 3, 6, 9, 12, the block after each tap global) -> RFDETRProjector
#   (P4 only, C2f with channel LayerNorm) -> LWDETRHead (256 wide, 300 queries, 13 Group DETR
#   groups in training, 8 self- / 16 cross-attention heads, 2 points, FFN 2048, IA-BCE);
# * data: RF-DETR's square multi-scale training resize (one of `scales`, or a 400-600 px resize,
#   a 384-600 px crop and one of `scales`), horizontal flip; square `resolution` at test; batch
#   padded to a multiple of patch x windows (RF-DETR's collate block size);
# * optimiser: AdamW lr 1e-4 (the decoder 0.7 of it), weight decay 1e-4 (not on the ViT's norms,
#   biases and embeddings), the ViT at 1.5e-4 x 0.7^2 with layer-wise lr decay 0.8 (RF-DETR's
#   exponent: 13 layers, the taps' last index + 1), gradient clipping 0.1; batch 4 per GPU;
# * EMA of the weights (decay 0.993, warm-up tau 100 optimizer steps) used for validation and
#   saved with the checkpoint; 100 epochs, lr x 0.1 after `lr_drop` epochs (RF-DETR's default
#   100: no drop within the 100 epochs).
# Weights: RF-DETR's own .pth files convert with tools/convert_weights.py --model rfdetr
# (its 91 COCO logits mapped to mmdet's 80 classes), then --cfg-options load_from=THAT_FILE;
# given unconverted to load_from they are refused naming that command (docs/rfdetr.md).
_base_ = ['../../_base_/datasets/coco_detection.py', '../../_base_/default_runtime.py']

num_classes = 80
patch_size = 16
num_windows = 2
#: RF-DETR's collate block: inputs padded to whole windows of whole patches
size_divisor = patch_size * num_windows
resolution = 384          # each size sets its own (and its `scales`)
num_decoder_layers = 2
#: RF-DETR's TrainConfig: epochs, lr_drop (a 10x step after that many epochs), batch, accumulation
max_epochs = 100
lr_drop = 100
batch_size = 4
grad_accum_steps = 1
#: RF-DETR's lr, weight_decay, lr_vit_layer_decay, clip_max_norm, ema_tau
base_lr = 1e-4
#: RF-DETR's ViT lr relative to `base_lr`: lr_encoder 1.5e-4 x lr_component_decay 0.7 squared
#: (training/param_groups.py, backbone.py get_named_param_lr_pairs) / lr 1e-4
backbone_lr_mult = 0.735
#: its decoder's: lr_component_decay
decoder_lr_mult = 0.7
weight_decay = 1e-4
layer_decay_rate = 0.8
#: the layer-decay exponent's depth: RF-DETR's num_layers = out_feature_indexes[-1] + 1
decay_layers = 13
clip_max_norm = 0.1
#: 1 - RF-DETR's ema_decay 0.993: the weight of the model in an EMA update (mmdet's momentum)
ema_momentum = 0.007
ema_tau = 100

model = dict(
    type='SingleStageDetector',
    data_preprocessor=dict(
        type='DetDataPreprocessor',
        mean=[123.675, 116.28, 103.53],  # ImageNet, RGB
        std=[58.395, 57.12, 57.375],
        bgr_to_rgb=True,
        pad_size_divisor=size_divisor),
    backbone=dict(
        type='DINOv2Backbone',
        arch='small',             # 384 wide, 12 blocks, 6 heads, LayerScale
        num_reg_tokens=0,         # RF-DETR's encoder 'dinov2_windowed_small': no registers
        drop_path_rate=0.0,       # RF-DETR's drop_path
        patch_size=patch_size,
        num_windows=num_windows,
        out_indices=(2, 5, 8, 11),  # RF-DETR's out_feature_indexes [3, 6, 9, 12] (1-based)
        pretrain_img_size=resolution,  # RF-DETR's positional_encoding_size = resolution / patch
        pretrain_patch_size=patch_size),
    neck=dict(
        type='RFDETRProjector',
        in_channels=(384, 384, 384, 384),
        out_channels=256,
        levels=('P4',),
        in_stride=patch_size,
        num_blocks=3),
    bbox_head=dict(
        type='LWDETRHead',
        num_classes=num_classes,
        embed_dims=256,
        num_levels=1,
        num_queries=300,
        num_groups=13,
        num_decoder_layers=num_decoder_layers,
        self_heads=8,
        cross_heads=16,
        num_points=2,
        ffn_dims=2048),
    test_cfg=dict(max_per_img=300))  # RF-DETR's num_select

backend_args = None
load = [dict(type='LoadImageFromFile', backend_args=backend_args),
        dict(type='LoadAnnotations', with_bbox=True)]
#: RF-DETR's first training branch (a size sets the scales): a square resize to one of them
square_resize = dict(type='RandomChoiceResize', keep_ratio=False)
#: its second branch: shortest side 400 / 500 / 600, a 384-600 px crop, then `square_resize`
crop_branch = [
    dict(type='RandomChoiceResize', scales=[(400, 4200), (500, 4200), (600, 4200)],
         keep_ratio=True),
    dict(type='RandomCrop', crop_type='absolute_range', crop_size=(384, 600),
         allow_negative_crop=True)]
test_pipeline = [
    dict(type='LoadImageFromFile', backend_args=backend_args),
    dict(type='Resize', scale=(resolution, resolution), keep_ratio=False),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='PackDetInputs',
         meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor'))
]
train_dataloader = dict(batch_size=batch_size, num_workers=4, batch_sampler=None)
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader

optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=base_lr, weight_decay=weight_decay),
    constructor='LayerDecayOptimWrapperConstructor',
    paramwise_cfg=dict(layer_decay_rate=layer_decay_rate, num_layers=decay_layers,
                       lr_mults={'backbone': backbone_lr_mult,
                                 'bbox_head.decoder': decoder_lr_mult},
                       # RF-DETR's weight decay: none on the ViT's norms, biases, embeddings
                       # (patch embedding included); on its LayerScale and on everything
                       # outside the ViT, norms and biases too
                       extra_no_decay_names=['patch_embed'], decay_names=['gamma'],
                       norm_decay_mult=1.0, bias_decay_mult=1.0),
    accumulative_counts=grad_accum_steps,
    clip_grad=dict(max_norm=clip_max_norm, norm_type=2))

train_cfg = dict(type='EpochBasedTrainLoop', max_epochs=max_epochs, val_interval=1)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')
param_scheduler = [dict(type='MultiStepLR', by_epoch=True, begin=0, end=max_epochs,
                        milestones=[lr_drop], gamma=0.1)]

# RF-DETR's EMA: ema = d * ema + (1 - d) * model after optimizer step t (from 1; buffers too),
# d = 0.993 * (1 - exp(-t / tau)), the first step copied: the model's weight 1 - d = 0.007 +
# 0.993 exp(-t / tau), StepExpMomentumEMA's curve with momentum 1 - 0.993 and gamma = tau, one
# average per optimizer step (interval and begin_iter: the accumulated iterations of one step)
custom_hooks = _base_.custom_hooks + [
    dict(type='EMAHook', ema_type='StepExpMomentumEMA', momentum=ema_momentum, gamma=ema_tau,
         interval=grad_accum_steps, begin_iter=grad_accum_steps, update_buffers=True,
         priority=49)]

# RF-DETR's batch is 4 (TrainConfig.batch_size 4, grad_accum_steps 1): on N GPUs, 4N per step;
# a larger batch on fewer GPUs: optim_wrapper.accumulative_counts=k with the EMA hook's interval
# and begin_iter k (tests/engine/test_rfdetr_trainer_parity.py checks k = 2 against rfdetr)
auto_scale_lr = dict(enable=False, base_batch_size=batch_size * grad_accum_steps)
