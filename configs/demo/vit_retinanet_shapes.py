# CPU demo: RetinaNet on a small plain ViT (ViTDet-style: window attention with global blocks,
# decomposed relative positions, a simple feature pyramid from the single map) on the embedded
# shapes dataset, trained from random init for a fixed wall-clock budget: 1051 iterations,
# bbox mAP 0.328 (2 idle cores, 2026-11-30). Run:
#   DEMO_CONFIG=configs/demo/vit_retinanet_shapes.py make demo
# Data (192 px), head, schedule (AdamW 2e-3, cosine, EMA) and the 9.5-minute budget are
# swin_retinanet_shapes.py's; the ViT: two-conv stem, 8 x 8 patches, embed 96, depth 6, 6 x 6
# windows with global blocks 2 and 5, ViTSimpleFPN (GN, 64 channels). The runs behind each
# choice: tools/dev/experiments.md.
_base_ = ['./swin_retinanet_shapes.py']
image_size = 192
embed_dims = 96
fpn_channels = 64
norm_cfg = dict(type='GN', num_groups=16, requires_grad=True)

model = dict(
    backbone=dict(
        _delete_=True,
        type='ViTBackbone',
        arch=dict(embed_dims=embed_dims, depth=6, num_heads=3),
        patch_size=8,              # one stride-8 map: 24 x 24 tokens at 192 px
        stem_channels=(16, 32),    # 3x3 stride-2 convs; the projection covers the last 2 x 2
        window_size=6,             # 24 x 24 tokens: 4 x 4 windows, no padding
        global_attn_indexes=(2, 5),
        img_size=image_size,       # global blocks' rel-pos tables sized for the 24 x 24 grid
        pretrain_img_size=image_size,
        pretrain_use_cls_token=False,
        drop_path_rate=0.0,
        out_indices=(-1, )),
    neck=dict(
        _delete_=True,
        type='ViTSimpleFPN',
        in_channels=embed_dims,
        in_stride=8,
        out_channels=fpn_channels,
        scale_factors=(1.0, 0.5),  # strides 8, 16 ...
        num_outs=3,                # ... and 32 (max-pooled): RetinaNet's P3-P5
        norm_cfg=norm_cfg))

# no weight decay on the backbone's no_weight_decay() parameters (position embedding, rel-pos
# tables, norms, biases)
optim_wrapper = dict(constructor='NoDecayOptimWrapperConstructor')
