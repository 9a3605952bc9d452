"""The whole load path of the DINOv2 / DINOv3 / EVA-02 backbones: official checkpoint layouts
(built from random timm models by the hand-written inverse maps of
tests/weights/test_official_vit_layouts.py) load strictly into our backbones and give timm's patch
tokens; a patch-14 checkpoint drives a patch-16 model exactly as timm's own loader resamples it;
refusals name the fix."""
import pytest
import timm
import torch
from helpers import max_rel_err
from test_official_vit_layouts import dinov2_official, dinov3_official, eva02_official, tiny
from timm.models import vision_transformer as timm_vit

import vitdet_plugin  # noqa: F401
from vitdet_plugin.models.backbones import DINOv2Backbone, DINOv3Backbone, EVA02Backbone
from vitdet_plugin.weights import load_pretrained
from vitdet_plugin.weights.checkpoint_io import CheckpointError

#: fp32 bound of the issue: max |ours - timm| / max |timm|.
TOL = 1e-5
#: The tiny timm models of tests/weights/test_official_vit_layouts.py: depth 2, width 64, 4 heads.
OURS = dict(embed_dims=64, depth=2, num_heads=4, global_attn_indexes=(0, 1))
#: Pretraining image of the patch-14 models there (a 4 x 4 grid).
IMG14 = 56
#: EVA-02 rope of those models: timm's eva02 ref_feat_shape, the 224 / 14 pretraining grid.
EVA_REF = 16
EVA_ROPE = dict(temperature=1e4, ref_grid=(EVA_REF, EVA_REF))

CASES = {
    'dinov2_reg4': ('vit_small_patch14_reg4_dinov2', IMG14, dinov2_official, DINOv2Backbone,
                    dict(arch='small', num_reg_tokens=4, pretrain_img_size=IMG14)),
    'dinov3_qkvb': ('vit_small_patch16_dinov3_qkvb', 64, dinov3_official, DINOv3Backbone,
                    dict(arch='small', qkv_bias='qv')),
    'dinov3': ('vit_small_patch16_dinov3', 64, dinov3_official, DINOv3Backbone,
               dict(arch='small')),
    'eva02_mim': ('eva02_tiny_patch14_224', IMG14,
                  lambda sd: eva02_official(sd, grid=4, ref_grid=EVA_REF), EVA02Backbone,
                  dict(arch='tiny', pretrain_img_size=IMG14, rope=EVA_ROPE)),
}


def patch_tokens(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    (out,) = model(x)
    return out.flatten(2).transpose(1, 2)                             # (B, N, C)


def timm_tokens(ref: torch.nn.Module, x: torch.Tensor, norm: bool) -> torch.Tensor:
    (out,) = ref.forward_intermediates(x, indices=[len(ref.blocks) - 1], norm=norm,
                                       intermediates_only=True)
    return out.flatten(2).transpose(1, 2)                             # (B, N, C)


@pytest.mark.parametrize('case', list(CASES))
def test_official_checkpoint_loads_strictly_and_gives_timms_tokens(case, caplog):
    name, img, to_official, cls, kw = CASES[case]
    ref = tiny(name, img)
    model = cls(**OURS, **kw).eval()
    with caplog.at_level('INFO', logger='vitdet_plugin'):
        dropped = load_pretrained(model, {'model': to_official(ref.state_dict())}).dropped
    assert 'mask_token' in dropped and 'official layout' in caplog.text
    patch = model.patch_size
    x = torch.randn(1, 3, 5 * patch, 7 * patch, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = patch_tokens(model, x)
        theirs = timm_tokens(_dynamic(ref, name, img), x, bool(model.final_norm))
    assert ours.shape == theirs.shape == (1, 35, 64)
    assert max_rel_err(ours, theirs) <= TOL


def _dynamic(ref: torch.nn.Module, name: str, img: int) -> torch.nn.Module:
    """``ref``'s weights in a timm model that takes any input size."""
    fresh = timm.create_model(name, img_size=img, dynamic_img_size=True, depth=2, embed_dim=64,
                              num_heads=4, num_classes=0, pretrained=False).eval()
    fresh.load_state_dict(ref.state_dict())
    return fresh


def test_patch14_checkpoint_drives_a_patch16_model_as_timm_resamples_it():
    """DINOv2 (patch 14) in a patch-16 model: the kernel is FlexiViT-resampled (timm's
    checkpoint_filter_fn into a patch-16 timm model is the reference) and the stored position
    grid stays the checkpoint's 4 x 4 (resized to the input in the forward)."""
    name = 'vit_small_patch14_reg4_dinov2'
    ref = tiny(name, IMG14)
    model = DINOv2Backbone(**OURS, arch='small', num_reg_tokens=4, patch_size=16,
                           pretrain_img_size=IMG14).eval()
    load_pretrained(model, dinov2_official(ref.state_dict()))
    assert model.pretrain_grid == (4, 4) and model.patch_size == 16
    timm16 = timm.create_model(name, img_size=64, patch_size=16, dynamic_img_size=True, depth=2,
                               embed_dim=64, num_heads=4, num_classes=0).eval()
    timm16.load_state_dict(timm_vit.checkpoint_filter_fn(ref.state_dict(), timm16))
    assert timm16.patch_embed.proj.weight.shape[-2:] == (16, 16)
    assert max_rel_err(model.patch_embed.proj.weight, timm16.patch_embed.proj.weight) <= TOL
    x = torch.randn(2, 3, 80, 112, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert max_rel_err(patch_tokens(model, x), timm_tokens(timm16, x, True)) <= TOL


def test_official_checkpoint_of_another_family_names_the_backbone():
    sd = dinov2_official(tiny('vit_small_patch14_reg4_dinov2', IMG14).state_dict())
    with pytest.raises(CheckpointError, match=r"^the checkpoint is a DINOv2 checkpoint \(dinov2 "
                                              r"official layout\); EVA02Backbone loads EVA-02 "
                                              r"checkpoints: build type='DINOv2Backbone'$"):
        load_pretrained(EVA02Backbone(**OURS, arch='tiny'), sd)


def test_eva02_det_checkpoint_needs_the_cls_token_dropped():
    """EVA-02/det's ViT has no cls token: a model keeping prefix tokens is told to drop them;
    with prefix_tokens='drop' it loads strictly."""
    ref = tiny('eva02_tiny_patch14_224', IMG14)
    net = eva02_official(ref.state_dict(), grid=4, ref_grid=EVA_REF, mim=False)
    net.pop('cls_token')
    det = {'backbone.net.' + k: v for k, v in net.items()}
    kw = dict(OURS, arch='tiny', pretrain_img_size=IMG14, rope=EVA_ROPE)
    with pytest.raises(CheckpointError, match=r"^the checkpoint is an EVA-02 detector's ViT "
                                              r"\(EVA-02/det backbone.net.\*\), which has no cls "
                                              r"token; build EVA02Backbone\(prefix_tokens='drop'"
                                              r"\) as EVA-02-det does$"):
        load_pretrained(EVA02Backbone(**kw), {'model': det})
    model = EVA02Backbone(**kw, prefix_tokens='drop')
    load_pretrained(model, {'model': det})
    assert torch.equal(model.patch_embed.proj.weight, ref.patch_embed.proj.weight)


def test_eva02_rope_grid_of_the_checkpoint_must_be_the_models():
    """The official tables fix the pretraining grid: a model built for another one is told the
    rope setting that matches."""
    sd = eva02_official(tiny('eva02_tiny_patch14_224', IMG14).state_dict(), grid=4, ref_grid=4)
    model = EVA02Backbone(**OURS, arch='tiny', pretrain_img_size=IMG14)
    with pytest.raises(CheckpointError, match=r"^the checkpoint's rotary tables are scaled to a "
                                              r"4 x 4 pretraining grid, EVA02Backbone was built "
                                              r"with rope ref_grid=\(16, 16\); build EVA02Backbone"
                                              r"\(rope=dict\(temperature=10000, ref_grid=\(4, 4\)"
                                              r"\)\)$"):
        load_pretrained(model, sd)


def test_register_count_must_match_the_checkpoint():
    """A reg4 checkpoint in a model built without registers is refused (never silently
    dropped); with prefix_tokens='drop' the model has no prefix tokens at all and takes it."""
    sd = tiny('vit_small_patch14_reg4_dinov2', IMG14).state_dict()
    kw = dict(OURS, arch='small', pretrain_img_size=IMG14)
    with pytest.raises(CheckpointError, match=r'^the checkpoint has 4 register tokens, the model '
                                              r'was built with num_reg_tokens=0: build it with '
                                              r'num_reg_tokens=4$'):
        load_pretrained(DINOv2Backbone(**kw), sd)
    dropped = load_pretrained(DINOv2Backbone(**kw, prefix_tokens='drop'), sd).dropped
    assert {'cls_token', 'reg_token'} <= set(dropped)
