# CPU segmentation demo (`make demo-seg`): Panoptic FPN, i.e. the lean Mask R-CNN of
# swin_mask_rcnn_shapes.py (small stem Swin, strides 8/16/32, FPN + RPN + RoI box and mask
# heads) plus a semantic FPN head for the stuff classes, on the shapes dataset's COCO panoptic
# ground truth (things: the 5 shapes; stuff: distractor lines, background), trained from random
# init for a fixed wall-clock budget. One evaluation pass reports all three tasks
# (AllOutputsPanopticFPN): instance segm / bbox mAP (CocoMetric), PQ (CocoPanopticMetric) and
# mIoU over things + stuff (SemSegMetric). Measured on 2 idle cores (2026-11-30): 927
# iterations, segm mAP 0.358 (bbox 0.356), PQ 41.0 (things 38.7, stuff 47.0), mIoU 38.0.
# Why this detector: tools/dev/experiments.md.
_base_ = [
    '../_base_/models/mask-rcnn_swin-stem_fpn_shapes.py',
    '../_base_/datasets/shapes_panoptic.py',  # COCO panoptic GT, PQ + bbox/segm mAP + mIoU
    '../_base_/schedules/cpu_time_budget_ema.py',  # AdamW 2e-3, 9.5-minute budget, EMA
]
thing_classes = _base_.thing_classes
stuff_classes = _base_.stuff_classes
norm_cfg = _base_.norm_cfg
fpn_channels = _base_.fpn_channels
ignore_index = 255  # void in gt_sem_seg (and the padding of the batch's semantic maps)

model = dict(
    type='AllOutputsPanopticFPN',
    data_preprocessor=dict(pad_seg=True, seg_pad_value=ignore_index, mask_pad_value=0),
    semantic_head=dict(
        type='PanopticFPNHead',
        num_things_classes=len(thing_classes),
        num_stuff_classes=len(stuff_classes),
        in_channels=fpn_channels,
        inner_channels=fpn_channels,
        start_level=0,           # P3 (stride 8): the map the head predicts at
        end_level=3,             # P3-P5
        norm_cfg=norm_cfg,
        loss_seg=dict(type='CrossEntropyLoss', ignore_index=ignore_index, loss_weight=0.5)),
    panoptic_fusion_head=dict(
        type='HeuristicFusionHead',
        num_things_classes=len(thing_classes),
        num_stuff_classes=len(stuff_classes)),
    test_cfg=dict(
        # instances of score >= instance_score_thr enter the fusion; stuff segments smaller
        # than stuff_area_limit px become void (mmdet's 4096 is for COCO-sized images)
        panoptic=dict(mask_overlap=0.5, stuff_area_limit=64, instance_score_thr=0.5)))

image_size = 192
# the dataset base's pipelines, resized to the demo's image size
train_pipeline = [dict(t, scale=(image_size, image_size)) if t['type'] == 'Resize' else t
                  for t in _base_.train_pipeline]
test_pipeline = [dict(t, scale=(image_size, image_size)) if t['type'] == 'Resize' else t
                 for t in _base_.test_pipeline]
train_dataloader = dict(dataset=dict(pipeline=train_pipeline))
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader
