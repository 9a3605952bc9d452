# DEIMv2 Atto on COCO: published box AP 23.8 on val2017 (Intellindust-AI-Lab/DEIMv2, 0.5M
# parameters). HGNetV2 Atto, LiteEncoder 64 wide, 3 decoder layers of 100 queries, FFN 160; 320 px
# (mosaic 160, boxes from 12 px), 500 epochs, lr 2e-3, backbone 1e-3
# (configs/deimv2/deimv2_hgnetv2_atto_coco.yml); the rest as Pico (_base_/deimv2_hgnetv2_lite.py).
# Train: tools/train.py configs/deimv2/deimv2_atto.py --cfg-options data_root=/path/to/coco/
_base_ = ['./_base_/deimv2_hgnetv2_lite.py']
input_size = 320
mosaic_size = 160
min_box_size = 12
mosaic_prob = 0.3
base_lr = 2e-3
backbone_lr = 1e-3
width = 64
model = dict(
    backbone=dict(arch='Atto'),
    neck=dict(in_channels=(256,), hidden_dim=width),
    bbox_head=dict(in_channels=(width, width), embed_dims=width, num_queries=100, ffn_dims=160))
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
    bias_decay_mult=1.0, custom_keys=dict(backbone=dict(lr_mult=backbone_lr / base_lr))))
custom_hooks = [_base_.custom_hooks[0],
                dict(_base_.custom_hooks[1], switch_pipeline=mosaic_pipeline),
                dict(_base_.custom_hooks[2], switch_pipeline=strong_pipeline),
                dict(_base_.custom_hooks[3], switch_pipeline=plain_pipeline),
                _base_.custom_hooks[4]]
