# RF-DETR L (large) on COCO: published box AP 56.5 on val2017 (rfdetr's RFDETRLarge,
# 6.8 ms on a T4 with TensorRT fp16). 704 px, patch 16, 2 x 2 windows, 4 decoder layers; the
# recipe is _base_/rfdetr_coco.py's (RF-DETR's, docs/rfdetr.md "Configs and training").
# Train:   tools/train.py configs/rfdetr/rfdetr_large.py --cfg-options data_root=/path/to/coco/
# From RF-DETR's weights: tools/convert_weights.py rf-detr-large.pth rfdetr_large.pth --model rfdetr
#   --num-classes 80, then add load_from=rfdetr_large.pth to the options (docs/rfdetr.md).
_base_ = ['./_base_/rfdetr_coco.py']
resolution = 704
num_decoder_layers = 4
#: RF-DETR's training sizes (compute_multi_scale_scales, expanded_scales): resolution //
#: (patch x windows) plus -5 ... 5, times 32 px
scales = [544, 576, 608, 640, 672, 704, 736, 768, 800, 832, 864]

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
