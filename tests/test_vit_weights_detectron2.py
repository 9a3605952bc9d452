"""A detectron2 ViTDet checkpoint built by hand, independently of our converters: the ViT
from timm samvit's weights under detectron2's names, the SimpleFeaturePyramid's ``simfp_*``
keys as detectron2's vitdet.py names them, checked against timm's features and a plain-torch
SimpleFeaturePyramid."""
from typing import List

import torch
import torch.nn.functional as F
from torch import nn

import vitdet_plugin  # noqa: F401
from helpers import assert_close_rel
from test_vit_weights import ARCH, samvit
from vitdet_plugin.models.backbones import ViTBackbone


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
    ref = samvit(img_size=128).eval()
    ckpt = _d2_checkpoint_from_samvit(ref)
    path = tmp_path / 'model_final.pth'
    torch.save(ckpt, path)
    model = ViTBackbone(**ARCH, img_size=128, pretrain_img_size=128,
                        pyramid=dict(out_channels=D2_OUT),
                        init_cfg=dict(type='Pretrained', checkpoint=str(path))).eval()
    model.init_weights()
    x = torch.randn(1, 3, 128, 128)
    with torch.no_grad():
        feat = ref.forward_intermediates(x, indices=[3], intermediates_only=True)[0]
        expected = _d2_simple_feature_pyramid(feat, ckpt['model'])
        assert_close_rel(model(x), expected, 1e-5)
