# The small stem Swin of the CPU demos on the shapes dataset (swin_retinanet_shapes.py,
# swin_mask_rcnn_shapes.py, swin_panoptic_fpn_shapes.py): embed 64, depths 2-2-2, 8 x 8 patches
# behind a 16-32 conv stem, window 6, strides 8/16/32, and the GN FPN on its three stages.
# Merged into a Swin model base:
#   model = dict(backbone=_base_.stem_swin, neck=dict(_base_.stem_fpn, num_outs=...), ...)
embed_dims = 64
fpn_channels = 64
norm_cfg = dict(type='GN', num_groups=16, requires_grad=True)
stem_swin = dict(
    patch_size=8,            # strides 8, 16, 32
    stem_channels=(16, 32),  # 3x3 stride-2 convs; the projection covers the last 2 x 2
    embed_dims=embed_dims,   # overrides the Swin-T preset
    depths=[2, 2, 2],
    num_heads=[2, 4, 8],
    window_size=6,           # 192 px input: 24/12/6 token maps, no window padding
    drop_path_rate=0.0,
    out_indices=(0, 1, 2))
stem_fpn = dict(
    in_channels=[embed_dims, embed_dims * 2, embed_dims * 4],
    out_channels=fpn_channels,
    norm_cfg=norm_cfg)
