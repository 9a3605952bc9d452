# EVA-02-L Cascade Mask R-CNN trained sharded (FSDP2 over the GPUs, configs/_base_/fsdp.py): the
# EVA-02 detection recipe of configs/eva02_cascade_mask_rcnn.py on vitdet_plugin EVA02Backbone
# 'large' (embed 1024, depth 24, heads 16, SwiGLU with sub-LN, q / v biases, 2-D rope, patch 16
# from the 14x14 kernel, 16x16 window attention with global attention in blocks 5, 11, 17, 23,
# drop path 0.4), layer-wise lr decay 0.8 (EVA-02/det's ViT-L files), ViTSimpleFPN strides 4-64.
# EVA-02 weights: the official MIM file eva02_L_pt_in21k_p14.pt (configs/_base_/pretrained.py)
# or timm's eva02_large_patch14_224.mim_in22k.
_base_ = ['./eva02_cascade_mask_rcnn.py', './_base_/fsdp.py']

model = dict(
    backbone=dict(
        arch='large',
        init_cfg=dict(type='Pretrained', checkpoint=_base_.eva02_l_in21k_p14),
    ),
    neck=dict(in_channels=1024))
optim_wrapper = dict(paramwise_cfg=dict(layer_decay_rate=0.8))
