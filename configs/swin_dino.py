# mmdet's own DINO (4-scale, 12 epochs, COCO) with vitdet_plugin's Swin-T backbone instead of
# ResNet-50: Swin-T out_indices (1, 2, 3) give strides 8 / 16 / 32 with 192 / 384 / 768
# channels, and the ChannelMapper adds the 4th (stride 64) level as in the R-50 config.
# Note: DINO's deformable attention is mmcv's compiled MultiScaleDeformableAttention (CPU and
# CUDA fp32; no bf16, unreliable in fp16). configs/swin_detr.py is the SDPA-only alternative.
# Starts from the official ImageNet-1k Swin-T (configs/_base_/pretrained.py).
_base_ = ['mmdet::dino/dino-4scale_r50_8xb2-12e_coco.py', './_base_/models/swin-t.py',
          './_base_/pretrained.py']

custom_imports = dict(imports=['vitdet_plugin'], allow_failed_imports=False)

model = dict(
    backbone=dict(_base_.swin_t, _delete_=True, out_indices=(1, 2, 3),
                  init_cfg=dict(type='Pretrained', checkpoint=_base_.swin_t_in1k)),
    neck=dict(in_channels=[192, 384, 768]))

# the 'backbone' key would decay our norms and biases: NoDecayOptimWrapperConstructor keeps the
# backbone's no_weight_decay() parameters (norms, biases, position tables) free of decay
optim_wrapper = dict(
    constructor='NoDecayOptimWrapperConstructor',
    paramwise_cfg=dict(
        custom_keys={
            'backbone': dict(lr_mult=0.1),
            # the longest matching key wins, so backbone-only keys repeat the lr_mult
            'absolute_pos_embed': dict(lr_mult=0.1, decay_mult=0.),
            'relative_position_bias_table': dict(lr_mult=0.1, decay_mult=0.),
        }))

# the config / data checks before the first iteration with any runner (mmdet's tools/train.py
# too; configs/_base_/default_runtime.py has them, this config's mmdet base does not)
custom_hooks = [dict(type='PreflightCheckHook')]
