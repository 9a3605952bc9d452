# RF-DETR-Seg L (large) on COCO instance segmentation: published mask AP 47.1 (AP50 70.5) on
# val2017, 8.8 ms on a T4 with TensorRT fp16 (rfdetr 1.11.2's RFDETRSegLarge; no box AP is
# published for the seg sizes). 504 px, patch 12, 2 x 2 windows, 5 decoder layers, 200 queries;
# everything else is _base_/rfdetr_seg_coco.py's (docs/rfdetr.md).
# Train: tools/train.py configs/rfdetr/rfdetr_seg_large.py --cfg-options data_root=/path/to/coco/
# RF-DETR's weights: tools/convert_weights.py rf-detr-seg-large.pt rfdetr_seg_large.pth
#   --model rfdetr --num-classes 80, then add load_from=rfdetr_seg_large.pth to the options.
_base_ = ['./_base_/rfdetr_seg_coco.py']
resolution = 504
num_decoder_layers = 5
#: num_queries = num_select
num_queries = 200

model = dict(data_preprocessor=dict(batch_augments=[
                  dict(_base_.batch_scale, resolution=resolution)]),
             backbone=dict(pretrain_img_size=resolution),
             bbox_head=dict(num_decoder_layers=num_decoder_layers, num_queries=num_queries),
             test_cfg=dict(max_per_img=num_queries))
train_dataloader = dict(dataset=dict(pipeline=[
    dict(t, resolution=resolution) if 'resolution' in t else t for t in _base_.train_pipeline]))
val_dataloader = dict(dataset=dict(pipeline=[
    dict(t, scale=(resolution, resolution)) if 'scale' in t else t for t in _base_.test_pipeline]))
test_dataloader = val_dataloader
