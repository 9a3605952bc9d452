# RF-DETR-Seg on COCO instance segmentation: _base_/rfdetr_coco.py (RF-DETR's detector and
# recipe) with what rfdetr 1.11.2 changes for its seg sizes (config.py RFDETRSeg*Config,
# SegmentationTrainConfig; docs/rfdetr.md): patch 12 (2 x 2 windows unless a size says), 4
# decoder layers and 100 queries (N, S; the larger sizes set theirs), LWDETRSegHead (RF-DETR's
# mask branch at a quarter of the padded batch, point-sampled BCE 5 + Dice 5 on every layer),
# masks loaded and scored (bbox + segm). A size config states its resolution (and what differs).
# RF-DETR-Seg's .pt files convert with tools/convert_weights.py --model rfdetr --num-classes 80
# (mask head included), then --cfg-options load_from=THAT_FILE.
_base_ = ['./rfdetr_coco.py']

patch_size = 12
num_windows = 2
#: RF-DETR's collate block and the step of its training scales
size_divisor = patch_size * num_windows
resolution = 384
num_decoder_layers = 4
#: RF-DETR-Seg N / S: num_queries = num_select = 100
num_queries = 100
#: RF-DETR's ModelConfig.mask_downsample_ratio; SegmentationTrainConfig's mask options
mask_downsample_ratio = 4
mask_point_sample_ratio = 16
mask_ce_loss_coef = 5.0
mask_dice_loss_coef = 5.0

batch_scale = dict(_base_.batch_scale, resolution=resolution, block=size_divisor)
model = dict(
    data_preprocessor=dict(pad_size_divisor=size_divisor, batch_augments=[batch_scale]),
    backbone=dict(patch_size=patch_size, pretrain_patch_size=patch_size,
                  num_windows=num_windows, pretrain_img_size=resolution),
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

#: the detection pipelines with the instance masks loaded, at this patch's block and size
train_pipeline = [dict(t, with_mask=True) if t['type'] == 'LoadAnnotations' else
                  dict(t, resolution=resolution, block=size_divisor) if 'resolution' in t else t
                  for t in _base_.train_pipeline]
test_pipeline = [dict(t, with_mask=True) if t['type'] == 'LoadAnnotations' else
                 dict(t, scale=(resolution, resolution)) if 'scale' in t else t
                 for t in _base_.test_pipeline]
train_dataloader = dict(dataset=dict(pipeline=train_pipeline))
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(metric=['bbox', 'segm'])
test_evaluator = val_evaluator
