"""DINOv3STABackbone against transformers 5's ``Deimv2ForObjectDetection`` with a DINOv3
backbone (``Deimv2DINOv3ConvEncoder``: DINOv3ViTBackbone taps + ``Deimv2SpatialTuningAdapter``
+ fusion projections) on the same weights, a tiny random model saved with ``save_pretrained``
and loaded through the layout table; the presets' sizes."""
import pytest
import torch
from helpers import assert_close_rel
from test_hgnetv2 import SIZES, perturb_
from transformers import Deimv2Config, Deimv2ForObjectDetection, DINOv3ViTConfig

import vitdet_plugin  # noqa: F401
from vitdet_plugin.models.backbones import DINOv3STABackbone

#: A 4-block, 32-wide DINOv3 (2 heads, 2 registers, no k bias), tapped after blocks 0, 1, 2.
TINY_VIT_HF = dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=4,
                   intermediate_size=64, num_register_tokens=2, out_indices=[1, 2, 3])
TINY_VIT = dict(embed_dims=32, depth=4, num_heads=2, mlp_ratio=2.0, num_reg_tokens=2,
                qkv_bias='qv', layer_scale=1.0, norm_eps=1e-5)
#: A tiny DEIMv2 encoder / decoder of width 32 over the adapter (``c = 8``).
TINY_DEIMV2 = dict(encoder_in_channels=[32, 32, 32], encoder_hidden_dim=32, encoder_ffn_dim=64,
                   encoder_attention_heads=4, d_model=32, decoder_in_channels=[32, 32, 32],
                   decoder_ffn_dim=64, decoder_layers=2, num_queries=10,
                   decoder_attention_heads=4, depth_mult=0.34, hidden_expansion=0.5,
                   num_labels=3, encoder_has_trailing_conv=False,
                   spatial_tuning_adapter_inplanes=8)


def deimv2_dinov3_reference(apply_layernorm: bool) -> Deimv2ForObjectDetection:
    config = Deimv2Config(backbone_config=DINOv3ViTConfig(apply_layernorm=apply_layernorm,
                                                          **TINY_VIT_HF), **TINY_DEIMV2)
    torch.manual_seed(0)
    return perturb_(Deimv2ForObjectDetection(config)).eval()


@pytest.fixture(scope='module', params=[False, True], ids=['no_tap_norm', 'tap_norm'])
def deimv2_dinov3(request, tmp_path_factory):
    model = deimv2_dinov3_reference(request.param)
    folder = tmp_path_factory.mktemp('deimv2_dinov3')
    model.save_pretrained(folder)
    return model, str(folder), request.param


def tiny_sta(folder: str, final_norm: bool) -> DINOv3STABackbone:
    ours = DINOv3STABackbone(arch='S', vit=TINY_VIT, taps=(0, 1, 2), final_norm=final_norm,
                             sta_channels=8, hidden_dim=32,
                             init_cfg=dict(type='Pretrained', checkpoint=folder))
    ours.init_weights()
    return ours.eval()


def test_backbone_matches_transformers_conv_encoder(deimv2_dinov3):
    ref, folder, norm = deimv2_dinov3
    ours = tiny_sta(folder, norm)
    assert ours.init_report.layout == 'DEIMv2 DINOv3 transformers Deimv2 DINOv3'
    assert ours.out_channels == (32, 32, 32) and ours.out_strides == (8, 16, 32)
    for h, w in SIZES:
        x = torch.randn(2, 3, h, w, generator=torch.Generator().manual_seed(h + w))
        with torch.no_grad():
            want = ref.model.conv_encoder(x)
            got = ours(x)
        assert_close_rel(got, want)


@pytest.mark.parametrize('arch, embed, hidden, params', [
    ('S', 192, 192, 5_689_360), ('M', 256, 256, 9_974_032), ('L', 384, 224, 22_159_200),
    ('X', 384, 256, 30_105_152)])
def test_presets(arch, embed, hidden, params):
    with torch.device('meta'):
        ours = DINOv3STABackbone(arch=arch)
    assert ours.vit.embed_dims == embed and ours.out_channels == (hidden,) * 3
    assert ours.vit.global_attn_indexes == tuple(range(12))
    assert (ours.vit.norm is not None) == (arch in 'LX')
    assert sum(p.numel() for p in ours.parameters()) == params
    assert ours.layer_id('vit.blocks.3.attn.qkv.weight') == 4
    assert ours.layer_id('sta.conv2.conv.weight') == 13
    assert 'fusion_proj.0.norm.weight' in ours.no_weight_decay()


def test_bad_sizes_and_arguments_name_the_fix():
    ours = DINOv3STABackbone(arch='S', vit=TINY_VIT, taps=(0, 1, 2), sta_channels=8,
                             hidden_dim=32)
    assert ours.fit_input((60, 90)) == (64, 96)
    with pytest.raises(ValueError, match=r'multiples of 32, got 48x64: pad the batch'):
        ours(torch.zeros(1, 3, 48, 64))
    with pytest.raises(ValueError, match=r"unknown DEIMv2 DINOv3 arch 'XL'"):
        DINOv3STABackbone(arch='XL')
    with pytest.raises(ValueError, match=r"vit_args sets 'out_indices', which "
                                         r'DINOv3STABackbone sets itself'):
        DINOv3STABackbone(arch='S', vit_args=dict(out_indices=(1,)))


def test_frozen_vit_blocks_and_meta_build():
    ours = DINOv3STABackbone(arch='S', vit=TINY_VIT, taps=(0, 1, 2), sta_channels=8,
                             hidden_dim=32, frozen_stages=1).train()
    frozen = {n for n, p in ours.named_parameters() if not p.requires_grad}
    assert 'vit.patch_embed.proj.weight' in frozen and 'vit.blocks.0.attn.qkv.weight' in frozen
    assert not any(n.startswith(('vit.blocks.1.', 'sta.', 'fusion_proj.')) for n in frozen)
    assert all(not m.training for m in ours.frozen_modules())
    with torch.device('meta'):
        meta = DINOv3STABackbone(arch='S', vit=TINY_VIT, taps=(0, 1, 2), sta_channels=8,
                                 hidden_dim=32).eval()
        shapes = [tuple(o.shape) for o in meta(torch.empty(1, 3, 64, 96))]
    assert shapes == [(1, 32, 8, 12), (1, 32, 4, 6), (1, 32, 2, 3)]
