"""ViTBackbone / ViTSimpleFPN (its neck): shapes, parity with timm, attention paths,
checkpointing, freezing, errors, and a Mask R-CNN built from an mmdet config."""
import ast
import functools
import math
from functools import partial

import pytest
import timm.models.vision_transformer as timm_vit
import timm.models.vision_transformer_sam as timm_sam
import torch
from helpers import assert_close_rel, randomize_
from mmdet.registry import MODELS
from torch import nn

import vitdet_plugin  # noqa: F401
from vitdet_plugin.functional import attend, decomposed_rel_pos_bias, decomposed_rel_pos_channels
from vitdet_plugin.models.backbones import ViTBackbone
from vitdet_plugin.models.backbones.vit import VIT_ARCHS
from vitdet_plugin.models.layers import eager_attention
from vitdet_plugin.models.necks import ViTSimpleFPN
from vitdet_plugin.weights.common import load_state_dict_checked
from vitdet_plugin.weights.vit import convert_vit

LN6 = partial(nn.LayerNorm, eps=1e-6)
TINY = dict(arch=dict(embed_dims=64, depth=4, num_heads=4), global_attn_indexes=(1, 3))


def tiny_vit(**kwargs) -> ViTBackbone:
    cfg = dict(TINY, window_size=3, img_size=128, pretrain_img_size=128)
    cfg.update(kwargs)
    return ViTBackbone(**cfg)


def grid(size, stride):
    return math.ceil(size[0] / stride), math.ceil(size[1] / stride)


def pyramid_sizes(size, patch=16, levels=(4.0, 2.0, 1.0, 0.5), extra=0):
    """Expected level sizes: deconvs multiply the stride-16 grid, max-pools round down (d2)."""
    h, w = grid(size, patch)
    out = []
    for s in levels:
        out.append((int(h * s), int(w * s)) if s >= 1 else (h // 2, w // 2))
    for _ in range(extra):
        h2, w2 = out[-1]
        out.append(((h2 + 1) // 2, (w2 + 1) // 2))
    return out


# ---------------------------------------------------------------------------- presets / shapes
@pytest.mark.parametrize('arch', ['base', 'large', 'huge'])
def test_preset_blocks_match_timm_samvit(arch):
    """Each preset has the ViTDet block layout: same block parameter shapes as timm's SAM ViT
    with the ViTDet global blocks, and the ViTDet drop-path rate."""
    spec = VIT_ARCHS[arch]
    with torch.device('meta'):
        ours = ViTBackbone(arch=arch)
        ref = timm_sam.VisionTransformerSAM(
            img_size=1024, embed_dim=spec['embed_dims'], depth=spec['depth'],
            num_heads=spec['num_heads'], global_attn_indexes=spec['global_attn_indexes'],
            window_size=14, use_rel_pos=True, num_classes=0)
    ours_blocks = {k: tuple(v.shape) for k, v in ours.state_dict().items()
                   if k.startswith('blocks.')}
    ref_blocks = {k: tuple(v.shape) for k, v in ref.state_dict().items()
                  if k.startswith('blocks.')}
    assert ours_blocks == ref_blocks
    assert ours.global_attn_indexes == spec['global_attn_indexes']
    assert [b.window_size is None for b in ours.blocks] == [
        i in spec['global_attn_indexes'] for i in range(spec['depth'])]
    assert ours.blocks[-1].drop_path.drop_prob == pytest.approx(spec['drop_path_rate'])
    assert tuple(ours.pos_embed.shape) == (1, 1 + 14 * 14, spec['embed_dims'])


@functools.cache
def meta_preset(arch):
    """A full-size preset and its simple pyramid (strides 4..32), on the meta device."""
    with torch.device('meta'):
        vit = ViTBackbone(arch=arch).eval()
        return vit, ViTSimpleFPN(in_channels=vit.embed_dims, out_channels=256, num_outs=4).eval()


@pytest.mark.parametrize('arch', ['base', 'large', 'huge'])
@pytest.mark.parametrize('size', [(1024, 1024), (800, 1216), (513, 769)])
def test_preset_shapes_meta(arch, size):
    """Full-size presets at odd sizes, shape-only on the meta device (alone and with the
    simple-pyramid neck)."""
    model, pyr = meta_preset(arch)
    with torch.device('meta'):
        x = torch.empty(1, 3, *size)
        (out,) = model(x)
        levels = pyr(model(x))
    c = VIT_ARCHS[arch]['embed_dims']
    assert tuple(out.shape) == (1, c, *grid(size, 16))
    assert model.out_channels == (c,) and model.out_strides == (16,)
    assert model.feature_info == [dict(num_chs=c, reduction=16)]
    assert [tuple(o.shape[-2:]) for o in levels] == pyramid_sizes(size)
    assert all(o.shape[1] == 256 for o in levels)
    assert pyr.out_strides == (4, 8, 16, 32) and pyr.out_channels == (256,) * 4


@pytest.mark.parametrize('size', [(128, 128), (100, 150), (65, 47)])
def test_tiny_shapes_any_size(size):
    model = tiny_vit().eval()
    with torch.no_grad():
        (out,) = model(torch.randn(2, 3, *size))
    assert tuple(out.shape) == (2, 64, *grid(size, 16))
    assert out.is_contiguous()


@pytest.mark.parametrize('size', [(128, 128), (208, 160), (97, 161)])
def test_simple_fpn_neck_strides_4_to_64(size):
    model = tiny_vit().eval()
    neck = ViTSimpleFPN(in_channels=model.out_channels, out_channels=32).eval()
    assert neck.out_strides == (4, 8, 16, 32, 64) and neck.out_channels == (32,) * 5
    with torch.no_grad():
        outs = neck(model(torch.randn(1, 3, *size)))
    assert [tuple(o.shape[-2:]) for o in outs] == pyramid_sizes(size, extra=1)
    assert all(o.shape[:2] == (1, 32) for o in outs)


def test_pyramid_argument_is_refused_with_the_neck_config_that_replaces_it():
    """The backbone builds no pyramid; the error gives the neck that builds the one asked for."""
    with pytest.raises(ValueError, match=r"no longer builds the simple feature pyramid, it is "
                                         r"the neck ViTSimpleFPN; remove pyramid and set "
                                         r"model.neck=\{'type': 'ViTSimpleFPN', 'in_channels': "
                                         r"64, 'in_stride': 16, 'scale_factors': \(2.0, 1.0\), "
                                         r"'num_outs': 2, 'out_channels': 32\}") as info:
        tiny_vit(pyramid=dict(out_channels=32, scale_factors=(2.0, 1.0)))
    neck_cfg = ast.literal_eval(str(info.value).split('model.neck=')[1].split(' (the heads')[0])
    neck = MODELS.build(neck_cfg)
    assert neck.out_strides == (8, 16) and neck.out_channels == (32, 32)


def test_custom_scale_factors_and_strides():
    neck = ViTSimpleFPN(in_channels=64, out_channels=16, scale_factors=(2.0, 1.0), num_outs=3)
    assert neck.out_strides == (8, 16, 32)
    outs = neck(torch.randn(1, 64, 6, 5))
    assert [tuple(o.shape[-2:]) for o in outs] == [(12, 10), (6, 5), (3, 3)]


# ---------------------------------------------------------------------------- parity with timm
def _samvit(img_size, use_abs_pos=True):
    return timm_sam.VisionTransformerSAM(
        img_size=img_size, patch_size=16, embed_dim=64, depth=4, num_heads=4, window_size=3,
        global_attn_indexes=(1, 3), use_rel_pos=True, use_abs_pos=use_abs_pos, norm_layer=LN6,
        num_classes=0).eval()


def _load_converted(ours, ref_sd):
    target = ours.checkpoint_target()
    sd, dropped = convert_vit(ref_sd, target.expected, pos_grid=target.pos_grid)
    load_state_dict_checked(ours, sd)
    return dropped


@pytest.mark.parametrize('img_size,use_abs_pos,sizes', [
    ((160, 224), True, [(160, 224)]),           # window padding 10x14 -> 12x15
    (128, False, [(128, 128), (96, 208)]),      # rel-pos tables resized for other grids
])
def test_parity_timm_samvit(img_size, use_abs_pos, sizes):
    ref = randomize_(_samvit(img_size, use_abs_pos))
    ours = tiny_vit(img_size=img_size, pretrain_img_size=img_size, use_abs_pos=use_abs_pos,
                    pretrain_use_cls_token=False).eval()
    dropped = _load_converted(ours, ref.state_dict())
    assert dropped and all(k.startswith('neck.') for k in dropped)
    for size in sizes:
        x = torch.randn(2, 3, *size)
        with torch.no_grad():
            expected = ref.forward_intermediates(x, indices=[3], intermediates_only=True)
            assert_close_rel(ours(x), expected, tol=1e-5)
            with eager_attention(ours):
                assert_close_rel(ours(x), expected, tol=1e-5)


@pytest.mark.parametrize('size', [(128, 128), (96, 160)], ids=['stored-grid', 'resized'])
def test_pos_embed_follows_data_writes(size):
    """A write through ``.data`` (mmengine's EMA) shows in the next forward: nothing derived
    from weights is cached."""
    model = randomize_(tiny_vit()).eval()
    fresh = tiny_vit().eval()
    x = torch.randn(1, 3, *size)
    with torch.no_grad():
        before = model(x)
        model.pos_embed.data.mul_(3.0)
        after = model(x)
        fresh.load_state_dict(model.state_dict())
        expected = fresh(x)
    assert (after[0] - before[0]).abs().max() > 1e-3
    assert_close_rel(after, expected, tol=0)


def test_autograd_forward_after_inference_mode_at_the_same_size():
    model = randomize_(tiny_vit(frozen_stages=2)).train()
    x = torch.randn(1, 3, 96, 160)
    with torch.inference_mode():
        model(x)
    x = x.requires_grad_()
    sum(o.sum() for o in model(x)).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_parity_timm_vit_all_global():
    ref = timm_vit.VisionTransformer(img_size=64, patch_size=16, embed_dim=48, depth=3,
                                     num_heads=3, class_token=False, global_pool='avg',
                                     num_classes=0).eval()
    randomize_(ref)
    ours = ViTBackbone(arch=dict(embed_dims=48, depth=3, num_heads=3),
                       global_attn_indexes=(0, 1, 2), use_rel_pos=False, img_size=64,
                       pretrain_img_size=64, pretrain_use_cls_token=False).eval()
    _load_converted(ours, ref.state_dict())
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = ref.forward_intermediates(x, indices=[2], norm=False,
                                             intermediates_only=True)
        assert_close_rel(ours(x), expected, tol=1e-5)


def test_parity_timm_vit_with_cls_token_patch_tokens():
    """MAE/DeiT layout (cls token, pos_embed with its slot): like ViTDet we drop the cls token
    and run the blocks on the patch tokens with the patch part of the position embedding."""
    ref = timm_vit.VisionTransformer(img_size=64, patch_size=16, embed_dim=48, depth=3,
                                     num_heads=3, num_classes=10).eval()
    randomize_(ref)
    ours = ViTBackbone(arch=dict(embed_dims=48, depth=3, num_heads=3),
                       global_attn_indexes=(0, 1, 2), use_rel_pos=False, img_size=64,
                       pretrain_img_size=64).eval()
    dropped = _load_converted(ours, ref.state_dict())
    assert {'cls_token', 'norm.weight', 'norm.bias', 'head.weight', 'head.bias'} <= set(dropped)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        tokens = ref.patch_embed(x) + ref.pos_embed[:, 1:]
        tokens = ref.blocks(tokens)
        expected = tokens.transpose(1, 2).reshape(2, 48, 4, 4)
        assert_close_rel(ours(x), [expected], tol=1e-5)


# ---------------------------------------------------------------------------- training features
def test_fused_and_eager_attention_agree():
    model = randomize_(tiny_vit(residual_block_indexes=(2,))).eval()
    x = torch.randn(1, 3, 100, 150)
    with torch.no_grad():
        fused = model(x)
        with eager_attention(model):
            eager = model(x)
    assert all(b.attn.fused for b in model.blocks)
    assert_close_rel(fused, eager, tol=1e-5)


def test_with_cp_same_outputs_and_grads():
    torch.manual_seed(0)
    plain = randomize_(nn.Sequential(tiny_vit(drop_path_rate=0.0),
                                     ViTSimpleFPN(in_channels=64, out_channels=16)))
    ckpt = nn.Sequential(tiny_vit(drop_path_rate=0.0, with_cp=True),
                         ViTSimpleFPN(in_channels=64, out_channels=16))
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(2, 3, 96, 80)
    outs = []
    for model in (plain, ckpt):
        model.train()
        model.zero_grad()
        y = model(x)
        sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in y).backward()
        outs.append((y, {k: p.grad.clone() for k, p in model.named_parameters()}))
    assert_close_rel(outs[1][0], outs[0][0], tol=1e-6)
    for k, g in outs[0][1].items():
        assert_close_rel([outs[1][1][k]], [g], tol=1e-5)


def test_frozen_stages():
    model = tiny_vit(frozen_stages=2, drop_path_rate=0.2)
    frozen = [k for k, p in model.named_parameters() if not p.requires_grad]
    assert frozen == [k for k, _ in model.named_parameters()
                      if k.startswith(('pos_embed', 'patch_embed.', 'blocks.0.', 'blocks.1.'))]
    assert model.train() is model
    assert not model.blocks[1].training and model.blocks[2].training
    assert not model.patch_embed.training
    sum(o.sum() for o in model(torch.randn(1, 3, 64, 64))).backward()
    for k, p in model.named_parameters():
        assert (p.grad is None) == (k in frozen), k
    assert model.eval() is model and not model.blocks[3].training


def test_frozen_stages_zero_freezes_embeddings_only():
    model = tiny_vit(frozen_stages=0)
    assert not model.pos_embed.requires_grad
    assert not model.patch_embed.proj.weight.requires_grad
    assert all(p.requires_grad for p in model.blocks.parameters())


def test_residual_blocks_start_as_identity():
    base = randomize_(tiny_vit()).eval()
    res = tiny_vit(residual_block_indexes=(1, 3)).eval()
    assert 'blocks.1.residual.conv1.weight' in res.state_dict()
    assert tuple(res.state_dict()['blocks.1.residual.conv2.weight'].shape) == (32, 32, 3, 3)
    res.load_state_dict(base.state_dict(), strict=False)
    x = torch.randn(1, 3, 64, 96)
    with torch.no_grad():
        assert_close_rel(res(x), base(x), tol=1e-6)


def test_out_indices_and_registry_build():
    model = MODELS.build(dict(type='ViTBackbone', **TINY, out_indices=(1, -1)))
    assert isinstance(model, ViTBackbone)
    assert model.out_indices == (1, 3)
    assert model.out_channels == (64, 64) and model.out_strides == (16, 16)
    outs = model.eval()(torch.randn(1, 3, 64, 64))
    assert len(outs) == 2 and outs[0].shape == outs[1].shape == (1, 64, 4, 4)
    assert MODELS.get('ViTSimpleFPN') is ViTSimpleFPN


# ---------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize('kwargs,match', [
    (dict(arch='giant'), r"unknown ViT arch 'giant'; choose one of \['base', 'huge', "
                         r"'large'\]"),
    (dict(arch='base', global_attn_indexes=(2, 12)),
     r'global_attn_indexes=\(2, 12\) contains \[12\], out of range for depth=12'),
    (dict(arch=dict(embed_dims=100, depth=2, num_heads=3)),
     r'embed_dims=100 is not divisible by num_heads=3'),
    (dict(arch='base', window_size=0), r'window_size must be positive, got 0'),
    (dict(arch='base', window_size=-2), r'window_size must be positive, got -2'),
    (dict(arch='base', residual_block_indexes=(-1,)),
     r'residual_block_indexes=\(-1,\) contains \[-1\]'),
    (dict(arch='base', frozen_stages=13), r'frozen_stages=13 must be in -1..12'),
    (dict(arch=dict(embed_dims=64, depth=2)), r"missing \['num_heads'\]"),
    (dict(arch=dict(embed_dims=64, depth=2, num_heads=4, heads=3)),
     r"arch dict has unknown keys \['heads'\]"),
])
def test_bad_arguments_raise_clear_errors(kwargs, match):
    with torch.device('meta'), pytest.raises(ValueError, match=match):
        ViTBackbone(**kwargs)


def test_bad_inputs_raise_clear_errors():
    model = tiny_vit()
    with pytest.raises(ValueError, match='input has 1 channels but the model was built with '
                                         'in_channels=3'):
        model(torch.randn(1, 1, 32, 32))
    with pytest.raises(ValueError, match=r'scale_factors=\(3.0,\) is not supported'):
        ViTSimpleFPN(scale_factors=(3.0,))
    with pytest.raises(ValueError, match='must be strictly decreasing'):
        ViTSimpleFPN(scale_factors=(1.0, 2.0))
    neck = ViTSimpleFPN(in_channels=64, out_channels=8)
    with pytest.raises(ValueError, match=r'expects \(B, 64, H, W\) maps \(in_channels=64\), '
                                         r'got \(1, 32, 4, 4\)'):
        neck(torch.randn(1, 32, 4, 4))


# ---------------------------------------------------------------------------- detector
def _mask_rcnn_cfg(variant):
    from mmdet.utils import register_all_modules
    from mmengine.config import Config
    register_all_modules()
    import os.path as osp

    import mmdet
    path = osp.join(osp.dirname(mmdet.__file__), '.mim', 'configs', 'mask_rcnn',
                    'mask-rcnn_r50_fpn_1x_coco.py')
    if not osp.exists(path):
        pytest.skip(f'mmdet configs not shipped: {path}')
    cfg = Config.fromfile(path)
    vit = dict(type='ViTBackbone', arch=dict(embed_dims=64, depth=4, num_heads=4),
               global_attn_indexes=(1, 3), window_size=4, img_size=128,
               drop_path_rate=0.1, _delete_=True)
    if variant == 'vitdet':  # ViTDet: plain backbone + simple pyramid neck (strides 4..64)
        backbone = MODELS.build({k: v for k, v in vit.items() if k != '_delete_'})
        cfg.merge_from_dict(dict(model=dict(
            backbone=vit,
            neck=dict(type='ViTSimpleFPN', in_channels=backbone.out_channels,
                      out_channels=32, _delete_=True))))
    else:  # two necks: the simple pyramid, then mmdet's FPN reading the pyramid's contract
        pyramid = MODELS.build(dict(type='ViTSimpleFPN', in_channels=64, out_channels=32,
                                    num_outs=4))
        fpn = dict(cfg.model.neck, in_channels=list(pyramid.out_channels), out_channels=32)
        cfg.merge_from_dict(dict(model=dict(backbone=vit)))
        cfg.model.neck = [dict(type='ViTSimpleFPN', in_channels=64, out_channels=32,
                               num_outs=4), fpn]
    cfg.model.rpn_head.in_channels = 32
    cfg.model.roi_head.bbox_roi_extractor.out_channels = 32
    cfg.model.roi_head.bbox_head.in_channels = 32
    cfg.model.roi_head.bbox_head.fc_out_channels = 64
    cfg.model.roi_head.mask_roi_extractor.out_channels = 32
    cfg.model.roi_head.mask_head.in_channels = 32
    cfg.model.roi_head.mask_head.conv_out_channels = 32
    cfg.model.train_cfg.rpn_proposal.nms_pre = 200
    cfg.model.train_cfg.rpn_proposal.max_per_img = 100
    cfg.model.train_cfg.rcnn.sampler.num = 64
    return cfg


@pytest.mark.parametrize('variant', ['vitdet', 'pyramid_then_fpn'])
def test_mask_rcnn_builds_and_runs_a_loss_step(variant):
    from mmdet.structures import DetDataSample
    from mmengine.structures import InstanceData

    cfg = _mask_rcnn_cfg(variant)
    model = MODELS.build(cfg.model)
    model.init_weights()
    model.train()
    img = torch.randint(0, 255, (3, 128, 128), dtype=torch.uint8)
    sample = DetDataSample(metainfo=dict(img_shape=(128, 128), ori_shape=(128, 128),
                                         pad_shape=(128, 128), scale_factor=(1.0, 1.0),
                                         batch_input_shape=(128, 128)))
    masks = torch.zeros(2, 128, 128, dtype=torch.bool)
    masks[0, 10:60, 20:90] = True
    masks[1, 70:120, 30:100] = True
    from mmdet.structures.mask import BitmapMasks
    sample.gt_instances = InstanceData(
        bboxes=torch.tensor([[20., 10., 90., 60.], [30., 70., 100., 120.]]),
        labels=torch.tensor([1, 5]), masks=BitmapMasks(masks.numpy(), 128, 128))
    data = model.data_preprocessor(dict(inputs=[img], data_samples=[sample]), training=True)
    losses = model(**data, mode='loss')
    total = sum(v.sum() if isinstance(v, torch.Tensor) else sum(x.sum() for x in v)
                for k, v in losses.items() if 'loss' in k)
    assert torch.isfinite(total)
    total.backward()
    assert model.backbone.blocks[0].attn.qkv.weight.grad is not None
    assert {'loss_rpn_cls', 'loss_cls', 'loss_bbox', 'loss_mask'} <= set(losses)


def test_parity_timm_samvit_gradients():
    """Training path (window padding, rel-pos, global blocks): same parameter gradients."""
    ref = randomize_(_samvit((160, 224))).train()
    ours = tiny_vit(img_size=(160, 224), pretrain_img_size=(160, 224),
                    pretrain_use_cls_token=False).train()
    _load_converted(ours, ref.state_dict())
    x = torch.randn(2, 3, 160, 224)
    weight = torch.randn(2, 64, 10, 14)
    (ref.forward_intermediates(x, indices=[3], intermediates_only=True)[0] * weight).sum() \
        .backward()
    (ours(x)[0] * weight).sum().backward()
    ref_grads = dict(ref.named_parameters())
    ours_sd_names = convert_vit({k: p.grad for k, p in ref_grads.items() if p.grad is not None},
                                ours.checkpoint_target().expected, ours.pretrain_grid)[0]
    for name, p in ours.named_parameters():
        assert_close_rel([p.grad], [ours_sd_names[name]], tol=1e-5)


@pytest.mark.parametrize('qh,qw', [(7, 9), (14, 14), (5, 2)])
def test_rel_pos_channels_equal_the_dense_bias_and_keep_no_square_tensor(qh, qw):
    """The decomposed bias as extra query/key channels: same values and gradients as the dense
    ``(N, N)`` bias, and nothing of size ``N * N`` is kept for backward."""
    b, heads, d = 2, 3, 8
    q, k, v = [torch.randn(b, heads, qh * qw, d, requires_grad=True) for _ in range(3)]
    tables = [torch.randn(2 * n - 1, d, requires_grad=True) for n in (qh, qw)]
    weight = torch.randn(b, heads, qh * qw, d)
    results = []
    for channels in (True, False):
        for t in (q, k, v, *tables):
            t.grad = None
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t, saved=saved: saved.append(t.shape) or t, lambda t: t):
            if channels:
                q2, k2, v2 = decomposed_rel_pos_channels(q, k, v, *tables, (qh, qw), d ** -0.5)
                assert q2.shape[-1] % 8 == 0 and q2.shape == k2.shape == v2.shape
                out = attend(q2, k2, v2, scale=1.0)[..., :d]
            else:
                bias = decomposed_rel_pos_bias(q, *tables, (qh, qw), (qh, qw))
                out = attend(q, k, v, bias, fused=False)
        (out * weight).sum().backward()
        results.append([out.detach()] + [t.grad.clone() for t in (q, k, v, *tables)])
        n2 = (qh * qw) ** 2
        assert any(math.prod(s[-2:]) == n2 for s in saved) != channels
    assert_close_rel(results[0], results[1], tol=1e-5)

