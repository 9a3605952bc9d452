# Mask2Former with a plain ViT-B (vitdet_plugin ViTBackbone), COCO 2017 panoptic segmentation with
# instance and semantic outputs: configs/swin_mask2former_panoptic.py (mmdet 3.3's
# mask2former_swin-t-p4-w7-224_8xb2-lsj-50e_coco-panoptic.py with SemanticMaskFormerFusionHead,
# semantic_on and SemSegMetric; see its notes) with ViTDet's backbone instead of Swin-T: ViT-B
# with 14x14 windows and global blocks 2, 5, 8, 11, ViTSimpleFPN as the neck, layer-wise lr
# decay 0.7 (the notes below the _base_ line give the details).
# Starts from the MAE ViT-B, as ViTDet (configs/_base_/pretrained.py; ViTDet / SAM files load too).
# (a detectron2 ViTDet checkpoint also holds the pyramid: give the neck the same init_cfg)
_base_ = './swin_mask2former_panoptic.py'
# Changed vs configs/swin_mask2former_panoptic.py:
#   - ViT-B as in ViTDet: 14x14 window attention, global attention in blocks 2, 5, 8, 11,
#     decomposed relative positions sized for 1024 inputs (the LSJ crop), drop path 0.1;
#   - ViTDet's simple feature pyramid as the neck (ViTSimpleFPN) turns the stride-16 map into
#     strides 4 / 8 / 16 / 32 with 256 channels each, the four levels the pixel decoder takes
#     (deformable attention on 8 / 16 / 32, the stride-4 lateral);
#   - layer-wise lr decay 0.7 (ViTDet-B) with LayerDecayOptimWrapperConstructor in place of
#     the stock backbone lr_mult 0.1; same AdamW lr 1e-4, wd 0.05, grad clip 0.01. No weight
#     decay on the backbone's norms, biases, position embedding and rel-pos tables, nor on
#     norms and biases outside it, nor (extra_no_decay_names, in place of the stock
#     custom_keys) on the query_embed / query_feat / level_embed embeddings.
# The pixel decoder runs mmcv's MultiScaleDeformableAttention: the CUDA kernel on a GPU, mmcv's
# pure-PyTorch (grid_sample) version on the CPU; no bf16 kernel and unreliable in fp16 (mmcv).

pyramid_channels = 256
model = dict(
    backbone=dict(
        _delete_=True,
        type='ViTBackbone',
        arch='base',  # embed 768, depth 12, heads 12, global blocks [2, 5, 8, 11]
        drop_path_rate=0.1,
        window_size=14,
        img_size=1024,
        use_rel_pos=True,
        out_indices=(-1,),
        with_cp=False,
        init_cfg=dict(type='Pretrained', checkpoint=_base_.mae_vit_b),
    ),
    neck=dict(
        type='ViTSimpleFPN',
        in_channels=768,
        out_channels=pyramid_channels,
        scale_factors=(4.0, 2.0, 1.0, 0.5),  # strides 4, 8, 16, 32
        in_stride=16,
        num_outs=4),
    panoptic_head=dict(in_channels=[pyramid_channels] * 4))

optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    constructor='LayerDecayOptimWrapperConstructor',
    paramwise_cfg=dict(
        layer_decay_rate=0.7,
        # the stock config's decay_mult=0 custom_keys of the head's embeddings
        extra_no_decay_names=('query_embed', 'query_feat', 'level_embed')),
    optimizer=dict(type='AdamW', lr=0.0001, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05),
    clip_grad=dict(max_norm=0.01, norm_type=2))
