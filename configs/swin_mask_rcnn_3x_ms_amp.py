# Mask R-CNN, Swin-T + FPN, COCO 2017, 3x schedule with multi-scale + random-crop training and
# automatic mixed precision (mmdet's swin/mask-rcnn_swin-t-p4-w7_fpn_amp-ms-crop-3x_coco.py
# with our backbone).
_base_ = [
    './_base_/models/mask-rcnn_swin-t_fpn.py',
    './_base_/datasets/coco_instance_ms_crop.py',
    './_base_/schedules/adamw_3x.py',
    './_base_/default_runtime.py',
    './_base_/pretrained.py',
]
# as mmdet's: from the official ImageNet-1k Swin-T (offline: see configs/_base_/pretrained.py)
model = dict(backbone=dict(init_cfg=dict(type='Pretrained', checkpoint=_base_.swin_t_in1k)))
# AMP; no weight decay on the backbone's no_weight_decay() parameters (norms, biases, position
# tables): the schedule's custom_keys leave the biases decayed.
optim_wrapper = dict(type='AmpOptimWrapper', constructor='NoDecayOptimWrapperConstructor')
