# The Swin-T backbone of every Swin config (vitdet_plugin's SwinBackbone; mmdet's swin-t-p4-w7):
# embed 96, depths [2, 2, 6, 2], heads [3, 6, 12, 24], patch 4, window 7. Only what differs
# from SwinBackbone's defaults is written (mlp_ratio 4, qkv_bias, no dropout, patch_norm, no
# checkpointing and all four stages (strides 4 / 8 / 16 / 32) are its defaults), plus the preset
# and the window this fragment is named for. Used as a variable, so a config whose model comes
# from another base (mmdet::...) can take it too:
#   _base_ = [..., './_base_/models/swin-t.py']
#   model = dict(backbone=dict(_base_.swin_t, out_indices=(1, 2, 3)), ...)
# init_cfg is left out so a child config or --cfg-options can add init_cfg=dict(type=
# 'Pretrained', checkpoint=...) (official, timm, mmdet/mmpretrain and Swin-OD layouts load).
swin_t = dict(
    type='SwinBackbone',
    arch='tiny',
    window_size=7,
    drop_path_rate=0.2)
