# RetinaNet, Swin V2-T (vitdet_plugin SwinV2Backbone) + FPN, COCO 2017, 1x AdamW:
# configs/swin_retinanet.py with the Swin V2 backbone (window 8, as its ImageNet checkpoint).
# Starts from the official ImageNet-1k Swin V2-T window 8 (configs/_base_/pretrained.py; official,
# timm and mmpretrain Swin V2 checkpoints are recognised; the window equals the pretraining one,
# so pretrained_window_sizes stays 0).
_base_ = [
    './_base_/models/retinanet_swin-t_fpn.py',
    './_base_/datasets/coco_detection.py',
    './_base_/schedules/adamw_1x.py',
    './_base_/default_runtime.py',
    './_base_/pretrained.py',
]
model = dict(
    backbone=dict(
        type='SwinV2Backbone',  # over the base's Swin-T: arch, drop path, out_indices 1-3
        window_size=8,
        init_cfg=dict(type='Pretrained', checkpoint=_base_.swinv2_t_w8_in1k)))
# as the official Swin V2 recipe: no weight decay on norms, biases (q_bias / v_bias included),
# the logit scales and the position-bias MLP: the backbone's no_weight_decay()
optim_wrapper = dict(constructor='NoDecayOptimWrapperConstructor')
