# SdpaDETR with a plain ViT-B backbone (vitdet_plugin ViTBackbone, ViTDet-style window attention
# with 4 global blocks) and ViTDet's simple feature pyramid, COCO 2017, 12 epochs. The pyramid
# makes strides 8 / 16 / 32 (+ a stride-64 max-pool level) from the stride-16 ViT map; the head
# attends densely to all four levels through SDPA (no compiled ops; fp32 / fp16 / bf16 AMP).
# Starts from the MAE ViT-B, as ViTDet (configs/_base_/pretrained.py; ViTDet / SAM files load too).
_base_ = './swin_detr.py'

model = dict(
    backbone=dict(
        _delete_=True,
        type='ViTBackbone',
        arch='base',  # embed 768, depth 12, heads 12, global blocks [2, 5, 8, 11], drop path 0.1
        window_size=14,
        img_size=1024,
        out_indices=(-1,),
        with_cp=False,
        init_cfg=dict(type='Pretrained', checkpoint=_base_.mae_vit_b),
    ),
    neck=dict(
        _delete_=True,
        type='ViTSimpleFPN',
        in_channels=768,
        out_channels=256,
        scale_factors=(2.0, 1.0, 0.5),  # strides 8, 16, 32
        in_stride=16,
        num_outs=4),  # + stride 64 (max-pool)
    bbox_head=dict(
        in_channels=[256, 256, 256, 256],
        num_extra_levels=0,
        encoder_levels=(2, 3)))

optim_wrapper = dict(
    paramwise_cfg=dict(
        custom_keys={
            'backbone': dict(lr_mult=0.1),
            'pos_embed': dict(lr_mult=0.1, decay_mult=0.),
            'rel_pos': dict(lr_mult=0.1, decay_mult=0.),
            'level_embed': dict(decay_mult=0.),
        }))
