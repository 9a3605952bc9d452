"""HGNetV2Backbone against transformers 5's ``DFineForObjectDetection`` (its HGNetV2 backbone)
on the same weights: a tiny random D-FINE saved with ``save_pretrained`` and loaded through the
layout table; the presets' shapes against transformers' HGNetV2 configs (B4: its default
config; B0 / Atto / Femto / Pico: DEIMv2's conversion script's)."""
import math
import re

import pytest
import torch
from helpers import assert_close_rel
from transformers import (DFineConfig, DFineForObjectDetection, HGNetV2Backbone as HFHGNetV2,
                          HGNetV2ForImageClassification,
                          HGNetV2Config)

import vitdet_plugin  # noqa: F401
from vitdet_plugin.models.backbones import HGNetV2Arch, HGNetV2Backbone
from vitdet_plugin.weights import CheckpointError

#: A two-layer-per-block, four-stage HGNetV2 with light blocks in stages 2-3 and LAB.
TINY_HF = dict(stem_channels=[3, 8, 8], stage_in_channels=[8, 16, 24, 32],
               stage_mid_channels=[8, 8, 8, 16], stage_out_channels=[16, 24, 32, 48],
               stage_num_blocks=[1, 2, 2, 1], stage_numb_of_layers=[2, 2, 2, 2],
               stage_downsample=[False, True, True, True],
               stage_light_block=[False, False, True, True], stage_kernel_size=[3, 3, 5, 5],
               hidden_sizes=[16, 24, 32, 48], depths=[2, 2, 2, 2])
#: The same arch in our names.
TINY = dict(stem_channels=(3, 8, 8), in_channels=(8, 16, 24, 32), mid_channels=(8, 8, 8, 16),
            out_channels=(16, 24, 32, 48), num_blocks=(1, 2, 2, 1), num_layers=(2, 2, 2, 2),
            downsample=(False, True, True, True), light_block=(False, False, True, True),
            kernel_size=(3, 3, 5, 5))
#: A tiny D-FINE encoder / decoder over the tiny HGNetV2 (strides 8 / 16 / 32).
TINY_DFINE = dict(encoder_in_channels=[24, 32, 48], encoder_hidden_dim=32, encoder_ffn_dim=64,
                  encoder_attention_heads=4, d_model=32, decoder_in_channels=[32, 32, 32],
                  decoder_ffn_dim=64, decoder_layers=2, num_queries=10,
                  decoder_attention_heads=4, depth_mult=0.34, hidden_expansion=0.5,
                  num_labels=3)
SIZES = ((64, 64), (64, 96))


def perturb_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every floating parameter and saved buffer random (frozen BatchNorms keep their affine as
    buffers; non-persistent buffers such as rotary frequencies stay): conv / linear weights at
    ``1 / sqrt(fan_in)``, norm scales around 1, running variances in [0.5, 1.5], the rest
    around 0."""
    g = torch.Generator().manual_seed(seed)
    saved = set(model.state_dict())
    tensors = [(n, t) for n, t in list(model.named_parameters()) + list(model.named_buffers())
               if n in saved]
    with torch.no_grad():
        for name, t in tensors:
            if not t.is_floating_point():
                continue
            if name.endswith('running_var'):
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
            elif t.dim() > 1:
                t.copy_(torch.randn(t.shape, generator=g) / math.sqrt(t[0].numel()))
            elif name.endswith(('weight', 'scale')):
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=g))
            else:
                t.copy_(0.2 * torch.randn(t.shape, generator=g))
    return model


def dfine_reference(**backbone: object) -> DFineForObjectDetection:
    """A tiny random ``DFineForObjectDetection`` in eval mode (fp32); by default with LAB and
    the stride 8 / 16 / 32 stages."""
    backbone = dict(dict(use_learnable_affine_block=True, out_indices=[2, 3, 4]), **backbone)
    config = DFineConfig(backbone_config=HGNetV2Config(**{**TINY_HF, **backbone}),
                         **TINY_DFINE)
    torch.manual_seed(0)
    return perturb_(DFineForObjectDetection(config)).eval()


@pytest.fixture(scope='module')
def dfine(tmp_path_factory):
    model = dfine_reference()
    folder = tmp_path_factory.mktemp('dfine')
    model.save_pretrained(folder)
    return model, str(folder)


def test_dfine_backbone_matches_transformers(dfine):
    ref, folder = dfine
    ours = HGNetV2Backbone(arch=TINY, out_indices=(1, 2, 3), use_lab=True,
                           init_cfg=dict(type='Pretrained', checkpoint=folder))
    ours.init_weights()
    ours.eval()
    assert ours.init_report.layout == 'D-FINE transformers DFine'
    assert ours.out_channels == (24, 32, 48) and ours.out_strides == (8, 16, 32)
    for h, w in SIZES:
        x = torch.randn(2, 3, h, w, generator=torch.Generator().manual_seed(h + w))
        with torch.no_grad():
            want = ref.model.backbone.model(x).feature_maps
            got = ours(x)
        assert_close_rel(got, want)


def _hf_names(key: str) -> str:
    """Our HGNetV2 name -> transformers' (for comparing the presets' shapes)."""
    key = re.sub(r'^stem\.', 'embedder.', key)
    key = re.sub(r'^stages\.', 'encoder.stages.', key)
    return key.replace('.conv.', '.convolution.').replace('.bn.', '.normalization.')


#: DEIMv2's conversion script's HGNetV2 configs (transformers' names).
DEIMV2_HF = {
    'B0': dict(stem_channels=[3, 16, 16], stage_in_channels=[16, 64, 256, 512],
               stage_mid_channels=[16, 32, 64, 128], stage_out_channels=[64, 256, 512, 1024],
               stage_num_blocks=[1, 1, 2, 1], stage_kernel_size=[3, 3, 5, 5],
               stage_numb_of_layers=[3, 3, 3, 3]),
    'Atto': dict(stem_channels=[3, 16, 16], stage_in_channels=[16, 64, 256],
                 stage_mid_channels=[16, 32, 64], stage_out_channels=[64, 256, 256],
                 stage_num_blocks=[1, 1, 1], stage_downsample=[False, True, True],
                 stage_light_block=[False, False, True], stage_kernel_size=[3, 3, 3],
                 stage_numb_of_layers=[3, 3, 3]),
    'Femto': dict(stem_channels=[3, 16, 16], stage_in_channels=[16, 64, 256],
                  stage_mid_channels=[16, 32, 64], stage_out_channels=[64, 256, 512],
                  stage_num_blocks=[1, 1, 1], stage_downsample=[False, True, True],
                  stage_light_block=[False, False, True], stage_kernel_size=[3, 3, 5],
                  stage_numb_of_layers=[3, 3, 3]),
    'Pico': dict(stem_channels=[3, 16, 16], stage_in_channels=[16, 64, 256],
                 stage_mid_channels=[16, 32, 64], stage_out_channels=[64, 256, 512],
                 stage_num_blocks=[1, 1, 2], stage_downsample=[False, True, True],
                 stage_light_block=[False, False, True], stage_kernel_size=[3, 3, 5],
                 stage_numb_of_layers=[3, 3, 3]),
    'B4': {},  # transformers' default HGNetV2Config
}


@pytest.mark.parametrize('arch', sorted(DEIMV2_HF))
def test_preset_shapes_match_transformers(arch):
    hf_cfg = dict(DEIMV2_HF[arch])
    if hf_cfg:
        hf_cfg.update(hidden_sizes=hf_cfg['stage_out_channels'],
                      depths=hf_cfg['stage_numb_of_layers'])
    with torch.device('meta'):
        ref = HFHGNetV2(HGNetV2Config(use_learnable_affine_block=True, **hf_cfg))
        ours = HGNetV2Backbone(arch=arch, out_indices=(len(HGNetV2Arch.PRESETS[arch]
                                                             ['out_channels']) - 1,),
                               use_lab=True)
    want = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    got = {_hf_names(k): tuple(v.shape) for k, v in ours.state_dict().items()}
    assert got == want


def test_contract_lab_without_decay_and_stage_layer_ids():
    ours = HGNetV2Backbone(arch=TINY, out_indices=(0, 3), use_lab=True, frozen_stages=1)
    assert ours.out_channels == (16, 48) and ours.out_strides == (4, 32)
    assert ours.num_layers == 4
    assert ours.layer_id('stem.stem1.conv.weight') == 0
    assert ours.layer_id('stages.2.blocks.0.aggregation.0.conv.weight') == 3
    no_decay = ours.no_weight_decay()
    assert 'stages.1.blocks.0.layers.0.lab.scale' in no_decay
    assert 'stages.1.blocks.0.layers.0.bn.weight' in no_decay
    assert 'stages.1.blocks.0.layers.0.conv.weight' not in no_decay
    assert not any(p.requires_grad for p in ours.stages[0].parameters())
    assert all(p.requires_grad for p in ours.stages[1].parameters())
    ours.train()
    assert not ours.stem.stem1.bn.training and ours.stages[1].blocks[0].layers[0].bn.training


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match=r"unknown HGNetV2 arch 'B9'; choose one of"):
        HGNetV2Backbone(arch='B9')
    with pytest.raises(ValueError, match=r'out_indices=\(1, 4\) must be ascending stage '
                                         r'indices in \[0, 3\] \(this arch has 4 stages\)'):
        HGNetV2Backbone(arch='B0', out_indices=(1, 4))
    with pytest.raises(ValueError, match=r'in_channels=\(8, 16, 24, 30\) must be the stem '
                                         r'output then each previous stage output'):
        HGNetV2Backbone(arch={**TINY, 'in_channels': (8, 16, 24, 30)})


def test_checkpoint_of_another_size_is_refused(dfine):
    _, folder = dfine
    ours = HGNetV2Backbone(arch='Atto', out_indices=(2,), use_lab=True,
                           init_cfg=dict(type='Pretrained', checkpoint=folder))
    with pytest.raises(CheckpointError, match='does not match HGNetV2Backbone: shape mismatch'):
        ours.init_weights()


def test_odd_sizes_meta_build_and_own_checkpoint_round_trip(tmp_path):
    """Odd sizes follow the declared strides (ceil), a meta build gives the same shapes, and a
    checkpoint of ours (the reference repositories' names) loads back through ``init_cfg``."""
    ref = perturb_(HGNetV2Backbone(arch=TINY, out_indices=(0, 1, 2, 3), use_lab=True)).eval()
    x = torch.randn(1, 3, 61, 45)
    with torch.no_grad():
        outs = ref(x)
    assert [tuple(o.shape[2:]) for o in outs] == [(-(-61 // s), -(-45 // s))
                                                  for s in ref.out_strides]
    with torch.device('meta'):
        meta = HGNetV2Backbone(arch=TINY, out_indices=(0, 1, 2, 3), use_lab=True).eval()
        assert [o.shape for o in meta(torch.empty(1, 3, 61, 45))] == [o.shape for o in outs]
    path = tmp_path / 'hgnetv2.pth'
    torch.save(dict(state_dict=ref.state_dict()), path)
    ours = HGNetV2Backbone(arch=TINY, out_indices=(0, 1, 2, 3), use_lab=True,
                           init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    ours.init_weights()
    assert ours.init_report.layout == 'HGNetV2 official'
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(),
                                                  ref.state_dict().values()))


def test_transformers_hgnetv2_classifier_folder_loads(tmp_path):
    """An ``HGNetV2ForImageClassification`` folder (the ImageNet weights' form): the backbone
    loads, the classifier is dropped."""
    ref = perturb_(HGNetV2ForImageClassification(HGNetV2Config(
        **TINY_HF, use_learnable_affine_block=True, num_labels=5))).eval()
    ref.save_pretrained(tmp_path)
    ours = HGNetV2Backbone(arch=TINY, out_indices=(3,), use_lab=True,
                           init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path)))
    ours.init_weights()
    assert ours.init_report.layout == 'HGNetV2 transformers HGNetV2'
    assert {k.split('.')[0] for k in ours.init_report.dropped} == {'fc'}
    x = torch.randn(1, 3, 64, 96)
    with torch.no_grad():
        want = ref.encoder(ref.embedder(x)).last_hidden_state
        assert_close_rel(ours.eval()(x), (want,))


def test_three_stage_model_starts_from_four_stage_weights(tmp_path):
    """DEIMv2's Femto / Pico start from B0's ImageNet weights (the reference loads them
    non-strictly): a three-stage model takes a four-stage checkpoint's stem and first three
    stages, the fourth reported as dropped."""
    ref = perturb_(HGNetV2Backbone(arch=TINY, use_lab=True))
    path = tmp_path / 'b0_like.pth'
    torch.save(dict(state_dict=ref.state_dict()), path)
    three = {k: v[:3] if isinstance(v, tuple) and k != 'stem_channels' else v
             for k, v in TINY.items()}
    ours = HGNetV2Backbone(arch=three, out_indices=(2,), use_lab=True,
                           init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    ours.init_weights()
    assert ours.init_report.dropped and all(k.startswith('stages.3.')
                                            for k in ours.init_report.dropped)
    want = ref.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in ours.state_dict().items())
