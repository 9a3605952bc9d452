"""detectron2 ViTDet checkpoints: the ViT (``backbone.net.*``) loads into ``ViTBackbone``, the
simple pyramid (``backbone.simfp_*``) into its neck ``ViTSimpleFPN``.

One checkpoint is built by hand, independently of our converters (the ViT from timm samvit's
weights under detectron2's names, the SimpleFeaturePyramid's ``simfp_*`` keys as detectron2's
vitdet.py names them) and checked against timm's features and a plain-torch
SimpleFeaturePyramid; the others round-trip our models through the layout. Checkpoints of ours
from before the pyramid became the neck (``pyramid.*`` inside the backbone) load the same way.
"""
import logging
import pickle
from functools import partial
from typing import List

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close_rel, randomize_
from test_vit_weights import ARCH, d2_checkpoint, ours, samvit
from torch import nn

import vitdet_plugin  # noqa: F401
from vitdet_plugin.models.backbones import ViTBackbone
from vitdet_plugin.weights import load_pretrained
from vitdet_plugin.models.necks import ViTSimpleFPN
from vitdet_plugin.weights.checkpoint_io import CheckpointError
from vitdet_plugin.weights.vit import (
    convert_simple_fpn,
    convert_vit,
    convert_vitdet_to_mmdet,
    simple_fpn_part,
    simple_fpn_to_detectron2,
)

#: detectron2's LayerNorm (channels-first) epsilon, detectron2/layers/batch_norm.py
D2_LN_EPS = 1e-6
D2_OUT = 16
D2_SCALES = (4.0, 2.0, 1.0, 0.5)


def _d2_checkpoint_from_samvit(ref: nn.Module, out: int = D2_OUT) -> dict:
    """detectron2's ViTDet ``{'model': sd}`` written by hand (not with our converters): the
    ViT under ``backbone.net.`` with timm samvit's parameter names (both follow the ViTDet
    code), the position embedding flattened behind a cls slot, and SimpleFeaturePyramid's
    ``simfp_{2..5}`` modules (stage index = log2 of the stride) with random weights."""
    g = torch.Generator().manual_seed(7)
    sd = {'backbone.net.' + k: v.clone() for k, v in ref.state_dict().items()
          if k != 'pos_embed'}
    pos = ref.pos_embed.detach().flatten(1, 2)
    sd['backbone.net.pos_embed'] = torch.cat([torch.randn(1, 1, pos.shape[-1], generator=g),
                                              pos], 1)
    d = ref.pos_embed.shape[-1]
    shapes = {  # the deconvolutions and the LayerNorm between the two of scale 4
        'simfp_2.0.weight': (d, d // 2, 2, 2), 'simfp_2.0.bias': (d // 2,),
        'simfp_2.1.weight': (d // 2,), 'simfp_2.1.bias': (d // 2,),
        'simfp_2.3.weight': (d // 2, d // 4, 2, 2), 'simfp_2.3.bias': (d // 4,),
        'simfp_3.0.weight': (d, d // 2, 2, 2), 'simfp_3.0.bias': (d // 2,)}
    # stage: (index of its 1x1 conv, input channels); the 3x3 conv follows; both with LN
    convs = {2: (4, d // 4), 3: (1, d // 2), 4: (0, d), 5: (1, d)}
    for stage, (i, cin) in convs.items():
        shapes[f'simfp_{stage}.{i}.weight'] = (out, cin, 1, 1)
        shapes[f'simfp_{stage}.{i + 1}.weight'] = (out, out, 3, 3)
        for j in (i, i + 1):
            shapes[f'simfp_{stage}.{j}.norm.weight'] = shapes[f'simfp_{stage}.{j}.norm.bias'] = \
                (out,)
    for k, shape in shapes.items():
        sd['backbone.' + k] = torch.randn(shape, generator=g) * 0.1 + (
            1.0 if k.endswith(('1.weight', 'norm.weight')) and len(shape) == 1 else 0.0)
    sd['roi_heads.box_predictor.cls_score.weight'] = torch.randn(81, 8, generator=g)
    return {'model': sd, '__author__': 'detectron2'}


def _d2_ln(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """detectron2.layers.LayerNorm: normalise over channels of an NCHW map."""
    u = x.mean(1, keepdim=True)
    s = (x - u).pow(2).mean(1, keepdim=True)
    return w[:, None, None] * (x - u) / torch.sqrt(s + D2_LN_EPS) + b[:, None, None]


def _d2_simple_feature_pyramid(x: torch.Tensor, sd: dict) -> List[torch.Tensor]:
    """detectron2's SimpleFeaturePyramid forward (vitdet.py), in plain torch ops."""
    p = {k[len('backbone.'):]: v for k, v in sd.items() if k.startswith('backbone.simfp_')}

    def conv_norm(y, key, pad):
        return _d2_ln(F.conv2d(y, p[f'{key}.weight'], padding=pad), p[f'{key}.norm.weight'],
                      p[f'{key}.norm.bias'])
    y = F.conv_transpose2d(x, p['simfp_2.0.weight'], p['simfp_2.0.bias'], stride=2)
    y = F.gelu(_d2_ln(y, p['simfp_2.1.weight'], p['simfp_2.1.bias']))
    y = F.conv_transpose2d(y, p['simfp_2.3.weight'], p['simfp_2.3.bias'], stride=2)
    outs = [conv_norm(conv_norm(y, 'simfp_2.4', 0), 'simfp_2.5', 1)]
    y = F.conv_transpose2d(x, p['simfp_3.0.weight'], p['simfp_3.0.bias'], stride=2)
    outs.append(conv_norm(conv_norm(y, 'simfp_3.1', 0), 'simfp_3.2', 1))
    outs.append(conv_norm(conv_norm(x, 'simfp_4.0', 0), 'simfp_4.1', 1))
    y = F.max_pool2d(x, kernel_size=2, stride=2)
    outs.append(conv_norm(conv_norm(y, 'simfp_5.1', 0), 'simfp_5.2', 1))
    return outs


def test_detectron2_checkpoint_built_by_hand_matches_timm_and_detectron2_pyramid(tmp_path):
    """The same file as the backbone's and the neck's init_cfg: together they give
    detectron2's SimpleFeaturePyramid(net=ViT) outputs."""
    ref = samvit(img_size=128).eval()
    ckpt = _d2_checkpoint_from_samvit(ref)
    path = tmp_path / 'model_final.pth'
    torch.save(ckpt, path)
    pretrained = dict(type='Pretrained', checkpoint=str(path))
    model = ViTBackbone(**ARCH, img_size=128, pretrain_img_size=128, init_cfg=pretrained).eval()
    neck = ViTSimpleFPN(in_channels=model.embed_dims, out_channels=D2_OUT,
                        scale_factors=D2_SCALES, num_outs=len(D2_SCALES),
                        init_cfg=pretrained).eval()
    model.init_weights()
    neck.init_weights()
    x = torch.randn(1, 3, 128, 128)
    with torch.no_grad():
        feat = ref.forward_intermediates(x, indices=[3], intermediates_only=True)[0]
        expected = _d2_simple_feature_pyramid(feat, ckpt['model'])
        assert_close_rel(model(x), [feat], 1e-5)
        assert_close_rel(neck(model(x)), expected, 1e-5)


def _neck(**kwargs) -> ViTSimpleFPN:
    return randomize_(ViTSimpleFPN(in_channels=64, out_channels=16, **kwargs)).eval()


def _assert_same_weights(model: nn.Module, ref: nn.Module) -> None:
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_detectron2_round_trip_backbone_and_neck():
    src, src_neck = ours(residual_block_indexes=(2,)), _neck()
    ckpt = d2_checkpoint(src, src_neck)
    dst = ViTBackbone(**ARCH, img_size=128, pretrain_img_size=128,
                      residual_block_indexes=(2,)).eval()
    conv, dropped = convert_vit(ckpt, dst.checkpoint_target().expected, pos_grid=dst.pretrain_grid)
    assert conv.keys() == src.state_dict().keys()
    for k, v in src.state_dict().items():
        assert torch.equal(conv[k], v), k
    # the pyramid is not the backbone's: dropped, reported (and read by simple_fpn_part)
    pyramid, used = simple_fpn_part(ckpt)
    assert sorted(dropped) == sorted(used + ['proposal_generator.rpn_head.conv.weight',
                                             'roi_heads.box_predictor.cls_score.weight'])
    assert 'backbone.simfp_2.0.weight' in dropped and 'backbone.simfp_5.2.norm.bias' in dropped
    assert pyramid.keys() == src_neck.state_dict().keys()
    for k, v in src_neck.state_dict().items():
        assert torch.equal(pyramid[k], v), k


def test_detectron2_simfp_names_map_exactly():
    """The key names and shapes of detectron2's SimpleFeaturePyramid (ViT-B, out 256,
    scales 4/2/1/0.5, norm LN) land on ViTSimpleFPN's parameters one to one."""
    d, o = 768, 256
    d2 = {
        'simfp_2.0.weight': (d, d // 2, 2, 2), 'simfp_2.0.bias': (d // 2,),
        'simfp_2.1.weight': (d // 2,), 'simfp_2.1.bias': (d // 2,),
        'simfp_2.3.weight': (d // 2, d // 4, 2, 2), 'simfp_2.3.bias': (d // 4,),
        'simfp_2.4.weight': (o, d // 4, 1, 1), 'simfp_2.4.norm.weight': (o,),
        'simfp_2.4.norm.bias': (o,), 'simfp_2.5.weight': (o, o, 3, 3),
        'simfp_2.5.norm.weight': (o,), 'simfp_2.5.norm.bias': (o,),
        'simfp_3.0.weight': (d, d // 2, 2, 2), 'simfp_3.0.bias': (d // 2,),
        'simfp_3.1.weight': (o, d // 2, 1, 1), 'simfp_3.1.norm.weight': (o,),
        'simfp_3.1.norm.bias': (o,), 'simfp_3.2.weight': (o, o, 3, 3),
        'simfp_3.2.norm.weight': (o,), 'simfp_3.2.norm.bias': (o,),
        'simfp_4.0.weight': (o, d, 1, 1), 'simfp_4.0.norm.weight': (o,),
        'simfp_4.0.norm.bias': (o,), 'simfp_4.1.weight': (o, o, 3, 3),
        'simfp_4.1.norm.weight': (o,), 'simfp_4.1.norm.bias': (o,),
        'simfp_5.1.weight': (o, d, 1, 1), 'simfp_5.1.norm.weight': (o,),
        'simfp_5.1.norm.bias': (o,), 'simfp_5.2.weight': (o, o, 3, 3),
        'simfp_5.2.norm.weight': (o,), 'simfp_5.2.norm.bias': (o,),
    }
    with torch.device('meta'):
        neck = ViTSimpleFPN(in_channels=d, out_channels=o)
    conv = convert_simple_fpn({k: torch.empty(s, device='meta') for k, s in d2.items()})
    assert {k: tuple(v.shape) for k, v in conv.items()} == {
        k: tuple(v.shape) for k, v in neck.state_dict().items()}
    back = simple_fpn_to_detectron2(conv, neck.scale_factors)
    assert {k: tuple(v.shape) for k, v in back.items()} == d2


def test_backbone_load_reports_the_pyramid_keys_as_the_necks(tmp_path, caplog):
    src, src_neck = ours(), _neck()
    path = tmp_path / 'model_final.pth'
    torch.save(d2_checkpoint(src, src_neck), path)
    dst = ViTBackbone(**ARCH, img_size=128, pretrain_img_size=128)
    with caplog.at_level(logging.WARNING, logger='vitdet_plugin'):
        dropped = load_pretrained(dst, str(path)).dropped
    _assert_same_weights(dst, src)
    pyramid = [k for k in dropped if k.startswith('backbone.simfp_')]
    assert len(pyramid) == len(src_neck.state_dict())
    msg = ' '.join(r.getMessage() for r in caplog.records)
    assert (f'its {len(pyramid)} simple-pyramid keys (backbone.simfp_2.0.weight, ' in msg
            and "are the weights of the neck, not of the backbone: load them with the neck's "
            f"init_cfg=dict(type='Pretrained', checkpoint={str(path)!r})" in msg
            and 'convert_vitdet_to_mmdet' in msg), msg


def test_detectron2_model_zoo_pkl(tmp_path):
    """Model-zoo files are plain pickles of numpy arrays: read safely, arrays -> tensors."""
    src, src_neck = ours(), _neck()
    ckpt = d2_checkpoint(src, src_neck)
    ckpt['model'] = {k: v.numpy() for k, v in ckpt['model'].items()}
    path = tmp_path / 'model_final.pkl'
    with open(path, 'wb') as f:
        pickle.dump(ckpt, f)
    pretrained = dict(type='Pretrained', checkpoint=str(path))
    dst = ViTBackbone(**ARCH, img_size=128, pretrain_img_size=128, init_cfg=pretrained)
    neck = ViTSimpleFPN(in_channels=64, out_channels=16, init_cfg=pretrained)
    dst.init_weights()
    neck.init_weights()
    _assert_same_weights(dst, src)
    _assert_same_weights(neck, src_neck)
    evil = tmp_path / 'evil.pkl'
    with open(evil, 'wb') as f:
        pickle.dump({'model': ckpt['model'], 'x': partial(print, 'pwned')}, f)
    with pytest.raises(CheckpointError, match=r"refused to load .*evil.pkl.*global "
                                              r"functools.partial is not allowed"):
        load_pretrained(dst, str(evil))
    with pytest.raises(CheckpointError, match=r"refused to load .*evil.pkl"):
        load_pretrained(neck, str(evil))


def test_detectron2_to_mmdet_detector_with_neck():
    """A detectron2 ViTDet checkpoint -> backbone.* + neck.* of an mmdet detector whose neck
    is ViTSimpleFPN (strides 4..64)."""
    src, src_neck = ours(), _neck()
    ckpt = d2_checkpoint(src, src_neck)
    plain = ViTBackbone(**ARCH, img_size=128, pretrain_img_size=128)
    neck = ViTSimpleFPN(in_channels=64, out_channels=16)
    det, dropped = convert_vitdet_to_mmdet(ckpt, plain.checkpoint_target().expected,
                                           pos_grid=plain.pretrain_grid)
    assert sorted(dropped) == ['proposal_generator.rpn_head.conv.weight',
                               'roi_heads.box_predictor.cls_score.weight']
    plain.load_state_dict({k[9:]: v for k, v in det.items() if k.startswith('backbone.')})
    neck.load_state_dict({k[5:]: v for k, v in det.items() if k.startswith('neck.')})
    _assert_same_weights(plain, src)
    _assert_same_weights(neck, src_neck)


def _before_the_neck(backbone: nn.Module, neck: nn.Module) -> dict:
    """Our backbone checkpoint from before the pyramid became the neck: ``pyramid.*`` inside."""
    return {**backbone.state_dict(), **{f'pyramid.{k}': v for k, v in neck.state_dict().items()}}


def test_own_pyramid_keys_dropped_and_reported_for_a_backbone_without_pyramid(caplog):
    """As a detectron2 simfp_* pyramid is: the backbone loads, the pyramid keys are reported
    as the neck's, and the neck loads them."""
    src, src_neck = ours(), _neck()
    old = _before_the_neck(src, src_neck)
    dst = ViTBackbone(**ARCH, img_size=128, pretrain_img_size=128).eval()
    with caplog.at_level(logging.WARNING, logger='vitdet_plugin'):
        dropped = load_pretrained(dst, {'state_dict': old}).dropped
    assert dropped and all(k.startswith('pyramid.') for k in dropped)
    assert {k for k in old if k.startswith('pyramid.')} == set(dropped)
    assert torch.equal(dst.blocks[1].attn.qkv.weight, src.blocks[1].attn.qkv.weight)
    assert 'are the weights of the neck' in caplog.text
    neck = ViTSimpleFPN(in_channels=64, out_channels=16)
    assert load_pretrained(neck, {'state_dict': old}).dropped == list(src.state_dict())
    _assert_same_weights(neck, src_neck)


@pytest.mark.parametrize('layout', ['ours', 'before_the_neck', 'prefix'])
def test_neck_init_cfg_reads_our_detector_checkpoints(tmp_path, layout):
    src, src_neck = ours(), _neck()
    det = {f'backbone.{k}': v for k, v in src.state_dict().items()}
    det['bbox_head.fc.weight'] = torch.zeros(2, 2)
    if layout == 'before_the_neck':
        det.update({f'backbone.{k}': v for k, v in _before_the_neck(src, src_neck).items()})
    else:
        det.update({f'neck.{k}': v for k, v in src_neck.state_dict().items()})
    path = tmp_path / 'det.pth'
    torch.save({'state_dict': det, 'meta': {}}, path)
    prefix = dict(prefix='neck.') if layout == 'prefix' else {}
    neck = ViTSimpleFPN(in_channels=64, out_channels=16,
                        init_cfg=dict(type='Pretrained', checkpoint=str(path), **prefix))
    neck.init_weights()
    _assert_same_weights(neck, src_neck)
    if layout == 'before_the_neck':  # also for load_from: backbone.* + neck.*
        conv, _ = convert_vitdet_to_mmdet(det, src.checkpoint_target().expected, src.pretrain_grid)
        assert {k for k in conv if k.startswith('neck.')} == {
            f'neck.{k}' for k in src_neck.state_dict()}


def test_neck_checkpoint_mismatches_are_errors():
    src, src_neck = ours(), _neck()
    ckpt = d2_checkpoint(src, src_neck)
    other = ViTSimpleFPN(in_channels=64, out_channels=16, scale_factors=(2.0, 1.0, 0.5))
    with pytest.raises(CheckpointError, match=r'the simple FPN checkpoint \(detectron2 layout\) '
                                              r'does not match ViTSimpleFPN: shape mismatch'):
        load_pretrained(other, ckpt)
    with pytest.raises(CheckpointError, match=r"^no simple-pyramid weights in the checkpoint: "
                                              r"expected detectron2 ViTDet keys .*\. The "
                                              r"checkpoint is a ViT checkpoint \(ours layout\): "
                                              r"load it into type='ViTBackbone'$"):
        load_pretrained(src_neck, src.state_dict())
