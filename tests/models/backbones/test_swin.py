"""SwinBackbone: shapes vs the declared contract, parity with mmdet and timm, training modes."""
import copy
import math

import pytest
import torch
from helpers import assert_close_rel, max_rel_err, randomize_
from torch import nn

import vitdet_plugin  # noqa: F401
from vitdet_plugin.weights import load_pretrained
from vitdet_plugin.models.backbones.swin import SwinBackbone
from vitdet_plugin.models.backbones.swin_archs import SwinArch
from vitdet_plugin.models.layers import eager_attention
from vitdet_plugin.weights.swin import swin_to_mmdet

SMALL = dict(arch=dict(embed_dims=32, depths=(2, 2, 2, 2), num_heads=(2, 2, 4, 4)))


def _expected_shapes(model, h, w, batch=1):
    return [(batch, c, math.ceil(h / s), math.ceil(w / s))
            for c, s in zip(model.out_channels, model.out_strides)]


@pytest.mark.parametrize('arch', sorted(SwinArch.PRESETS))
@pytest.mark.parametrize('hw', [(224, 224), (513, 769), (800, 1216), (97, 131)])
def test_preset_shapes_follow_contract(arch, hw):
    with torch.device('meta'):
        model = SwinBackbone(arch=arch, drop_path_rate=0.0).eval()
        outs = model(torch.empty(1, 3, *hw))
    spec = SwinArch.PRESETS[arch]
    c = spec['embed_dims']
    assert model.out_channels == (c, 2 * c, 4 * c, 8 * c)
    assert model.out_strides == (4, 8, 16, 32)
    assert [tuple(o.shape) for o in outs] == _expected_shapes(model, *hw)


def test_shapes_513x769_as_documented():
    model = SwinBackbone(**SMALL).eval()
    with torch.no_grad():
        outs = model(torch.randn(1, 3, 513, 769))
    assert [tuple(o.shape[-2:]) for o in outs] == [(129, 193), (65, 97), (33, 49), (17, 25)]


@pytest.mark.parametrize('hw', [(97, 131), (61, 45), (224, 224)])
def test_real_forward_shapes_and_out_indices(hw):
    model = SwinBackbone(**SMALL, out_indices=(1, 3), window_size=(5, 7)).eval()
    assert model.out_channels == (64, 256) and model.out_strides == (8, 32)
    with torch.no_grad():
        outs = model(torch.randn(2, 3, *hw))
    assert [tuple(o.shape) for o in outs] == _expected_shapes(model, *hw, batch=2)
    assert all(torch.isfinite(o).all() for o in outs)


# --------------------------------------------------------------------------- parity
def _mmdet_swin(embed_dims, depths, heads, window, **kw):
    from mmdet.models.backbones import SwinTransformer
    model = SwinTransformer(embed_dims=embed_dims, depths=depths, num_heads=heads,
                            window_size=window, drop_path_rate=0.0, out_indices=(0, 1, 2, 3),
                            **kw)
    model.eval()  # mmdet's train() returns None, so no chaining
    return model


@pytest.mark.parametrize('hw', [(224, 224), (97, 131), (200, 312), (67, 67)])
@pytest.mark.parametrize('batch', [1, 2])
def test_parity_with_mmdet_same_weights(hw, batch):
    cfg = dict(embed_dims=32, depths=(2, 2, 2, 2), heads=(2, 2, 4, 4), window=7)
    ref = randomize_(_mmdet_swin(**cfg))
    ours = SwinBackbone(arch=dict(embed_dims=32, depths=(2, 2, 2, 2), num_heads=(2, 2, 4, 4)),
                        window_size=7, drop_path_rate=0.0).eval()
    # load ours from the mmdet state dict through our converter (auto-detected format)
    load_pretrained(ours, {'state_dict': ref.state_dict()})
    x = torch.randn(batch, 3, *hw)
    with torch.no_grad():
        assert_close_rel(ours(x), ref(x), tol=1e-5)


@pytest.mark.parametrize('kw', [dict(patch_norm=False), dict(qkv_bias=False),
                                dict(mlp_ratio=2), dict(qk_scale=0.1), dict(qk_scale=0)],
                         ids=['no-patch-norm', 'no-qkv-bias', 'mlp2', 'qk-scale',
                              'qk-scale-0-is-default'])
def test_parity_with_mmdet_other_settings(kw):
    """mmdet's arguments mean the same here (patch_norm=False also drops the merging norm)."""
    ref = randomize_(_mmdet_swin(32, (2, 2, 2, 2), (2, 2, 4, 4), 7, **kw))
    ours = SwinBackbone(**SMALL, window_size=7, drop_path_rate=0.0, **kw).eval()
    load_pretrained(ours, {'state_dict': ref.state_dict()})
    x = torch.randn(1, 3, 97, 131)
    with torch.no_grad():
        assert_close_rel(ours(x), ref(x), tol=1e-5)


def test_parity_with_mmdet_training_gradients():
    """Training path at a size that pads and shifts: the same parameter and input gradients
    as mmdet's SwinTransformer (gradients mapped to mmdet's layout by the export converter)."""
    cfg = dict(embed_dims=32, depths=(2, 2, 2, 2), heads=(2, 2, 4, 4), window=7)
    ref = randomize_(_mmdet_swin(**cfg))
    ref.train()
    ours = SwinBackbone(**SMALL, window_size=7, drop_path_rate=0.0).train()
    ours.load_state_dict(_ours_from_mmdet(ref.state_dict()))
    x = torch.randn(2, 3, 97, 131)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    weights = [torch.randn(o.shape) for o in ours(x)]
    sum((o * w).sum() for o, w in zip(ours(xa), weights)).backward()
    sum((o * w).sum() for o, w in zip(ref(xb), weights)).backward()
    assert_close_rel([xa.grad], [xb.grad], tol=1e-5)
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}
    grads = {k: v for k, v in swin_to_mmdet({k: p.grad for k, p in ours.named_parameters()})
             .items() if not k.endswith('relative_position_index')}          # buffers
    assert grads.keys() == ref_grads.keys()
    for k in grads:
        assert max_rel_err(grads[k], ref_grads[k]) <= 1e-4, k


def test_parity_with_mmdet_swin_tiny_and_abs_pos():
    ref = randomize_(_mmdet_swin(96, (2, 2, 6, 2), (3, 6, 12, 24), 7, use_abs_pos_embed=True,
                                 pretrain_img_size=224))
    ours = SwinBackbone(arch='tiny', use_abs_pos_embed=True, drop_path_rate=0.0).eval()
    ours.load_state_dict(_ours_from_mmdet(ref.state_dict()))
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        assert_close_rel(ours(x), ref(x), tol=1e-5)


def _ours_from_mmdet(sd):
    from vitdet_plugin.weights.swin import convert_swin
    converted, _ = convert_swin(sd)
    return converted


def test_mmdet_export_roundtrip():
    ours = randomize_(SwinBackbone(**SMALL)).eval()
    sd = ours.state_dict()
    back = _ours_from_mmdet(swin_to_mmdet(sd))
    assert back.keys() == sd.keys()
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


def _timm_swin(img_size, embed_dim=32, depths=(2, 2, 2, 2), heads=(2, 2, 4, 4), window=7):
    from timm.models.swin_transformer import SwinTransformer
    return SwinTransformer(img_size=img_size, embed_dim=embed_dim, depths=depths,
                           num_heads=heads, window_size=window, drop_path_rate=0.0,
                           num_classes=10).eval()


def _timm_stage_outputs(model, x):
    x = model.patch_embed(x)
    outs = []
    for layer in model.layers:
        x = layer(x)
        outs.append(x)
    return outs


def _plain_ln(t):  # NHWC -> parameter-free LayerNorm over C
    return torch.nn.functional.layer_norm(t, t.shape[-1:])


def test_parity_with_timm_where_every_stage_has_several_windows():
    hw = (448, 672)
    ref = randomize_(_timm_swin(hw), seed=1)
    ours = SwinBackbone(**SMALL, drop_path_rate=0.0).eval()
    load_pretrained(ours, ref.state_dict())   # timm layout, auto-detected
    for i in range(4):  # compare through a parameter-free LayerNorm
        norm = getattr(ours, f'norm{i}')
        torch.nn.init.ones_(norm.weight)
        torch.nn.init.zeros_(norm.bias)
    x = torch.randn(1, 3, *hw)
    with torch.no_grad():
        refs = [_plain_ln(t).permute(0, 3, 1, 2) for t in _timm_stage_outputs(ref, x)]
        assert_close_rel(ours(x), refs, tol=1e-5)


# --------------------------------------------------------------------------- attention paths
def test_fused_and_eager_attention_agree_with_shift_padding_and_batch():
    model = randomize_(SwinBackbone(**SMALL, window_size=(5, 7))).eval()
    x = torch.randn(2, 3, 93, 141)
    with torch.no_grad():
        fused = model(x)
        with eager_attention(model):
            eager = model(x)
    assert_close_rel(fused, eager, tol=1e-5)


@pytest.mark.parametrize('change', ['data', 'assign', 'new_parameter', 'functional_call'])
def test_inference_follows_weight_changes_autograd_does_not_count(change):
    """Writes through ``.data`` (mmengine's EMA update and EMAHook's swap), a state dict loaded
    with ``assign=True``, a replaced Parameter and ``functional_call`` leave the table's
    version counter alone: inference (the chunked CPU path) must follow them all the same."""
    model = randomize_(SwinBackbone(**SMALL)).eval()
    fresh = copy.deepcopy(model)
    x = torch.randn(1, 3, 64, 64)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    for k in sd:
        if k.endswith('relative_position_bias_table'):
            sd[k] = torch.randn_like(sd[k])
    with torch.no_grad():
        before = model(x)                    # fills the caches
        if change == 'data':
            for name, p in model.named_parameters():
                p.data.copy_(sd[name])
        elif change == 'assign':
            model.load_state_dict(sd, assign=True)
        elif change == 'new_parameter':
            for name, m in model.named_modules():
                if hasattr(m, 'relative_position_bias_table'):
                    key = f'{name}.relative_position_bias_table'
                    m.relative_position_bias_table = nn.Parameter(sd[key].clone())
        if change == 'functional_call':
            after = torch.func.functional_call(model, sd, (x, ))
        else:
            after = model(x)
        fresh.load_state_dict(sd)
        expected = fresh(x)
    assert max_rel_err(expected[0], before[0]) > 1e-3
    assert_close_rel(after, expected, tol=1e-6)


@pytest.mark.parametrize('frozen', [-1, 4])
@pytest.mark.parametrize('train', [True, False], ids=['train', 'eval'])
def test_autograd_forward_after_inference_mode_at_the_same_size(train, frozen):
    """Caches filled under ``torch.inference_mode()`` (windowing, shift mask, bias) are reused
    by a later forward + backward at that size: they must not be inference tensors."""
    model = randomize_(SwinBackbone(**SMALL, frozen_stages=frozen, drop_path_rate=0.0))
    model.train(train)
    x = torch.randn(2, 3, 61, 75)
    with torch.inference_mode():
        expected = model(x)
    x = x.requires_grad_()
    outs = model(x)
    sum(o.sum() for o in outs).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert_close_rel(outs, expected, tol=1e-5)


@pytest.mark.parametrize('mode', ['no_grad', 'inference_mode'])
def test_size_caches_hold_no_autograd_history(mode):
    """Cached shift masks must not require grad or be inference tensors: a later autograd
    forward at the same size reuses them."""
    from vitdet_plugin.functional import window
    window._SHIFT_MASKS.clear()
    model = randomize_(SwinBackbone(**SMALL)).eval()
    ctx = torch.no_grad() if mode == 'no_grad' else torch.inference_mode()
    with ctx:
        model(torch.randn(1, 3, 64, 96))
    masks = list(window._SHIFT_MASKS._entries.values())
    assert masks and not any(m.requires_grad or m.is_inference() for m in masks)


def test_with_cp_same_outputs_and_grads():
    torch.manual_seed(0)
    a = randomize_(SwinBackbone(**SMALL, drop_path_rate=0.0))
    b = randomize_(SwinBackbone(**SMALL, drop_path_rate=0.0, with_cp=True))
    x = torch.randn(2, 3, 70, 90)
    outs_a, outs_b = a.train()(x), b.train()(x)
    assert_close_rel(outs_b, outs_a, tol=1e-6)
    sum(o.square().mean() for o in outs_a).backward()
    sum(o.square().mean() for o in outs_b).backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert max_rel_err(pb.grad, pa.grad) <= 1e-5, name


# --------------------------------------------------------------------------- training modes
def test_every_trainable_parameter_gets_a_gradient():
    model = SwinBackbone(**SMALL, use_abs_pos_embed=True, pretrain_img_size=64).train()
    outs = model(torch.randn(1, 3, 64, 96))
    sum(o.mean() for o in outs).backward()
    no_grad = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert no_grad == []


@pytest.mark.parametrize('frozen', [0, 1, 2, 4])
def test_frozen_stages_applied_at_init_and_kept_in_train(frozen):
    model = SwinBackbone(**SMALL, frozen_stages=frozen, use_abs_pos_embed=True,
                         pretrain_img_size=64)
    frozen_prefixes = ['patch_embed.', 'absolute_pos_embed'] + [
        f'layers.{i}.' for i in range(frozen)] + [f'norm{i}.' for i in range(frozen)]
    for name, p in model.named_parameters():
        should_freeze = any(name.startswith(pref) for pref in frozen_prefixes)
        assert p.requires_grad != should_freeze, name
    assert model.train() is model                       # chains, unlike mmdet's train()
    assert not model.patch_embed.training
    assert all(not model.layers[i].training for i in range(frozen))
    if frozen < 4:
        assert model.layers[frozen].training
    outs = model(torch.randn(1, 3, 64, 64))
    if frozen == 4:  # everything frozen: nothing to back-propagate into
        assert not any(o.requires_grad for o in outs)
        return
    sum(o.mean() for o in outs).backward()
    for name, p in model.named_parameters():
        assert (p.grad is None) == (not p.requires_grad), name


def test_eval_returns_module_and_norm_eval():
    model = SwinBackbone(**SMALL, norm_eval=True, norm_cfg=dict(type='BN'))
    assert model.eval() is model
    model.train()
    assert all(not m.training for m in model.modules()
               if isinstance(m, torch.nn.modules.batchnorm._BatchNorm))


def test_drop_path_schedule_is_linear():
    model = SwinBackbone(**SMALL, drop_path_rate=0.3)
    rates = [blk.drop_path.drop_prob if hasattr(blk.drop_path, 'drop_prob') else 0.0
             for stage in model.layers for blk in stage.blocks]
    assert rates == pytest.approx([0.3 * i / 7 for i in range(8)])


def test_abs_pos_embed_interpolated_to_any_size():
    model = SwinBackbone(**SMALL, use_abs_pos_embed=True, pretrain_img_size=224).eval()
    assert tuple(model.absolute_pos_embed.shape) == (1, 32, 56, 56)
    with torch.no_grad():
        outs = model(torch.randn(1, 3, 130, 301))
    assert tuple(outs[0].shape) == (1, 32, 33, 76)


def test_training_fused_and_eager_agree_in_outputs_and_grads():
    """Training (GELU-recompute MLPs, SDPA) against the plain autograd MLP and the eager
    attention formula."""
    a = randomize_(SwinBackbone(**SMALL, drop_path_rate=0.0, window_size=(5, 7))).train()
    b = randomize_(SwinBackbone(**SMALL, drop_path_rate=0.0, window_size=(5, 7))).train()
    x = torch.randn(2, 3, 93, 141)
    outs_a = a(x)
    with eager_attention(b):
        outs_b = b(x)
    assert_close_rel(outs_a, outs_b, tol=1e-5)
    sum((o * torch.linspace(-1, 1, o.shape[-1])).sum() for o in outs_a).backward()
    sum((o * torch.linspace(-1, 1, o.shape[-1])).sum() for o in outs_b).backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert max_rel_err(pa.grad, pb.grad) <= 1e-4, name


def test_conv_stem_shapes_contract_and_freezing():
    """An optional convolutional stem replaces part of the patch stride: same contract and
    ceil-division shapes at odd sizes, frozen with the patch embedding, trained otherwise."""
    model = SwinBackbone(**SMALL, patch_size=8, stem_channels=(8, 16), out_indices=(0, 1, 2))
    assert model.out_strides == (8, 16, 32)
    assert model.patch_embed.proj.kernel_size == (2, 2)          # 8 = stem 4 x proj 2
    outs = model(torch.randn(2, 3, 97, 131))
    for out, c, s in zip(outs, model.out_channels, model.out_strides):
        assert out.shape == (2, c, math.ceil(97 / s), math.ceil(131 / s))
    sum(o.mean() for o in outs).backward()
    assert all(p.grad is not None for p in model.patch_embed.stem.parameters())
    frozen = SwinBackbone(**SMALL, patch_size=8, stem_channels=(8, 16), frozen_stages=0).train()
    assert not any(p.requires_grad for p in frozen.patch_embed.stem.parameters())
    assert not frozen.patch_embed.stem.training                   # BN statistics frozen too


def test_conv_stem_inference_matches_training_path_in_eval():
    model = randomize_(SwinBackbone(**SMALL, stem_channels=(8, ))).eval()
    x = torch.randn(1, 3, 70, 90)
    with torch.no_grad():
        fast = model(x)
    assert_close_rel(fast, model(x), tol=1e-5)


@pytest.mark.parametrize('stem, patch, match', [
    ((8, 16, 32), 4, r'stem has stride 8, which does not divide the patch size \(4, 4\)'),
    ((0, ), 4, 'ConvStem channels must be a non-empty list of positive ints'),
])
def test_conv_stem_bad_settings(stem, patch, match):
    with pytest.raises(ValueError, match=match):
        SwinBackbone(**SMALL, patch_size=patch, stem_channels=stem)


def test_bias_only_fine_tuning_gets_mmdets_gradients():
    """BitFit-style: only biases train. fc2's bias must get its gradient although fc2's weight
    is frozen (the GELU-recomputing MLP computes the two separately)."""
    ref = randomize_(_mmdet_swin(32, (2, 2, 2, 2), (2, 2, 4, 4), 7))
    ours = SwinBackbone(**SMALL, window_size=7, drop_path_rate=0.0)
    ours.load_state_dict(_ours_from_mmdet(ref.state_dict()))
    ours.train(), ref.train()
    for model in (ours, ref):
        for name, p in model.named_parameters():
            p.requires_grad_(name.endswith('.bias'))
    x = torch.randn(1, 3, 64, 96)
    sum((o * o).sum() for o in ours(x)).backward()
    sum((o * o).sum() for o in ref(x)).backward()
    got = swin_to_mmdet({k: p.grad for k, p in ours.named_parameters() if p.requires_grad})
    want = {k: p.grad for k, p in ref.named_parameters() if p.requires_grad}
    assert got.keys() - {k for k in got if k.endswith('relative_position_index')} == want.keys()
    for k, g in want.items():
        assert got[k] is not None and max_rel_err(got[k], g) <= 1e-4, k


def test_built_on_meta_then_materialised_with_to_empty_and_loaded():
    """The FSDP / accelerate empty-init pattern: nothing derived may be left uninitialised."""
    src = randomize_(SwinBackbone(**SMALL, drop_path_rate=0.0)).eval()
    with torch.device('meta'):
        model = SwinBackbone(**SMALL, drop_path_rate=0.0)
    model = model.to_empty(device='cpu').eval()
    model.load_state_dict(src.state_dict())
    x = torch.randn(1, 3, 64, 96)
    with torch.no_grad():
        assert_close_rel(model(x), src(x), tol=0)


@pytest.mark.parametrize('mode', ['no_grad', 'inference_mode'])
def test_meta_forward_gives_shapes_without_grad(mode):
    with torch.device('meta'):
        model = SwinBackbone(**SMALL).eval()
        with getattr(torch, mode)():
            outs = model(torch.empty(2, 3, 97, 131))
    assert [tuple(o.shape) for o in outs] == _expected_shapes(model, 97, 131, batch=2)


@pytest.mark.parametrize('bad', [(1.7, ), ('2', ), (True, ), 2.0])
def test_out_indices_must_be_ints(bad):
    with pytest.raises(ValueError, match='out_indices'):
        SwinBackbone(**SMALL, out_indices=bad)
