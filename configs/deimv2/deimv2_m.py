# DEIMv2 M on COCO: published box AP 53.0 on val2017 (Intellindust-AI-Lab/DEIMv2, 18.1M
# parameters). Distilled DINOv3 ViT-Tiny+ (256 wide, taps 3 / 7 / 11) + STA, encoder 256 wide
# (expansion 0.67), 4 decoder layers of FFN 512; 102 epochs, policy 4 / 49 / 90, matcher change
# at 80, ViT lr 2.5e-5 (configs/deimv2/deimv2_dinov3_m_coco.yml).
# Train: tools/train.py configs/deimv2/deimv2_m.py --cfg-options data_root=/path/to/coco/
_base_ = ['./_base_/deimv2_coco.py']
max_epochs = 102
flat_epoch = 49
no_aug_epoch = 12
policy_epochs = (4, 49, 90)
stop_epoch = 90
base_size_repeat = 6
matcher_change_epoch = 80
backbone_lr = 2.5e-5
weight_decay = 1e-4
model = dict(
    data_preprocessor=dict(batch_augments=[
        dict(_base_.model.data_preprocessor.batch_augments[0], mixup_epochs=(4, 49),
             copyblend_epochs=(4, 90)),
        dict(_base_.model.data_preprocessor.batch_augments[1], base_size_repeat=base_size_repeat,
             stop_epoch=stop_epoch)]),
    backbone=dict(arch='M'),
    neck=dict(ffn_dim=512, expansion=0.67, depth_mult=1.0),
    bbox_head=dict(ffn_dims=512, num_layers=4))
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
