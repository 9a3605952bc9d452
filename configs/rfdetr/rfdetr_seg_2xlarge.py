# RF-DETR-Seg 2XL (2xlarge) on COCO instance segmentation: published mask AP 49.9 (AP50 73.1) on
# val2017, 21.8 ms on a T4 with TensorRT fp16 (rfdetr 1.11.2's RFDETRSeg2XLarge; no box AP is
# published for the seg sizes). 768 px, patch 12, 2 x 2 windows, 6 decoder layers, 300 queries;
# everything else is _base_/rfdetr_seg_coco.py's (docs/rfdetr.md).
# Train: tools/train.py configs/rfdetr/rfdetr_seg_2xlarge.py --cfg-options data_root=/path/to/coco/
# RF-DETR's weights: tools/convert_weights.py rf-detr-seg-xxlarge.pt rfdetr_seg_2xlarge.pth
#   --model rfdetr --num-classes 80, then add load_from=rfdetr_seg_2xlarge.pth to the options.
_base_ = ['./_base_/rfdetr_seg_coco.py']
resolution = 768
num_decoder_layers = 6
#: num_queries = num_select
num_queries = 300

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
