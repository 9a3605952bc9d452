# mmdet's DINO (4-scale, 12 epochs, COCO) on DINOv3 7B/16 trained sharded (FSDP2 over the GPUs,
# configs/_base_/fsdp.py; 6.7B backbone parameters: 107 GB of fp32 weights + gradients + AdamW
# state in all, per GPU in docs/large_models.md#memory): configs/dinov3_dino.py with
# vitdet_plugin DINOv3Backbone '7b' (embed 4096, depth 40, heads 32, SwiGLU 8192 wide, no qkv
# bias, 4 storage tokens, 2-D rope base 100, LayerScale, 16x16 window attention with global
# attention in blocks 9, 19, 29, 39, drop path 0.5), ViTSimpleFPN strides 8-64.
# DINOv3 weights: the official dinov3_vit7b16 file (configs/_base_/pretrained.py: a local path;
# Meta gives it on request) or timm's vit_7b_patch16_dinov3. To train the head on a frozen
# backbone (DINOv3's own detector): model.backbone.frozen_stages=40.
_base_ = ['./dinov3_dino.py', './_base_/fsdp.py']

model = dict(
    backbone=dict(
        arch='7b',
        init_cfg=dict(type='Pretrained', checkpoint=_base_.dinov3_vit7b16),
    ),
    neck=dict(in_channels=4096))
optim_wrapper = dict(paramwise_cfg=dict(layer_decay_rate=0.9))  # 40 blocks
# no rank builds the 27 GB of fp32 weights: every rank builds the model on the meta device and
# reads its own shards of the pretrained file (docs/large_models.md#per-rank-host-memory);
# init_on_rank0=True instead has rank 0 build them all and send the shards
model_wrapper_cfg = dict(init_device='meta')
