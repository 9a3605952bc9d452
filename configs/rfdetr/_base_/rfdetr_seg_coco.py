# RF-DETR-Seg on COCO instance segmentation: _base_/rfdetr_coco.py (RF-DETR's detection model
# and recipe) with what the `rfdetr` package (1.11.2) changes for its seg sizes (config.py
# RFDETRSeg{Nano,Small}Config / SegmentationTrainConfig; docs/rfdetr.md):
# * model: patch 12 (the sizes set the windows and the resolution), 100 queries, 100
#   detections kept (`num_select`), 4 decoder layers, LWDETRSegHead: RF-DETR's mask branch on
#   the projector's P4 at a quarter of the padded batch (`mask_downsample_ratio` 4), point mask
#   losses (`mask_point_sample_ratio` 16) sigmoid BCE 5 (`mask_ce_loss_coef`) and Dice 5
#   (`mask_dice_loss_coef`) on every decoder layer and the proposals, the matcher with both mask
#   costs (the head's default assigner); classification weight 1 (`cls_loss_coef`, as detection);
# * data: masks loaded (`with_mask`), the same square multi-scale resizes and crop;
# * metrics: mmdet's CocoMetric on boxes and masks.
# The optimiser, EMA and schedule are the detection recipe's (SegmentationTrainConfig only adds
# the mask weights to TrainConfig).
# Weights: RF-DETR-Seg's .pth files convert with tools/convert_weights.py --model rfdetr
# --num-classes 80 (mask head included), then --cfg-options load_from=THAT_FILE.
_base_ = ['./rfdetr_coco.py']

patch_size = 12
num_decoder_layers = 4
#: RF-DETR-Seg N / S: num_queries = num_select = 100
num_queries = 100
#: RF-DETR's ModelConfig.mask_downsample_ratio; SegmentationTrainConfig's mask options
mask_downsample_ratio = 4
mask_point_sample_ratio = 16
mask_ce_loss_coef = 5.0
mask_dice_loss_coef = 5.0

model = dict(
    backbone=dict(patch_size=patch_size, pretrain_patch_size=patch_size),
    neck=dict(in_stride=patch_size),
    bbox_head=dict(
        type='LWDETRSegHead',
        num_queries=num_queries,
        num_decoder_layers=num_decoder_layers,
        mask_downsample_ratio=mask_downsample_ratio,
        mask_point_sample_ratio=mask_point_sample_ratio,
        loss_mask=dict(type='CrossEntropyLoss', use_sigmoid=True, loss_weight=mask_ce_loss_coef),
        loss_dice=dict(type='DiceLoss', use_sigmoid=True, activate=True, naive_dice=True,
                       eps=1.0, loss_weight=mask_dice_loss_coef)),
    test_cfg=dict(max_per_img=num_queries))

load = [dict(type='LoadImageFromFile', backend_args=_base_.backend_args),
        dict(type='LoadAnnotations', with_bbox=True, with_mask=True)]
test_pipeline = [dict(t, with_mask=True) if t['type'] == 'LoadAnnotations' else t
                 for t in _base_.test_pipeline]
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(metric=['bbox', 'segm'])
test_evaluator = val_evaluator
