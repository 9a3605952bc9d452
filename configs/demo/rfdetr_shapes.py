# CPU demo: RF-DETR (windowed DINOv2 -> RFDETRProjector -> LWDETRHead in mmdet's
# SingleStageDetector, configs/rfdetr/) shrunk for the shapes set and trained from random init
# for the demos' 9.5-minute budget (TimeBudgetHook), evaluated with COCO bbox mAP: 0.377 at
# 1,607 iterations (seed 0; seeds 1-2: 0.353 / 0.321; docs/rfdetr.md). Run:
#   make demo-rfdetr
# (= DEMO_CONFIG=configs/demo/rfdetr_shapes.py DEMO_WORK_DIR=work_dirs/demo_rfdetr make demo)
# What is RF-DETR's and what is shrunk (4 DINOv2 blocks, patch 8, P4 + P5, 2 groups, dense
# one-to-many proposals, AdamW 6e-4 / 3e-4) and the runs behind each choice:
# tools/dev/experiments.md.
_base_ = [
    '../_base_/datasets/shapes_detection.py',
    '../_base_/schedules/cpu_time_budget_ema.py',
]
num_classes = 5
image_size = 192
embed_dims = 96
width = 128
patch_size = 8
num_windows = 2
#: side of the proposals' token anchors, normalised (the shapes are 15-75 px at 192 px)
anchor_size = 0.25
#: DINOv2 blocks
depth = 4
#: taps after blocks 2 and 4 (1-based); block 3 is global (RF-DETR's rule)
out_indices = (1, 3)
#: the projector's levels (P4 = the patch stride, P5 = twice it)
levels = ('P4', 'P5')

model = dict(
    type='SingleStageDetector',
    data_preprocessor=dict(
        type='DetDataPreprocessor',
        mean=[123.675, 116.28, 103.53],
        std=[58.395, 57.12, 57.375],
        bgr_to_rgb=True,
        pad_size_divisor=patch_size * num_windows),  # whole windows of whole patches
    backbone=dict(
        type='DINOv2Backbone',
        arch=dict(embed_dims=embed_dims, depth=depth, num_heads=3, num_reg_tokens=0,
                  layer_scale=None, drop_path_rate=0.0),
        patch_size=patch_size,
        stem_channels=(16, 32),  # 3x3 stride-2 convs; the projection covers the last 2 x 2
        num_windows=num_windows,
        pretrain_img_size=image_size,  # the position table at the 24 x 24 grid
        pretrain_patch_size=patch_size,
        out_indices=out_indices),
    neck=dict(
        type='RFDETRProjector',
        in_channels=(embed_dims,) * len(out_indices),
        out_channels=width,
        levels=levels,
        in_stride=patch_size,
        num_blocks=1),
    bbox_head=dict(
        type='LWDETRHead',
        num_classes=num_classes,
        embed_dims=width,
        num_levels=len(levels),
        num_queries=100,
        num_groups=2,
        num_decoder_layers=2,
        self_heads=4,
        cross_heads=8,
        num_points=2,
        ffn_dims=512,
        anchor_size=anchor_size,
        dense_one_to_many=2),
    test_cfg=dict(max_per_img=100))

# the dataset base's pipelines, resized to the demo's image size
train_pipeline = [dict(t, scale=(image_size, image_size)) if t['type'] == 'Resize' else t
                  for t in _base_.train_pipeline]
test_pipeline = [dict(t, scale=(image_size, image_size)) if t['type'] == 'Resize' else t
                 for t in _base_.test_pipeline]
train_dataloader = dict(batch_size=4, dataset=dict(pipeline=train_pipeline))
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader

base_lr = 6e-4
#: the backbone's learning rate as a fraction of base_lr (the projector's and head's): 3e-4
backbone_lr_mult = 0.5
optim_wrapper = dict(
    optimizer=dict(lr=base_lr, weight_decay=1e-4),
    constructor='NoDecayOptimWrapperConstructor',  # no decay on the ViT's tokens, norms, biases
    paramwise_cfg=dict(custom_keys=dict(backbone=dict(lr_mult=backbone_lr_mult))),
    clip_grad=dict(max_norm=0.1, norm_type=2))
