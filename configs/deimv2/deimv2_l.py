# DEIMv2 L on COCO: published box AP 56.0 on val2017 (Intellindust-AI-Lab/DEIMv2, 32.2M
# parameters). DINOv3 ViT-S/16 (taps 5 / 8 / 11) + STA, encoder 224 wide (FFN 896, expansion
# 1, depth 1), 4 decoder layers of FFN 1792; 68 epochs, policy 4 / 34 / 60, matcher change at
# 50, ViT lr 1.25e-5 (configs/deimv2/deimv2_dinov3_l_coco.yml).
# Train: tools/train.py configs/deimv2/deimv2_l.py --cfg-options data_root=/path/to/coco/
_base_ = ['./_base_/deimv2_coco.py']
max_epochs = 68
flat_epoch = 34
policy_epochs = (4, 34, 60)
stop_epoch = 60
matcher_change_epoch = 50
backbone_lr = 1.25e-5
model = dict(
    data_preprocessor=dict(batch_augments=[
        dict(_base_.model.data_preprocessor.batch_augments[0], mixup_epochs=(4, 34),
             copyblend_epochs=(4, 60)),
        dict(_base_.model.data_preprocessor.batch_augments[1], stop_epoch=stop_epoch)]),
    backbone=dict(arch='L'),
    neck=dict(in_channels=(224, 224, 224), hidden_dim=224, ffn_dim=896, expansion=1.0,
              depth_mult=1.0),
    bbox_head=dict(in_channels=(224, 224, 224), embed_dims=224, ffn_dims=1792, num_layers=4))
optim_wrapper = dict(
    optimizer=dict(weight_decay=_base_.weight_decay),
    paramwise_cfg=dict(custom_keys={'backbone.vit': dict(lr_mult=backbone_lr / _base_.base_lr)}))
train_cfg = dict(max_epochs=max_epochs)
param_scheduler = [_base_.param_scheduler[0],
                   dict(_base_.param_scheduler[1], begin=flat_epoch,
                        end=max_epochs - _base_.no_aug_epoch)]
custom_hooks = [_base_.custom_hooks[0], _base_.custom_hooks[1],
                dict(_base_.custom_hooks[2], switch_epoch=policy_epochs[1]),
                dict(_base_.custom_hooks[3], switch_epoch=policy_epochs[2]),
                dict(_base_.custom_hooks[4], switch_epoch=matcher_change_epoch)]
