"""configs/dfine/dfine_{n,s,m,l,x}.py: each config's model (built on the meta device) has
exactly the tensors of transformers' ``DFineForObjectDetection`` of the same size, built from
its own config classes (no weights): the whole-detector conversion
(:func:`~vitdet_plugin.weights.dfine_detector.dfine_to_detector`) maps every tensor of one onto
the other with equal shapes; and the published parameter counts."""
import pytest
import torch
from helpers import REPO_ROOT
from mmengine.config import Config
from mmengine.registry import init_default_scope
from transformers import DFineConfig, DFineForObjectDetection, HGNetV2Config

import vitdet_plugin  # noqa: F401
from mmdet.registry import MODELS
from vitdet_plugin.models.backbones.hgnetv2 import HGNetV2Arch
from vitdet_plugin.weights.dfine_detector import dfine_to_detector

#: Per size: the paper's parameter count (millions, published as whole numbers, some rounded
#: and some truncated: ours within 1M).
PUBLISHED_PARAMS = {'n': 4, 's': 10, 'm': 19, 'l': 31, 'x': 62}


def _hgnetv2(backbone: dict) -> HGNetV2Config:
    """transformers' HGNetV2 config of our backbone config (its preset's arch)."""
    arch = HGNetV2Arch.resolve(backbone['arch'])
    return HGNetV2Config(
        stem_channels=list(arch.stem_channels), stage_in_channels=list(arch.in_channels),
        stage_mid_channels=list(arch.mid_channels), stage_out_channels=list(arch.out_channels),
        stage_num_blocks=list(arch.num_blocks), stage_numb_of_layers=list(arch.num_layers),
        stage_downsample=list(arch.downsample), stage_light_block=list(arch.light_block),
        stage_kernel_size=list(arch.kernel_size), hidden_sizes=list(arch.out_channels),
        depths=list(arch.num_blocks), use_learnable_affine_block=backbone['use_lab'],
        out_indices=[i + 1 for i in backbone['out_indices']])


def _reference(model: dict) -> DFineConfig:
    """transformers' D-FINE config of the same sizes as our model config."""
    neck, head = model['neck'], model['bbox_head']
    levels = len(head['in_channels'])
    return DFineConfig(
        backbone_config=_hgnetv2(model['backbone']), num_labels=head['num_classes'],
        encoder_in_channels=list(neck['in_channels']), feat_strides=list(neck['in_strides']),
        encoder_hidden_dim=neck['hidden_dim'], encoder_ffn_dim=neck['ffn_dim'],
        encoder_attention_heads=neck['num_heads'],
        encode_proj_layers=list(neck.get('encoder_levels', (2,))),
        hidden_expansion=neck['expansion'], depth_mult=neck['depth_mult'],
        d_model=head['embed_dims'], decoder_in_channels=list(head['in_channels']),
        num_feature_levels=levels, decoder_ffn_dim=head['ffn_dims'],
        decoder_layers=head['num_layers'], decoder_attention_heads=head['num_heads'],
        decoder_n_points=list(head['num_points']), num_queries=head['num_queries'],
        reg_scale=head['reg_scale'], num_denoising=head['num_denoising'])


@pytest.mark.parametrize('size', sorted(PUBLISHED_PARAMS))
def test_config_model_is_transformers_model_of_its_size(size):
    init_default_scope('mmdet')
    cfg = Config.fromfile(str(REPO_ROOT / 'configs' / 'dfine' / f'dfine_{size}.py'))
    with torch.device('meta'):
        ours = MODELS.build(cfg.model)
        theirs = DFineForObjectDetection(_reference(cfg.model))
    expected = {k: v.shape for k, v in ours.state_dict().items()}
    converted, _ = dfine_to_detector(theirs.state_dict(), expected)  # strict: names and shapes
    assert set(converted) == set(expected)
    count = sum(p.numel() for p in ours.parameters()) / 1e6
    assert abs(count - PUBLISHED_PARAMS[size]) < 1, count
