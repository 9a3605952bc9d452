# DEIMv2 S on COCO: published box AP 50.9 on val2017 (Intellindust-AI-Lab/DEIMv2, 9.7M
# parameters). Distilled DINOv3 ViT-Tiny (192 wide, taps 3 / 7 / 11) + STA, encoder 192 wide
# (expansion 0.34, depth 0.67), 4 decoder layers of FFN 512; 132 epochs, policy 4 / 64 / 120,
# matcher change at 100, ViT lr 2.5e-5 (configs/deimv2/deimv2_dinov3_s_coco.yml).
# Train: tools/train.py configs/deimv2/deimv2_s.py --cfg-options data_root=/path/to/coco/
_base_ = ['./_base_/deimv2_coco.py']
max_epochs = 132
flat_epoch = 64
no_aug_epoch = 12
policy_epochs = (4, 64, 120)
stop_epoch = 120
base_size_repeat = 20
matcher_change_epoch = 100
backbone_lr = 2.5e-5
weight_decay = 1e-4
model = dict(
    data_preprocessor=dict(batch_augments=[
        dict(_base_.model.data_preprocessor.batch_augments[0], mixup_epochs=(4, 64),
             copyblend_epochs=(4, 120)),
        dict(_base_.model.data_preprocessor.batch_augments[1], base_size_repeat=base_size_repeat,
             stop_epoch=stop_epoch)]),
    backbone=dict(arch='S'),
    neck=dict(in_channels=(192, 192, 192), hidden_dim=192, ffn_dim=512, expansion=0.34,
              depth_mult=0.67),
    bbox_head=dict(in_channels=(192, 192, 192), embed_dims=192, ffn_dims=512, num_layers=4))
optim_wrapper = dict(
    optimizer=dict(weight_decay=weight_decay),
    paramwise_cfg=dict(custom_keys={'backbone.vit': dict(lr_mult=backbone_lr / _base_.base_lr)}))
train_cfg = dict(max_epochs=max_epochs)
param_scheduler = [_base_.param_scheduler[0],
                   dict(_base_.param_scheduler[1], begin=flat_epoch,
                        end=max_epochs - no_aug_epoch)]
custom_hooks = [_base_.custom_hooks[0], _base_.custom_hooks[1],
                dict(_base_.custom_hooks[2], switch_epoch=policy_epochs[1]),
                dict(_base_.custom_hooks[3], switch_epoch=policy_epochs[2]),
                dict(_base_.custom_hooks[4], switch_epoch=matcher_change_epoch)]
