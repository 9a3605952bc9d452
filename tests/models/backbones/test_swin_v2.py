"""Swin V2: parity with timm's ``SwinTransformerV2`` (same random weights), the formulation's
pieces, checkpoints in the official / timm / mmpretrain layouts built from the reference
model's own state dict, clear errors, the CLI converter and the two configs.

The generic backbone contract (shapes at odd sizes, freezing, with_cp, layer ids, no-decay
names, meta build, own checkpoints) runs in ``test_contract.py`` (``TINY['SwinV2Backbone']``).
"""
import math
import os.path as osp
import re
from typing import Dict, List

import pytest
import torch
import torch.nn.functional as F
from helpers import REPO_ROOT, assert_close_rel, load_tool, randomize_
from mmdet.registry import MODELS
from timm.models.swin_transformer_v2 import SwinTransformerV2
from torch import Tensor

import vitdet_plugin  # noqa: F401
from vitdet_plugin.functional.swin_bias import log_spaced_relative_coords
from vitdet_plugin.models.backbones import SwinBackbone, SwinV2Backbone
from vitdet_plugin.weights import load_pretrained
from vitdet_plugin.models.backbones.swin_v2_block import SwinV2Block
from vitdet_plugin.weights import CheckpointError, detect_layout
from vitdet_plugin.weights.swin_v2 import check_pretrained_windows, convert_swin_v2

ROOT = str(REPO_ROOT)
EMBED, DEPTHS, HEADS = 32, (2, 2, 2, 2), (2, 4, 4, 8)
#: Per-stage windows and pretraining windows: mixed on purpose (0: the stage's own window).
WINDOWS = (8, 4, 4, 2)
PRETRAINED = (6, 0, 3, 4)
#: Every stage map is a multiple of its window with more than one window per stage (32x64,
#: 16x32, 8x16, 4x8), where timm (roll, then pad) and ours (pad, then roll) agree.
SIZE = (128, 256)
#: fp32 tolerance of the logit-scale and position-bias MLP gradients (whole-map sums).
SHARED_GRAD_TOL = 3e-5


def _timm(clamped_head: bool = False, **kw) -> SwinTransformerV2:
    """timm's Swin V2 with random weights (logit scales around log 10; with ``clamped_head``
    one head per block above the clamp at log 100)."""
    model = SwinTransformerV2(img_size=SIZE, embed_dim=EMBED, depths=DEPTHS, num_heads=HEADS,
                              window_size=WINDOWS, pretrained_window_sizes=PRETRAINED,
                              num_classes=10, drop_path_rate=0.0, strict_img_size=False,
                              always_partition=True, **kw)
    randomize_(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith('logit_scale'):
                p.add_(math.log(10.0))
                if clamped_head:
                    p[0] = math.log(200.0)
    return model.eval()


def _ours(**kw) -> SwinV2Backbone:
    args = dict(arch=dict(embed_dims=EMBED, depths=DEPTHS, num_heads=HEADS),
                window_size=WINDOWS, pretrained_window_sizes=PRETRAINED, drop_path_rate=0.0)
    return SwinV2Backbone(**{**args, **kw}).eval()


def timm_stages(model: SwinTransformerV2, x: Tensor) -> List[Tensor]:
    """timm's per-stage maps ``(B, H, W, C)`` (before any output norm)."""
    x = model.patch_embed(x)
    outs = []
    for layer in model.layers:
        x = layer(x)
        outs.append(x)
    return outs


def our_stages(model: SwinV2Backbone, x: Tensor) -> List[Tensor]:
    """Our per-stage maps ``(B, H, W, C)`` before the output norms ``norm{i}``."""
    x = model.patch_embed(x)
    outs = []
    for stage in model.layers:
        out, x = stage(x)
        outs.append(out)
    return outs


def _loaded(ref: SwinTransformerV2, **kw) -> SwinV2Backbone:
    ours = _ours(**kw)
    ours.init_weights()  # the output norms, which timm's classifier does not have
    load_pretrained(ours, ref.state_dict())
    return ours


# ----------------------------------------------------------------------------- formulation
def test_log_spaced_coordinates_match_the_formula():
    table = log_spaced_relative_coords((3, 2), (0, 0))
    assert table.shape == (5, 3, 2)

    def f(x: float) -> float:
        return math.copysign(math.log2(abs(x) + 1) / 3, x)
    # dy in -2..2 over (3 - 1), dx in -1..1 over (2 - 1), times 8, log-spaced
    want = torch.tensor([[[f(8 * dy / 2), f(8 * dx)] for dx in (-1, 0, 1)]
                         for dy in (-2, -1, 0, 1, 2)])
    assert torch.allclose(table, want, atol=0, rtol=1e-6)
    # a pretrained window rescales; a one-token axis divides by 1, not 0
    assert torch.allclose(log_spaced_relative_coords((3, 1), (5, 1))[..., 0][:, 0],
                          torch.tensor([f(-4.0), f(-2.0), 0.0, f(2.0), f(4.0)]))


def test_equal_to_the_official_formulation_at_the_pretrained_window():
    """pretrained_window_sizes equal to the windows is the formulation without them."""
    ref = _ours(pretrained_window_sizes=0)
    randomize_(ref)
    model = _ours(pretrained_window_sizes=WINDOWS)
    model.load_state_dict(ref.state_dict())
    x = torch.randn(1, 3, *SIZE)
    with torch.no_grad():
        assert_close_rel(model(x), ref(x), tol=0)
        other = _ours()
        other.load_state_dict(ref.state_dict())
        assert (other(x)[0] - ref(x)[0]).abs().max() > 1e-4  # and it matters


# ----------------------------------------------------------------------------- timm parity
def _parity(ref: SwinTransformerV2, ours: SwinV2Backbone, x: Tensor, tol: float) -> None:
    """Stage maps, detection outputs, input and parameter gradients of ours equal timm's."""
    with torch.no_grad():
        assert_close_rel(our_stages(ours, x), timm_stages(ref, x), tol=tol)
        # the detection outputs are those maps through the output norms, NCHW
        want = [getattr(ours, f'norm{i}')(t).permute(0, 3, 1, 2)
                for i, t in enumerate(timm_stages(ref, x))]
        assert_close_rel(ours(x), want, tol=tol)

    ours.train()
    ref.train()
    weights = [torch.randn(t.shape, dtype=x.dtype) for t in timm_stages(ref, x)]
    grads = []
    for model, run in ((ours, our_stages), (ref, timm_stages)):
        xi = x.clone().requires_grad_()
        loss = sum((o * w).sum() for o, w in zip(run(model, xi), weights))
        loss.backward()
        grads.append((xi.grad, {n: p.grad for n, p in model.named_parameters()
                                if p.grad is not None}))
    (gx_ours, g_ours), (gx_ref, g_ref) = grads
    assert_close_rel([gx_ours], [gx_ref], tol=tol)
    g_ref_ours, _ = convert_swin_v2(g_ref, src_format='timm')  # timm names -> ours
    assert set(g_ref_ours) == set(g_ours)
    names = sorted(g_ref_ours)
    assert any(n.endswith('logit_scale') for n in names)
    assert any('.cpb_mlp.0.' in n for n in names) and any(n.endswith('q_bias') for n in names)
    shared = [n for n in names if n.endswith('logit_scale') or '.cpb_mlp.' in n]
    rest = [n for n in names if n not in shared]
    assert_close_rel([g_ours[n] for n in rest], [g_ref_ours[n] for n in rest], tol=tol)
    # the gradients of a head's logit scale and of the position-bias MLP are sums over every
    # window and token pair: their fp32 rounding differs by up to ~1.1e-5 (float64: 1e-13,
    # see the test below)
    assert_close_rel([g_ours[n] for n in shared], [g_ref_ours[n] for n in shared],
                     tol=max(tol, SHARED_GRAD_TOL))


def test_forward_and_gradients_equal_timm():
    ref = _timm()
    _parity(ref, _loaded(ref), torch.randn(2, 3, *SIZE), tol=1e-5)


def test_clamped_logit_scale_equals_timm_in_float64():
    """A head above the clamp (scale 100: sharp softmax, whose fp32 gradients differ by
    rounding at ~1e-4) gives the same function and gradients in float64."""
    ref = _timm(clamped_head=True)
    ours = _loaded(ref)
    _parity(ref.double(), ours.double(), torch.randn(2, 3, *SIZE, dtype=torch.float64),
            tol=1e-10)


def test_shifted_blocks_fold_windows_and_mask_like_timm():
    """One shifted block at a map of 2x3 windows of 4x4, alone (mask, roll, fold checked)."""
    ref = _timm()
    ours = _loaded(ref)
    block, ref_block = ours.layers[1].blocks[1], ref.layers[1].blocks[1]
    assert tuple(ref_block.shift_size) == block.shift_size == (2, 2)
    x = torch.randn(2, 8, 12, 2 * EMBED)
    with torch.no_grad():
        assert_close_rel([block(x)], [ref_block(x)], tol=1e-5)


# ----------------------------------------------------------------------------- semantics
def test_any_input_size_pads_and_always_shifts():
    model = randomize_(_ours()).eval()
    with torch.no_grad():
        outs = model(torch.randn(1, 3, 61, 45))
    assert [tuple(o.shape) for o in outs] == [(1, 32, 16, 12), (1, 64, 8, 6), (1, 128, 4, 3),
                                              (1, 256, 2, 2)]
    assert all(torch.isfinite(o).all() for o in outs)


def test_pad_small_map_false_is_mmpretrains_classification_rule():
    kw = dict(dim=8, num_heads=2, window_size=(4, 4), pretrained_window_size=(0, 0))
    shifted = randomize_(SwinV2Block(shift=True, pad_small_map=False, **kw)).eval()
    plain = SwinV2Block(shift=False, **kw).eval()
    plain.load_state_dict(shifted.state_dict())
    detection = SwinV2Block(shift=True, pad_small_map=True, **kw).eval()
    detection.load_state_dict(shifted.state_dict())
    x = torch.randn(1, 4, 8, 8)  # a side equal to the window: no shift
    with torch.no_grad():
        assert torch.equal(shifted(x), plain(x))
        assert not torch.allclose(detection(x), plain(x))
        y = torch.randn(1, 8, 12, 8)  # larger: shifts as usual
        assert torch.equal(shifted(y), detection(y))
    with pytest.raises(ValueError, match=r'a 3x8 feature map is smaller than the 4x4 window, '
                                         r'which pad_small_map=False does not allow; set '
                                         r'pad_small_map=True'):
        shifted(torch.randn(1, 3, 8, 8))


def test_contract_names():
    model = _ours(out_indices=(1, 3))
    assert model.out_channels == (64, 256) and model.out_strides == (8, 32)
    assert model.num_layers == 8
    assert model.layer_id('layers.1.blocks.1.attn.cpb_mlp.0.weight') == 4
    assert model.layer_id('layers.0.downsample.reduction.weight') == 2
    no_decay = model.no_weight_decay()
    for name in ('layers.2.blocks.0.attn.logit_scale', 'layers.2.blocks.0.attn.q_bias',
                 'layers.2.blocks.0.attn.v_bias', 'layers.2.blocks.0.attn.cpb_mlp.0.bias',
                 'layers.0.downsample.norm.weight', 'layers.2.blocks.1.norm2.weight'):
        assert name in no_decay
    assert 'layers.2.blocks.0.attn.qkv.weight' not in no_decay
    assert model.layers[0].downsample.norm.normalized_shape == (2 * EMBED,)  # V2: after


def test_init_weights_matches_the_official_init():
    model = _ours()
    model.init_weights()
    attn = model.layers[0].blocks[0].attn
    assert torch.allclose(attn.logit_scale, torch.full_like(attn.logit_scale, math.log(10)))
    assert not attn.q_bias.any() and not attn.v_bias.any()
    block = model.layers[2].blocks[1]  # residual post-norm starts at zero: identity blocks
    assert not block.norm1.weight.any() and not block.norm2.weight.any()
    x = torch.randn(1, 8, 8, 128)
    with torch.no_grad():
        assert torch.equal(block(x), x)


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize('kw,message', [
    (dict(window_size=(8, 8, 8)), "window_size must be an int or a pair (h, w), or one int or "
                                  "(h, w) pair per stage (the model has 4 stages), got (8, 8, 8)"),
    (dict(window_size=(8, 0, 8, 8)), 'window_size must be positive, got (8, 0, 8, 8)'),
    (dict(window_size=-2), 'window_size must be positive, got -2'),
    (dict(pretrained_window_sizes=(12, 12, 12)),
     'pretrained_window_sizes must be an int or one int or (h, w) pair per stage (the model '
     'has 4 stages), got (12, 12, 12)'),
    (dict(pretrained_window_sizes=(12, 12)),
     'pretrained_window_sizes must be an int or one int or (h, w) pair per stage (the model '
     'has 4 stages), got (12, 12)'),
    (dict(pretrained_window_sizes=(12, -1, 12, 6)),
     "pretrained_window_sizes must be >= 0 (0: the stage's own window), got (12, -1, 12, 6)"),
    (dict(arch=dict(embed_dims=32, depths=(2,), num_heads=(2,), extra_norm_every_n_blocks=-1)),
     'extra_norm_every_n_blocks must be an int >= 0 (0: none), got -1'),
])
def test_bad_windows_fail_at_construction(kw, message):
    args = {'arch': 'tiny', **kw}
    with pytest.raises(ValueError, match=re.escape(message)):
        SwinV2Backbone(**args)


def test_v1_checkpoint_into_v2_and_the_reverse_are_refused(tmp_path):
    v1 = SwinBackbone(arch=dict(embed_dims=32, depths=(2, 2), num_heads=(2, 4)),
                      out_indices=(0, 1))
    torch.save({'state_dict': v1.state_dict()}, tmp_path / 'v1.pth')
    v2 = SwinV2Backbone(arch=dict(embed_dims=32, depths=(2, 2), num_heads=(2, 4)),
                        out_indices=(0, 1),
                        init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'v1.pth')))
    with pytest.raises(CheckpointError, match='^' + re.escape(
            'the checkpoint is a Swin checkpoint (ours layout); SwinV2Backbone loads Swin V2 '
            "checkpoints: build type='SwinBackbone'") + '$'):
        v2.init_weights()
    torch.save({'model': _timm().state_dict()}, tmp_path / 'v2.pth')
    v1 = SwinBackbone(arch=dict(embed_dims=32, depths=(2, 2), num_heads=(2, 4)),
                      out_indices=(0, 1),
                      init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'v2.pth')))
    with pytest.raises(CheckpointError, match='^' + re.escape(
            'the checkpoint is a Swin V2 checkpoint (timm layout); SwinBackbone loads Swin '
            "checkpoints: build type='SwinV2Backbone'") + '$'):
        v1.init_weights()


def test_mismatched_architecture_is_a_strict_error():
    ref = _timm()
    model = SwinV2Backbone(arch=dict(embed_dims=EMBED, depths=(2, 2, 1, 2), num_heads=HEADS))
    with pytest.raises(CheckpointError, match=r'^the Swin V2 checkpoint \(timm layout\) holds '
                                              r'embed_dims=32, depths=\(2, 2, 2, 2\), '
                                              r'num_heads=\(2, 4, 4, 8\); SwinV2Backbone was '
                                              r'built with embed_dims=32, depths=\(2, 2, 1, 2\), '
                                              r'num_heads=\(2, 4, 4, 8\): set its architecture '
                                              r'arguments to embed_dims=32, depths=\(2, 2, 2, 2\), '
                                              r'num_heads=\(2, 4, 4, 8\)$'):
        load_pretrained(model, ref.state_dict())


# ----------------------------------------------------------------------------- checkpoints
def _official_from_timm(ref: SwinTransformerV2) -> Dict[str, Tensor]:
    """The official layout, hand-mapped from timm's keys (REFERENCE.md): downsample at the end
    of stage i, the buffers official checkpoints carry, ``head.*``, under ``model``."""
    sd = {}
    for k, v in ref.state_dict().items():
        m = re.match(r'layers\.(\d+)\.downsample\.(.*)', k)
        k = f'layers.{int(m.group(1)) - 1}.downsample.{m.group(2)}' if m else k
        sd[k.replace('head.fc.', 'head.')] = v
    for k, v in ref.named_buffers():
        if k.endswith(('relative_coords_table', 'relative_position_index')):
            sd[k] = v
    n = WINDOWS[0] ** 2
    sd['layers.0.blocks.1.attn_mask'] = torch.zeros(32 // WINDOWS[0] * 64 // WINDOWS[0], n, n)
    return sd


def _unfold_columns(w: Tensor) -> Tensor:
    """A ``(out, 4C)`` merge weight with official columns ``(dx, dy, c)`` (x0 = (0::2, 0::2),
    x1 = (1::2, 0::2), ...) reordered to ``nn.Unfold``'s ``(c, ky, kx)``."""
    out, c4 = w.shape
    c = c4 // 4
    return w.view(out, 2, 2, c).permute(0, 3, 2, 1).reshape(out, c4)  # (dx,dy,c)->(c,dy,dx)


def test_unfold_column_map_is_what_nn_unfold_computes():
    """mmpretrain's merge (nn.Unfold, reduction, norm) with the mapped weight equals timm's."""
    ref = _timm()
    merge = ref.layers[1].downsample
    x = torch.randn(2, 8, 6, EMBED)
    with torch.no_grad():
        want = merge(x)                                              # (2, 4, 3, 2C)
        cols = F.unfold(x.permute(0, 3, 1, 2), kernel_size=2, stride=2).transpose(1, 2)
        got = merge.norm(cols @ _unfold_columns(merge.reduction.weight).t())
    assert_close_rel([got.view(want.shape)], [want], tol=1e-5)


def _mmpretrain_from_timm(ref: SwinTransformerV2) -> Dict[str, Tensor]:
    """mmpretrain's ``SwinTransformerV2`` layout by a hand-written key map (REFERENCE.md):
    ``stages.{i}.blocks.{j}.attn.w_msa.*`` with its persistent buffers, ``ffn.layers.0.0`` /
    ``ffn.layers.1``, ``patch_embed.projection``, Unfold-ordered downsample at the start of
    stages 1-3 (norm on the 2C output, unchanged), the classifier's ``norm3`` out norm, all
    under ``backbone.``, and ``head.fc``."""
    block = r'^layers\.(\d+)\.blocks\.(\d+)\.'
    renames = [(r'^patch_embed\.proj\.', 'patch_embed.projection.'),
               (block + r'attn\.', r'stages.\1.blocks.\2.attn.w_msa.'),
               (block + r'mlp\.fc1\.', r'stages.\1.blocks.\2.ffn.layers.0.0.'),
               (block + r'mlp\.fc2\.', r'stages.\1.blocks.\2.ffn.layers.1.'),
               (r'^layers\.', 'stages.'), (r'^norm\.', 'norm3.')]
    sd = {}
    state = dict(ref.state_dict())
    state.update({k: v for k, v in ref.named_buffers()
                  if k.endswith(('relative_coords_table', 'relative_position_index'))})
    for k, v in state.items():
        if k.startswith('head.'):
            sd[k] = v
            continue
        if re.match(r'layers\.\d+\.downsample\.reduction\.weight$', k):
            v = _unfold_columns(v)
        for pattern, repl in renames:
            new = re.sub(pattern, repl, k)
            if new != k:
                k = new
                break
        sd['backbone.' + k] = v
    return sd


LAYOUTS = {
    'timm': lambda ref: ref.state_dict(),
    'official': lambda ref: {'model': _official_from_timm(ref)},
    'mmpretrain': lambda ref: {'state_dict': _mmpretrain_from_timm(ref),
                               'meta': {'note': 'mmpretrain'}},
}


@pytest.mark.parametrize('layout', sorted(LAYOUTS))
def test_checkpoint_files_in_each_layout_load_to_the_reference(layout, tmp_path):
    ref = _timm()
    path = tmp_path / f'{layout}.pth'
    torch.save(LAYOUTS[layout](ref), path)
    from vitdet_plugin.weights import checkpoint_state_dict
    assert detect_layout(checkpoint_state_dict(str(path))).name == layout
    model = _ours(init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    model.init_weights()
    x = torch.randn(1, 3, *SIZE)
    with torch.no_grad():
        assert_close_rel(our_stages(model, x), timm_stages(ref, x), tol=1e-5)
        if layout == 'mmpretrain':  # its out norm 3 came along (timm's final norm)
            assert torch.equal(model.norm3.weight, ref.norm.weight)


def test_pretrained_window_mismatch_is_reported():
    """Official / mmpretrain checkpoints record how they normalised offsets; a model that
    normalises otherwise (pretrained_window_sizes not set) is told which stage and what to set."""
    sd = _official_from_timm(_timm())
    assert check_pretrained_windows(sd, _ours().checkpoint_target().pretrained_windows) == []
    sd_mm = _mmpretrain_from_timm(_timm())
    assert check_pretrained_windows(sd_mm, _ours().checkpoint_target().pretrained_windows) == []
    windows = _ours(pretrained_window_sizes=0).checkpoint_target().pretrained_windows
    got = check_pretrained_windows(sd, windows)
    assert got == [
        'stage 0: the checkpoint normalised relative offsets by 6x6 windows, the model by '
        "8x8; set pretrained_window_sizes[0] to the checkpoint's window",
        'stage 2: the checkpoint normalised relative offsets by 3x3 windows, the model by '
        "4x4; set pretrained_window_sizes[2] to the checkpoint's window",
        'stage 3: the checkpoint normalised relative offsets by 4x4 windows, the model by '
        "2x2; set pretrained_window_sizes[3] to the checkpoint's window"]


def test_convert_cli_detects_swin_v2(tmp_path):
    cli = load_tool('convert_weights.py')
    ref = _timm()
    torch.save({'model': _official_from_timm(ref)}, tmp_path / 'official.pth')
    assert cli.main([str(tmp_path / 'official.pth'), str(tmp_path / 'ours.pth')]) == 0
    saved = torch.load(tmp_path / 'ours.pth', weights_only=True)
    assert saved['meta']['model'] == 'swinv2' and saved['meta']['converted_from'] == 'official'
    model = _ours(init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'ours.pth')))
    model.init_weights()
    x = torch.randn(1, 3, *SIZE)
    with torch.no_grad():
        assert_close_rel(our_stages(model, x), timm_stages(ref, x), tol=1e-5)
    with pytest.raises(SystemExit):
        cli.main([str(tmp_path / 'official.pth'), str(tmp_path / 'x.pth'), '--window-size', '7'])


# ----------------------------------------------------------------------------- configs
CONFIGS = ['configs/swinv2_mask_rcnn.py', 'configs/swinv2_retinanet.py']


@pytest.mark.parametrize('config', CONFIGS)
def test_config_builds_and_runs_one_loss_step(config):
    from mmdet.testing import demo_mm_inputs
    from mmengine.optim import build_optim_wrapper

    from vitdet_plugin.config import load_config

    cfg = load_config(osp.join(ROOT, config))
    bb = cfg.model.backbone
    assert bb.type == 'SwinV2Backbone' and bb.arch == 'tiny'
    full = MODELS.build(dict(bb, init_cfg=None))
    assert list(cfg.model.neck.in_channels) == list(full.out_channels)
    if 'mask_rcnn' in config:
        assert full.window_sizes == ((16, 16),) * 4
        assert full.pretrained_window_sizes == ((8, 8),) * 4
    # one loss step with a small Swin V2 of the same stage count and the config's windows
    bb.update(embed_dims=16, depths=[2, 2, 2, 2], num_heads=[1, 2, 2, 4], drop_path_rate=0.0,
              init_cfg=None)
    small = [16 * 2**i for i in full.out_indices]
    cfg.model.neck.in_channels = small
    torch.manual_seed(0)
    model = MODELS.build(cfg.model)
    model.init_weights()
    randomize_(model.backbone)  # as if pretrained: the init's zero post-norms stop gradients
    with_mask = 'mask_head' in cfg.model.get('roi_head', {})
    packed = demo_mm_inputs(batch_size=1, image_shapes=[(3, 96, 128)], num_items=[2],
                            num_classes=80, with_mask=with_mask)
    data = model.data_preprocessor(packed, training=True)
    model.train()
    losses = model.loss(data['inputs'], data['data_samples'])
    total = sum(v.sum() if isinstance(v, Tensor) else sum(v) for v in losses.values())
    assert torch.isfinite(total)
    total.backward()
    attn = model.backbone.layers[0].blocks[1].attn
    assert attn.logit_scale.grad is not None and attn.cpb_mlp[0].weight.grad.abs().sum() > 0
    # the recipe: no weight decay on logit scales and the position-bias MLP
    wrapper = build_optim_wrapper(model, cfg.optim_wrapper)
    decay = {id(p): g['weight_decay'] for g in wrapper.optimizer.param_groups
             for p in g['params']}
    assert decay[id(attn.cpb_mlp[0].weight)] == 0 and decay[id(attn.logit_scale)] == 0
    assert decay[id(attn.qkv.weight)] == cfg.optim_wrapper.optimizer.weight_decay


# ----------------------------------------------------------------------------- benchmark
def test_benchmark_models_compute_the_same_function_where_they_must(monkeypatch):
    """``tools/benchmark.py --model swinv2``: timm's weights reach ours (last maps equal at a
    size where every stage is whole windows); elsewhere the difference is only recorded."""
    monkeypatch.syspath_prepend(osp.join(ROOT, 'tools'))
    from dev.bench.models import build
    from dev.bench.rows import check_parity

    aligned = build('swinv2', 'tiny', (256, 256), with_cp=False)
    assert aligned.parity_ref == 'timm' and aligned.parity_sizes == ((256, 256),)
    for m in aligned.models.values():
        m.eval()
    assert check_parity(aligned, torch.randn(1, 3, 256, 256), 'fp32', torch.no_grad) < 1e-5
    assert build('swinv2', 'tiny', (224, 224), with_cp=False).parity_sizes == ()
