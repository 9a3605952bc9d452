# D-FINE S on COCO: published box AP 48.5 on val2017 (Peterande/D-FINE, 10M parameters).
# HGNetV2 B0 with LAB (trained whole), encoder 256 wide (expansion 0.5, depth 0.34), 3 decoder
# layers; 132 epochs, augmentations until 120 (configs/dfine/dfine_hgnetv2_s_coco.yml).
# Train: tools/train.py configs/dfine/dfine_s.py --cfg-options data_root=/path/to/coco/
# transformers' weights: model.init_cfg=dict(type='Pretrained', checkpoint=FOLDER).
_base_ = ['./_base_/dfine_coco.py']
max_epochs = 132
stop_epoch = 120
base_size_repeat = 20
base_lr = 2e-4
backbone_lr = 1e-4
weight_decay = 1e-4
model = dict(
    data_preprocessor=dict(batch_augments=[dict(
        type='DEIMBatchScale', base_size=_base_.input_size, base_size_repeat=base_size_repeat,
        stop_epoch=stop_epoch)]),
    backbone=dict(arch='B0', use_lab=True, frozen_stages=-1, norm_eval=False),
    neck=dict(in_channels=(256, 512, 1024), expansion=0.5, depth_mult=0.34),
    bbox_head=dict(num_layers=3))
optim_wrapper = dict(
    optimizer=dict(lr=base_lr, weight_decay=weight_decay),
    paramwise_cfg=dict(bias_decay_mult=0.0,
                       custom_keys={'backbone': dict(lr_mult=backbone_lr / base_lr)}))
train_cfg = dict(max_epochs=max_epochs)
custom_hooks = [_base_.custom_hooks[0],
                dict(_base_.custom_hooks[1], switch_epoch=stop_epoch)]
