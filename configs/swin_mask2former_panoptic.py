# Mask2Former, Swin-T (vitdet_plugin SwinBackbone), COCO 2017 panoptic segmentation (80 thing +
# 53 stuff classes) with instance and semantic outputs: mmdet 3.3's
# mask2former/mask2former_swin-t-p4-w7-224_8xb2-lsj-50e_coco-panoptic.py (mmdet's metafile:
# 53.4 PQ, 46.3 box / 43.4 mask AP with ImageNet-1k Swin-T) with our backbone, no-decay
# constructor and semantic output (SemanticMaskFormerFusionHead, SemSegMetric); the notes below
# the _base_ list give the recipe and every change from the stock config.
# Panoptic data and metrics need panopticapi: `make env` installs it; elsewhere
# `pip install --no-deps panopticapi-lite==0.2.0` (its numpy<2 pin would downgrade numpy).
# Starts from the official ImageNet-1k Swin-T, as the stock config (configs/_base_/pretrained.py;
# timm / mmdet / mmpretrain layouts and local paths work too, detected without convert_weights).
_base_ = [
    'mmdet::mask2former/mask2former_swin-t-p4-w7-224_8xb2-lsj-50e_coco-panoptic.py',
    './_base_/models/swin-t.py',
    './_base_/pretrained.py',
]
# The stock recipe: 100 queries, 6-layer deformable-attention pixel decoder, 9-layer
# masked-attention decoder, 1024 LSJ, 368750 iterations at batch 16 ~ 50 epochs, AdamW lr 1e-4
# wd 0.05, grad clip 0.01.
# Changed vs the stock config:
#   - backbone: SwinBackbone (tiny, window 7, drop path 0.3 as stock), all four stages
#     (strides 4 / 8 / 16 / 32, channels 96 / 192 / 384 / 768) into the pixel decoder;
#   - optimizer: constructor='NoDecayOptimWrapperConstructor' gives no weight decay to the
#     backbone's no_weight_decay() parameters (every norm, bias, relative-position table). The
#     stock custom_keys named mmdet's parameters (backbone.stages.{i}.blocks.{j}.norm,
#     backbone.stages.{i}.downsample.norm), which miss our block and patch-merging norms
#     (official layers.{i}.blocks.{j} names); unlike the stock config, the backbone's biases get
#     no weight decay either. The backbone lr_mult 0.1 and the query_embed / query_feat /
#     level_embed decay_mult 0 keys stay;
#   - semantic segmentation: SemanticMaskFormerFusionHead (vitdet_plugin; mmdet 3.3's fusion head
#     raises on semantic_on) adds pred_sem_seg, the stuff + thing map of Mask2Former's semantic
#     inference (argmax over classes of sum_q softmax(cls_q) * sigmoid(mask_q)); test_cfg
#     semantic_on=True and mmdet's SemSegMetric (mIoU over the 133 classes, VOID ignored) joins
#     the panoptic (PQ) and COCO bbox / segm metrics.
# The pixel decoder runs mmcv's MultiScaleDeformableAttention: the CUDA kernel on a GPU, mmcv's
# pure-PyTorch (grid_sample) version on the CPU; no bf16 kernel and unreliable in fp16 (mmcv).

custom_imports = dict(imports=['vitdet_plugin'], allow_failed_imports=False)

num_things_classes = 80
num_stuff_classes = 53
model = dict(
    # all four stages (strides 4 / 8 / 16 / 32), drop path 0.3 as stock
    backbone=dict(_base_.swin_t, _delete_=True, drop_path_rate=0.3,
                  init_cfg=dict(type='Pretrained', checkpoint=_base_.swin_t_in1k)),
    panoptic_head=dict(in_channels=[96, 192, 384, 768]),
    panoptic_fusion_head=dict(
        type='SemanticMaskFormerFusionHead',
        num_things_classes=num_things_classes,
        num_stuff_classes=num_stuff_classes),
    test_cfg=dict(panoptic_on=True, semantic_on=True, instance_on=True))

no_decay_embed = dict(lr_mult=1.0, decay_mult=0.0)
optim_wrapper = dict(
    constructor='NoDecayOptimWrapperConstructor',
    paramwise_cfg=dict(
        _delete_=True,
        custom_keys={
            'backbone': dict(lr_mult=0.1, decay_mult=1.0),
            'query_embed': no_decay_embed,
            'query_feat': no_decay_embed,
            'level_embed': no_decay_embed,
        },
        norm_decay_mult=0.0))

# the stock evaluators (panoptic quality; COCO bbox / segm of the instance output) + mIoU
data_root = 'data/coco/'
backend_args = None
val_evaluator = [
    dict(
        type='CocoPanopticMetric',
        ann_file=data_root + 'annotations/panoptic_val2017.json',
        seg_prefix=data_root + 'annotations/panoptic_val2017/',
        backend_args=backend_args),
    dict(
        type='CocoMetric',
        ann_file=data_root + 'annotations/instances_val2017.json',
        metric=['bbox', 'segm'],
        backend_args=backend_args),
    dict(type='SemSegMetric', iou_metrics=['mIoU']),
]
test_evaluator = val_evaluator

# the config / data checks before the first iteration with any runner (mmdet's tools/train.py
# too; configs/_base_/default_runtime.py has them, this config's mmdet base does not)
custom_hooks = [dict(type='PreflightCheckHook')]
