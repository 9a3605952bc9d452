# RF-DETR N (nano) on COCO: published box AP 48.4 on val2017 (rfdetr's RFDETRNano,
# 2.3 ms on a T4 with TensorRT fp16). 384 px, patch 16, 2 x 2 windows, 2 decoder layers; the
# recipe is _base_/rfdetr_coco.py's (RF-DETR's, docs/rfdetr.md "Configs and training").
# Train:   tools/train.py configs/rfdetr/rfdetr_nano.py --cfg-options data_root=/path/to/coco/
# From RF-DETR's weights: tools/convert_weights.py rf-detr-nano.pth rfdetr_nano.pth --model rfdetr
#   --num-classes 80, then add load_from=rfdetr_nano.pth to the options (docs/rfdetr.md).
_base_ = ['./_base_/rfdetr_coco.py']
resolution = 384
num_decoder_layers = 2
#: RF-DETR's training sizes (compute_multi_scale_scales, expanded_scales): resolution //
#: (patch x windows) plus -5 ... 5, times 32 px
scales = [224, 256, 288, 320, 352, 384, 416, 448, 480, 512, 544]

model = dict(backbone=dict(pretrain_img_size=resolution),
             bbox_head=dict(num_decoder_layers=num_decoder_layers))
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
