# RF-DETR N (nano) on COCO: published box AP 48.4 (AP50 67.6) on val2017, 2.3 ms on a T4
# with TensorRT fp16 (rfdetr 1.11.2's RFDETRNano). 384 px, patch 16, 2 x 2 windows, 2 decoder
# layers; everything else is _base_/rfdetr_coco.py's (RF-DETR's recipe, docs/rfdetr.md).
# Train: tools/train.py configs/rfdetr/rfdetr_nano.py --cfg-options data_root=/path/to/coco/
# RF-DETR's weights: tools/convert_weights.py rf-detr-nano.pth rfdetr_nano.pth --model rfdetr
#   --num-classes 80, then add load_from=rfdetr_nano.pth to the options (docs/rfdetr.md).
_base_ = ['./_base_/rfdetr_coco.py']
resolution = 384
num_decoder_layers = 2

model = dict(data_preprocessor=dict(batch_augments=[
                  dict(_base_.batch_scale, resolution=resolution)]),
             backbone=dict(pretrain_img_size=resolution),
             bbox_head=dict(num_decoder_layers=num_decoder_layers))
train_dataloader = dict(dataset=dict(pipeline=[
    dict(t, resolution=resolution) if 'resolution' in t else t for t in _base_.train_pipeline]))
val_dataloader = dict(dataset=dict(pipeline=[
    dict(t, scale=(resolution, resolution)) if 'scale' in t else t for t in _base_.test_pipeline]))
test_dataloader = val_dataloader
