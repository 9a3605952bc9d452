"""LayerDecayOptimWrapperConstructor: exact lr multipliers and weight decays per parameter."""
import pytest
import torch
from mmengine.registry import OPTIM_WRAPPER_CONSTRUCTORS
from torch import nn

import vitdet_plugin  # noqa: F401
from vitdet_plugin.engine import LayerDecayOptimWrapperConstructor
from vitdet_plugin.models.backbones import SwinBackbone, ViTBackbone
from vitdet_plugin.models.necks import ViTSimpleFPN

LR, WD, RATE = 1e-4, 0.1, 0.7


class Detector(nn.Module):
    """Stands in for an mmdet detector: ``backbone``, ``neck`` and a head."""

    def __init__(self, backbone: nn.Module, neck: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        self.neck = neck
        self.head = nn.Sequential(nn.Conv2d(8, 4, 1), nn.GroupNorm(2, 4))


def build(model, **paramwise):
    ctor = OPTIM_WRAPPER_CONSTRUCTORS.build(dict(
        type='LayerDecayOptimWrapperConstructor',
        optim_wrapper_cfg=dict(type='OptimWrapper',
                               optimizer=dict(type='AdamW', lr=LR, weight_decay=WD)),
        paramwise_cfg=dict(layer_decay_rate=RATE, **paramwise)))
    wrapper = ctor(model)
    table = {}
    for group in wrapper.optimizer.param_groups:
        for name in group['param_names']:
            assert name not in table
            table[name] = (group['lr'] / LR, group['weight_decay'], group['layer_id'])
    return wrapper, table


def vit_detector(**kwargs):
    vit = ViTBackbone(arch=dict(embed_dims=32, depth=6, num_heads=2),
                      global_attn_indexes=(2, 5), window_size=4, img_size=64,
                      residual_block_indexes=(4,), **kwargs)
    return Detector(vit, ViTSimpleFPN(in_channels=32, out_channels=8))


def test_registered_under_our_name():
    assert OPTIM_WRAPPER_CONSTRUCTORS.get('LayerDecayOptimWrapperConstructor') is \
        LayerDecayOptimWrapperConstructor


def test_vit_groups():
    model = vit_detector()
    wrapper, t = build(model)
    n = 6  # blocks; layers 0..7
    approx = pytest.approx
    expect = {
        'backbone.patch_embed.proj.weight': (RATE ** (n + 1), WD, 0),
        'backbone.patch_embed.proj.bias': (RATE ** (n + 1), 0.0, 0),
        'backbone.pos_embed': (RATE ** (n + 1), 0.0, 0),
        'backbone.blocks.0.attn.qkv.weight': (RATE ** n, WD, 1),
        'backbone.blocks.0.attn.qkv.bias': (RATE ** n, 0.0, 1),
        'backbone.blocks.0.norm1.weight': (RATE ** n, 0.0, 1),
        'backbone.blocks.0.attn.rel_pos_h': (RATE ** n, 0.0, 1),
        'backbone.blocks.2.attn.rel_pos_w': (RATE ** (n - 2), 0.0, 3),
        'backbone.blocks.3.mlp.fc1.weight': (RATE ** (n - 3), WD, 4),
        'backbone.blocks.5.mlp.fc2.weight': (RATE, WD, 6),
        'backbone.blocks.5.norm2.bias': (RATE, 0.0, 6),
        # detectron2: residual conv blocks are new layers at the full rate
        'backbone.blocks.4.residual.conv1.weight': (1.0, WD, 7),
        'backbone.blocks.4.residual.norm1.weight': (1.0, 0.0, 7),
        'neck.lateral_convs.0.conv.weight': (1.0, WD, 7),
        'neck.lateral_convs.0.norm.weight': (1.0, 0.0, 7),
        'neck.scales.0.1.weight': (1.0, 0.0, 7),
        'neck.scales.0.0.bias': (1.0, 0.0, 7),
        'head.0.weight': (1.0, WD, 7),
        'head.1.weight': (1.0, 0.0, 7),
    }
    for name, (scale, wd, layer) in expect.items():
        assert t[name] == (approx(scale), approx(wd), layer), name
    assert set(t) == {k for k, _ in model.named_parameters()}
    # one group per (layer, decay)
    assert len(wrapper.optimizer.param_groups) == len({(v[2], v[1]) for v in t.values()})


def test_vit_num_layers_override_and_frozen_params():
    model = vit_detector(frozen_stages=1)
    _, t = build(model, num_layers=8)
    assert 'backbone.blocks.0.attn.qkv.weight' not in t  # frozen: not optimized
    assert 'backbone.patch_embed.proj.weight' not in t
    assert t['backbone.blocks.1.attn.qkv.weight'][0] == pytest.approx(RATE ** 7)
    assert t['neck.lateral_convs.0.conv.weight'][:2] == (pytest.approx(1.0), WD)
    with pytest.raises(ValueError, match="num_layers=4 is smaller than the backbone's 6 "
                                         'layers'):
        build(vit_detector(), num_layers=4)


def test_swin_groups():
    swin = SwinBackbone(arch=dict(embed_dims=16, depths=(2, 2, 6, 2), num_heads=(1, 2, 4, 8)),
                        window_size=4, use_abs_pos_embed=True)
    model = Detector(swin, nn.Conv2d(16, 8, 1))
    _, t = build(model)
    L = 12  # blocks over all stages; layers 0..13
    approx = pytest.approx
    expect = {
        'backbone.patch_embed.proj.weight': (RATE ** (L + 1), WD, 0),
        'backbone.patch_embed.norm.weight': (RATE ** (L + 1), 0.0, 0),
        'backbone.absolute_pos_embed': (RATE ** (L + 1), 0.0, 0),
        'backbone.layers.0.blocks.0.attn.qkv.weight': (RATE ** L, WD, 1),
        'backbone.layers.0.blocks.1.attn.relative_position_bias_table': (RATE ** (L - 1), 0.0,
                                                                          2),
        'backbone.layers.0.downsample.reduction.weight': (RATE ** (L - 1), WD, 2),
        'backbone.layers.0.downsample.norm.weight': (RATE ** (L - 1), 0.0, 2),
        'backbone.layers.2.blocks.3.mlp.fc1.weight': (RATE ** (L + 1 - 8), WD, 8),
        'backbone.layers.2.blocks.3.mlp.fc1.bias': (RATE ** (L + 1 - 8), 0.0, 8),
        'backbone.layers.2.downsample.reduction.weight': (RATE ** (L + 1 - 10), WD, 10),
        'backbone.layers.3.blocks.1.norm2.weight': (RATE, 0.0, 12),
        'backbone.norm3.weight': (1.0, 0.0, 13),
        'backbone.norm0.bias': (1.0, 0.0, 13),
        'neck.weight': (1.0, WD, 13),
    }
    for name, (scale, wd, layer) in expect.items():
        assert t[name] == (approx(scale), approx(wd), layer), name


def test_vit_backbone_alone_and_optimizer_step():
    vit = ViTBackbone(arch=dict(embed_dims=32, depth=2, num_heads=2), img_size=64,
                      window_size=4)
    wrapper, t = build(vit)
    assert t['blocks.1.attn.proj.weight'][0] == pytest.approx(RATE)
    assert t['patch_embed.proj.weight'][0] == pytest.approx(RATE ** 3)
    before = vit.blocks[0].mlp.fc1.weight.detach().clone()
    loss = vit(torch.randn(1, 3, 64, 64))[0].square().mean()
    wrapper.update_params(loss)
    assert not torch.equal(before, vit.blocks[0].mlp.fc1.weight)


def test_bad_configs():
    with pytest.raises(ValueError, match=r"paramwise_cfg has unsupported keys \['custom_keys'\]"):
        build(vit_detector(), custom_keys={})
    with pytest.raises(ValueError, match=r'layer_decay_rate=1.5 must be in \(0, 1\]'):
        OPTIM_WRAPPER_CONSTRUCTORS.build(dict(
            type='LayerDecayOptimWrapperConstructor',
            optim_wrapper_cfg=dict(optimizer=dict(type='AdamW', lr=LR)),
            paramwise_cfg=dict(layer_decay_rate=1.5)))
    with pytest.raises(TypeError, match=r'Linear does not declare the backbone contract \(out_'
                                        r'channels, out_strides, num_layers, layer_id, '
                                        r'no_weight_decay\); derive it from'):
        build(Detector(nn.Linear(2, 2), nn.Identity()))


class QueryDetector(Detector):
    """A detector with DETR / Mask2Former-style embeddings in its head."""

    def __init__(self, backbone: nn.Module, neck: nn.Module) -> None:
        super().__init__(backbone, neck)
        self.query_embed = nn.Embedding(4, 8)
        self.level_embed = nn.Parameter(torch.zeros(3, 8))


def test_extra_no_decay_names_match_any_name_component():
    base = vit_detector()
    model = QueryDetector(base.backbone, base.neck)
    _, t = build(model)
    assert t['query_embed.weight'][1] == WD and t['level_embed'][1] == WD
    _, t = build(model, extra_no_decay_names=['query_embed', 'level_embed'])
    assert t['query_embed.weight'][1] == 0.0 and t['level_embed'][1] == 0.0
    assert t['backbone.pos_embed'][1] == 0.0  # the defaults stay
    assert t['head.0.weight'][1] == WD
    _, t = build(model, no_decay_names=['query_embed'])  # replaces the defaults
    assert t['query_embed.weight'][1] == 0.0 and t['level_embed'][1] == WD
    assert t['backbone.pos_embed'][1] == 0.0  # the backbone's contract still applies
    with pytest.raises(ValueError, match=r"extra_no_decay_names='query_embed' must be a list of "
                                         r"names, e.g. \['query_embed'\]"):
        build(model, extra_no_decay_names='query_embed')


def test_lr_mults_scale_whole_modules_on_top_of_the_decay():
    """RF-DETR's recipe: the ViT at 0.735 of its layer-decayed lr, the decoder at 0.7; the
    longest module name wins, parameters outside every listed module keep 1."""
    model = QueryDetector(vit_detector().backbone, ViTSimpleFPN(in_channels=32, out_channels=8))
    _, plain = build(model)
    _, t = build(model, lr_mults={'backbone': 0.5, 'head': 0.7, 'head.1': 0.2})
    assert t['backbone.blocks.3.attn.qkv.weight'][0] == pytest.approx(
        0.5 * plain['backbone.blocks.3.attn.qkv.weight'][0])
    assert t['backbone.pos_embed'][0] == pytest.approx(0.5 * RATE ** 7)
    assert t['head.0.weight'][0] == pytest.approx(0.7)
    assert t['head.1.weight'][0] == pytest.approx(0.2)  # head.1 is longer than head
    assert t['neck.scales.0.1.weight'][0] == t['query_embed.weight'][0] == 1.0
    with pytest.raises(ValueError, match=r"^lr_mults=\{'head': 0.0\} must be positive "
                                         r'multipliers$'):
        build(model, lr_mults={'head': 0})
