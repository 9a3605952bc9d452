# RF-DETR-Seg N (nano) on COCO instance segmentation: published mask AP 40.3 (AP50 63.0) on
# val2017, 3.4 ms on a T4 with TensorRT fp16 (the rfdetr 1.11.2 package's README, its PyPI
# description; no box AP is published for the seg sizes). 312 px, patch 12, one window (1 x 1),
# 4 decoder layers, 100 queries; the recipe is _base_/rfdetr_seg_coco.py's (docs/rfdetr.md).
# Train:   tools/train.py configs/rfdetr/rfdetr_seg_nano.py --cfg-options data_root=/path/to/coco/
# From RF-DETR's weights: tools/convert_weights.py rf-detr-seg-nano.pt rfdetr_seg_nano.pth
#   --model rfdetr --num-classes 80, then add load_from=rfdetr_seg_nano.pth to the options.
_base_ = ['./_base_/rfdetr_seg_coco.py']
resolution = 312
num_windows = 1
#: RF-DETR's training sizes (compute_multi_scale_scales, expanded_scales): resolution //
#: (patch x windows) plus -5 ... 5, times 12 px
scales = [252, 264, 276, 288, 300, 312, 324, 336, 348, 360, 372]

model = dict(data_preprocessor=dict(pad_size_divisor=_base_.patch_size * num_windows),
             backbone=dict(pretrain_img_size=resolution, num_windows=num_windows))
square = dict(_base_.square_resize, scales=[(s, s) for s in scales])
train_pipeline = _base_.load + [
    dict(type='RandomFlip', prob=0.5),
    dict(type='RandomChoice', transforms=[[square], _base_.crop_branch + [square]]),
    dict(type='PackDetInputs')]
test_pipeline = [dict(t, scale=(resolution, resolution)) if t['type'] == 'Resize' else t
                 for t in _base_.test_pipeline]
train_dataloader = dict(dataset=dict(pipeline=train_pipeline))
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader
