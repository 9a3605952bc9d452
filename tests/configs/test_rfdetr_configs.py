"""configs/rfdetr/ hold RF-DETR's published sizes and recipe, read from the `rfdetr` package
(1.11.2): every size against its ``RFDETR{Nano,Small,Medium,Large}Config`` (the seg sizes
against ``RFDETRSeg{Nano,Small,Medium,Large,XLarge,2XLarge}Config`` and
``SegmentationTrainConfig``), the training scales (the pipeline's ``RFDETRTrainResize`` and the
data preprocessor's ``RFDETRBatchScale``, as built) against its ``compute_multi_scale_scales``,
the optimiser / schedule against ``TrainConfig``'s defaults, and the EMA hook's averaged weights
against its ``ModelEma`` over accumulated steps.
Config files are only read here (tests/configs/test_configs.py builds and trains them)."""
import importlib.util
import os.path as osp

import pytest
import torch

import vitdet_plugin.datasets  # noqa: F401  (RF-DETR's transforms)
from mmdet.registry import MODELS, TRANSFORMS
from vitdet_plugin.config import load_config
from vitdet_plugin.models.heads.lwdetr_loss import IA_BCE_LOSS
from helpers import REPO_ROOT

SIZES = {'nano': 'RFDETRNanoConfig', 'small': 'RFDETRSmallConfig',
         'medium': 'RFDETRMediumConfig', 'large': 'RFDETRLargeConfig',
         'seg_nano': 'RFDETRSegNanoConfig', 'seg_small': 'RFDETRSegSmallConfig',
         'seg_medium': 'RFDETRSegMediumConfig', 'seg_large': 'RFDETRSegLargeConfig',
         'seg_xlarge': 'RFDETRSegXLargeConfig', 'seg_2xlarge': 'RFDETRSeg2XLargeConfig'}
#: optimizer steps of the EMA comparison (the warm-up, tau = 100 steps, and beyond)
EMA_STEPS = 150
#: StepExpMomentumEMA's first average copies the weights of step 1, ModelEma's keeps 1% of its
#: initial copy (decay 0.993 (1 - exp(-1 / 100))), which fades over the warm-up
EMA_TOL = 1e-3


def _cfg(name: str):
    return load_config(osp.join(str(REPO_ROOT), 'configs', 'rfdetr', f'rfdetr_{name}.py'))


def _model_ema_class():
    """rfdetr's ``ModelEma`` (training/model_ema.py: torch only) without ``rfdetr.training``'s
    package import, which needs PyTorch Lightning."""
    spec = importlib.util.find_spec('rfdetr')
    path = osp.join(spec.submodule_search_locations[0], 'training', 'model_ema.py')
    module_spec = importlib.util.spec_from_file_location('rfdetr_model_ema', path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.ModelEma


@pytest.mark.parametrize('name', SIZES)
def test_sizes_are_rfdetrs(name):
    import rfdetr.config
    from rfdetr.datasets.coco import compute_multi_scale_scales

    theirs = getattr(rfdetr.config, SIZES[name])(pretrain_weights=None)
    train = rfdetr.config.TrainConfig.model_fields
    cfg = _cfg(name)
    bb, neck, head = cfg.model.backbone, cfg.model.neck, cfg.model.bbox_head
    assert (bb.patch_size, bb.num_windows) == (theirs.patch_size, theirs.num_windows)
    # rfdetr's Backbone: registers only for an encoder named '..._registers_...'
    assert bb.num_reg_tokens == (4 if 'registers' in theirs.encoder.split('_') else 0)
    assert [i + 1 for i in bb.out_indices] == theirs.out_feature_indexes
    assert bb.pretrain_img_size // bb.pretrain_patch_size == theirs.positional_encoding_size
    assert cfg.model.data_preprocessor.pad_size_divisor == theirs.patch_size * theirs.num_windows
    assert list(neck.levels) == theirs.projector_scale
    assert neck.out_channels == head.embed_dims == theirs.hidden_dim
    assert (head.num_decoder_layers, head.self_heads, head.cross_heads, head.num_points) == (
        theirs.dec_layers, theirs.sa_nheads, theirs.ca_nheads, theirs.dec_n_points)
    assert (head.num_queries, head.num_groups) == (theirs.num_queries, theirs.group_detr)
    assert cfg.model.test_cfg.max_per_img == theirs.num_select
    resize = cfg.test_dataloader.dataset.pipeline[1]
    assert (resize.type, resize.scale, resize.get('keep_ratio', False)) == (
        'RFDETRResize', (theirs.resolution,) * 2, False)
    # rfdetr's default multi_scale (PER_BATCH): every image at the largest scale, then one
    # scale per optimizer step for the batch
    assert train['multi_scale'].default.value == 'per-batch'
    scales = compute_multi_scale_scales(theirs.resolution, train['expanded_scales'].default,
                                        theirs.patch_size, theirs.num_windows)
    (train_resize,) = [TRANSFORMS.build(t) for t in cfg.train_dataloader.dataset.pipeline
                       if t.type == 'RFDETRTrainResize']
    assert train_resize.scales == scales
    assert [t.scale for t in train_resize.squares] == [(scales[-1],) * 2]
    (batch_scale,) = [MODELS.build(a) for a in cfg.model.data_preprocessor.batch_augments]
    assert type(batch_scale).__name__ == 'RFDETRBatchScale' and batch_scale.scales == scales
    assert batch_scale.interval == cfg.optim_wrapper.accumulative_counts
    assert (head.type == 'LWDETRSegHead') == theirs.segmentation_head


@pytest.mark.parametrize('name', [n for n in SIZES if n.startswith('seg_')])
def test_seg_sizes_are_rfdetrs(name):
    """The mask options (ModelConfig), the mask loss weights and point sampling
    (SegmentationTrainConfig), masks loaded and scored."""
    import rfdetr.config

    theirs = getattr(rfdetr.config, SIZES[name])(pretrain_weights=None)
    train = {k: v.default for k, v in rfdetr.config.SegmentationTrainConfig.model_fields.items()}
    cfg = _cfg(name)
    head = cfg.model.bbox_head
    assert head.mask_downsample_ratio == theirs.mask_downsample_ratio
    assert head.mask_point_sample_ratio == train['mask_point_sample_ratio']
    assert (head.loss_mask.loss_weight, head.loss_dice.loss_weight) == (
        train['mask_ce_loss_coef'], train['mask_dice_loss_coef'])
    # the class weight is the head's default IA-BCE's
    assert 'loss_cls' not in head and IA_BCE_LOSS['loss_weight'] == train['cls_loss_coef']
    for pipeline in (cfg.train_dataloader.dataset.pipeline, cfg.test_dataloader.dataset.pipeline):
        (load,) = [t for t in pipeline if t.type == 'LoadAnnotations']
        assert load.with_bbox and load.with_mask
    assert cfg.val_evaluator.metric == cfg.test_evaluator.metric == ['bbox', 'segm']


def test_recipe_is_rfdetrs():
    from rfdetr.config import _MANAGED_SCHEDULER_DEFAULTS, TrainConfig

    train = {k: v.default for k, v in TrainConfig.model_fields.items()}
    cfg = _cfg('nano')
    optim = cfg.optim_wrapper
    assert (optim.optimizer.type, optim.optimizer.lr, optim.optimizer.weight_decay) == (
        'AdamW', train['lr'], train['weight_decay'])
    assert optim.constructor == 'LayerDecayOptimWrapperConstructor'
    assert optim.paramwise_cfg.layer_decay_rate == train['lr_vit_layer_decay']
    # rfdetr's get_named_param_lr_pairs: num_layers = out_feature_indexes[-1] + 1
    assert optim.paramwise_cfg.num_layers == cfg.model.backbone.out_indices[-1] + 2
    # rfdetr's ViT lr: lr_encoder x lr_component_decay^2; its decoder's: lr x lr_component_decay
    mults = optim.paramwise_cfg.lr_mults
    assert mults['backbone'] * train['lr'] == pytest.approx(
        train['lr_encoder'] * train['lr_component_decay'] ** 2)
    assert mults['bbox_head.decoder'] == train['lr_component_decay']
    assert optim.clip_grad.max_norm == train['clip_max_norm']
    assert cfg.train_dataloader.batch_size == train['batch_size']
    assert cfg.train_cfg.max_epochs == train['epochs']
    (step,) = cfg.param_scheduler
    assert (step.type, step.milestones, step.gamma) == (
        'MultiStepLR', [_MANAGED_SCHEDULER_DEFAULTS['lr_drop']], 0.1)
    ema = cfg.custom_hooks[-1]
    assert (ema.type, ema.ema_type, ema.update_buffers) == ('EMAHook', 'StepExpMomentumEMA', True)
    assert ema.momentum == pytest.approx(1 - train['ema_decay'])
    assert ema.gamma == train['ema_tau']
    assert optim.accumulative_counts == ema.interval == ema.begin_iter == train['grad_accum_steps']


def test_ema_hook_averages_as_rfdetrs_model_ema():
    """The config's EMA (our StepExpMomentumEMA as mmengine's EMAHook calls it: after every
    iteration from ``begin_iter``, an optimizer step every ``accumulative_counts``) against
    rfdetr's ModelEma updated after every optimizer step, on the same sequence of weights (a
    random walk); tests/engine/test_rfdetr_trainer_parity.py checks it against rfdetr's
    trainer."""
    from vitdet_plugin.engine.hooks import StepExpMomentumEMA
    cfg = _cfg('nano')
    hook = cfg.custom_hooks[-1]
    accumulate = cfg.optim_wrapper.accumulative_counts
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    ours = StepExpMomentumEMA(model, momentum=hook.momentum, gamma=hook.gamma,
                              interval=hook.interval, update_buffers=hook.update_buffers)
    theirs = _model_ema_class()(model, decay=1 - hook.momentum, tau=cfg.ema_tau)
    for iteration in range(EMA_STEPS * accumulate):
        if (iteration + 1) % accumulate == 0:  # mmengine's optimizer step of this iteration
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p))
            theirs.update(model)
        if iteration + 1 >= hook.begin_iter:  # EMAHook's _ema_started
            ours.update_parameters(model)
    for (name, mine), ref in zip(ours.module.state_dict().items(),
                                 theirs.module.state_dict().values()):
        err = ((mine - ref).norm() / ref.norm()).item()
        assert err < EMA_TOL, (name, err)


#: rfdetr's class of each size config whose file is loaded here (N, S, M and Seg N load in
#: tests/models/test_rfdetr_model_parity.py; Seg S in tests/weights/)
LOADED_SIZES = {'large': 'RFDETRLarge', 'seg_medium': 'RFDETRSegMedium',
                'seg_large': 'RFDETRSegLarge', 'seg_xlarge': 'RFDETRSegXLarge',
                'seg_2xlarge': 'RFDETRSeg2XLarge'}


@pytest.mark.parametrize('name', LOADED_SIZES)
def test_rfdetrs_file_of_the_size_loads_strictly(name, tmp_path):
    """rfdetr's model of the size (random init) saved in its checkpoint format, converted with
    the command of the config's header (tools/convert_weights.py --model rfdetr
    --num-classes 80), loads into the config's model with every key and shape matched."""
    import copy

    import rfdetr
    from helpers import load_tool, save_rfdetr_checkpoint

    theirs = getattr(rfdetr, LOADED_SIZES[name])(pretrain_weights=None)
    src, dst = str(tmp_path / 'rfdetr.pth'), str(tmp_path / 'converted.pth')
    save_rfdetr_checkpoint(theirs, src)
    assert load_tool('convert_weights.py').main(
        [src, dst, '--model', 'rfdetr', '--num-classes', '80']) == 0
    ours = MODELS.build(copy.deepcopy(_cfg(name).model))
    state = torch.load(dst, weights_only=True)['state_dict']
    ours.load_state_dict(state, strict=True)
    # the converted ViT is rfdetr's (spot check: the first block's attention projection)
    want = theirs.model.model.backbone[0].encoder.encoder.encoder.layer[0].attention.attention
    assert torch.equal(state['backbone.blocks.0.attn.qkv.weight'][:want.query.weight.shape[0]],
                       want.query.weight)
