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
from vitdet_plugin.weights import CheckpointError

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


#: transformers' DEIMv2 conversion script's ViTs (``DINOV3_PRESETS`` of
#: convert_deimv2_original_pytorch_checkpoint_to_hf.py) and its DINOv3STAs settings.
HF_PRESETS = {
    'S': (dict(hidden_size=192, num_attention_heads=3, intermediate_size=768,
               num_register_tokens=0, key_bias=False, apply_layernorm=False), 16, 192),
    'M': (dict(hidden_size=256, num_attention_heads=4, intermediate_size=1024,
               num_register_tokens=0, key_bias=False, apply_layernorm=False), 16, 256),
    'L': (dict(hidden_size=384, num_attention_heads=6, intermediate_size=1536,
               num_register_tokens=4, key_bias=True, layerscale_value=1e-5), 32, 224),
    'X': (dict(hidden_size=384, num_attention_heads=6, intermediate_size=1536,
               use_gated_mlp=True, num_register_tokens=4, key_bias=True,
               layerscale_value=1e-5), 64, 256),
}


@pytest.mark.parametrize('arch', sorted(HF_PRESETS))
def test_presets_match_transformers_conversion_configs(arch):
    """Each preset has transformers' DEIMv2 conv encoder's parameters but for: its mask token;
    the k bias (L / X: transformers keeps one, the original masks it to zero; S / M: the
    original's, which transformers drops); S / M's LayerScale and final norm (transformers
    adds them at 1 / identity, the original ViT-Tiny has none)."""
    vit, c, hidden = HF_PRESETS[arch]
    taps = (3, 7, 11) if arch in 'SM' else (5, 8, 11)
    config = Deimv2Config(backbone_config=DINOv3ViTConfig(
        num_hidden_layers=12, out_indices=[t + 1 for t in taps], **vit),
        **{**TINY_DEIMV2, 'encoder_hidden_dim': hidden, 'spatial_tuning_adapter_inplanes': c,
           'encoder_in_channels': [hidden] * 3})
    with torch.device('meta'):
        ref = Deimv2ForObjectDetection(config).model.conv_encoder
        ours = DINOv3STABackbone(arch=arch)
    dim, depth = vit['hidden_size'], 12
    tiny_vit = arch in 'SM'
    extra = dim * depth * (1 if tiny_vit else -1)            # k bias
    missing = dim + (2 * dim * depth + 2 * dim if tiny_vit else 0)  # mask, LayerScale, norm
    assert (sum(p.numel() for p in ours.parameters())
            == sum(p.numel() for p in ref.parameters()) + extra - missing)
    assert ours.vit.embed_dims == dim and ours.out_channels == (hidden,) * 3
    assert ours.vit.out_indices == taps and ours.vit.global_attn_indexes == tuple(range(12))
    assert (ours.vit.norm is not None) == (not tiny_vit)


def test_layer_ids_and_no_decay():
    ours = DINOv3STABackbone(arch='S', vit=TINY_VIT, taps=(0, 1, 2), sta_channels=8,
                             hidden_dim=32)
    assert ours.num_layers == 4
    assert ours.layer_id('vit.patch_embed.proj.weight') == 0
    assert ours.layer_id('vit.blocks.3.attn.qkv.weight') == 4
    assert ours.layer_id('sta.conv2.conv.weight') == 5
    no_decay = ours.no_weight_decay()
    assert {'fusion_proj.0.norm.weight', 'vit.cls_token', 'vit.blocks.0.ls1.gamma'} <= no_decay
    assert 'fusion_proj.0.conv.weight' not in no_decay


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
    with pytest.raises(ValueError, match=r'needs a ViT patch that divides 32 \(its taps are '
                                         r'resized to strides \(8, 16, 32\) of inputs padded '
                                         r"to 32\), got patch 12: give vit_args=dict\("
                                         r"patch_size=16\) \(DEIMv2's\) or 8"):
        DINOv3STABackbone(arch='S', vit=TINY_VIT, taps=(0, 1, 2), vit_args=dict(patch_size=12))
    # another patch that divides 32 keeps the strides
    fine = DINOv3STABackbone(arch='S', vit=TINY_VIT, taps=(0, 1, 2), sta_channels=8,
                             hidden_dim=32, vit_args=dict(patch_size=8))
    with torch.no_grad():
        maps = fine(torch.zeros(1, 3, 64, 96))
    assert [tuple(m.shape[-2:]) for m in maps] == [(8, 12), (4, 6), (2, 3)]


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


def test_distilled_vit_checkpoint_loads_without_its_identity_layerscale(tmp_path):
    """transformers' DEIMv2 S / M folders give the ViT-Tiny (no LayerScale, no registers, no
    final norm, q / k / v biases) a LayerScale of 1, a final norm and no k bias: ours drops the
    first two and reads a zero k bias; outputs equal on taps before the last block (transformers
    normalises its last block's tap, the original does not)."""
    vit_hf = dict(TINY_VIT_HF, num_register_tokens=0, apply_layernorm=False)
    config = Deimv2Config(backbone_config=DINOv3ViTConfig(**vit_hf), **TINY_DEIMV2)
    torch.manual_seed(0)
    ref = perturb_(Deimv2ForObjectDetection(config)).eval()
    backbone = ref.model.conv_encoder.backbone
    with torch.no_grad():
        for layer in backbone.model.layer:
            layer.layer_scale1.lambda1.fill_(1.0)
            layer.layer_scale2.lambda1.fill_(1.0)
    ref.save_pretrained(tmp_path)
    vit = dict(TINY_VIT, qkv_bias='qkv', layer_scale=None, num_reg_tokens=0)
    ours = DINOv3STABackbone(arch='S', vit=vit, taps=(0, 1, 2), final_norm=False,
                             sta_channels=8, hidden_dim=32,
                             init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path)))
    ours.init_weights()
    dropped = ours.init_report.dropped
    assert 'model.conv_encoder.backbone.layer.0.layer_scale1.lambda1' in dropped  # on disk
    assert not ours.vit.blocks[0].attn.qkv.bias[32:64].any()  # the k rows
    x = torch.randn(1, 3, 64, 96)
    with torch.no_grad():
        assert_close_rel(ours.eval()(x), ref.model.conv_encoder(x))
    with torch.no_grad():
        backbone.model.layer[1].layer_scale2.lambda1.mul_(2)
    ref.save_pretrained(tmp_path / 'scaled')
    ours = DINOv3STABackbone(arch='S', vit=vit, taps=(0, 1, 2), final_norm=False,
                             sta_channels=8, hidden_dim=32,
                             init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'scaled')))
    with pytest.raises(CheckpointError, match=r'layer\.1\.layer_scale2\.lambda1 is not 1\) and '
                                              r"DINOv3STABackbone's has none: build it with "
                                              r'vit=dict\(\.\.\., layer_scale=1\.0\)'):
        ours.init_weights()


def test_exported_backbone_keeps_the_input_size_symbolic(tmp_path):
    """Exported at one size (torch's dynamo exporter, dynamic H / W), onnxruntime runs another
    and gives the module's maps (the taps' resize follows the input, not the sample)."""
    import onnxruntime as ort
    torch.manual_seed(0)
    ours = DINOv3STABackbone(arch='S', vit=TINY_VIT, taps=(0, 1, 2), sta_channels=8,
                             hidden_dim=32).eval()
    path = str(tmp_path / 'sta.onnx')
    h, w = torch.export.Dim('h', min=2, max=64), torch.export.Dim('w', min=2, max=64)
    torch.onnx.export(ours, (torch.randn(1, 3, 64, 96),), path, dynamo=True,
                      dynamic_shapes=({2: 32 * h, 3: 32 * w},), external_data=False)
    session = ort.InferenceSession(path, providers=['CPUExecutionProvider'])
    x = torch.randn(1, 3, 96, 160, generator=torch.Generator().manual_seed(1))
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        want = ours(x)
    assert [tuple(g.shape) for g in got] == [tuple(t.shape) for t in want]
    assert_close_rel([torch.from_numpy(g) for g in got], list(want), 1e-4)
