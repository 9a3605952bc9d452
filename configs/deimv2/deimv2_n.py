# DEIMv2 N on COCO: published box AP 43.0 on val2017 (Intellindust-AI-Lab/DEIMv2, 3.6M
# parameters). HGNetV2 B0 with LAB (strides 16 / 32), D-FINE's hybrid encoder 128 wide (FFN
# 512, expansion 0.34, depth 0.5), 3 decoder layers of 6 points per level; 160 epochs, policy
# 4 / 78 / 148, one scale, lr flat after the warm-up, matcher change at 136
# (configs/deimv2/deimv2_hgnetv2_n_coco.yml). Pixels RGB / 255.
# Train: tools/train.py configs/deimv2/deimv2_n.py --cfg-options data_root=/path/to/coco/
_base_ = ['./_base_/deimv2_coco.py']
max_epochs = 160
no_aug_epoch = 12
policy_epochs = (4, 78, 148)
matcher_change_epoch = 136
base_lr = 8e-4
backbone_lr = 4e-4
weight_decay = 1e-4
model = dict(
    data_preprocessor=dict(mean=[0.0, 0.0, 0.0], std=[255.0, 255.0, 255.0], batch_augments=[
        dict(_base_.model.data_preprocessor.batch_augments[0], mixup_epochs=(4, 78),
             copyblend_prob=0.4, copyblend_epochs=(4, 78))]),
    backbone=dict(type='HGNetV2Backbone', arch='B0', out_indices=(2, 3), use_lab=True),
    neck=dict(in_channels=(512, 1024), in_strides=(16, 32), hidden_dim=128, ffn_dim=512,
              encoder_levels=(1,), expansion=0.34, depth_mult=0.5, version='dfine',
              input_proj=True),
    bbox_head=dict(in_channels=(128, 128), embed_dims=128, ffn_dims=512, num_layers=3,
                   num_points=(6, 6)))
optim_wrapper = dict(
    optimizer=dict(lr=base_lr, weight_decay=weight_decay),
    paramwise_cfg=dict(custom_keys=dict(
        _delete_=True, backbone=dict(lr_mult=backbone_lr / base_lr))))
train_cfg = dict(max_epochs=max_epochs)
param_scheduler = [_base_.param_scheduler[0]]  # lr_gamma 1: no cosine
custom_hooks = [_base_.custom_hooks[0], _base_.custom_hooks[1],
                dict(_base_.custom_hooks[2], switch_epoch=policy_epochs[1]),
                dict(_base_.custom_hooks[3], switch_epoch=policy_epochs[2]),
                dict(type='DEIMMatcherSwitchHook', switch_epoch=matcher_change_epoch)]
