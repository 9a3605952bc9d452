"""DINOv2Backbone / DINOv3Backbone / EVA02Backbone against timm 1.0.31 with the same weights
(global attention in every block): patch tokens and input gradients at sizes that are not the
pretraining size; rope tables against timm's rope modules; the checkpoint loader (family
detection, refusals); layer ids, no-decay names, errors."""
import math

import pytest
import timm
import torch
from helpers import max_rel_err
from timm.layers.pos_embed_sincos import RotaryEmbeddingCat, RotaryEmbeddingDinoV3

import vitdet_plugin  # noqa: F401
from vitdet_plugin.functional import RopeSpec, rope_tables
from vitdet_plugin.models.backbones import (
    DINOv2Backbone,
    DINOv3Backbone,
    EVA02Backbone,
    ViTBackbone,
)
from vitdet_plugin.weights import load_pretrained
from vitdet_plugin.weights.checkpoint_io import CheckpointError
from vitdet_plugin.weights.vit_families import convert_vit_family, detect_vit_family

#: fp32 bound of the issue: max |ours - timm| / max |timm|.
TOL = 1e-5
DIMS = dict(embed_dim=64, depth=3, num_heads=4)
OURS = dict(embed_dims=64, depth=3, num_heads=4, global_attn_indexes=range(3))
#: timm model, timm kwargs, our class, our kwargs, two input sizes (square, non-square; neither
#: the pretraining size: patch-14 models are built for 56 px, patch-16 ones for 64 px).
CASES = {
    'dinov2': ('vit_small_patch14_dinov2', dict(img_size=56), DINOv2Backbone,
               dict(arch='small', pretrain_img_size=56)),
    'dinov2_reg4': ('vit_small_patch14_reg4_dinov2', dict(img_size=56), DINOv2Backbone,
                    dict(arch='small', num_reg_tokens=4, pretrain_img_size=56)),
    'dinov2_packed_swiglu': ('vit_giant_patch14_dinov2', dict(img_size=56, mlp_ratio=4.0),
                             DINOv2Backbone, dict(arch='giant', mlp_ratio=2.0,
                                                  pretrain_img_size=56)),
    'dinov3': ('vit_small_patch16_dinov3', dict(img_size=64), DINOv3Backbone,
               dict(arch='small')),
    'dinov3_qkvb': ('vit_small_patch16_dinov3_qkvb', dict(img_size=64), DINOv3Backbone,
                    dict(arch='small', qkv_bias='qv')),
    'dinov3_swiglu': ('vit_small_plus_patch16_dinov3', dict(img_size=64), DINOv3Backbone,
                      dict(arch='small_plus')),
    'eva02_packed': ('eva02_tiny_patch14_224', dict(img_size=56, ref_feat_shape=(4, 4)),
                     EVA02Backbone, dict(arch='tiny', pretrain_img_size=56,
                                         rope=dict(temperature=1e4, ref_grid=(4, 4)))),
    'eva02_sub_ln': ('eva02_base_patch14_224', dict(img_size=56, ref_feat_shape=(4, 4)),
                     EVA02Backbone, dict(arch='base', pretrain_img_size=56,
                                         rope=dict(temperature=1e4, ref_grid=(4, 4)))),
}


def timm_model(name: str, seed: int = 0, **kw) -> torch.nn.Module:
    model = timm.create_model(name, pretrained=False, num_classes=0, dynamic_img_size=True,
                              **{**DIMS, **kw}).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # random everything (biases, LayerScale, norms): all weights seen
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    return model


def ours_from_timm(case: str, **extra):
    name, timm_kw, cls, ours_kw = CASES[case]
    ref = timm_model(name, **timm_kw)
    model = cls(**{**OURS, **ours_kw, **extra}).eval()
    load_pretrained(model, ref.state_dict())
    return model, ref


def timm_patch_tokens(ref: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return ref.forward_features(x)[:, ref.num_prefix_tokens:]        # (B, N, C)


def sizes(patch: int):
    return [(5 * patch, 5 * patch), (5 * patch, 7 * patch)]


@pytest.mark.parametrize('case', list(CASES))
def test_patch_tokens_and_input_gradients_equal_timm(case):
    model, ref = ours_from_timm(case)
    g = torch.Generator().manual_seed(1)
    for hw in sizes(model.patch_size):
        x = torch.randn(2, 3, *hw, generator=g)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        (out,) = model(xa)
        ours = out.flatten(2).transpose(1, 2)                        # (B, N, C)
        theirs = timm_patch_tokens(ref, xb)
        assert ours.shape == theirs.shape == (2, hw[0] * hw[1] // model.patch_size ** 2, 64)
        assert max_rel_err(ours, theirs) <= TOL, (case, hw)
        w = torch.randn(theirs.shape, generator=g)
        (ours * w).sum().backward()
        (theirs * w).sum().backward()
        assert max_rel_err(xa.grad, xb.grad) <= TOL, (case, hw)


def test_timm_layouts_are_detected_and_converted():
    """The renames of each timm layout (and the DINOv2-reg4 cls slot) as written out."""
    for case, want in [('dinov2', ('DINOv2', 'ours')), ('dinov2_reg4', ('DINOv2', 'timm')),
                       ('dinov3', ('DINOv3', 'timm')), ('eva02_packed', ('EVA-02', 'timm')),
                       ('eva02_sub_ln', ('EVA-02', 'timm'))]:
        ref = timm_model(CASES[case][0], **CASES[case][1])
        assert detect_vit_family(ref.state_dict()) == want, case
    sd = timm_model(*CASES['eva02_sub_ln'][:1], **CASES['eva02_sub_ln'][1]).state_dict()
    out, dropped = convert_vit_family(sd, 'EVA-02')
    attn = 'blocks.1.attn.'
    assert torch.equal(out[attn + 'qkv.weight'], torch.cat(
        [sd[attn + 'q_proj.weight'], sd[attn + 'k_proj.weight'], sd[attn + 'v_proj.weight']]))
    assert torch.equal(out[attn + 'q_bias'], sd[attn + 'q_proj.bias'])
    assert torch.equal(out[attn + 'v_bias'], sd[attn + 'v_proj.bias'])
    assert not any('_proj.' in k for k in out) and dropped == ['fc_norm.weight', 'fc_norm.bias']
    sd = timm_model(*CASES['dinov3'][:1], **CASES['dinov3'][1]).state_dict()
    out, _ = convert_vit_family(sd, 'DINOv3')
    assert torch.equal(out['blocks.2.ls2.gamma'], sd['blocks.2.gamma_2'])
    sd = timm_model(*CASES['dinov2_reg4'][:1], **CASES['dinov2_reg4'][1]).state_dict()
    out, _ = convert_vit_family(sd, 'DINOv2')
    assert sd['pos_embed'].shape == (1, 16, 64) and out['pos_embed'].shape == (1, 17, 64)
    assert torch.equal(out['pos_embed'][:, 0], torch.zeros(1, 64))
    assert torch.equal(out['pos_embed'][:, 1:], sd['pos_embed'])


def test_position_grid_is_resized_to_the_stored_grid_as_timm_does(tmp_path):
    """A 518-px (37 x 37) checkpoint into a model stored at 224 px: the grid is resized
    bicubically with antialiasing (timm's resample_abs_pos_embed) and the model then equals
    timm built at 224 px from the same file."""
    big = timm_model('vit_small_patch14_dinov2', img_size=518)
    from timm.layers import resample_abs_pos_embed
    small = timm_model('vit_small_patch14_dinov2', img_size=224)
    sd = big.state_dict()
    small.load_state_dict({**sd, 'pos_embed': resample_abs_pos_embed(
        sd['pos_embed'], (16, 16), (37, 37), num_prefix_tokens=1)})
    path = tmp_path / 'dinov2.pth'
    torch.save(sd, path)
    model = DINOv2Backbone(**OURS, arch='small', pretrain_img_size=224,
                           init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    model.init_weights()
    x = torch.randn(1, 3, 70, 98)
    with torch.no_grad():
        assert max_rel_err(model.eval()(x)[0].flatten(2).transpose(1, 2),
                           timm_patch_tokens(small, x)) <= TOL


@pytest.mark.parametrize('grid', [(4, 4), (5, 7), (9, 3)])
def test_rope_tables_equal_timms_rope_modules(grid):
    eva = RotaryEmbeddingCat(dim=32, in_pixels=False, ref_feat_shape=(16, 16), temperature=1e4)
    sin, cos = eva.get_embed(grid).chunk(2, dim=-1)
    ours = rope_tables(RopeSpec('eva02', 32, 1e4, (16, 16)), grid)
    assert max_rel_err(ours[0], sin) <= 1e-6 and max_rel_err(ours[1], cos) <= 1e-6
    dino = RotaryEmbeddingDinoV3(dim=32, temperature=100)
    sin, cos = dino.get_embed(list(grid)).chunk(2, dim=-1)
    ours = rope_tables(RopeSpec('dinov3', 32, 100.0), grid)
    assert max_rel_err(ours[0], sin) <= 1e-6 and max_rel_err(ours[1], cos) <= 1e-6


def test_rope_table_of_a_padded_grid_continues_the_coordinates():
    spec = RopeSpec('dinov3', 16, 100.0)
    sin, _ = rope_tables(spec, (3, 5), (4, 6))
    inside, _ = rope_tables(spec, (3, 5))
    assert sin.shape == (24, 16)
    assert torch.equal(sin.reshape(4, 6, 16)[:3, :5].reshape(15, 16), inside)
    assert rope_tables(spec, (3, 5)) is rope_tables(spec, (3, 5))    # cached


# ---------------------------------------------------------------------------- contract
def test_layer_ids_and_exact_no_decay_names():
    model = DINOv2Backbone(arch=dict(embed_dims=32, depth=2, num_heads=2, num_reg_tokens=4,
                                     layer_scale=1e-5))
    assert model.layer_id('cls_token') == model.layer_id('reg_token') == 0
    assert model.layer_id('pos_embed') == model.layer_id('patch_embed.proj.weight') == 0
    assert model.layer_id('blocks.1.ls2.gamma') == 2 and model.layer_id('norm.weight') == 3
    per_block = {'norm1.weight', 'norm1.bias', 'norm2.weight', 'norm2.bias', 'attn.qkv.bias',
                 'attn.proj.bias', 'mlp.fc1.bias', 'mlp.fc2.bias', 'ls1.gamma', 'ls2.gamma'}
    want = {'cls_token', 'reg_token', 'pos_embed', 'patch_embed.proj.bias', 'norm.weight',
            'norm.bias'} | {f'blocks.{i}.{n}' for i in range(2) for n in per_block}
    assert model.no_weight_decay() == want
    eva = EVA02Backbone(arch=dict(embed_dims=32, depth=1, num_heads=2, mlp='swiglu',
                                  mlp_sub_ln=True, qkv_bias='qv'))
    assert eva.no_weight_decay() == {
        'cls_token', 'pos_embed', 'patch_embed.proj.bias'} | {
        f'blocks.0.{n}' for n in ('norm1.weight', 'norm1.bias', 'norm2.weight', 'norm2.bias',
                                  'attn.q_bias', 'attn.v_bias', 'attn.proj.bias',
                                  'mlp.fc1_g.bias', 'mlp.fc1_x.bias', 'mlp.norm.weight',
                                  'mlp.norm.bias', 'mlp.fc2.bias')}


def test_presets_have_timms_parameter_shapes():
    """Every preset builds the block parameter shapes of its timm model (meta device)."""
    pairs = [(DINOv2Backbone, 'giant', 'vit_giant_patch14_dinov2', {}),
             (DINOv3Backbone, 'huge_plus', 'vit_huge_plus_patch16_dinov3', {}),
             (DINOv3Backbone, 'small_plus', 'vit_small_plus_patch16_dinov3', {}),
             (EVA02Backbone, 'large', 'eva02_large_patch14_224', {}),
             (EVA02Backbone, 'tiny', 'eva02_tiny_patch14_224', {})]
    for cls, arch, name, kw in pairs:
        with torch.device('meta'):
            ours = cls(arch=arch)
            ref = timm.create_model(name, pretrained=False, num_classes=0, **kw)
        ref_sd, _ = convert_vit_family(ref.state_dict(), ours.FAMILY,
                                       {k: v.shape for k, v in ours.state_dict().items()})
        block = {k: tuple(v.shape) for k, v in ref_sd.items() if k.startswith('blocks.0.')}
        assert block == {k: tuple(v.shape) for k, v in ours.state_dict().items()
                         if k.startswith('blocks.0.')}, (cls.__name__, arch)
        assert len(ours.blocks) == len(ref.blocks)


# ---------------------------------------------------------------------------- errors
def test_checkpoint_of_another_family_names_the_backbone():
    ref = timm_model(*CASES['dinov2'][:1], **CASES['dinov2'][1])
    eva = EVA02Backbone(**OURS, arch='tiny')
    with pytest.raises(CheckpointError, match=r"^the checkpoint is a DINOv2 checkpoint \(ours "
                                              r"layout\); EVA02Backbone loads EVA-02 "
                                              r"checkpoints: build type='DINOv2Backbone'$"):
        load_pretrained(eva, ref.state_dict())
    vit = ViTBackbone(embed_dims=64, depth=3, num_heads=4, global_attn_indexes=(2,))
    sd = timm_model(*CASES['eva02_sub_ln'][:1], **CASES['eva02_sub_ln'][1]).state_dict()
    with pytest.raises(CheckpointError, match=r"^the checkpoint is an EVA-02 checkpoint \(timm "
                                              r"layout\); ViTBackbone loads ViT checkpoints: "
                                              r"build type='EVA02Backbone'$"):
        load_pretrained(vit, sd)


BAD = [
    (EVA02Backbone, dict(rope=None), r"^EVA02Backbone needs its rotary settings: rope=None "
     r"must be a dict with exactly \['ref_grid', 'temperature'\] \(EVA-02 checkpoints: "
     r"rope=\{'temperature': 10000.0, 'ref_grid': \(16, 16\)\}\)$"),
    (DINOv3Backbone, dict(rope=dict(temperature=100)), None),
    (DINOv3Backbone, dict(rope=dict()), r"DINOv3Backbone needs its rotary settings"),
    (DINOv2Backbone, dict(rope=dict(temperature=1.0)), r"^DINOv2Backbone has no rotary "
     r"position embedding \(DINOv2 uses an absolute one\): remove rope="),
    (DINOv3Backbone, dict(pretrain_img_size=224), r'^DINOv3Backbone has no absolute position '
     r'embedding \(rotary only\): remove pretrain_img_size / pretrain_patch_size$'),
    (DINOv3Backbone, dict(rope_coords='local'), r"^rope_coords='local' is not one of "
     r"\['window', 'global'\]"),
    (EVA02Backbone, dict(prefix_tokens='average'), r"^prefix_tokens='average' is not one of "
     r"\['keep', 'drop'\]"),
    (DINOv2Backbone, dict(qkv_bias='k'), r"^qkv_bias='k' is not one of \['qkv', 'qv', 'none'\]"),
    (DINOv3Backbone, dict(num_heads=16), r'^rotary embedding needs a head dim divisible by 4 '
     r'\(two axes of channel pairs\), got 2; choose embed_dims / num_heads accordingly$'),
    (DINOv2Backbone, dict(window_size=0), r'^window_size must be positive, got 0; for global '
     r'attention in every block give global_attn_indexes=range\(depth\)$'),
    (EVA02Backbone, dict(arch='huge'), r"^unknown EVA-02 arch 'huge'; choose one of \['base', "
     r"'large', 'small', 'tiny'\]"),
    (DINOv2Backbone, dict(pretrain_img_size=10), r'^pretrain_img_size=10 is smaller than the '
     r'patch \(14 pixels\): the grid it describes would be empty'),
]


@pytest.mark.parametrize('cls,kw,match', BAD, ids=[f'{c.__name__}-{k}' for c, k, _ in BAD])
def test_bad_arguments_name_the_fix(cls, kw, match):
    base = dict(embed_dims=32, depth=2, num_heads=2) if 'arch' not in kw else {}
    if match is None:  # the accepted form of the setting
        cls(**{**base, **kw})
        return
    with pytest.raises((ValueError, TypeError), match=match):
        cls(**{**base, **kw})


def test_patch_grid_maps_any_size():
    model = DINOv3Backbone(embed_dims=32, depth=2, num_heads=2, window_size=3,
                           global_attn_indexes=(1,), out_indices=(0, 1)).eval()
    with torch.no_grad():
        outs = model(torch.randn(2, 3, 61, 45))
    assert [tuple(o.shape) for o in outs] == [(2, 32, math.ceil(61 / 16), math.ceil(45 / 16))] * 2
    assert model.out_strides == (16, 16) and model.out_channels == (32, 32)


def test_detector_checkpoint_of_ours_and_dropped_tokens_are_reported():
    """Our layout under ``backbone.`` (a detector checkpoint): neck / head keys and, for a
    model built with prefix_tokens='drop', the cls / register tokens are returned as dropped."""
    src = DINOv3Backbone(**OURS, arch='small')
    sd = {f'backbone.{k}': v for k, v in src.state_dict().items()}
    sd['neck.conv.weight'] = torch.zeros(1)
    assert detect_vit_family(sd) == ('DINOv3', 'ours')
    model = DINOv3Backbone(**OURS, arch='small', prefix_tokens='drop')
    dropped = load_pretrained(model, sd).dropped
    assert sorted(dropped) == ['cls_token', 'neck.conv.weight', 'reg_token']
    assert torch.equal(model.blocks[0].attn.qkv.weight, src.blocks[0].attn.qkv.weight)
