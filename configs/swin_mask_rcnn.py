# Mask R-CNN, Swin-T (vitdet_plugin SwinBackbone) + FPN, COCO 2017 instance segmentation,
# 1x AdamW (mmdet's swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py with our backbone).
_base_ = [
    './_base_/models/mask-rcnn_swin-t_fpn.py',
    './_base_/datasets/coco_instance.py',
    './_base_/schedules/adamw_1x.py',
    './_base_/default_runtime.py',
    './_base_/pretrained.py',
]
# as mmdet's: from the official ImageNet-1k Swin-T (offline: see configs/_base_/pretrained.py)
model = dict(backbone=dict(init_cfg=dict(type='Pretrained', checkpoint=_base_.swin_t_in1k)))
# No weight decay on the backbone's no_weight_decay() parameters (norms, biases, position
# tables); the schedule's custom_keys leave the biases decayed.
optim_wrapper = dict(constructor='NoDecayOptimWrapperConstructor')
