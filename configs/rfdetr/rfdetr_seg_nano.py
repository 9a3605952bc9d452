# RF-DETR-Seg N (nano) on COCO instance segmentation: published mask AP 40.3 (AP50 63.0) on
# val2017, 3.4 ms on a T4 with TensorRT fp16 (rfdetr 1.11.2's RFDETRSegNano; no box AP is
# published for the seg sizes). 312 px, patch 12, one window (1 x 1), 4 decoder layers, 100 queries;
# everything else is _base_/rfdetr_seg_coco.py's (docs/rfdetr.md).
# Train: tools/train.py configs/rfdetr/rfdetr_seg_nano.py --cfg-options data_root=/path/to/coco/
# RF-DETR's weights: tools/convert_weights.py rf-detr-seg-nano.pt rfdetr_seg_nano.pth
#   --model rfdetr --num-classes 80, then add load_from=rfdetr_seg_nano.pth to the options.
_base_ = ['./_base_/rfdetr_seg_coco.py']
resolution = 312
num_windows = 1
#: the collate block and the step of the training scales: one window of patches
block = _base_.patch_size * num_windows

model = dict(data_preprocessor=dict(pad_size_divisor=block, batch_augments=[
                 dict(_base_.batch_scale, resolution=resolution, block=block)]),
             backbone=dict(pretrain_img_size=resolution, num_windows=num_windows))
train_dataloader = dict(dataset=dict(pipeline=[
    dict(t, resolution=resolution, block=block) if 'resolution' in t else t
    for t in _base_.train_pipeline]))
val_dataloader = dict(dataset=dict(pipeline=[
    dict(t, scale=(resolution, resolution)) if 'scale' in t else t for t in _base_.test_pipeline]))
test_dataloader = val_dataloader
