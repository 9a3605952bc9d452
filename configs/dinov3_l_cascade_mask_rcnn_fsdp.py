# DINOv3-L/16 Cascade Mask R-CNN trained sharded (FSDP2 over the GPUs, configs/_base_/fsdp.py):
# the EVA-02 Cascade recipe of configs/eva02_cascade_mask_rcnn.py (LSJ 1024, three cascade
# stages, AdamW with layer-wise lr decay) on vitdet_plugin DINOv3Backbone 'large' (embed 1024,
# depth 24, heads 16, 4 register tokens, 2-D rope, LayerScale, 16x16 window attention with
# global attention in blocks 5, 11, 17, 23, drop path 0.4), ViTSimpleFPN strides 4-64.
# DINOv3 weights: the official dinov3_vitl16 file (configs/_base_/pretrained.py: a local path;
# Meta gives it on request) or timm's vit_large_patch16_dinov3.
_base_ = ['./eva02_cascade_mask_rcnn.py', './_base_/fsdp.py']

model = dict(
    backbone=dict(
        _delete_=True,
        type='DINOv3Backbone',
        arch='large',
        window_size=16,  # 1024 / 16 = 64 tokens a side: 4 x 4 whole windows
        init_cfg=dict(type='Pretrained', checkpoint=_base_.dinov3_vitl16),
    ),
    neck=dict(in_channels=1024))
optim_wrapper = dict(paramwise_cfg=dict(layer_decay_rate=0.8))  # 24 blocks (0.7 for 12)
