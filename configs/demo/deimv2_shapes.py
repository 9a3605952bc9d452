# CPU demo: DEIMv2 (DINOv3 + Spatial Tuning Adapter -> HybridEncoder -> DFineHead, the modules
# of DEIMv2's DINOv3 sizes, docs/deimv2.md) shrunk for the shapes set and trained from random
# init (D-FINE's VFL class loss, DEIMv2's dense one-to-one matching, denoising, the demos' EMA)
# for the 9.5-minute budget (TimeBudgetHook), evaluated with COCO bbox mAP: 0.318 at 2,178
# iterations (the budget on a 2-core VM; DEMO_ITERS=2178, seed 0; docs/deimv2.md). Run:
#   make demo-deimv2
# (= DEMO_CONFIG=configs/demo/deimv2_shapes.py DEMO_WORK_DIR=work_dirs/demo_deimv2 make demo)
# What is DEIMv2's and what is shrunk, and the runs behind it: tools/dev/experiments.md.
_base_ = [
    '../_base_/datasets/shapes_detection.py',
    '../_base_/schedules/cpu_time_budget_ema.py',
]
num_classes = 5
image_size = 192
#: the ViT's width and blocks (DEIMv2 S: 192 wide, 12 blocks)
embed_dims = 96
depth = 4
#: the three ViT blocks tapped for strides 8 / 16 / 32 (0-based)
taps = (1, 2, 3)
#: encoder and decoder width (every backbone output has it)
width = 96
#: the adapter's base width c (detail maps 2c / 4c / 4c): DEIMv2 L's, the shapes' detail
sta_channels = 32

model = dict(
    type='SingleStageDetector',
    data_preprocessor=dict(
        type='DetDataPreprocessor',
        mean=[123.675, 116.28, 103.53],
        std=[58.395, 57.12, 57.375],
        bgr_to_rgb=True,
        pad_size_divisor=32),  # the backbone's coarsest stride
    backbone=dict(
        type='DINOv3STABackbone',
        arch='S',
        vit=dict(embed_dims=embed_dims, depth=depth, num_heads=3, qkv_bias='qkv',
                 layer_scale=None, num_reg_tokens=0, norm_eps=1e-6),
        taps=taps,
        final_norm=False,
        sta_channels=sta_channels,
        hidden_dim=width),
    neck=dict(
        type='HybridEncoder',
        in_channels=(width,) * 3,
        in_strides=(8, 16, 32),
        hidden_dim=width,
        num_heads=4,
        ffn_dim=2 * width,
        expansion=0.34,
        depth_mult=0.34,
        fuse_op='sum',
        version='deim',
        csp_type='csp2',
        input_proj=False),
    bbox_head=dict(
        type='DFineHead',
        num_classes=num_classes,
        in_channels=(width,) * 3,
        embed_dims=width,
        num_queries=100,
        num_heads=4,
        ffn_dims=2 * width,
        num_layers=3,
        num_points=(3, 6, 3),
        style='deimv2',
        enc_output=False,
        decoder=dict(query_pos_act='silu', mlp_act='silu', query_pos_per_layer=False),
        num_denoising=50,
        class_loss='vfl',  # DEIMv2's MAL learns slower from random init
        dense_one_to_one=True),
    test_cfg=dict(max_per_img=100))

# the dataset base's pipelines, resized to the demo's image size
train_pipeline = [dict(t, scale=(image_size, image_size)) if t['type'] == 'Resize' else t
                  for t in _base_.train_pipeline]
test_pipeline = [dict(t, scale=(image_size, image_size)) if t['type'] == 'Resize' else t
                 for t in _base_.test_pipeline]
train_dataloader = dict(batch_size=4, dataset=dict(pipeline=train_pipeline))
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader

base_lr = 8e-4
#: the backbone's learning rate as a fraction of base_lr
backbone_lr_mult = 1.0
optim_wrapper = dict(
    optimizer=dict(lr=base_lr, weight_decay=1e-4),
    constructor='NoDecayOptimWrapperConstructor',  # no decay on the ViT's tokens, norms, biases
    paramwise_cfg=dict(custom_keys=dict(backbone=dict(lr_mult=backbone_lr_mult))),
    clip_grad=dict(max_norm=0.1, norm_type=2))
