# RetinaNet, Swin-T (vitdet_plugin SwinBackbone) + FPN, COCO 2017, 1x AdamW.
# Mirrors mmdet's swin/retinanet_swin-t-p4-w7_fpn_1x_coco.py with our backbone and mmdet's Swin
# AdamW recipe. ImageNet weights: set
#   model.backbone.init_cfg=dict(type='Pretrained', checkpoint='swin_tiny_patch4_window7_224.pth')
# (official, timm, mmdet/mmpretrain and Swin-OD checkpoints are recognised automatically).
_base_ = [
    './_base_/models/retinanet_swin-t_fpn.py',
    './_base_/datasets/coco_detection.py',
    './_base_/schedules/adamw_1x.py',
    './_base_/default_runtime.py',
]
# No weight decay on the backbone's no_weight_decay() parameters (norms, biases, position
# tables); the schedule's custom_keys leave the biases decayed.
optim_wrapper = dict(constructor='NoDecayOptimWrapperConstructor')
