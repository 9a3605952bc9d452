# RF-DETR-Seg S (small) on COCO instance segmentation: published mask AP 43.1 (AP50 66.2) on
# val2017, 4.4 ms on a T4 with TensorRT fp16 (rfdetr 1.11.2's RFDETRSegSmall; no box AP is
# published for the seg sizes). 384 px, patch 12, 2 x 2 windows, 4 decoder layers, 100 queries;
# everything else is _base_/rfdetr_seg_coco.py's (docs/rfdetr.md).
# Train: tools/train.py configs/rfdetr/rfdetr_seg_small.py --cfg-options data_root=/path/to/coco/
# RF-DETR's weights: tools/convert_weights.py rf-detr-seg-small.pt rfdetr_seg_small.pth
#   --model rfdetr --num-classes 80, then add load_from=rfdetr_seg_small.pth to the options.
_base_ = ['./_base_/rfdetr_seg_coco.py']
resolution = 384

model = dict(data_preprocessor=dict(batch_augments=[
                  dict(_base_.batch_scale, resolution=resolution)]),
             backbone=dict(pretrain_img_size=resolution))
train_dataloader = dict(dataset=dict(pipeline=[
    dict(t, resolution=resolution) if 'resolution' in t else t for t in _base_.train_pipeline]))
val_dataloader = dict(dataset=dict(pipeline=[
    dict(t, scale=(resolution, resolution)) if 'scale' in t else t for t in _base_.test_pipeline]))
test_dataloader = val_dataloader
