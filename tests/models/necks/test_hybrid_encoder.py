"""HybridEncoder and LiteEncoder against transformers 5's encoders on the same weights (tiny
random detectors saved with ``save_pretrained``, loaded through the layout table):

* D-FINE (``DFineHybridEncoder`` after ``DFineModel.encoder_input_proj``): concatenating
  fusion, RepNCSPELAN4 with D-FINE's CSP layers;
* DEIMv2 over HGNetV2 (``Deimv2HybridEncoder`` after ``Deimv2ConvEncoder``'s projections):
  summing fusion, RepNCSPELAN4 with split CSP layers;
* DEIMv2 over DINOv3 + STA: RepNCSPELAN5, no input projection;
* DEIMv2's lite sizes (``Deimv2LiteEncoder``).
"""
import pytest
import torch
from helpers import assert_close_rel
from test_dinov3_sta import deimv2_dinov3_reference
from test_hgnetv2 import SIZES, TINY, TINY_DFINE, TINY_HF, dfine_reference, perturb_
from transformers import Deimv2Config, Deimv2ForObjectDetection, HGNetV2Config

import vitdet_plugin  # noqa: F401
from vitdet_plugin.models.backbones import HGNetV2Backbone
from vitdet_plugin.models.necks import HybridEncoder, LiteEncoder
from vitdet_plugin.weights import CheckpointError

#: Our encoder for the tiny references (width 32, 4 heads, one RepVGG block, branch 8).
TINY_ENCODER = dict(hidden_dim=32, num_heads=4, ffn_dim=64, expansion=0.5, depth_mult=0.34)


def _save(model, tmp_path_factory, name: str) -> str:
    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder)
    return str(folder)


def _inputs(channels, strides, h, w):
    g = torch.Generator().manual_seed(h + w)
    return [torch.randn(2, c, h // s, w // s, generator=g) for c, s in zip(channels, strides)]


def _loaded(cls, folder: str, **kwargs):
    ours = cls(init_cfg=dict(type='Pretrained', checkpoint=folder), **kwargs)
    ours.init_weights()
    return ours.eval()


def deimv2_hgnetv2_reference(lite: bool) -> Deimv2ForObjectDetection:
    """A tiny DEIMv2 over the tiny HGNetV2: hybrid (strides 8-32) or lite (stride 16 in)."""
    extra = (dict(encoder_type='lite', encoder_in_channels=[32], feat_strides=[16],
                  encoder_layers=0, decoder_in_channels=[32, 32], num_feature_levels=2)
             if lite else {})
    backbone = HGNetV2Config(**TINY_HF, use_learnable_affine_block=True,
                             out_indices=[3] if lite else [2, 3, 4])
    config = Deimv2Config(backbone_config=backbone, **{**TINY_DFINE, **extra})
    torch.manual_seed(0)
    return perturb_(Deimv2ForObjectDetection(config)).eval()


@pytest.fixture(scope='module')
def folders(tmp_path_factory):
    refs = {'dfine': dfine_reference(),
            'deimv2': deimv2_hgnetv2_reference(lite=False),
            'deimv2_dinov3': deimv2_dinov3_reference(apply_layernorm=True),
            'deimv2_lite': deimv2_hgnetv2_reference(lite=True)}
    return {k: (m, _save(m, tmp_path_factory, k)) for k, m in refs.items()}


def _hf_encoder(name: str, ref, feats):
    """transformers' encoder outputs on ``feats`` (its inputs after the backbone)."""
    model = ref.model
    if name == 'dfine':
        proj = [p(f) for p, f in zip(model.encoder_input_proj, feats)]
        return model.encoder(proj).last_hidden_state
    if name == 'deimv2':
        proj = [p(f) for p, f in zip(model.conv_encoder.encoder_input_proj, feats)]
        return model.encoder(proj).feature_maps
    return model.encoder(list(feats)).feature_maps


CASES = {
    'dfine': (HybridEncoder, dict(in_channels=(24, 32, 48), fuse_op='cat', version='dfine',
                                  csp_type='csp'), (8, 16, 32)),
    'deimv2': (HybridEncoder, dict(in_channels=(24, 32, 48), fuse_op='sum', version='dfine',
                                   csp_type='csp2'), (8, 16, 32)),
    'deimv2_dinov3': (HybridEncoder, dict(in_channels=(32, 32, 32), fuse_op='sum',
                                          version='deim', csp_type='csp2', input_proj=False),
                      (8, 16, 32)),
    'deimv2_lite': (LiteEncoder, dict(in_channels=(32,), in_strides=(16,)), (16,)),
}


@pytest.mark.parametrize('name', sorted(CASES))
def test_encoder_matches_transformers(folders, name):
    ref, folder = folders[name]
    cls, args, strides = CASES[name]
    kwargs = dict(TINY_ENCODER, **args)
    if cls is LiteEncoder:
        kwargs.pop('num_heads'), kwargs.pop('ffn_dim')
    else:
        kwargs['in_strides'] = strides
    ours = _loaded(cls, folder, **kwargs)
    assert ours.out_channels == (32,) * len(ours.out_strides)
    for h, w in SIZES:
        feats = _inputs(args['in_channels'], strides, h, w)
        with torch.no_grad():
            want = _hf_encoder(name, ref, [f.clone() for f in feats])
            got = ours(feats)
        assert_close_rel(got, want)


def test_lite_encoder_outputs_two_strides():
    ours = LiteEncoder(in_channels=(32,), in_strides=(16,), hidden_dim=32)
    assert ours.out_strides == (16, 32)
    fine, coarse = ours([torch.randn(1, 32, 4, 6)])
    assert fine.shape == (1, 32, 4, 6) and coarse.shape == (1, 32, 2, 3)


def test_encoder_of_another_layout_is_refused(folders):
    _, folder = folders['deimv2_lite']
    ours = HybridEncoder(in_channels=(32,) * 3, input_proj=False, fuse_op='sum',
                         version='deim', csp_type='csp2', **TINY_ENCODER,
                         init_cfg=dict(type='Pretrained', checkpoint=folder))
    want = (r'a DEIMv2 checkpoint \(transformers Deimv2 layout\) holds a LiteEncoder \(its '
            r"encoder keys\), not a HybridEncoder: build type='LiteEncoder'")
    with pytest.raises(CheckpointError, match=want):
        ours.init_weights()


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match=r'input_proj=False needs inputs of hidden_dim=32 '
                                         r'channels, got in_channels=\(24, 32, 48\): give '
                                         r'input_proj=True'):
        HybridEncoder(in_channels=(24, 32, 48), hidden_dim=32, input_proj=False)
    with pytest.raises(ValueError, match=r"fuse_op='add' is not one of \['cat', 'sum'\]"):
        HybridEncoder(fuse_op='add')
    with pytest.raises(ValueError, match=r'in_strides=\(8, 16, 64\) must double'):
        HybridEncoder(in_strides=(8, 16, 64))
    with pytest.raises(ValueError, match=r'LiteEncoder takes one input level'):
        LiteEncoder(in_channels=(16, 32), in_strides=(16, 32))


@pytest.mark.parametrize('name', ['dfine', 'deimv2'])
def test_backbone_then_encoder_end_to_end(folders, name):
    """Pixels -> our HGNetV2 -> our encoder equals transformers' backbone, projections and
    encoder (the encoder outputs ``DFineModel`` / ``Deimv2Model`` feed the decoder)."""
    ref, folder = folders[name]
    backbone = _loaded(HGNetV2Backbone, folder, arch=TINY, out_indices=(1, 2, 3), use_lab=True)
    cls, args, strides = CASES[name]
    neck = _loaded(cls, folder, in_strides=strides, **TINY_ENCODER, **args)
    for h, w in SIZES:
        x = torch.randn(1, 3, h, w, generator=torch.Generator().manual_seed(h * w))
        with torch.no_grad():
            got = neck(backbone(x))
            if name == 'dfine':
                feats = [f for f, _ in ref.model.backbone(x, torch.ones(1, h, w))]
            else:
                feats = list(ref.model.conv_encoder.model(x).feature_maps)
            want = _hf_encoder(name, ref, feats)
        assert_close_rel(got, want)
