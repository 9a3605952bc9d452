# CPU demo: RetinaNet on a small plain ViT (ViTDet-style: window attention with global blocks,
# decomposed relative positions, a simple feature pyramid from the single stride-16 map) on the
# embedded shapes dataset, trained from random init for a fixed wall-clock budget.
#   DEMO_CONFIG=configs/demo/vit_retinanet_shapes.py make demo
# Data, head, schedule and time budget are those of swin_retinanet_shapes.py (see its header).
_base_ = ['./swin_retinanet_shapes.py']
image_size = 192
embed_dims = 192
fpn_channels = 64
norm_cfg = dict(type='GN', num_groups=16, requires_grad=True)

model = dict(
    backbone=dict(
        _delete_=True,
        type='ViTBackbone',
        arch=dict(embed_dims=embed_dims, depth=6, num_heads=6),
        patch_size=16,             # one stride-16 map: 12 x 12 tokens at 192 px
        stem_channels=(16, 32),    # 3x3 stride-2 convs; the projection covers the last 4 x 4
        window_size=6,             # 12 x 12 tokens: 2 x 2 windows, no padding
        global_attn_indexes=(2, 5),
        img_size=image_size,       # global blocks' rel-pos tables sized for the 12 x 12 grid
        pretrain_img_size=image_size,
        pretrain_use_cls_token=False,
        drop_path_rate=0.0,
        out_indices=(-1, )),
    neck=dict(
        _delete_=True,
        type='ViTSimpleFPN',
        in_channels=embed_dims,
        in_stride=16,
        out_channels=fpn_channels,
        scale_factors=(2.0, 1.0, 0.5),  # strides 8, 16, 32 (RetinaNet's P3-P5)
        num_outs=3,
        norm_cfg=norm_cfg))

# no weight decay on the backbone's no_weight_decay() parameters (position embedding, rel-pos
# tables, norms, biases)
optim_wrapper = dict(constructor='NoDecayOptimWrapperConstructor')
