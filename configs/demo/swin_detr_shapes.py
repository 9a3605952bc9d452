# CPU demo: SdpaDETR (our DETR-style head) on the stem Swin + GN FPN of `make demo`
# (swin_retinanet_shapes.py: same backbone, neck, data at 192 px), trained from random init for
# the 9.5-minute budget: 1083 iterations, bbox mAP 0.127 (encoder tokens matched one-to-many,
# enc_one_to_many=4). swin_detr_pretrained_shapes.py (`make demo-detr`) is this detector with
# the backbone and neck of `make demo`'s checkpoint (0.381). Run:
#   DEMO_CONFIG=configs/demo/swin_detr_shapes.py DEMO_WORK_DIR=work_dirs/demo_swin_detr make demo
# What holds the head back from scratch (the runs): tools/dev/experiments.md.
_base_ = [
    '../_base_/models/sdpa_detr_head_shapes.py',  # the demos' DETR head
    '../_base_/models/swin-stem_shapes.py',  # the backbone and FPN of make demo
    '../_base_/datasets/shapes_detection.py',
    '../_base_/schedules/cpu_time_budget_ema.py',
]
num_classes = 5
image_size = 192
fpn_channels = _base_.fpn_channels

model = dict(
    type='SdpaDETR',
    data_preprocessor=dict(
        type='DetDataPreprocessor',
        mean=[123.675, 116.28, 103.53],
        std=[58.395, 57.12, 57.375],
        bgr_to_rgb=True,
        pad_size_divisor=32),
    backbone=dict(_base_.stem_swin, type='SwinBackbone', arch='tiny'),
    neck=dict(_base_.stem_fpn, type='FPN', num_outs=3),
    bbox_head=dict(
        _base_.shapes_detr_head,
        in_channels=[fpn_channels] * 3,
        enc_one_to_many=4,),
    test_cfg=dict(max_per_img=50))

# the dataset base's pipelines, resized to the demo's image size
train_pipeline = [dict(t, scale=(image_size, image_size)) if t['type'] == 'Resize' else t
                  for t in _base_.train_pipeline]
test_pipeline = [dict(t, scale=(image_size, image_size)) if t['type'] == 'Resize' else t
                 for t in _base_.test_pipeline]
train_dataloader = dict(batch_size=4, dataset=dict(pipeline=train_pipeline))
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader

base_lr = 1e-3
optim_wrapper = dict(
    optimizer=dict(lr=base_lr, weight_decay=1e-4),
    paramwise_cfg=dict(custom_keys={'level_embed': dict(decay_mult=0.)}),
    clip_grad=dict(max_norm=1.0, norm_type=2))
