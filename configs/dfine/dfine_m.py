# D-FINE M on COCO: published box AP 52.3 on val2017 (Peterande/D-FINE, 19M parameters).
# HGNetV2 B2 with LAB (trained whole), encoder depth 0.67, 4 decoder layers; 132 epochs,
# augmentations until 120, lr 2e-4, backbone 2e-5 (configs/dfine/dfine_hgnetv2_m_coco.yml).
# Train: tools/train.py configs/dfine/dfine_m.py --cfg-options data_root=/path/to/coco/
# transformers' weights: model.init_cfg=dict(type='Pretrained', checkpoint=FOLDER).
_base_ = ['./_base_/dfine_coco.py']
max_epochs = 132
stop_epoch = 120
base_size_repeat = 6
base_lr = 2e-4
backbone_lr = 2e-5
weight_decay = 1e-4
model = dict(
    data_preprocessor=dict(batch_augments=[dict(
        type='DEIMBatchScale', base_size=_base_.input_size, base_size_repeat=base_size_repeat,
        stop_epoch=stop_epoch)]),
    backbone=dict(arch='B2', use_lab=True, frozen_stages=-1, norm_eval=False),
    neck=dict(in_channels=(384, 768, 1536), depth_mult=0.67),
    bbox_head=dict(num_layers=4))
optim_wrapper = dict(
    optimizer=dict(lr=base_lr, weight_decay=weight_decay),
    paramwise_cfg=dict(bias_decay_mult=0.0,
                       custom_keys={'backbone': dict(lr_mult=backbone_lr / base_lr)}))
train_cfg = dict(max_epochs=max_epochs)
custom_hooks = [_base_.custom_hooks[0],
                dict(_base_.custom_hooks[1], switch_epoch=stop_epoch)]
