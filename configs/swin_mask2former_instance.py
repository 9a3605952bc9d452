# Mask2Former, Swin-T (vitdet_plugin SwinBackbone), COCO 2017 instance segmentation: mmdet 3.3's
# mask2former/mask2former_swin-t-p4-w7-224_8xb2-lsj-50e_coco.py (100 queries, 6-layer
# deformable-attention pixel decoder, 9-layer masked-attention decoder, 1024 LSJ, 368750
# iterations at batch 16 ~ 50 epochs, AdamW lr 1e-4 wd 0.05, grad clip 0.01; mmdet's metafile:
# 47.7 box / 44.7 mask AP with ImageNet-1k Swin-T) with our backbone and no-decay constructor
# (the notes below the _base_ list say what changed and why).
# Starts from the official ImageNet-1k Swin-T, as the stock config (configs/_base_/pretrained.py;
# timm / mmdet / mmpretrain layouts and local paths work too, detected without convert_weights).
# Train: tools/train.py configs/swin_mask2former_instance.py --cfg-options data_root=/path/
_base_ = [
    'mmdet::mask2former/mask2former_swin-t-p4-w7-224_8xb2-lsj-50e_coco.py',
    './_base_/models/swin-t.py',
    './_base_/pretrained.py',
]
# Changed vs the stock config:
#   - backbone: SwinBackbone (tiny, window 7, drop path 0.3 as stock), all four stages
#     (strides 4 / 8 / 16 / 32, channels 96 / 192 / 384 / 768) into the pixel decoder;
#   - optimizer: constructor='NoDecayOptimWrapperConstructor' gives no weight decay to the
#     backbone's no_weight_decay() parameters (every norm, bias, relative-position table). The
#     stock custom_keys named mmdet's parameters (backbone.stages.{i}.blocks.{j}.norm,
#     backbone.stages.{i}.downsample.norm), which miss our block and patch-merging norms
#     (official layers.{i}.blocks.{j} names); unlike the stock config, the backbone's biases get
#     no weight decay either. The backbone lr_mult 0.1 and the query_embed / query_feat /
#     level_embed decay_mult 0 keys stay.
# The pixel decoder runs mmcv's MultiScaleDeformableAttention: the CUDA kernel on a GPU, mmcv's
# pure-PyTorch (grid_sample) version on the CPU; no bf16 kernel and unreliable in fp16 (mmcv).

custom_imports = dict(imports=['vitdet_plugin'], allow_failed_imports=False)

model = dict(
    # all four stages (strides 4 / 8 / 16 / 32), drop path 0.3 as stock
    backbone=dict(_base_.swin_t, _delete_=True, drop_path_rate=0.3,
                  init_cfg=dict(type='Pretrained', checkpoint=_base_.swin_t_in1k)),
    panoptic_head=dict(in_channels=[96, 192, 384, 768]))

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

# the config / data checks before the first iteration with any runner (mmdet's tools/train.py
# too; configs/_base_/default_runtime.py has them, this config's mmdet base does not)
custom_hooks = [dict(type='PreflightCheckHook')]
