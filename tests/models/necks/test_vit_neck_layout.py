"""The ViT configs after ViTDet's simple pyramid moved from inside ``ViTBackbone``
(``pyramid=dict(...)``) to the neck ``ViTSimpleFPN``: each config resolves as before apart from
the moved keys, and its detector has the same parameters (``backbone.pyramid.*`` is now
``neck.*``) and gives the same outputs for the same weights.

The "before" side (:data:`BEFORE`) was recorded from the code before the move by running this
file there (``python tests/models/necks/test_vit_neck_layout.py --record OUT.json``; every
helper below reads both layouts): the resolved ``model`` / ``optim_wrapper`` of every ViT config
and, for the two configs whose pyramid sat in the backbone, a shrunk detector's parameter
shapes, its optimizer's (lr, weight decay) per backbone parameter and a fingerprint of its
outputs, with every weight filled from its parameter name.
"""
import copy
import hashlib
import json
import os.path as osp
import sys
import zlib
from typing import Any, Dict, List

import pytest
import torch
from mmdet.registry import MODELS
from torch import Tensor, nn

import vitdet_plugin  # noqa: F401
from vitdet_plugin.config import load_config
from helpers import REPO_ROOT

ROOT = str(REPO_ROOT)
BEFORE = osp.join(ROOT, 'tests', 'fixtures', 'vit_pyramid_before_neck.json')
#: Configs whose pyramid was ``ViTBackbone(pyramid=...)`` and is now the neck.
MOVED = ['vit_mask2former_panoptic.py', 'demo/vit_detr_shapes.py']
#: ViT configs that had the pyramid as their neck already: resolved exactly as before.
UNCHANGED = ['vit_mask_rcnn.py', 'vit_detr.py', 'demo/vit_retinanet_shapes.py']
#: Where the pyramid's parameters were before the move (inside the backbone) and are now.
OLD_PREFIX, NEW_PREFIX = 'backbone.pyramid.', 'neck.'
#: The shrunk ViT of the DETR demo (its head is small already); 256 px: 64 stride-32 tokens,
#: enough for the 50 queries its two-stage proposal picks.
TINY_DETR_VIT = dict(arch=dict(embed_dims=32, depth=2, num_heads=2), global_attn_indexes=(1,))
DETR_INPUT = (256, 256)
#: Fingerprint projections per output tensor, and the tolerance of the comparison.
NUM_PROJECTIONS = 2
FINGERPRINT_TOL = 1e-5


def _plain(node: Any) -> Any:
    """A config (ConfigDicts, tuples) as JSON data."""
    return json.loads(json.dumps(node.to_dict() if hasattr(node, 'to_dict') else node,
                                 default=repr))


def _config(name: str) -> Any:
    return load_config(osp.join(ROOT, 'configs', name))


def _tiny(name: str, model_cfg: Any) -> Any:
    """The config's model, shrunk in size only (either layout)."""
    if 'panoptic_head' in model_cfg:
        from test_mask2former import _shrink  # tests/models/heads (conftest puts it on sys.path)
        return _shrink(model_cfg)
    cfg = copy.deepcopy(model_cfg)
    cfg.backbone.update(TINY_DETR_VIT)
    if cfg.get('neck') is not None:
        cfg.neck.in_channels = TINY_DETR_VIT['arch']['embed_dims']
    return cfg


def _old_name(name: str) -> str:
    return OLD_PREFIX + name[len(NEW_PREFIX):] if name.startswith(NEW_PREFIX) else name


def _fill_by_name_(model: nn.Module) -> nn.Module:
    """Every parameter from a generator seeded by its name before the move (the same weights in
    both layouts): norm weights near 1, other vectors near 0, tensors scaled by their fan-in."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            old = _old_name(name)
            g = torch.Generator().manual_seed(zlib.crc32(old.encode()))
            value = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if p.dim() == 1:
                value = value * 0.1 + (1.0 if 'norm' in old and old.endswith('weight') else 0.0)
            else:
                value = value / (p.numel() / p.shape[0]) ** 0.5
            p.copy_(value)
    return model


def _tensors(node: Any) -> List[Tensor]:
    if isinstance(node, Tensor):
        return [node]
    if isinstance(node, (list, tuple)):
        return [t for item in node for t in _tensors(item)]
    if isinstance(node, dict):
        return [t for key in sorted(node) for t in _tensors(node[key])]
    return []


def _fingerprint(outputs: Any) -> List[dict]:
    """Shape and fixed random projections of every output tensor."""
    prints = []
    for i, t in enumerate(_tensors(outputs)):
        g = torch.Generator().manual_seed(i)
        flat = t.detach().double().flatten()
        proj = [float(flat @ torch.randn(flat.numel(), generator=g, dtype=torch.float64))
                for _ in range(NUM_PROJECTIONS)]
        prints.append(dict(shape=list(t.shape), projections=proj, abs_sum=float(flat.abs().sum())))
    return prints


def _inputs(model: nn.Module, hw: tuple) -> dict:
    from mmdet.testing import demo_mm_inputs
    torch.manual_seed(0)
    packed = demo_mm_inputs(batch_size=1, image_shapes=[(3, *hw)], num_items=[2],
                            num_classes=5)
    return model.data_preprocessor(packed, training=False)


def _record_model(name: str, model_cfg: Any, optim_cfg: Any) -> dict:
    """Parameter shapes, backbone (lr, weight decay) and output fingerprint of the shrunk
    detector (names as before the move)."""
    from mmengine.optim import build_optim_wrapper

    from vitdet_plugin.engine.no_decay import decay_report
    torch.manual_seed(0)
    model = _fill_by_name_(MODELS.build(_tiny(name, model_cfg))).eval()
    hw = (64, 64) if 'panoptic_head' in model_cfg else DETR_INPUT
    with torch.no_grad():
        data = _inputs(model, hw)
        outputs = model._forward(data['inputs'], data['data_samples'])
    shapes = {_old_name(k): list(v.shape) for k, v in model.state_dict().items()}
    moved = {k: v for k, v in shapes.items() if k.startswith('backbone.')}
    rest = sorted(f'{k}:{v}' for k, v in shapes.items() if not k.startswith('backbone.'))
    decay = decay_report(build_optim_wrapper(model, copy.deepcopy(optim_cfg)), model)
    return dict(backbone_shapes=moved,
                other_shapes_sha256=hashlib.sha256('\n'.join(rest).encode()).hexdigest(),
                backbone_lr_wd={_old_name(k): list(v) for k, v in decay.items()
                                if _old_name(k).startswith('backbone.')},
                outputs=_fingerprint(outputs))


def _record() -> Dict[str, dict]:
    out = {}
    for name in MOVED + UNCHANGED:
        cfg = _config(name)
        out[name] = dict(model=_plain(cfg.model), optim_wrapper=_plain(cfg.optim_wrapper))
        if name in MOVED:
            out[name].update(_record_model(name, cfg.model, cfg.optim_wrapper))
    return out


@pytest.fixture(scope='module')
def before() -> Dict[str, dict]:
    with open(BEFORE) as f:
        return json.load(f)


@pytest.mark.parametrize('name', MOVED + UNCHANGED)
def test_resolved_config_equals_the_old_one_apart_from_the_moved_keys(name, before):
    old, cfg = before[name], _config(name)
    new = _plain(cfg.model)
    # the backbone's pretrained default came after the move (tests/checks/test_init_sources.py)
    init = new['backbone'].pop('init_cfg', None)
    assert init is None or init['type'] == 'Pretrained', init
    old = copy.deepcopy(old)
    old['model']['backbone'].pop('init_cfg', None)
    assert _plain(cfg.optim_wrapper) == old['optim_wrapper']
    if name in UNCHANGED:
        assert new == old['model']
        return
    old_model = copy.deepcopy(old['model'])
    pyramid = old_model['backbone'].pop('pyramid')
    assert old_model.pop('neck', None) is None  # the backbone's pyramid fed the head directly
    neck = new.pop('neck')
    assert new == old_model  # the backbone without pyramid, the heads and the rest unchanged
    with torch.device('meta'):
        vit = MODELS.build(dict(cfg.model.backbone))
    # the moved keys, plus what the backbone gave its pyramid (its width and stride) and the
    # number of levels (the in-backbone pyramid added no max-pooled level)
    assert neck == dict(pyramid, type='ViTSimpleFPN', in_channels=vit.embed_dims,
                        in_stride=vit.patch_size, num_outs=len(pyramid['scale_factors']))


@pytest.mark.parametrize('name', MOVED)
def test_detector_has_the_old_parameters_and_outputs_for_the_same_weights(name, before):
    cfg = _config(name)
    now = _record_model(name, cfg.model, cfg.optim_wrapper)
    old = before[name]
    assert any(k.startswith(OLD_PREFIX) for k in old['backbone_shapes'])
    assert now['backbone_shapes'] == old['backbone_shapes']
    assert now['other_shapes_sha256'] == old['other_shapes_sha256']
    assert now['backbone_lr_wd'].keys() == old['backbone_lr_wd'].keys()
    for k, (lr, wd) in old['backbone_lr_wd'].items():
        assert now['backbone_lr_wd'][k] == pytest.approx([lr, wd], rel=1e-12), k
    assert len(now['outputs']) == len(old['outputs'])
    for i, (got, want) in enumerate(zip(now['outputs'], old['outputs'])):
        assert got['shape'] == want['shape'], i
        scale = max(want['abs_sum'], 1e-12)
        for a, b in zip(got['projections'] + [got['abs_sum']],
                        want['projections'] + [want['abs_sum']]):
            assert abs(a - b) <= FINGERPRINT_TOL * scale, (i, a, b)


if __name__ == '__main__' and sys.argv[1:2] == ['--record']:
    with open(sys.argv[2], 'w') as f:
        json.dump(_record(), f, indent=1, sort_keys=True)
