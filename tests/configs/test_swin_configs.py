"""The Swin configs after the Swin-T backbone moved into configs/_base_/models/swin-t.py and the
restated defaults left the leaf configs: every Swin config's backbone is the one it was.

``EXPECTED_BACKBONES`` holds each config's resolved ``model.backbone`` as it was before the move
(frozen once from the configs of that time, restated defaults included), so the test needs no
git history. A config's backbone now must (1) give the same constructor arguments once both are
filled with the class's defaults, and (2) build the same module: the same ``repr`` and the same
state-dict names and shapes (built on the meta device: no memory, no init cost).
"""
import glob
import inspect
import os.path as osp
from typing import Any, Dict

import pytest
import torch

import vitdet_plugin  # noqa: F401  (registers the backbones)
from vitdet_plugin.config import load_config
from helpers import REPO_ROOT

ROOT = str(REPO_ROOT)
CONFIGS = osp.join(ROOT, 'configs')
#: the published weights the full configs start from (configs/_base_/pretrained.py)
SWIN_T_IN1K = ('https://github.com/SwinTransformer/storage/releases/download/v1.0.0/'
               'swin_tiny_patch4_window7_224.pth')
SWINV2_T_W8 = ('https://github.com/SwinTransformer/storage/releases/download/v2.0.0/'
               'swinv2_tiny_patch4_window8_256.pth')

EXPECTED_BACKBONES: Dict[str, dict] = {
    'demo/swin_detr_demo.py': dict(
        type='SwinBackbone',
        arch=dict(embed_dims=48, depths=[2, 2, 2, 2], num_heads=[3, 6, 12, 24]), window_size=8,
        drop_path_rate=0.1, out_indices=[1, 2, 3]),
    'demo/swin_detr_pretrained_shapes.py': dict(type='SwinBackbone', arch='tiny', embed_dims=64,
        depths=[2, 2, 2], num_heads=[2, 4, 8], patch_size=8, stem_channels=[16, 32], window_size=6,
        drop_path_rate=0.0, out_indices=[0, 1, 2],
        init_cfg=dict(type='Pretrained', checkpoint='work_dirs/demo_swin_retinanet/CHECKPOINT.pth',
                      prefix='backbone.')),
    'demo/swin_detr_shapes.py': dict(type='SwinBackbone', arch='tiny', embed_dims=64,
        depths=[2, 2, 2], num_heads=[2, 4, 8], patch_size=8, stem_channels=[16, 32], window_size=6,
        drop_path_rate=0.0, out_indices=[0, 1, 2]),
    'demo/swin_mask_rcnn_shapes.py': dict(type='SwinBackbone', arch='tiny', embed_dims=64,
        depths=[2, 2, 2], num_heads=[2, 4, 8], patch_size=8, stem_channels=[16, 32], window_size=6,
        mlp_ratio=4, qkv_bias=True, qk_scale=None, drop_rate=0.0, attn_drop_rate=0.0,
        drop_path_rate=0.0, patch_norm=True, out_indices=[0, 1, 2], with_cp=False,
        convert_weights=True),
    'demo/swin_panoptic_fpn_shapes.py': dict(type='SwinBackbone', arch='tiny', embed_dims=64,
        depths=[2, 2, 2], num_heads=[2, 4, 8], patch_size=8, stem_channels=[16, 32], window_size=6,
        mlp_ratio=4, qkv_bias=True, qk_scale=None, drop_rate=0.0, attn_drop_rate=0.0,
        drop_path_rate=0.0, patch_norm=True, out_indices=[0, 1, 2], with_cp=False,
        convert_weights=True),
    'demo/swin_retinanet_shapes.py': dict(type='SwinBackbone', arch='tiny', embed_dims=64,
        depths=[2, 2, 2], num_heads=[2, 4, 8], patch_size=8, stem_channels=[16, 32], window_size=6,
        mlp_ratio=4, qkv_bias=True, qk_scale=None, drop_rate=0.0, attn_drop_rate=0.0,
        drop_path_rate=0.0, patch_norm=True, out_indices=[0, 1, 2], with_cp=False,
        convert_weights=True),
    'demo/swinv2_retinanet_shapes.py': dict(type='SwinV2Backbone', embed_dims=64, depths=[2, 2, 2],
        num_heads=[2, 4, 8], patch_size=8, window_size=6, drop_path_rate=0.0, out_indices=[0, 1,
        2]),
    'swin_detr.py': dict(type='SwinBackbone', arch='tiny', window_size=7, drop_path_rate=0.2,
        out_indices=[1, 2, 3], with_cp=False,
        init_cfg=dict(type='Pretrained', checkpoint=SWIN_T_IN1K)),
    'swin_dino.py': dict(type='SwinBackbone', arch='tiny', window_size=7, drop_path_rate=0.2,
        out_indices=[1, 2, 3], with_cp=False,
        init_cfg=dict(type='Pretrained', checkpoint=SWIN_T_IN1K)),
    'swin_mask2former_instance.py': dict(type='SwinBackbone', arch='tiny', window_size=7,
        mlp_ratio=4, qkv_bias=True, qk_scale=None, drop_rate=0.0, attn_drop_rate=0.0,
        drop_path_rate=0.3, patch_norm=True, out_indices=[0, 1, 2, 3], frozen_stages=-1,
        with_cp=False, convert_weights=True,
        init_cfg=dict(type='Pretrained', checkpoint=SWIN_T_IN1K)),
    'swin_mask2former_panoptic.py': dict(type='SwinBackbone', arch='tiny', window_size=7,
        mlp_ratio=4, qkv_bias=True, qk_scale=None, drop_rate=0.0, attn_drop_rate=0.0,
        drop_path_rate=0.3, patch_norm=True, out_indices=[0, 1, 2, 3], frozen_stages=-1,
        with_cp=False, convert_weights=True,
        init_cfg=dict(type='Pretrained', checkpoint=SWIN_T_IN1K)),
    'swin_mask_rcnn.py': dict(type='SwinBackbone', arch='tiny', window_size=7, mlp_ratio=4,
        qkv_bias=True, qk_scale=None, drop_rate=0.0, attn_drop_rate=0.0, drop_path_rate=0.2,
        patch_norm=True, out_indices=[0, 1, 2, 3], with_cp=False, convert_weights=True,
        init_cfg=dict(type='Pretrained', checkpoint=SWIN_T_IN1K)),
    'swin_mask_rcnn_3x_ms_amp.py': dict(type='SwinBackbone', arch='tiny', window_size=7,
        mlp_ratio=4, qkv_bias=True, qk_scale=None, drop_rate=0.0, attn_drop_rate=0.0,
        drop_path_rate=0.2, patch_norm=True, out_indices=[0, 1, 2, 3], with_cp=False,
        convert_weights=True,
        init_cfg=dict(type='Pretrained', checkpoint=SWIN_T_IN1K)),
    'swin_retinanet.py': dict(type='SwinBackbone', arch='tiny', window_size=7, mlp_ratio=4,
        qkv_bias=True, qk_scale=None, drop_rate=0.0, attn_drop_rate=0.0, drop_path_rate=0.2,
        patch_norm=True, out_indices=[1, 2, 3], with_cp=False, convert_weights=True,
        init_cfg=dict(type='Pretrained', checkpoint=SWIN_T_IN1K)),
    'swinv2_mask_rcnn.py': dict(type='SwinV2Backbone', arch='tiny', window_size=16,
        pretrained_window_sizes=[8, 8, 8, 8], drop_path_rate=0.2, out_indices=[0, 1, 2, 3],
        with_cp=False,
        init_cfg=dict(type='Pretrained', checkpoint=SWINV2_T_W8)),
    'swinv2_retinanet.py': dict(type='SwinV2Backbone', arch='tiny', window_size=8,
        drop_path_rate=0.2, out_indices=[1, 2, 3], with_cp=False,
        init_cfg=dict(type='Pretrained', checkpoint=SWINV2_T_W8)),

}


def _swin_configs():
    return sorted(osp.relpath(p, CONFIGS)
                  for p in glob.glob(osp.join(CONFIGS, '**', 'swin*.py'), recursive=True)
                  if '_base_' not in p.split(osp.sep))


def _plain(value: Any) -> Any:
    """Tuples as lists (a config resolves tuples to lists; signatures default to tuples)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _with_defaults(backbone: dict) -> dict:
    """``backbone``'s constructor arguments with every default the class would use filled in."""
    from mmdet.registry import MODELS

    cls = MODELS.get(backbone['type'])
    params = inspect.signature(cls.__init__).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        unknown = set(backbone) - set(params) - {'type'}
        assert not unknown, f'{backbone["type"]} takes no {sorted(unknown)}'
    filled = {name: p.default for name, p in params.items()
              if name != 'self' and p.default is not inspect.Parameter.empty}
    filled.update(backbone)
    return _plain(filled)


def _build_on_meta(backbone: dict) -> torch.nn.Module:
    from mmdet.registry import MODELS

    with torch.device('meta'):
        return MODELS.build(dict(backbone))


def test_every_swin_config_is_listed():
    assert _swin_configs() == sorted(EXPECTED_BACKBONES)


@pytest.mark.parametrize('name', sorted(EXPECTED_BACKBONES))
def test_backbone_is_the_one_before_the_move(name):
    new = load_config(osp.join(CONFIGS, name)).model.backbone.to_dict()
    old = EXPECTED_BACKBONES[name]
    assert _with_defaults(new) == _with_defaults(old)
    new_model, old_model = _build_on_meta(new), _build_on_meta(old)
    assert repr(new_model) == repr(old_model)
    assert ({k: tuple(v.shape) for k, v in new_model.state_dict().items()}
            == {k: tuple(v.shape) for k, v in old_model.state_dict().items()})


@pytest.mark.parametrize('name', sorted(EXPECTED_BACKBONES))
def test_leaf_configs_restate_no_default(name):
    """What a leaf config (and its bases) write for the backbone differs from the class's
    defaults, except the preset and window the Swin-T fragment is named for."""
    from mmdet.registry import MODELS

    backbone = load_config(osp.join(CONFIGS, name)).model.backbone.to_dict()
    params = inspect.signature(MODELS.get(backbone['type']).__init__).parameters
    restated = sorted(k for k, v in backbone.items()
                      if k in params and k not in ('arch', 'window_size')
                      and _plain(v) == _plain(params[k].default))
    assert not restated, f'{name} restates defaults of {backbone["type"]}: {restated}'
