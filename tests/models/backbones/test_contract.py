"""The backbone contract, run against every backbone and neck this plugin registers.

A new backbone gets these tests by being registered (and listing a tiny config in
:data:`TINY`); per-model files keep only the parity tests against the reference
implementations.
"""
import copy
import inspect
import re
from typing import Dict, List

import pytest
import torch
from helpers import assert_close_rel, randomize_
from mmdet.registry import MODELS

import vitdet_plugin  # noqa: F401
from vitdet_plugin.models.backbones import BackboneContract
from vitdet_plugin.models.layers import eager_attention

#: A small, fast configuration of every registered backbone (variants: name -> kwargs).
TINY: Dict[str, Dict[str, dict]] = {
    'SwinBackbone': {
        'swin': dict(arch=dict(embed_dims=16, depths=(2, 2, 2), num_heads=(1, 2, 2)),
                     window_size=(3, 5), drop_path_rate=0.1, out_indices=(0, 1, 2)),
        'swin-abs-pos': dict(arch=dict(embed_dims=16, depths=(1, 2), num_heads=(2, 2)),
                             use_abs_pos_embed=True, pretrain_img_size=32, out_indices=(1,)),
    },
    'SwinV2Backbone': {
        'swinv2': dict(arch=dict(embed_dims=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4)),
                       window_size=(3, 5), pretrained_window_sizes=(4, 0, 3, 0),
                       drop_path_rate=0.1, out_indices=(0, 1, 3)),
        'swinv2-per-stage': dict(arch=dict(embed_dims=16, depths=(2, 3), num_heads=(2, 2),
                                           extra_norm_every_n_blocks=2),
                                 window_size=((4, 3), 2), pretrained_window_sizes=(6, 0),
                                 out_indices=(1,)),
    },
    'ViTBackbone': {
        'vit': dict(arch=dict(embed_dims=32, depth=4, num_heads=2), patch_size=8, img_size=64,
                    window_size=3, pretrain_img_size=48, residual_block_indexes=(1,),
                    out_indices=(1, 3), drop_path_rate=0.1),
        'vit-last-block': dict(arch=dict(embed_dims=32, depth=2, num_heads=2), patch_size=8,
                               img_size=64, window_size=4, pretrain_img_size=48),
        'vit-stem': dict(arch=dict(embed_dims=32, depth=2, num_heads=2), patch_size=8,
                         stem_channels=(8, 16), img_size=64, window_size=4,
                         global_attn_indexes=(1,)),
    },
    'DINOv2Backbone': {
        'dinov2-reg': dict(arch=dict(embed_dims=32, depth=3, num_heads=2, num_reg_tokens=2,
                                     layer_scale=1e-5, global_attn_indexes=(1,)),
                           patch_size=8, window_size=3, pretrain_img_size=48,
                           out_indices=(1, 2), drop_path_rate=0.1),
    },
    'DINOv3Backbone': {
        'dinov3': dict(arch=dict(embed_dims=32, depth=3, num_heads=2, qkv_bias='qv',
                                 global_attn_indexes=(2,), num_reg_tokens=1,
                                 layer_scale=1e-5), patch_size=8, window_size=(3, 4),
                       rope_coords='global', drop_path_rate=0.1),
    },
    'EVA02Backbone': {
        'eva02': dict(arch=dict(embed_dims=32, depth=2, num_heads=2, mlp='swiglu',
                                mlp_sub_ln=True, attn_sub_ln=True, global_attn_indexes=(1,)),
                      patch_size=8, window_size=4, pretrain_img_size=48,
                      rope=dict(temperature=1e4, ref_grid=(6, 6))),
        'eva02-drop-packed': dict(arch=dict(embed_dims=32, depth=2, num_heads=2,
                                            mlp='swiglu_packed', mlp_sub_ln=False,
                                            global_attn_indexes=(1,)),
                                  patch_size=8, window_size=3, prefix_tokens='drop',
                                  final_norm=True),
    },
}
#: Arguments the ViT families take in another form: their qkv bias is a mode (None: the
#: arch's). BAD_ARGUMENTS key -> the families' bad value and expected error.
FAMILY_ARGUMENTS = {
    'qkv_bias': (dict(qkv_bias=True), r"qkv_bias=True is not one of \['qkv', 'qv', 'none'\]"),
}
FAMILIES = ('DINOv2Backbone', 'DINOv3Backbone', 'EVA02Backbone')
#: Necks: registered name -> kwargs (``in_channels``, ``in_stride``: the map it takes).
TINY_NECKS = {'ViTSimpleFPN': dict(in_channels=32, out_channels=16, in_stride=16),
              'RFDETRProjector': dict(in_channels=32, out_channels=16, in_stride=16,
                                      num_blocks=1, levels=('P3', 'P4', 'P5', 'P6'))}
NECK_VARIANTS = {'ViTSimpleFPN': [dict(), dict(scale_factors=(2.0, 1.0, 0.5), num_outs=3,
                                              norm_cfg=dict(type='GN', num_groups=4))]}

#: Odd input sizes: not multiples of any patch, window or stride.
ODD_SIZES = [(61, 45), (97, 131)]


#: Registered modules whose contract is tested in their own files (a CNN backbone without
#: patch embedding, one that takes sides of multiples of 32, necks over several levels).
CONTRACT_ELSEWHERE = {'HGNetV2Backbone': 'tests/models/backbones/test_hgnetv2.py',
                      'DINOv3STABackbone': 'tests/models/backbones/test_dinov3_sta.py',
                      'HybridEncoder': 'tests/models/necks/test_hybrid_encoder.py',
                      'LiteEncoder': 'tests/models/necks/test_hybrid_encoder.py'}


def _ours(registry_names: List[str]) -> List[str]:
    return sorted(n for n in registry_names
                  if MODELS.get(n).__module__.startswith('vitdet_plugin.models')
                  and n not in CONTRACT_ELSEWHERE)


OUR_BACKBONES = [n for n in _ours(list(MODELS.module_dict))
                 if issubclass(MODELS.get(n), BackboneContract)]
VARIANTS = [(cls, var) for cls in OUR_BACKBONES for var in TINY.get(cls, {})]


def _build(cls: str, variant: str, **kw) -> torch.nn.Module:
    return MODELS.build(dict(type=cls, **{**TINY[cls][variant], **kw}))


def test_every_registered_backbone_has_a_tiny_config():
    assert OUR_BACKBONES, 'no backbone of ours is registered'
    missing = [cls for cls in OUR_BACKBONES if not TINY.get(cls)]
    assert not missing, (f'add tiny configs for {missing} to '
                         'tests/models/backbones/test_contract.py TINY')
    ours = _ours(list(MODELS.module_dict))
    necks = [n for n in ours if MODELS.get(n).__module__.startswith('vitdet_plugin.models.necks')]
    assert 'ViTSimpleFPN' in necks
    neckless = [n for n in necks if n not in TINY_NECKS]
    assert not neckless, f'add {neckless} to TINY_NECKS'


def _check_shapes(model, outs, hw, batch):
    assert len(outs) == len(model.out_channels) == len(model.out_strides)
    assert model.feature_info == [dict(num_chs=c, reduction=s)
                                  for c, s in zip(model.out_channels, model.out_strides)]
    patch = model.patch_embed.patch_size[0]
    for out, c, s in zip(outs, model.out_channels, model.out_strides):
        assert out.shape[:2] == (batch, c)
        # the map covers the image: at most one cell short (a pooled level rounds down), and
        # past it by less than the padding to the patch grid (or one cell)
        for size, full in zip(out.shape[2:], hw):
            assert full - s < size * s < full + max(s, patch), (tuple(out.shape), hw, s)
        assert torch.isfinite(out).all()


@pytest.mark.parametrize('hw', ODD_SIZES)
@pytest.mark.parametrize('cls,variant', VARIANTS)
def test_outputs_follow_the_declared_channels_and_strides(cls, variant, hw):
    model = randomize_(_build(cls, variant))
    x = torch.randn(2, 3, *hw)
    with torch.no_grad():
        _check_shapes(model.eval(), model(x), hw, 2)
    _check_shapes(model.train(), model(x), hw, 2)


@pytest.mark.parametrize('cls,variant', VARIANTS)
def test_layer_ids_and_no_decay_names(cls, variant):
    model = _build(cls, variant)
    names = dict(model.named_parameters())
    ids = {n: model.layer_id(n) for n in names}
    assert all(0 <= i <= model.num_layers + 1 for i in ids.values())
    assert 0 in ids.values() and model.num_layers in ids.values()
    assert ids[next(n for n in names if n.startswith('patch_embed.'))] == 0
    no_decay = model.no_weight_decay()
    assert no_decay <= set(names)
    norms = {f'{m}.{p}' for m, mod in model.named_modules() for p, _ in
             mod.named_parameters(recurse=False)
             if isinstance(mod, (torch.nn.LayerNorm, torch.nn.GroupNorm,
                                 torch.nn.modules.batchnorm._BatchNorm))}
    biases = {n for n in names if n.endswith(('.bias', '.q_bias', '.v_bias'))}
    tables = {n for n in names if set(n.split('.')) & set(model.NO_DECAY_PARAMS)}
    assert no_decay == norms | biases | tables
    assert all(names[n].dim() > 1 for n in set(names) - no_decay)  # only weights decay


@pytest.mark.parametrize('cls,variant', VARIANTS)
def test_frozen_stages_freeze_at_construction_and_stay_frozen(cls, variant):
    model = randomize_(_build(cls, variant, frozen_stages=1)).train()
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert any(n.startswith('patch_embed.') for n in frozen)
    assert any(model.layer_id(n) == 1 for n in frozen)           # the first block / stage
    assert not any(model.layer_id(n) == model.num_layers for n in frozen)
    assert model.train() is model
    assert all(not m.training for m in model.frozen_modules())
    outs = model(torch.randn(1, 3, 61, 45))
    sum(o.sum() for o in outs).backward()
    for n, p in model.named_parameters():
        assert (p.grad is None) == (n in frozen), n


@pytest.mark.parametrize('cls,variant', VARIANTS)
def test_with_cp_gives_the_same_outputs_and_gradients(cls, variant):
    kw = dict(drop_path_rate=0.0)
    a = randomize_(_build(cls, variant, **kw)).train()
    b = _build(cls, variant, with_cp=True, **kw).train()
    b.load_state_dict(a.state_dict())
    x = torch.randn(1, 3, 61, 45)
    grads = []
    for m in (a, b):
        outs = m(x)
        sum(o.square().sum() for o in outs).backward()
        grads.append([p.grad for p in m.parameters()])
    assert_close_rel(a(x), b(x), tol=1e-6)
    assert_close_rel(grads[0], grads[1], tol=1e-5)


@pytest.mark.parametrize('cls,variant', VARIANTS)
def test_fused_and_eager_attention_agree(cls, variant):
    model = randomize_(_build(cls, variant)).eval()
    x = torch.randn(2, 3, 61, 45)
    with torch.no_grad():
        fused = model(x)
        with eager_attention(model):
            eager = model(x)
    assert_close_rel(fused, eager, tol=1e-5)


@pytest.mark.parametrize('cls,variant', VARIANTS)
def test_meta_build_then_materialised_and_loaded(cls, variant):
    ref = randomize_(_build(cls, variant)).eval()
    with torch.device('meta'):
        model = _build(cls, variant)
        meta_outs = model.eval()(torch.empty(1, 3, 61, 45))
    assert [o.shape for o in meta_outs] == [o.shape for o in ref(torch.randn(1, 3, 61, 45))]
    model = model.to_empty(device='cpu')
    model.load_state_dict(ref.state_dict())
    x = torch.randn(1, 3, 61, 45)
    with torch.no_grad():
        assert_close_rel(model(x), ref(x), tol=0)


@pytest.mark.parametrize('cls,variant', VARIANTS)
def test_own_checkpoint_round_trip_through_init_cfg(cls, variant, tmp_path):
    ref = randomize_(_build(cls, variant))
    path = tmp_path / 'ckpt.pth'
    torch.save(dict(state_dict=ref.state_dict()), path)
    model = _build(cls, variant, init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    model.init_weights()
    want = ref.state_dict()
    got = model.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


BAD_ARGUMENTS = [
    (dict(in_channels=0), r'in_channels must be a positive int'),
    (dict(out_indices=(99,)), r'out_indices'),
    (dict(out_indices=(0.5,)), r'out_indices'),
    (dict(frozen_stages=-2), r'frozen_stages=-2 must be in -1\.\.'),
    (dict(frozen_stages=1.5), r'frozen_stages'),
    (dict(drop_path_rate=1.5), r'drop_path_rate must be'),
    (dict(attn_drop_rate=-0.1), r'attn_drop_rate must be'),
    (dict(window_size=0), r'window_size must be positive'),
    (dict(window_size=(2, 3, 4)), r'window_size must be an int or a pair'),
    (dict(patch_size=0), r'patch_size must be a positive int'),
    (dict(mlp_ratio=0), r'mlp_ratio must be positive'),
    (dict(with_cp='yes'), r"with_cp must be True or False, got 'yes'"),
    (dict(fused_attn=True), r'fused_attn=\.\.\.\) was removed: attention always runs '
                            r'F\.scaled_dot_product_attention; .*eager_attention\(model\)'),
    (dict(qkv_bias=None), r'qkv_bias must be True or False, got None'),
    (dict(accel='auto'), r'accel=\.\.\.\) was removed: .* export the detector to ONNX .*'
                         r'\(docs/deploy\.md: tools/export_onnx\.py, then tools/infer\.py '
                         r'--backend onnxruntime\); delete accel from the config'),
    (dict(bogus=1), r"__init__\(\) got an unexpected keyword argument 'bogus'"),
    (dict(arch='nonexistent'), r"unknown .* arch 'nonexistent'; choose one of"),
    (dict(arch=dict(bogus=1)), r"arch dict has unknown keys \['bogus'\]"),
    (dict(arch=7), r'arch must be a preset name, a dict or None, got int'),
]


@pytest.mark.parametrize('kw,match', BAD_ARGUMENTS, ids=[str(k) for k, _ in BAD_ARGUMENTS])
@pytest.mark.parametrize('cls', OUR_BACKBONES)
def test_bad_arguments_fail_at_construction_naming_the_argument(cls, kw, match):
    variant = next(iter(TINY[cls]))
    cfg = copy.deepcopy(TINY[cls][variant])
    if cls in FAMILIES and set(kw) & set(FAMILY_ARGUMENTS):
        kw, match = FAMILY_ARGUMENTS[next(iter(kw))]
        cfg['arch'].pop('qkv_bias', None)
    if 'arch' in kw:
        cfg.pop('arch')
    with pytest.raises((ValueError, TypeError), match=match):
        MODELS.build(dict(type=cls, **{**cfg, **kw}))


@pytest.mark.parametrize('name', sorted(TINY_NECKS))
@pytest.mark.parametrize('hw', [(5, 7), (8, 8)])
def test_necks_follow_their_declared_channels_and_strides(name, hw):
    kw = TINY_NECKS[name]
    stride = kw['in_stride']
    neck = randomize_(MODELS.build(dict(type=name, **kw))).eval()
    x = torch.randn(2, kw['in_channels'], *hw)
    with torch.no_grad():
        outs = neck(x)
    assert len(outs) == len(neck.out_channels) == len(neck.out_strides)
    for out, c, s in zip(outs, neck.out_channels, neck.out_strides):
        assert out.shape[:2] == (2, c)
        assert all(abs(size - n * stride / s) < 1 for size, n in zip(out.shape[2:], hw)), \
            (tuple(out.shape), s)


def _neck_variants():
    return [(name, i) for name in sorted(TINY_NECKS)
            for i in range(len(NECK_VARIANTS.get(name, [{}])))]


def _build_neck(name: str, variant: int, **kw) -> torch.nn.Module:
    extra = NECK_VARIANTS.get(name, [{}])[variant]
    return MODELS.build(dict(type=name, **{**TINY_NECKS[name], **extra, **kw}))


@pytest.mark.parametrize('name,variant', _neck_variants())
def test_necks_run_on_meta_tensors_as_on_real_ones(name, variant):
    """The config checks probe necks on the meta device: same shapes as a real forward."""
    ref = randomize_(_build_neck(name, variant)).eval()
    x = torch.randn(1, TINY_NECKS[name]['in_channels'], 7, 5)
    with torch.device('meta'):
        neck = _build_neck(name, variant).eval()
        meta_outs = neck(torch.empty(x.shape))
    with torch.no_grad():
        assert [o.shape for o in meta_outs] == [o.shape for o in ref(x)]


@pytest.mark.parametrize('name,variant', _neck_variants())
def test_neck_own_checkpoint_round_trip_through_init_cfg(name, variant, tmp_path):
    ref = randomize_(_build_neck(name, variant))
    path = tmp_path / 'ckpt.pth'
    torch.save(dict(state_dict={f'neck.{k}': v for k, v in ref.state_dict().items()}), path)
    neck = _build_neck(name, variant, init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    neck.init_weights()
    want, got = ref.state_dict(), neck.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize('name', ['SwinBackbone', 'SwinV2Backbone', 'ViTBackbone',
                                  'DINOv2Backbone', 'DINOv3Backbone', 'EVA02Backbone'])
def test_every_constructor_argument_is_documented_on_the_class(name):
    """``help(DINOv2Backbone)`` shows each argument's docs (not only the base class's)."""
    cls = MODELS.get(name)
    args = inspect.getdoc(cls).split('Args:', 1)[1]
    missing = [p for p in inspect.signature(cls.__init__).parameters
               if p != 'self' and not re.search(rf'\b{p}\b', args)]
    assert missing == [], f'{name} does not document {missing}'
