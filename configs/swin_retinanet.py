# RetinaNet, Swin-T (vitdet_plugin SwinBackbone) + FPN, COCO 2017, 1x AdamW.
# Mirrors mmdet's swin/retinanet_swin-t-p4-w7_fpn_1x_coco.py with our backbone and mmdet's Swin
# AdamW recipe. Starts, as mmdet's, from the official ImageNet-1k Swin-T (configs/_base_/
# pretrained.py; offline: --cfg-options model.backbone.init_cfg.checkpoint=YOUR_COPY, or
# model.backbone.init_cfg=None for random init).
_base_ = [
    './_base_/models/retinanet_swin-t_fpn.py',
    './_base_/datasets/coco_detection.py',
    './_base_/schedules/adamw_1x.py',
    './_base_/default_runtime.py',
    './_base_/pretrained.py',
]
model = dict(backbone=dict(init_cfg=dict(type='Pretrained', checkpoint=_base_.swin_t_in1k)))
# No weight decay on the backbone's no_weight_decay() parameters (norms, biases, position
# tables); the schedule's custom_keys leave the biases decayed.
optim_wrapper = dict(constructor='NoDecayOptimWrapperConstructor')
