# DEIMv2's smallest COCO models (Atto / Femto / Pico: configs/deimv2/deimv2_hgnetv2_*_coco.yml)
# over deimv2_coco.py, at the Pico size: 3-stage pruned HGNetV2 (stride 16) -> LiteEncoder
# (strides 16 / 32) -> 3 decoder layers, one distribution head, no gate; MAL + boxes only (no
# FGL / DDF, no dense one-to-one); no MixUp / Copy-Blend, one scale; 500 epochs, policy 4 /
# 250 / 400, lr quadratic warm-up over 4000 iterations, flat until 250, cosine to 0.5 x at 468.
# Pixels RGB / 255.
_base_ = ['./deimv2_coco.py']

input_size = 640
mosaic_size = 320
min_box_size = 8
max_epochs = 500
warmup_iters = 4000
flat_epoch = 250
no_aug_epoch = 32
policy_epochs = (4, 250, 400)
matcher_change_epoch = 450
batch_size = 16  # per GPU: the recipe's 128 on 8 GPUs
base_lr = 1.6e-3
backbone_lr = 8e-4
weight_decay = 1e-4
width = 112

model = dict(
    data_preprocessor=dict(mean=[0.0, 0.0, 0.0], std=[255.0, 255.0, 255.0],
                           batch_augments=None),
    backbone=dict(_delete_=True, type='HGNetV2Backbone', arch='Pico', out_indices=(2,),
                  use_lab=True),
    neck=dict(_delete_=True, type='LiteEncoder', in_channels=(512,), in_strides=(16,),
              hidden_dim=width, expansion=0.34, depth_mult=0.5),
    bbox_head=dict(in_channels=(width, width), embed_dims=width, num_queries=200, ffn_dims=320,
                   num_layers=3, num_points=(4, 2), dense_one_to_one=False,
                   decoder=dict(use_gateway=False, share_reg_branch=True),
                   criterion=dict(loss_weights=dict(fgl=0.0, ddf=0.0))))
_load = _base_.plain_pipeline[:3]
_resize = [dict(type='DEIMSanitizeBoxes', min_size=min_box_size),
           dict(type='RandomFlip', prob=0.5),
           dict(type='Resize', scale=(input_size, input_size), keep_ratio=False,
                backend='pillow'),
           dict(type='DEIMSanitizeBoxes', min_size=min_box_size),
           dict(type='PackDetInputs')]
_choice = _base_.mosaic_pipeline[3]
plain_pipeline = _load + _resize
mosaic_pipeline = _load + [dict(_choice, transforms=[
    [dict(_choice.transforms[0][0], output_size=mosaic_size), _choice.transforms[0][1]],
    _choice.transforms[1]])] + _resize
strong_pipeline = _load + _choice.transforms[1] + _resize
test_pipeline = [_base_.test_pipeline[0],
                 dict(_base_.test_pipeline[1], scale=(input_size, input_size)),
                 *_base_.test_pipeline[2:]]
train_dataloader = dict(batch_size=batch_size, dataset=dict(pipeline=plain_pipeline))
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader
optim_wrapper = dict(
    optimizer=dict(lr=base_lr, weight_decay=weight_decay),
    paramwise_cfg=dict(custom_keys=dict(
        _delete_=True, backbone=dict(lr_mult=backbone_lr / base_lr))))
train_cfg = dict(max_epochs=max_epochs)
param_scheduler = [dict(_base_.param_scheduler[0], end=warmup_iters),
                   dict(_base_.param_scheduler[1], begin=flat_epoch,
                        end=max_epochs - no_aug_epoch)]
custom_hooks = [_base_.custom_hooks[0],
                dict(_base_.custom_hooks[1], switch_epoch=policy_epochs[0],
                     switch_pipeline=mosaic_pipeline),
                dict(_base_.custom_hooks[2], switch_epoch=policy_epochs[1],
                     switch_pipeline=strong_pipeline),
                dict(_base_.custom_hooks[3], switch_epoch=policy_epochs[2],
                     switch_pipeline=plain_pipeline),
                dict(_base_.custom_hooks[4], switch_epoch=matcher_change_epoch)]
auto_scale_lr = dict(base_batch_size=128)
