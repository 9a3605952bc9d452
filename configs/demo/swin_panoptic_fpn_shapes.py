# CPU segmentation demo (`make demo-seg`): Panoptic FPN, i.e. the lean Mask R-CNN of
# swin_mask_rcnn_shapes.py (small stem Swin, strides 8/16/32, FPN + RPN + RoI box and mask
# heads) plus a semantic FPN head for the stuff classes, on the shapes dataset's COCO panoptic
# ground truth (things: the 5 shapes; stuff: distractor lines, background), trained from random
# init for a fixed wall-clock budget. One evaluation pass reports all three tasks
# (AllOutputsPanopticFPN): instance segm / bbox mAP (CocoMetric), PQ (CocoPanopticMetric) and
# mIoU over things + stuff (SemSegMetric).
#
# Why this detector (2 CPU cores, 9.5 minutes from scratch):
# * a Mask R-CNN learns masks from few updates: its RoI mask head only has to separate one
#   object from its box's background, and box and mask losses train the same RoI features.
#   The stem-Swin recipe of the detection demo (swin_retinanet_shapes.py: 192 px, 8 x 8 patches
#   behind a 16-32 conv stem, 3 stages, GN FPN, square anchors, EMA, AdamW 2e-3) made it cheap:
#   0.42-0.53 s per iteration, 1195 iterations, segm mAP 0.444 (bbox 0.457) for the instance-only
#   swin_mask_rcnn_shapes.py, against 4.4 s per iteration and segm mAP 0.001 for the earlier
#   4-stage, 256 px, 96-channel Mask R-CNN demo. Mask2Former / DETR-style set prediction
#   (Hungarian matching, 100 queries, point-sampled mask losses) needs far more updates from
#   scratch (the DETR demos learn boxes slowly on this data), so it is not the demo's model; its
#   configs are covered by tests (tests/models/heads/test_mask2former.py).
# * the stuff head (PanopticFPNHead on P3-P5, 64 channels, GN) adds ~15 % per iteration and the
#   panoptic output; box head with GIoU on decoded boxes (mmdet's faster-rcnn giou recipe) and
#   32 sampled RoIs per image: segm mAP 0.308 -> 0.358 (PQ 33.4 -> 41.0, mIoU 31.2 -> 38.0).
# Measured on 2 idle cores (2026-11-30, `make demo-seg`): 927 iterations, segm mAP 0.358 (bbox
# 0.356), PQ 41.0 (things 38.7, stuff 47.0), mIoU 38.0; 10.0 min of training + evaluation.
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
