"""DINOv3 7B (``DINOv3Backbone(arch='7b')``): the full architecture's shapes on the meta device
against timm's ``vit_7b_patch16_dinov3`` (no memory: 6.7B parameters), and a small-width
stand-in of the official 7B layout (facebookresearch/dinov3 ``dinov3_vit7b16``: no qkv bias,
SwiGLU ``w1 / w2 / w3`` aligned to 64, storage tokens, the pretraining-only
``local_cls_norm``) that loads strictly and gives timm's patch tokens."""
import re

import timm
import torch
from helpers import max_rel_err
from test_official_vit_layouts import TINY, dinov3_official, randn, tiny
from test_vit_family_loading import TOL, patch_tokens, timm_tokens

import vitdet_plugin  # noqa: F401
from vitdet_plugin.models.backbones import DINOv3Backbone
from vitdet_plugin.weights import load_pretrained

NAME = 'vit_7b_patch16_dinov3'
#: parameters of dinov3_vit7b16 without its pretraining-only tokens / norms (timm's count)
PARAMS_7B = 6_716_030_976
IMG = 64


def _timm_names(key: str) -> str:
    return re.sub(r'\.ls([12])\.gamma$', r'.gamma_\1', key)


def test_7b_full_architecture_on_meta_has_timms_shapes():
    with torch.device('meta'):
        ours = DINOv3Backbone(arch='7b')
        ref = timm.create_model(NAME, pretrained=False, num_classes=0)
    shapes = {_timm_names(k): tuple(v.shape) for k, v in ours.state_dict().items()}
    assert shapes == {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert sum(p.numel() for p in ours.parameters()) == PARAMS_7B
    block = ours.blocks[0]
    assert block.mlp.fc1_g.weight.shape == (8192, 4096)  # swiglu64 of ffn_ratio 3
    assert ours.reg_token.shape == (1, 4, 4096) and block.attn.qkv.bias is None


def test_7b_official_layout_small_width_loads_and_gives_timms_tokens():
    ref = tiny(NAME, IMG)
    official = {k: v for k, v in dinov3_official(ref.state_dict()).items()
                if '.attn.qkv.bias' not in k}  # qkv_bias=False: no bias, no bias_mask
    dim = TINY['embed_dim']
    official.update({'local_cls_norm.weight': randn(dim, seed=7),
                     'local_cls_norm.bias': randn(dim, seed=8)})
    model = DINOv3Backbone(arch='7b', embed_dims=dim, depth=TINY['depth'],
                           num_heads=TINY['num_heads'], global_attn_indexes=(0, 1)).eval()
    dropped = load_pretrained(model, {'model': official}).dropped
    assert sorted(dropped) == ['local_cls_norm.bias', 'local_cls_norm.weight',
                               'mask_token', 'rope_embed.periods']
    x = torch.randn(1, 3, 5 * 16, 7 * 16, generator=torch.Generator().manual_seed(0))
    fresh = timm.create_model(NAME, img_size=IMG, dynamic_img_size=True, **TINY).eval()
    fresh.load_state_dict(ref.state_dict())
    with torch.no_grad():
        ours, theirs = patch_tokens(model, x), timm_tokens(fresh, x, True)
    assert ours.shape == theirs.shape == (1, 35, dim)
    assert max_rel_err(ours, theirs) <= TOL
