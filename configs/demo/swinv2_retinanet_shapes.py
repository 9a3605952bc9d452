# CPU demo with Swin V2: the shapes RetinaNet of swin_retinanet_shapes.py (same data, neck, head,
# schedule and time budget; see its header for the recipe) with a SwinV2Backbone of the same
# size (embed 64, depths 2-2-2, 8 x 8 patches, window 6) trained from random init.
#   DEMO_CONFIG=configs/demo/swinv2_retinanet_shapes.py make demo
# SwinV2Backbone has no convolutional stem (the V1 demo's largest recipe gain), so this demo
# measures the plain V2 design against the stem-less V1 number in that header (0.206).
# Measured (2 idle cores, 2026-12-01): 2449 iterations in the 9.5-minute budget, COCO bbox mAP
# 0.307 (mAP_50 0.465, mAP_75 0.349); 10.4 min for the whole `make demo`. (2026-11-30, before the
# backbone's no_weight_decay() names left weight decay: 1810 iterations, 0.226; single runs, and
# unseeded runs of one config differ by up to 0.09.)
_base_ = ['./swin_retinanet_shapes.py']
embed_dims = 64

model = dict(
    backbone=dict(
        _delete_=True,
        type='SwinV2Backbone',
        embed_dims=embed_dims,
        depths=[2, 2, 2],
        num_heads=[2, 4, 8],
        patch_size=8,           # strides 8, 16, 32
        window_size=6,          # 192 px input: 24/12/6 token maps, no window padding
        drop_path_rate=0.0,
        out_indices=(0, 1, 2)))
# no weight decay on the backbone's no_weight_decay() parameters, as the official Swin V2 recipe
# (the schedule's norm / bias multipliers miss cpb_mlp and logit_scale); added after the
# measurement above, which decayed those
optim_wrapper = dict(constructor='NoDecayOptimWrapperConstructor')
