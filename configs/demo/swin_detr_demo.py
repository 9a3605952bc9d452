# CPU demo: SdpaDETR (our DETR-style head, SDPA attention only) on a small Swin (embed 48,
# depths 2-2-2-2, window 8) on the embedded shapes dataset (256 px, 5 classes, <= 5 objects),
# trained from random init for a fixed wall-clock budget (TimeBudgetHook), evaluated with COCO
# bbox mAP. Run: DEMO_CONFIG=configs/demo/swin_detr_demo.py \
#   DEMO_WORK_DIR=work_dirs/demo_swin_detr bash tools/demo.sh
#
# Fast-convergence recipe: encoder-proposal query selection (two-stage), Gaussian box prior in
# cross-attention, iterative box refinement with auxiliary losses, contrastive denoising
# queries; 3 decoder layers and 50 queries (images hold at most 5 objects); AdamW 4e-4,
# batch 4.
_base_ = [
    '../_base_/models/sdpa_detr_head_shapes.py',  # the demos' DETR head
    '../_base_/datasets/shapes_detection.py',
    '../_base_/schedules/cpu_time_budget.py',
]
num_classes = 5

model = dict(
    type='SdpaDETR',
    data_preprocessor=dict(
        type='DetDataPreprocessor',
        mean=[123.675, 116.28, 103.53],
        std=[58.395, 57.12, 57.375],
        bgr_to_rgb=True,
        pad_size_divisor=32),
    backbone=dict(
        type='SwinBackbone',
        arch=dict(embed_dims=48, depths=[2, 2, 2, 2], num_heads=[3, 6, 12, 24]),
        window_size=8,  # 256 px input: 64/32/16/8 token maps, no window padding
        out_indices=(1, 2, 3)),  # strides 8/16/32, channels 96/192/384
    neck=None,
    bbox_head=dict(
        _base_.shapes_detr_head,
        in_channels=[96, 192, 384],),
    test_cfg=dict(max_per_img=50))

# batch 4: twice the updates of batch 8 in the same CPU time (from-scratch training on small
# data profits more from steps than from batch size)
train_dataloader = dict(batch_size=4)

base_lr = 4e-4
optim_wrapper = dict(
    optimizer=dict(lr=base_lr, weight_decay=1e-4, fused=True),
    paramwise_cfg=dict(custom_keys={'level_embed': dict(decay_mult=0.)}),
    clip_grad=dict(max_norm=1.0, norm_type=2))
