# RF-DETR on COCO with the `rfdetr` package's (1.11.2) published model and recipe; the sizes
# (rfdetr_{nano,small,medium,large}.py, RF-DETR-Seg: _base_/rfdetr_seg_coco.py) state only what
# differs (resolution, decoder depth, queries, windows, patch). docs/rfdetr.md maps every option:
# * model: DINOv2 ViT-S (RF-DETR's windows, taps after blocks 3, 6, 9, 12) -> RFDETRProjector
#   (P4) -> LWDETRHead (300 queries, 13 Group DETR groups, IA-BCE);
# * data: RF-DETR's resizes (vitdet_plugin.datasets.rfdetr_transforms): RFDETRTrainResize and
#   per-batch scales (RFDETRBatchScale) from `resolution`, RFDETRResize as its predict at test;
# * recipe: rfdetr's TrainConfig (AdamW with layer decay, EMA per optimizer step, batch 4),
#   checked step for step against its trainer (tests/engine/test_rfdetr_trainer_parity.py).
# RF-DETR's .pth files: tools/convert_weights.py --model rfdetr, then load_from=THAT_FILE.
_base_ = ['../../_base_/datasets/coco_detection.py', '../../_base_/default_runtime.py']

num_classes = 80
patch_size = 16
num_windows = 2
#: RF-DETR's collate block: inputs padded to whole windows of whole patches
size_divisor = patch_size * num_windows
#: the model's input side: the training scales, the test size and the position table follow
resolution = 384
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

#: rfdetr's MultiScale.PER_BATCH: the batch resized to one training scale per optimizer step
batch_scale = dict(type='RFDETRBatchScale', resolution=resolution, block=size_divisor,
                   interval=grad_accum_steps)
model = dict(
    type='SingleStageDetector',
    data_preprocessor=dict(
        type='DetDataPreprocessor',
        mean=[123.675, 116.28, 103.53],  # ImageNet, RGB
        std=[58.395, 57.12, 57.375],
        bgr_to_rgb=True,
        pad_size_divisor=size_divisor,
        batch_augments=[batch_scale]),
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
#: RF-DETR's training resize (square at the largest training scale, or its crop branch first:
#: RFDETRBatchScale draws the batch's scale) and flip
train_pipeline = load + [
    dict(type='RFDETRTrainResize', resolution=resolution, block=size_divisor),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs')]
#: RF-DETR's predict: a float bilinear resize to the square input
test_pipeline = [
    dict(type='LoadImageFromFile', backend_args=backend_args),
    dict(type='RFDETRResize', scale=(resolution, resolution)),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='PackDetInputs',
         meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor'))
]
train_dataloader = dict(batch_size=batch_size, num_workers=4, batch_sampler=None,
                        dataset=dict(pipeline=train_pipeline))
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
