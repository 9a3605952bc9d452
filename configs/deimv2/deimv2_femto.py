# DEIMv2 Femto on COCO: published box AP 31.0 on val2017 (Intellindust-AI-Lab/DEIMv2, 1.0M
# parameters). HGNetV2 Femto, LiteEncoder 96 wide, 3 decoder layers of 150 queries, FFN 256; 416 px
# (mosaic 208, boxes from 10 px), 500 epochs, lr 1.6e-3, backbone 8e-4
# (configs/deimv2/deimv2_hgnetv2_femto_coco.yml); the rest as Pico (_base_/deimv2_hgnetv2_lite.py).
# Train: tools/train.py configs/deimv2/deimv2_femto.py --cfg-options data_root=/path/to/coco/
_base_ = ['./_base_/deimv2_hgnetv2_lite.py']
input_size = 416
mosaic_size = 208
min_box_size = 10
mosaic_prob = 0.5
base_lr = 1.6e-3
backbone_lr = 8e-4
width = 96
model = dict(
    backbone=dict(arch='Femto'),
    neck=dict(in_channels=(512,), hidden_dim=width),
    bbox_head=dict(in_channels=(width, width), embed_dims=width, num_queries=150, ffn_dims=256))
_load = _base_.plain_pipeline[:3]
_resize = [dict(_base_.plain_pipeline[3], min_size=min_box_size), _base_.plain_pipeline[4],
           dict(_base_.plain_pipeline[5], scale=(input_size, input_size)),
           dict(_base_.plain_pipeline[6], min_size=min_box_size), _base_.plain_pipeline[7]]
_choice = _base_.mosaic_pipeline[3]
plain_pipeline = _load + _resize
mosaic_pipeline = _load + [dict(_choice, prob=[mosaic_prob, 1 - mosaic_prob], transforms=[
    [dict(_choice.transforms[0][0], output_size=mosaic_size), _choice.transforms[0][1]],
    _choice.transforms[1]])] + _resize
strong_pipeline = _load + _choice.transforms[1] + _resize
test_pipeline = [_base_.test_pipeline[0],
                 dict(_base_.test_pipeline[1], scale=(input_size, input_size)),
                 *_base_.test_pipeline[2:]]
train_dataloader = dict(dataset=dict(pipeline=plain_pipeline))
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader
optim_wrapper = dict(optimizer=dict(lr=base_lr), paramwise_cfg=dict(
    custom_keys=dict(backbone=dict(lr_mult=backbone_lr / base_lr))))
custom_hooks = [_base_.custom_hooks[0],
                dict(_base_.custom_hooks[1], switch_pipeline=mosaic_pipeline),
                dict(_base_.custom_hooks[2], switch_pipeline=strong_pipeline),
                dict(_base_.custom_hooks[3], switch_pipeline=plain_pipeline),
                _base_.custom_hooks[4]]
