# DINOv2-B/14 with 4 registers as a ViTDet backbone in Mask R-CNN: vitdet_plugin DINOv2Backbone
# (LayerScale, cls + 4 register tokens, absolute position embedding stored at DINOv2's 37x37
# grid and resized to the input), run at patch 16 so it drives ViTDet's stride-16 simple pyramid
# (the loader resamples the 14x14 patch kernel to 16x16, FlexiViT-style), 14x14 window attention
# with global attention in blocks 2, 5, 8, 11, drop path 0.1. Everything else is
# configs/vit_mask_rcnn.py: ViTSimpleFPN (strides 4-32 + a stride-64 max-pool level), LSJ 1024,
# AdamW lr 1e-4 wd 0.1 with layer-wise lr decay 0.7, 184375 iterations at batch 64.
# DINOv2 weights (the official hub file or timm's vit_base_patch14_reg4_dinov2 in .pth /
# .safetensors):
# the official file is the default (configs/_base_/pretrained.py).
_base_ = './vit_mask_rcnn.py'

model = dict(
    backbone=dict(
        _delete_=True,
        type='DINOv2Backbone',
        arch='base',  # embed 768, depth 12, heads 12, global blocks [2, 5, 8, 11], drop path 0.1
        num_reg_tokens=4,
        patch_size=16,  # position grid stays the checkpoint's 37 x 37 (518 / 14)
        init_cfg=dict(type='Pretrained', checkpoint=_base_.dinov2_vitb14_reg4),
    ))
