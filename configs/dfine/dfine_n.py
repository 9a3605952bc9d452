# D-FINE N on COCO: published box AP 42.8 on val2017 (Peterande/D-FINE, 4M parameters).
# HGNetV2 B0 with LAB, strides 16 / 32 only, encoder and decoder 128 wide (FFN 512), 3 decoder
# layers of 6 points per level; 160 epochs, augmentations until 148, one scale, batch 128,
# lr 8e-4, backbone 4e-4 (configs/dfine/dfine_hgnetv2_n_coco.yml).
# Train: tools/train.py configs/dfine/dfine_n.py --cfg-options data_root=/path/to/coco/
# transformers' weights: model.init_cfg=dict(type='Pretrained', checkpoint=FOLDER).
_base_ = ['./_base_/dfine_coco.py']
max_epochs = 160
stop_epoch = 148
batch_size = 16  # per GPU: the recipe's 128 on 8 GPUs
base_lr = 8e-4
backbone_lr = 4e-4
weight_decay = 1e-4
model = dict(
    data_preprocessor=dict(batch_augments=None),
    backbone=dict(arch='B0', out_indices=(2, 3), use_lab=True, frozen_stages=-1,
                  norm_eval=False),
    neck=dict(in_channels=(512, 1024), in_strides=(16, 32), hidden_dim=128, ffn_dim=512,
              encoder_levels=(1,), expansion=0.34, depth_mult=0.5),
    bbox_head=dict(in_channels=(128, 128), embed_dims=128, ffn_dims=512, num_layers=3,
                   num_points=(6, 6)))
train_dataloader = dict(batch_size=batch_size)
optim_wrapper = dict(
    optimizer=dict(lr=base_lr, weight_decay=weight_decay),
    paramwise_cfg=dict(bias_decay_mult=0.0,
                       custom_keys={'backbone': dict(lr_mult=backbone_lr / base_lr)}))
train_cfg = dict(max_epochs=max_epochs)
custom_hooks = [_base_.custom_hooks[0],
                dict(_base_.custom_hooks[1], switch_epoch=stop_epoch)]
auto_scale_lr = dict(base_batch_size=128)
