# mmdet's DINO (4-scale, 12 epochs, COCO) on a DINOv3-B/16 ViTDet backbone: vitdet_plugin
# DINOv3Backbone (2-D rotary position embedding, LayerScale, cls + 4 register tokens, no
# absolute position embedding), 16x16 window attention with global attention in blocks 2, 5, 8,
# 11, drop path 0.1, at 1024 px (a 64x64 token grid); ViTDet's simple feature pyramid makes
# strides 8 / 16 / 32 from the stride-16 map plus a stride-64 max-pool level (DINO's four
# levels). AdamW lr 1e-4 wd 1e-4 with layer-wise lr decay 0.7 over the backbone.
# Note: DINO's deformable attention is mmcv's MultiScaleDeformableAttention (compile-free here).
# DINOv3 weights (the official file or timm's vit_base_patch16_dinov3):
# Meta gives the official file on request, so the default is a local path
# (configs/_base_/pretrained.py: checkpoints/dinov3_vitb16_pretrain_lvd1689m.pth).
_base_ = ['mmdet::dino/dino-4scale_r50_8xb2-12e_coco.py', './_base_/pretrained.py']

custom_imports = dict(imports=['vitdet_plugin'], allow_failed_imports=False)

model = dict(
    backbone=dict(
        _delete_=True,
        type='DINOv3Backbone',
        arch='base',  # embed 768, depth 12, heads 12, 4 registers, global blocks [2, 5, 8, 11]
        window_size=16,  # 1024 / 16 = 64 tokens a side: 4 x 4 whole windows
        init_cfg=dict(type='Pretrained', checkpoint=_base_.dinov3_vitb16),
    ),
    neck=dict(
        _delete_=True,
        type='ViTSimpleFPN',
        in_channels=768,
        out_channels=256,
        scale_factors=(2.0, 1.0, 0.5),  # strides 8, 16, 32
        in_stride=16,
        num_outs=4))  # + stride 64 (max-pool)

optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    constructor='LayerDecayOptimWrapperConstructor',
    paramwise_cfg=dict(layer_decay_rate=0.7,
                       extra_no_decay_names=('query_embedding', 'level_embed')),
    optimizer=dict(type='AdamW', lr=1e-4, weight_decay=1e-4),
    clip_grad=dict(max_norm=0.1, norm_type=2))

# the config / data checks before the first iteration with any runner (mmdet's tools/train.py
# too; configs/_base_/default_runtime.py has them, this config's mmdet base does not)
custom_hooks = [dict(type='PreflightCheckHook')]
