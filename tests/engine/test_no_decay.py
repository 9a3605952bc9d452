"""NoDecayOptimWrapperConstructor: the backbone's no_weight_decay() parameters get no weight
decay under every config of ours and under stock mmdet configs with only the backbone type
changed; everything else is exactly what mmengine's default constructor makes."""
import copy
import glob
import os.path as osp
import re
from typing import Dict, List, Optional, Set, Tuple
from unittest import mock

import pytest
import torch
from mmengine.config import Config, ConfigDict
from mmengine.optim import DefaultOptimWrapperConstructor, OptimWrapper, build_optim_wrapper
from mmengine.registry import OPTIM_WRAPPER_CONSTRUCTORS
from torch import nn

import vitdet_plugin  # noqa: F401
from vitdet_plugin.config import load_config
from vitdet_plugin.engine import (
    NoDecayOptimWrapperConstructor,
    backbone_no_decay_names,
    decay_report,
)
from vitdet_plugin.engine import no_decay as no_decay_module
from vitdet_plugin.models.backbones import SwinBackbone
from helpers import REPO_ROOT

ROOT = str(REPO_ROOT)
CONFIGS = sorted(glob.glob(osp.join(ROOT, 'configs', '*.py'))
                 + glob.glob(osp.join(ROOT, 'configs', 'demo', '*.py')))
CONFIG_IDS = [osp.relpath(p, osp.join(ROOT, 'configs')) for p in CONFIGS]
LR, WD = 1e-3, 0.05
Report = Dict[str, Tuple[float, float]]


# ----------------------------------------------------------------------------- helpers
def _build_wrapper(model: nn.Module, optim_cfg: dict) -> OptimWrapper:
    """``build_optim_wrapper`` on a copy of the config as written; mmengine refuses to build
    an ``AmpOptimWrapper`` without an accelerator, so on CPU it is built as on a GPU (the wrapper
    type plays no part in the param groups)."""
    import mmengine.optim.optimizer.amp_optimizer_wrapper as amp_module

    optim_cfg = copy.deepcopy(optim_cfg)
    with mock.patch.object(amp_module, 'is_cuda_available', lambda: True):
        return build_optim_wrapper(model, optim_cfg)


def _default_report(model: nn.Module, optim_cfg: dict) -> Report:
    """What mmengine's own constructor makes of the same optimizer and paramwise_cfg."""
    cfg = copy.deepcopy(dict(optim_cfg))
    cfg.pop('constructor', None)
    paramwise = cfg.pop('paramwise_cfg', None)
    cfg.update(type='OptimWrapper')
    for key in ('loss_scale', 'dtype'):  # AmpOptimWrapper-only arguments
        cfg.pop(key, None)
    return decay_report(DefaultOptimWrapperConstructor(cfg, paramwise)(model), model)


def _load(path: str) -> Config:
    cfg = load_config(path)
    cfg.model.backbone.init_cfg = None  # nothing to download; the weights play no part here
    return cfg


def _build_model(cfg: Config, on_meta: bool = False) -> nn.Module:
    """The config's detector; ``on_meta``: on the meta device (parameter names, shapes and
    flags without memory: the DINOv3 7B config's weights alone would take 27 GB; mmdet's own
    Swin calls ``.item()`` while building, which a meta tensor refuses)."""
    from mmdet.registry import MODELS
    with torch.device('meta' if on_meta else 'cpu'):
        return MODELS.build(copy.deepcopy(cfg.model))


def _decayed(report: Report, names: Set[str]) -> List[str]:
    """The optimized ones of ``names`` with weight decay."""
    return sorted(n for n in names if n in report and report[n][1] > 0)


def _mmengine_decay_mult(name: str, custom_keys: dict) -> Optional[float]:
    """decay_mult of the custom key mmengine applies to ``name`` (the longest contained key,
    ties alphabetical), None when no key matches."""
    for key in sorted(sorted(custom_keys), key=len, reverse=True):
        if key in name:
            return float(custom_keys[key].get('decay_mult', 1.0))
    return None


# ----------------------------------------------------------------------------- our configs
def test_configs_found():
    names = set(CONFIG_IDS)
    assert {'swin_retinanet.py', 'swin_mask_rcnn.py', 'vit_mask_rcnn.py',
            'demo/swin_retinanet_shapes.py', 'demo/swinv2_retinanet_shapes.py'} <= names


@pytest.mark.parametrize('path', CONFIGS, ids=CONFIG_IDS)
def test_config_keeps_no_decay_params_free_of_decay(path):
    cfg = _load(path)
    model = _build_model(cfg, on_meta=True)
    optim_cfg = cfg.optim_wrapper
    report = decay_report(_build_wrapper(model, optim_cfg), model)
    no_decay = backbone_no_decay_names(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    missing = sorted(no_decay & trainable - set(report))
    assert no_decay and not missing, f'trainable no-decay params outside the optimizer: {missing}'
    decayed = _decayed(report, no_decay)
    assert not decayed, (f'{len(decayed)} backbone no_weight_decay() params get weight decay '
                         f'under {osp.basename(path)}: {decayed}')

    if 'backbone' in cfg.model.get('frozen_parts', ()):  # a head on a fixed backbone
        assert not [n for n in trainable if n.startswith('backbone.')]
        return
    weights = [n for n, p in model.named_parameters()
               if n.startswith('backbone.') and p.requires_grad and p.ndim >= 2
               and n not in no_decay]
    assert weights
    constructor = optim_cfg.get('constructor', 'DefaultOptimWrapperConstructor')
    if constructor == 'LayerDecayOptimWrapperConstructor':
        # its own rule: every other backbone weight gets the optimizer's weight decay
        want = {n: float(optim_cfg.optimizer.weight_decay) for n in weights}
    else:
        assert constructor in ('DefaultOptimWrapperConstructor',
                               'NoDecayOptimWrapperConstructor'), constructor
        default = _default_report(model, optim_cfg)
        want = {n: default[n][1] for n in weights}
        if constructor == 'NoDecayOptimWrapperConstructor':
            # nothing but the no-decay parameters' weight decay differs from mmengine's result
            changed = sorted(n for n in report if report[n] != default[n]
                             and not (n in no_decay and report[n][0] == default[n][0]))
            assert not changed, f'{osp.basename(path)}: {changed}'
    lost = sorted(f'{n}: {report[n][1]} != {want[n]}' for n in weights if report[n][1] != want[n])
    assert not lost, (f'{len(lost)} backbone weights lost the config\'s decay under '
                      f'{osp.basename(path)}: {lost}')


# ----------------------------------------------------------------------------- stock mmdet
M2F = 'mmdet::mask2former/mask2former_swin-t-p4-w7-224_8xb2-lsj-50e_coco.py'
MASK_RCNN = 'mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py'
DEPTHS = (2, 2, 6, 2)  # Swin-T, as both stock configs
BLOCKS = sum(DEPTHS)
# our Swin-T's no-decay parameters by kind (weight + bias of each norm)
BLOCK_NORMS = BLOCKS * 2 * 2                        # norm1, norm2 per block
MERGE_NORMS = (len(DEPTHS) - 1) * 2                 # layers.{i}.downsample.norm
LINEAR_BIASES = BLOCKS * 4 + 1                      # qkv, proj, fc1, fc2 + patch_embed.proj


def _stock(name: str, tmp_path, ours: bool = True) -> Tuple[Config, nn.Module]:
    """A stock mmdet config loaded through the ``mmdet::`` prefix, with our backbone type."""
    path = tmp_path / 'stock.py'
    path.write_text(f'_base_ = {name!r}\n')
    cfg = load_config(str(path))
    bb = cfg.model.backbone
    assert bb.type == 'SwinTransformer' and tuple(bb.depths) == DEPTHS
    if ours:
        bb.type = 'SwinBackbone'
    bb.init_cfg = None
    return cfg, _build_model(cfg)


def _summary(model: nn.Module, optim_cfg: dict) -> Tuple[Report, List[str]]:
    with mock.patch.object(no_decay_module, 'print_log') as log:
        report = decay_report(_build_wrapper(model, optim_cfg), model)
    return report, [c.args[0] for c in log.call_args_list]


def _check_fixed(cfg: Config, model: nn.Module, wrong: List[str], overrode: int) -> Report:
    """The one-liner: no backbone no-decay parameter decays, nothing else changes, and the log
    line counts what changed."""
    no_decay = backbone_no_decay_names(model)
    optim_cfg = copy.deepcopy(cfg.optim_wrapper)
    optim_cfg.constructor = 'NoDecayOptimWrapperConstructor'
    report, logged = _summary(model, optim_cfg)
    assert _decayed(report, no_decay) == []
    default = _default_report(model, cfg.optim_wrapper)
    assert {n: v for n, v in report.items() if n not in no_decay} == \
        {n: v for n, v in default.items() if n not in no_decay}
    assert all(report[n][0] == default[n][0] for n in no_decay)
    assert logged == [f'NoDecayOptimWrapperConstructor: weight_decay=0 set on {len(wrong)} of '
                      f'the {len(no_decay)} optimized backbone no_weight_decay() parameters '
                      f'({overrode} over a custom_keys decay_mult)']
    return report


def test_stock_mask2former_with_our_swin(tmp_path):
    cfg, model = _stock(M2F, tmp_path)
    custom_keys = cfg.optim_wrapper.paramwise_cfg.custom_keys
    assert 'backbone.stages.0.downsample.norm' in custom_keys  # mmdet's names, not ours
    no_decay = backbone_no_decay_names(model)
    # without the one-liner: the catch-all 'backbone' key (decay_mult 1) is the longest key
    # matching our block and patch-merging norms and all linear biases
    report = decay_report(_build_wrapper(model, cfg.optim_wrapper), model)
    wrong = _decayed(report, no_decay)
    mults = {n: _mmengine_decay_mult(n, custom_keys) for n in no_decay}
    assert None not in mults.values()  # every backbone name matches a key ('backbone')
    assert wrong == sorted(n for n, m in mults.items() if m)
    assert len(wrong) == BLOCK_NORMS + MERGE_NORMS + LINEAR_BIASES == 103
    assert sum('.downsample.norm.' in n for n in wrong) == MERGE_NORMS

    report = _check_fixed(cfg, model, wrong, overrode=len(wrong))
    base_lr = cfg.optim_wrapper.optimizer.lr
    backbone = [n for n in report if n.startswith('backbone.')]
    assert all(report[n][0] == pytest.approx(0.1 * base_lr) for n in backbone)
    embeds = [n for n in report if any(k in n for k in ('query_embed', 'query_feat',
                                                        'level_embed'))]
    assert {n.split('.')[-2] for n in embeds} == {'query_embed', 'query_feat', 'level_embed'}
    assert all(report[n] == (base_lr, 0.0) for n in embeds)
    weights = [n for n, p in model.named_parameters()
               if n.startswith('backbone.') and p.ndim >= 2 and n not in no_decay]
    assert weights
    assert all(report[n][1] == cfg.optim_wrapper.optimizer.weight_decay for n in weights)


def test_stock_mask_rcnn_with_our_swin(tmp_path):
    cfg, model = _stock(MASK_RCNN, tmp_path)
    paramwise = cfg.optim_wrapper.paramwise_cfg
    assert set(paramwise) == {'custom_keys'}  # no norm / bias multipliers to fall back on
    custom_keys = paramwise.custom_keys
    no_decay = backbone_no_decay_names(model)
    report = decay_report(_build_wrapper(model, cfg.optim_wrapper), model)
    wrong = _decayed(report, no_decay)
    # 'norm' / the table keys (decay_mult 0) cover norms and tables; no key matches the biases
    # of the linear and conv layers, which therefore keep the base weight decay
    mults = {n: _mmengine_decay_mult(n, custom_keys) for n in no_decay}
    assert set(mults.values()) == {0.0, None}
    assert wrong == sorted(n for n, m in mults.items() if m is None)
    owners = dict(model.named_modules())
    assert all(n.endswith('.bias') and isinstance(owners[n[:-len('.bias')]], (nn.Linear,
                                                                                nn.Conv2d))
               for n in wrong)
    assert len(wrong) == LINEAR_BIASES == 49
    _check_fixed(cfg, model, wrong, overrode=0)


def test_stock_mask2former_custom_keys_work_for_mmdet_swin(tmp_path):
    """The reference: mmdet's own Swin under the same config keeps every norm and table of its
    backbone free of decay (only our names escape the keys)."""
    cfg, model = _stock(M2F, tmp_path, ours=False)
    report = decay_report(_build_wrapper(model, cfg.optim_wrapper), model)
    norms_and_tables = [n for n in report if n.startswith('backbone.') and (
        '.norm' in n or 'relative_position_bias_table' in n)]
    assert len(norms_and_tables) > BLOCK_NORMS
    assert _decayed(report, set(norms_and_tables)) == []


# ----------------------------------------------------------------------------- unit tests
class Detector(nn.Module):
    """Stands in for an mmdet detector: ``backbone``, a neck with a norm, a head with a
    depthwise conv and a free-standing embedding."""

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        self.neck = nn.Sequential(nn.Conv2d(32, 8, 1), nn.GroupNorm(2, 8))
        self.head = nn.Sequential(nn.Conv2d(8, 8, 3, groups=8), nn.Linear(8, 4))
        self.query_embed = nn.Parameter(torch.zeros(5, 8))


def tiny_swin(**kwargs) -> SwinBackbone:
    return SwinBackbone(embed_dims=16, depths=[2, 2], num_heads=[1, 2], window_size=4,
                        out_indices=(0, 1), **kwargs)


def build(model: nn.Module, paramwise: Optional[dict] = None,
          constructor: str = 'NoDecayOptimWrapperConstructor',
          weight_decay: Optional[float] = WD) -> OptimWrapper:
    optimizer = dict(type='AdamW', lr=LR)
    if weight_decay is not None:
        optimizer.update(weight_decay=weight_decay)
    return OPTIM_WRAPPER_CONSTRUCTORS.build(dict(
        type=constructor, optim_wrapper_cfg=dict(type='OptimWrapper', optimizer=optimizer),
        paramwise_cfg=paramwise))(model)


def _check_against_default(model: nn.Module, paramwise: Optional[dict]) -> Report:
    ours = decay_report(build(model, paramwise), model)
    default = decay_report(build(model, paramwise, 'DefaultOptimWrapperConstructor'), model)
    no_decay = backbone_no_decay_names(model)
    assert set(ours) == set(default)
    assert _decayed(ours, no_decay) == []
    assert {n: ours[n][0] for n in ours} == {n: default[n][0] for n in default}
    assert {n: v for n, v in ours.items() if n not in no_decay} == \
        {n: v for n, v in default.items() if n not in no_decay}
    return ours


def test_registered_under_our_name():
    assert OPTIM_WRAPPER_CONSTRUCTORS.get('NoDecayOptimWrapperConstructor') is \
        NoDecayOptimWrapperConstructor


def test_empty_paramwise_cfg_splits_mmengine_single_group():
    model = Detector(tiny_swin())
    wrapper = build(model)
    groups = wrapper.optimizer.param_groups
    no_decay = backbone_no_decay_names(model)
    named = dict(model.named_parameters())
    assert len(groups) == 2
    assert [len(g['params']) for g in groups] == [len(named) - len(no_decay), len(no_decay)]
    assert [g['weight_decay'] for g in groups] == [WD, 0.0]
    assert {id(p) for g in groups for p in g['params']} == {id(p) for p in model.parameters()}
    report = _check_against_default(model, None)
    assert report['backbone.layers.0.blocks.0.norm1.weight'] == (LR, 0.0)
    assert report['backbone.layers.0.blocks.0.attn.relative_position_bias_table'] == (LR, 0.0)
    assert report['backbone.layers.0.blocks.0.attn.qkv.weight'] == (LR, WD)
    assert report['neck.1.weight'] == (LR, WD)  # outside the backbone: as mmengine, decayed


def test_custom_key_decay_mult_loses_to_no_decay():
    model = Detector(tiny_swin())
    paramwise = dict(custom_keys={
        'backbone.layers.0.blocks.0.norm1': dict(lr_mult=0.5, decay_mult=2.0),
        'neck.1': dict(decay_mult=2.0),
        'backbone': dict(lr_mult=0.1)})
    report = _check_against_default(model, paramwise)
    assert report['backbone.layers.0.blocks.0.norm1.weight'] == (0.5 * LR, 0.0)
    assert report['backbone.layers.0.blocks.1.norm1.bias'] == (pytest.approx(0.1 * LR), 0.0)
    assert report['backbone.layers.0.blocks.0.attn.qkv.weight'] == (pytest.approx(0.1 * LR), WD)
    assert report['neck.1.weight'] == (LR, 2.0 * WD)  # not the backbone's: the key applies
    wrapper = build(model, paramwise)
    norm1 = dict(model.named_parameters())['backbone.layers.0.blocks.0.norm1.weight']
    group = next(g for g in wrapper.optimizer.param_groups if g['params'][0] is norm1)
    assert group['decay_mult'] == 0.0 and group['lr_mult'] == 0.5


def test_every_mmengine_option_still_applies():
    model = Detector(tiny_swin())
    model.head.append(model.neck[1])  # a shared module, for bypass_duplicate
    paramwise = dict(bias_lr_mult=2.0, bias_decay_mult=0.5, norm_decay_mult=0.25,
                     dwconv_decay_mult=0.3, flat_decay_mult=0.7, bypass_duplicate=True,
                     custom_keys={'query_embed': dict(lr_mult=3.0, decay_mult=0.0)})
    report = _check_against_default(model, paramwise)
    assert report['neck.0.bias'] == (2.0 * LR, 0.5 * WD)
    assert report['neck.1.weight'] == (LR, 0.25 * WD)
    assert report['head.0.weight'] == (LR, pytest.approx(0.3 * WD))
    assert report['query_embed'] == (3.0 * LR, 0.0)
    assert report['head.2.weight'] == report['neck.1.weight']  # one parameter, two names
    # in the backbone, the multipliers' lr parts stay; the weight decay is 0 for the no-decay set
    assert report['backbone.layers.0.blocks.0.attn.qkv.bias'] == (2.0 * LR, 0.0)
    assert report['backbone.layers.0.blocks.0.attn.qkv.weight'] == (LR, WD)


def test_optimizer_default_weight_decay_is_overridden_too():
    """No ``weight_decay`` in the optimizer config: mmengine leaves AdamW's default (0.01) on
    every group; the no-decay parameters still get 0."""
    model = Detector(tiny_swin())
    for paramwise in (None, dict(custom_keys={'backbone': dict(lr_mult=0.1)})):
        report = decay_report(build(model, paramwise, weight_decay=None), model)
        assert report['backbone.layers.1.blocks.0.norm2.weight'][1] == 0.0
        assert report['backbone.layers.1.blocks.0.mlp.fc1.weight'][1] == 0.01


def test_model_that_is_a_backbone():
    model = tiny_swin()
    report = _check_against_default(model, dict(norm_decay_mult=1.0))
    assert backbone_no_decay_names(model) == model.no_weight_decay()
    assert report['patch_embed.norm.weight'] == (LR, 0.0)
    assert report['layers.0.downsample.norm.bias'] == (LR, 0.0)
    assert report['layers.0.downsample.reduction.weight'] == (LR, WD)


def test_wrapped_model_is_unwrapped():
    class Wrapper(nn.Module):  # as DDP: the model under .module
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    model = Detector(tiny_swin())
    report = decay_report(build(Wrapper(model), dict(bias_lr_mult=1.0)), model)
    assert report['backbone.layers.0.blocks.0.norm1.weight'] == (LR, 0.0)


def test_frozen_backbone_parameters_are_left_out_as_by_mmengine():
    model = Detector(tiny_swin(frozen_stages=0))
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen
    report = _check_against_default(model, dict(norm_decay_mult=0.0))
    assert not frozen & set(report)


def test_backbone_without_contract_is_a_type_error():
    model = Detector(nn.Conv2d(3, 32, 3))
    msg = ('Conv2d does not declare the backbone contract (out_channels, out_strides, '
           'num_layers, layer_id, no_weight_decay); derive it from '
           'vitdet_plugin.models.backbones.BackboneContract or use SwinBackbone / ViTBackbone')
    for paramwise in (None, dict(norm_decay_mult=0.0)):
        with pytest.raises(TypeError, match=re.escape(msg)) as err:
            build(model, paramwise)
        assert str(err.value) == msg
    with pytest.raises(TypeError, match=re.escape(msg.replace('Conv2d', 'Linear'))):
        build(nn.Linear(2, 2))


def test_decay_report_accepts_an_optimizer_and_lists_shared_names():
    model = Detector(tiny_swin())
    model.head.append(model.neck[1])
    wrapper = build(model)
    assert decay_report(wrapper.optimizer, model) == decay_report(wrapper, model)
    report = decay_report(wrapper, model)
    assert report['head.2.bias'] == report['neck.1.bias']
    assert len(report) == len(list(model.named_parameters(remove_duplicate=False)))


def test_config_dict_optim_wrapper_is_left_untouched():
    """The constructor must not edit the config it is built from (configs are reused)."""
    optim_cfg = ConfigDict(type='OptimWrapper', constructor='NoDecayOptimWrapperConstructor',
                           optimizer=dict(type='AdamW', lr=LR, weight_decay=WD))
    before = copy.deepcopy(optim_cfg)
    build_optim_wrapper(Detector(tiny_swin()), optim_cfg)
    assert optim_cfg == before
