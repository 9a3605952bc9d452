# Mask R-CNN, Swin V2-T (vitdet_plugin SwinV2Backbone) + FPN, COCO 2017 instance segmentation,
# 1x AdamW: configs/swin_mask_rcnn.py with the Swin V2 backbone.
# Windows of 16 in every stage, fine-tuned from the official ImageNet-1k window-8 checkpoint
# (swinv2_tiny_patch4_window8_256.pth, or timm's swinv2_tiny_window8_256; configs/_base_/
# pretrained.py).
# pretrained_window_sizes tells the position-bias MLP how that checkpoint normalised its
# relative coordinates (by its 8x8 windows), so it keeps its meaning in the 16x16 windows.
# For the window-16 checkpoint (swinv2_tiny_patch4_window16_256; its last stage ran 8x8
# windows at 256 px) use pretrained_window_sizes=(16, 16, 16, 8); for the published 12-to-16
# fine-tunes (12, 12, 12, 6). Official, timm and mmpretrain layouts are recognised.
_base_ = [
    './_base_/models/mask-rcnn_swin-t_fpn.py',
    './_base_/datasets/coco_instance.py',
    './_base_/schedules/adamw_1x.py',
    './_base_/default_runtime.py',
    './_base_/pretrained.py',
]
model = dict(
    backbone=dict(
        type='SwinV2Backbone',  # over the base's Swin-T: arch, drop path, all four stages
        window_size=16,
        pretrained_window_sizes=(8, 8, 8, 8),
        init_cfg=dict(type='Pretrained', checkpoint=_base_.swinv2_t_w8_in1k)))
# as the official Swin V2 recipe: no weight decay on norms, biases (q_bias / v_bias included),
# the logit scales and the position-bias MLP: the backbone's no_weight_decay()
optim_wrapper = dict(constructor='NoDecayOptimWrapperConstructor')
