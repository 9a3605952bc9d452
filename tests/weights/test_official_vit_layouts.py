"""Official DINOv2 / DINOv3 / EVA-02 checkpoint layouts -> timm's layout, and the FlexiViT
patch-kernel resample.

The official files are built here from small random timm models by hand-written maps (timm ->
official, written from the official model code: dinov2/models/vision_transformer.py,
dinov3/models/vision_transformer.py + layers/, EVA-02/asuka modeling_pretrain.py + rope.py),
an inverse independent of the converter; converted back, they must load strictly into a
fresh timm model with equal tensors and outputs, and agree with timm's own
``checkpoint_filter_fn``.
"""
import math
import re
from typing import Dict

import pytest
import timm  # a test dependency: never skipped
import torch
import torch.nn.functional as F
from helpers import max_rel_err, randomize_
from timm.layers.patch_embed import resample_patch_embed
from timm.models import eva as timm_eva
from timm.models import vision_transformer as timm_vit
from torch import Tensor

from vitdet_plugin.weights import (
    OFFICIAL_VIT_LAYOUTS,
    detect_official_vit_layout,
    official_to_timm,
    resample_patch_kernel,
)
from vitdet_plugin.weights.checkpoint_io import CheckpointError
from vitdet_plugin.weights.official_vit import eva02_det_window_blocks

TINY = dict(depth=2, embed_dim=64, num_heads=4, num_classes=0, pretrained=False)
HEAD_DIM = TINY['embed_dim'] // TINY['num_heads']
DEPTH = TINY['depth']


def tiny(name: str, img_size: int, **kwargs) -> torch.nn.Module:
    return randomize_(timm.create_model(name, img_size=img_size, **TINY, **kwargs)).eval()


def randn(*shape: int, seed: int = 1) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def image(size: int) -> Tensor:
    return randn(1, 3, size, size, seed=2)


def check_round_trip(ref: torch.nn.Module, converted: Dict[str, Tensor], name: str, size: int,
                     **kwargs) -> None:
    """``converted`` loads strictly into a fresh timm model equal to ``ref``: same tensors,
    same outputs."""
    fresh = timm.create_model(name, img_size=size, **TINY, **kwargs).eval()
    fresh.load_state_dict(converted, strict=True)
    for k, v in ref.state_dict().items():
        assert torch.allclose(converted[k], v, rtol=1e-6, atol=1e-7), k
    with torch.no_grad():
        assert torch.allclose(fresh(image(size)), ref(image(size)), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- DINOv2
def dinov2_official(ref_sd: Dict[str, Tensor], block_chunks: int = 0) -> Dict[str, Tensor]:
    """timm -> DinoVisionTransformer names: register_tokens after a cls slot of pos_embed
    (added to the cls token only), SwiGLUFFNFused w12 / w3, BlockChunk nesting, mask_token."""
    sd = dict(ref_sd)
    fc1, fc2 = ref_sd['blocks.0.mlp.fc1.weight'], ref_sd['blocks.0.mlp.fc2.weight']
    if fc1.shape[0] == 2 * fc2.shape[1]:  # the giant's packed SwiGLU: fc1 has both halves
        sd = {re.sub(r'\.mlp\.fc1\.', '.mlp.w12.', re.sub(r'\.mlp\.fc2\.', '.mlp.w3.', k)): v
              for k, v in sd.items()}
    if 'reg_token' in sd:
        cls_slot = randn(1, 1, sd['cls_token'].shape[-1], seed=3)
        sd['register_tokens'] = sd.pop('reg_token')
        sd['cls_token'] = sd['cls_token'] - cls_slot
        sd['pos_embed'] = torch.cat([cls_slot, sd['pos_embed']], dim=1)
    if block_chunks:
        size = DEPTH // block_chunks
        sd = {re.sub(r'^blocks\.(\d+)\.', lambda m: f'blocks.{int(m.group(1)) // size}.'
                     f'{m.group(1)}.', k): v for k, v in sd.items()}
    sd['mask_token'] = randn(1, sd['cls_token'].shape[-1], seed=4)
    return sd


DINOV2 = [('vit_small_patch14_reg4_dinov2', {}, 0), ('vit_small_patch14_dinov2', {}, 2),
          ('vit_giant_patch14_dinov2', dict(mlp_ratio=4), 0),
          ('vit_giant_patch14_reg4_dinov2', dict(mlp_ratio=4), 2)]


@pytest.mark.parametrize('name,kwargs,chunks', DINOV2)
def test_dinov2_official_to_timm(name, kwargs, chunks):
    ref = tiny(name, 56, **kwargs)
    official = dinov2_official(ref.state_dict(), chunks)
    if 'giant' in name:
        assert 'blocks.0.mlp.w12.weight' in official or 'blocks.0.0.mlp.w12.weight' in official
    assert detect_official_vit_layout(official) == 'dinov2'
    assert detect_official_vit_layout({'module': official}) == 'dinov2'  # DDP wrapper
    assert detect_official_vit_layout(ref.state_dict()) is None  # timm's own layout
    converted, dropped = official_to_timm(official, 'dinov2')
    assert dropped == ['mask_token']
    check_round_trip(ref, converted, name, 56, **kwargs)
    if not chunks:  # timm's own converter, an independent check (no block_chunks support)
        theirs = timm_vit.checkpoint_filter_fn(dict(official), ref)
        assert sorted(theirs) == sorted(converted)
        assert all(torch.equal(theirs[k], converted[k]) for k in theirs)


# ---------------------------------------------------------------------------- DINOv3
def dinov3_periods_official(head_dim: int, base: float = 100.0) -> Tensor:
    """RopePositionEmbedding._init_weights (dinov3/layers/rope_position_encoding.py)."""
    return base ** (2 * torch.arange(head_dim // 4, dtype=torch.float32) / (head_dim // 2))


def dinov3_official(ref_sd: Dict[str, Tensor], k_bias_seed: int = 5) -> Dict[str, Tensor]:
    """timm Eva -> DinoVisionTransformer names: storage_tokens, ls1 / ls2.gamma,
    LinearKMaskedBias qkv.bias (q, an unused k third, v) + bias_mask, SwiGLUFFN w1 / w2 / w3,
    rope_embed.periods, mask_token."""
    sd: Dict[str, Tensor] = {}
    swiglu = 'blocks.0.mlp.fc1_g.weight' in ref_sd
    dim = ref_sd['cls_token'].shape[-1]
    for k, v in ref_sd.items():
        k = k.replace('reg_token', 'storage_tokens')
        k = re.sub(r'\.gamma_([12])$', r'.ls\1.gamma', k)
        if swiglu:
            k = k.replace('.mlp.fc1_g.', '.mlp.w1.').replace('.mlp.fc1_x.', '.mlp.w2.')
            k = k.replace('.mlp.fc2.', '.mlp.w3.')
        sd[k] = v
    for i in range(DEPTH):
        prefix = f'blocks.{i}.attn.'
        q = sd.pop(prefix + 'q_bias', torch.zeros(dim))  # the distilled hub models: all zero
        v = sd.pop(prefix + 'v_bias', torch.zeros(dim))
        sd[prefix + 'qkv.bias'] = torch.cat([q, randn(dim, seed=k_bias_seed + i), v])
        sd[prefix + 'qkv.bias_mask'] = torch.cat([torch.ones(dim), torch.zeros(dim),
                                                  torch.ones(dim)])
    sd['rope_embed.periods'] = dinov3_periods_official(HEAD_DIM)
    sd['mask_token'] = randn(1, dim, seed=6)
    return sd


DINOV3 = [('vit_small_patch16_dinov3_qkvb', None), ('vit_small_patch16_dinov3', False),
          ('vit_huge_plus_patch16_dinov3_qkvb', None), ('vit_huge_plus_patch16_dinov3', False)]


@pytest.mark.parametrize('name,qkv_bias', DINOV3)
def test_dinov3_official_to_timm(name, qkv_bias):
    ref = tiny(name, 64)
    official = dinov3_official(ref.state_dict())
    assert detect_official_vit_layout(official) == 'dinov3'
    assert detect_official_vit_layout(ref.state_dict()) is None
    converted, dropped = official_to_timm(official, 'dinov3', qkv_bias=qkv_bias)
    masks = [f'blocks.{i}.attn.qkv.bias_mask' for i in range(DEPTH)]
    biases = [f'blocks.{i}.attn.qkv.bias' for i in range(DEPTH)] if qkv_bias is False else []
    assert sorted(dropped) == sorted(['rope_embed.periods', 'mask_token', *masks, *biases])
    check_round_trip(ref, converted, name, 64)
    theirs = timm_eva.checkpoint_filter_fn(dict(official), ref)
    assert sorted(theirs) == sorted(converted)
    assert all(torch.equal(theirs[k], converted[k]) for k in theirs)


def test_dinov3_refuses_buffers_it_cannot_drop():
    official = dinov3_official(tiny('vit_small_patch16_dinov3_qkvb', 64).state_dict())
    bad_mask = dict(official)
    bad_mask['blocks.1.attn.qkv.bias_mask'] = torch.cat([torch.zeros(64), torch.ones(128)])
    with pytest.raises(CheckpointError) as e:
        official_to_timm(bad_mask, 'dinov3')
    assert str(e.value) == (
        'dinov3 checkpoint: blocks.1.attn.qkv.bias_mask [0, 1, 1] around the q/k boundary is '
        'not the k-bias mask of LinearKMaskedBias (ones on the q and v thirds, zeros on the k '
        "third of 192); timm's layout has no k bias. Convert a checkpoint saved from a model "
        'built with mask_k_bias=True (every DINOv3 hub ViT), whose mask init_weights() has '
        'filled')
    nan_mask = dict(official)  # never initialised: LinearKMaskedBias fills it with NaN
    nan_mask['blocks.0.attn.qkv.bias_mask'] = torch.full((192,), math.nan)
    with pytest.raises(CheckpointError, match='is not the k-bias mask of LinearKMaskedBias'):
        official_to_timm(nan_mask, 'dinov3')

    no_mask = {k: v for k, v in official.items() if not k.endswith('bias_mask')}
    with pytest.raises(CheckpointError) as e:
        official_to_timm(no_mask, 'dinov3')
    assert str(e.value) == (
        'dinov3 checkpoint: blocks.0.attn.qkv.bias has a non-zero k third and no bias_mask (a '
        "model built with mask_k_bias=False): the k bias moves with rope and timm's dinov3 "
        'layout has none. Convert a checkpoint trained with mask_k_bias=True (every DINOv3 hub '
        'ViT)')

    wrong_periods = dict(official, **{'rope_embed.periods': dinov3_periods_official(16, 10.0)})
    with pytest.raises(CheckpointError) as e:
        official_to_timm(wrong_periods, 'dinov3')
    assert str(e.value) == (
        "dinov3 checkpoint: 'rope_embed.periods' [1, 1.77828, 3.16228, ...] are not the rope "
        'periods of base 100 (base ** (2 i / (head_dim / 2)), head_dim 16: [1, 3.16228, 10, '
        "...]); timm's dinov3 layout computes them from the base. Pass rope_base=<the "
        'pos_embed_rope_base it was trained with>; a checkpoint trained with '
        'pos_embed_rope_min_period / max_period has no timm layout')
    converted, _ = official_to_timm(wrong_periods, 'dinov3', rope_base=10.0)  # its own base
    assert 'blocks.0.attn.q_bias' in converted

    with pytest.raises(CheckpointError) as e:
        official_to_timm(official, 'dinov3', qkv_bias=False)
    assert str(e.value) == (
        'dinov3 checkpoint: blocks.0.attn.qkv.bias has non-zero q / v biases, which a model '
        "without qkv bias would lose: build DINOv3Backbone with q / v biases (arch=dict(..., "
        "qkv_bias='qv')); for timm, convert with qkv_bias=None or True and use the *_qkvb "
        'model')


# ---------------------------------------------------------------------------- EVA-02
def eva02_rope_official(grid: int, ref_grid: int, head_dim: int) -> Dict[str, Tensor]:
    """VisionRotaryEmbeddingFast(dim=head_dim // 2, pt_seq_len=ref_grid, ft_seq_len=grid)
    (EVA-02/asuka/rope.py): 'lang' frequencies, each repeated twice, h half then w half."""
    dim = head_dim // 2
    freqs = 1.0 / (10000 ** (torch.arange(0, dim, 2)[:dim // 2].float() / dim))
    t = torch.arange(grid) / grid * ref_grid
    freqs = torch.einsum('i,f->if', t, freqs)
    freqs = torch.stack([freqs, freqs], dim=-1).flatten(-2)  # '... n -> ... (n r)', r=2
    freqs = torch.cat([freqs[:, None, :].expand(grid, grid, dim),
                       freqs[None, :, :].expand(grid, grid, dim)], dim=-1)
    return {'freqs_cos': freqs.cos().view(-1, head_dim), 'freqs_sin': freqs.sin().view(-1,
                                                                                       head_dim)}


def eva02_official(ref_sd: Dict[str, Tensor], grid: int, ref_grid: int,
                   mim: bool = True) -> Dict[str, Tensor]:
    """timm Eva -> EVA-02 (modeling_pretrain / modeling_finetune) names: q_bias / v_bias next
    to fused qkv or q/k/v_proj without bias, xformers' SwiGLU w12 / w3 or the naive w1 / w2 /
    ffn_ln / w3, inner_attn_ln; the shared rope module's buffers at the model and in every
    block; MIM: final norm (timm's fc_norm), lm_head, mask_token."""
    sd: Dict[str, Tensor] = {}
    packed = 'blocks.0.mlp.fc1_g.weight' not in ref_sd
    for k, v in ref_sd.items():
        k = re.sub(r'\.attn\.([qv])_proj\.bias$', r'.attn.\1_bias', k)
        k = k.replace('.attn.norm.', '.attn.inner_attn_ln.')
        k = k.replace('.mlp.fc1_g.', '.mlp.w1.').replace('.mlp.fc1_x.', '.mlp.w2.')
        k = k.replace('.mlp.norm.', '.mlp.ffn_ln.').replace('.mlp.fc2.', '.mlp.w3.')
        if packed:
            k = k.replace('.mlp.fc1.', '.mlp.w12.')
        if mim and k.startswith('fc_norm.'):
            k = k[len('fc_'):]
        sd[k] = v
    rope = eva02_rope_official(grid, ref_grid, HEAD_DIM)
    for prefix in ['rope.'] + [f'blocks.{i}.attn.rope.' for i in range(DEPTH)]:
        sd.update({prefix + k: v for k, v in rope.items()})
    if mim:
        dim = ref_sd['cls_token'].shape[-1]
        sd.update({'mask_token': randn(1, 1, dim, seed=7), 'lm_head.weight': randn(32, dim),
                   'lm_head.bias': randn(32)})
    return sd


EVA02 = [('eva02_tiny_patch14_224', {}, True), ('eva02_base_patch14_224', {}, True),
         ('eva02_base_patch14_224', dict(scale_attn_inner=True), False)]


@pytest.mark.parametrize('name,kwargs,mim', EVA02)
def test_eva02_official_to_timm(name, kwargs, mim):
    ref = tiny(name, 56, **kwargs)
    official = eva02_official(ref.state_dict(), grid=8 if not mim else 4, ref_grid=4, mim=mim)
    assert detect_official_vit_layout(official) == 'eva02'
    assert detect_official_vit_layout({'module': official}) == 'eva02'  # DeepSpeed's wrapper
    assert detect_official_vit_layout(ref.state_dict()) is None
    converted, dropped = official_to_timm({'module': official}, 'eva02')
    rope = [k for k in official if '.freqs_' in k]
    assert len(rope) == 2 * (1 + DEPTH)
    assert sorted(dropped) == sorted(rope + (['mask_token', 'lm_head.weight', 'lm_head.bias']
                                             if mim else []))
    check_round_trip(ref, converted, name, 56, **kwargs)
    theirs = timm_eva.checkpoint_filter_fn(dict(official), ref)
    assert sorted(theirs) == sorted(converted)
    assert all(torch.equal(theirs[k], converted[k]) for k in theirs)


def test_eva02_det_backbone_to_timm():
    """EVA-02/det ViT (detectron2/modeling/backbone/vit.py): backbone.net.*, no cls token,
    block 0 windowed (rope_win: a 2x2 window on the 16x16 pretraining grid's scale), block 1
    global (rope_glb: the 4x4 grid), the pyramid and heads next to it."""
    ref = tiny('eva02_base_patch14_224', 56)
    net = eva02_official(ref.state_dict(), grid=4, ref_grid=16, mim=False)
    net.pop('cls_token')
    for name, grid in (('rope_win.', 2), ('rope_glb.', 4)):
        net.update({name + k: v for k, v in eva02_rope_official(grid, 16, HEAD_DIM).items()})
    net.update({'blocks.0.attn.rope.' + k: v for k, v in net.items() if k.startswith('rope_win.')
                for k in [k[len('rope_win.'):]]})
    net = {k: v for k, v in net.items() if not k.startswith('rope.')}  # the det ViT has none
    det = {'backbone.net.' + k: v for k, v in net.items()}
    det.update({'backbone.simfp_2.0.weight': randn(8, 8), 'roi_heads.box_head.fc1.weight':
                randn(8, 8)})
    assert detect_official_vit_layout({'model': det}) == 'eva02_det'
    assert eva02_det_window_blocks(det) == [0]
    converted, dropped = official_to_timm({'model': det}, 'eva02_det')
    assert sorted(dropped) == sorted(['backbone.simfp_2.0.weight', 'roi_heads.box_head.fc1.weight']
                                     + [k for k in det if '.freqs_' in k])
    fresh = timm.create_model('eva02_base_patch14_224', img_size=56, **TINY).eval()
    missing, unexpected = fresh.load_state_dict(converted, strict=False)
    assert missing == ['cls_token'] and unexpected == []
    assert all(torch.equal(converted[k], v) for k, v in ref.state_dict().items()
               if k != 'cls_token')
    with pytest.raises(CheckpointError) as e:
        official_to_timm(net, 'eva02_det')
    assert str(e.value).startswith("eva02_det checkpoint: no key starts with 'backbone.net.' ")


def test_eva02_refuses_other_rope_tables():
    official = eva02_official(tiny('eva02_tiny_patch14_224', 56).state_dict(), 4, 4)
    other = eva02_rope_official(4, 4, HEAD_DIM)['freqs_sin'] * 0.5
    with pytest.raises(CheckpointError) as e:
        official_to_timm(dict(official, **{'blocks.1.attn.rope.freqs_sin': other}), 'eva02')
    assert str(e.value) == (
        "EVA-02 checkpoint: the rope table 'blocks.1.attn.rope.freqs_cos' / "
        "'blocks.1.attn.rope.freqs_sin' is not the table of EVA-02's VisionRotaryEmbeddingFast "
        '(theta 10000) for its grid 4 and the pretraining grid its slowest frequency gives (2); '
        "timm's eva02 layout rebuilds rope from those settings, so this checkpoint (other rope "
        'settings) cannot be converted: use the model code it was trained with')


# ---------------------------------------------------------------------------- layouts
def test_unknown_layouts():
    with pytest.raises(CheckpointError) as e:
        official_to_timm({'cls_token': torch.zeros(1, 1, 4)}, 'dinov4')
    assert str(e.value) == ("layout='dinov4' is not an official ViT layout; give one of "
                            f'{OFFICIAL_VIT_LAYOUTS}, or detect it with '
                            'detect_official_vit_layout(state_dict)')
    mae = dict(tiny('vit_small_patch14_dinov2', 56).state_dict(),
               mask_token=torch.zeros(1, 1, 64))  # MAE: a (1, 1, C) mask token
    assert detect_official_vit_layout(mae) is None


# ---------------------------------------------------------------------------- patch resample
@pytest.mark.parametrize('old,new', [(14, 16), (16, 14), (14, (16, 12))])
def test_resample_patch_kernel_matches_timm(old, new):
    kernel = randn(32, 3, old, old)
    size = (new, new) if isinstance(new, int) else new
    ours = resample_patch_kernel(kernel, size)
    assert ours.shape == (32, 3, *size) and ours.dtype == kernel.dtype
    assert max_rel_err(ours, resample_patch_embed(kernel, list(size))) < 1e-5
    half = resample_patch_kernel(kernel.to(torch.bfloat16), size)
    assert half.dtype == torch.bfloat16
    assert resample_patch_kernel(kernel, (old, old)) is kernel


def test_resample_patch_kernel_flexivit_property():
    """A token from the resampled kernel on the resized patch equals the original kernel's
    token on the original patch: exactly (up to float32) for the resize the kernel is fitted
    to (bicubic, antialiased, 14 -> 16), within the bilinear / bicubic difference for a
    bilinearly resized smooth image (image content, not white noise)."""
    kernel = randn(32, 3, 14, 14)
    patches = F.interpolate(randn(8, 3, 4, 4, seed=9), size=(14, 14), mode='bicubic',
                            align_corners=False)
    tokens = torch.einsum('oihw,bihw->bo', kernel, patches)
    new = resample_patch_kernel(kernel, (16, 16))
    bilinear = F.interpolate(patches, size=(16, 16), mode='bilinear', align_corners=False)
    assert max_rel_err(torch.einsum('oihw,bihw->bo', new, bilinear), tokens) < 0.05
    bicubic = F.interpolate(patches, size=(16, 16), mode='bicubic', antialias=True,
                            align_corners=False)
    assert max_rel_err(torch.einsum('oihw,bihw->bo', new, bicubic), tokens) < 1e-4
    # resizing the kernel itself is off (unscaled: far; area-scaled: not within float32)
    naive = F.interpolate(kernel, size=(16, 16), mode='bicubic', align_corners=False)
    assert max_rel_err(torch.einsum('oihw,bihw->bo', naive, bilinear), tokens) > 0.2
    scaled = naive * (14 / 16) ** 2
    assert max_rel_err(torch.einsum('oihw,bihw->bo', scaled, bicubic), tokens) > 1e-3


def test_resample_patch_kernel_errors():
    with pytest.raises(CheckpointError) as e:
        resample_patch_kernel(torch.zeros(8, 3, 14), (16, 16))
    assert str(e.value) == ('a patch-embedding kernel is (C_out, C_in, kh, kw), got (8, 3, 14); '
                            'pass patch_embed.proj.weight')
    with pytest.raises(ValueError, match=r'new_size must be a pair \(h, w\), got \(16,\)'):
        resample_patch_kernel(torch.zeros(8, 3, 14, 14), (16,))
