# D-FINE X on COCO: published box AP 55.8 on val2017 (Peterande/D-FINE, 62M parameters).
# HGNetV2 B5, encoder width 384 (FFN 2048), 6 decoder layers of 256 over 1x1 projections,
# reg_scale 8; lr 2.5e-4, backbone 2.5e-6 (configs/dfine/dfine_hgnetv2_x_coco.yml).
# Train: tools/train.py configs/dfine/dfine_x.py --cfg-options data_root=/path/to/coco/
# transformers' weights: model.init_cfg=dict(type='Pretrained', checkpoint=FOLDER).
_base_ = ['./_base_/dfine_coco.py']
backbone_lr = 2.5e-6
model = dict(
    backbone=dict(arch='B5'),
    neck=dict(hidden_dim=384, ffn_dim=2048),
    bbox_head=dict(in_channels=(384, 384, 384), reg_scale=8.0))
optim_wrapper = dict(paramwise_cfg=dict(custom_keys={
    'backbone': dict(lr_mult=backbone_lr / _base_.base_lr)}))
