"""A DETR head on another detector's backbone and neck: the Pretrained init_cfg of every part
of an SdpaDETR loads strictly and is reported (mmdet's FPN too, which mmengine would load with
strict=False), and ``frozen_parts`` keeps those parts fixed while the head trains."""
import copy
import os.path as osp
import re

import pytest
import torch

import vitdet_plugin  # noqa: F401  (registers our modules)
from vitdet_plugin.config import load_config
from vitdet_plugin.datasets import generate_dataset
from vitdet_plugin.weights import CheckpointError
from helpers import REPO_ROOT

ROOT = str(REPO_ROOT)
RETINANET = osp.join(ROOT, 'configs', 'demo', 'swin_retinanet_shapes.py')
PRETRAINED_DETR = osp.join(ROOT, 'configs', 'demo', 'swin_detr_pretrained_shapes.py')
BATCH = 4
#: The loss-falls check of tests/configs/test_demo_configs.py: optimiser steps on one fixed
#: batch and the drop the last three losses' mean must reach.
STEPS = 15
MAX_LOSS_RATIO = 0.75


@pytest.fixture(scope='module')
def shapes_root(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp('parts_shapes')
    generate_dataset(str(root), seed=5, num_train=BATCH, num_val=1, progress=False)
    return str(root) + '/'


@pytest.fixture(scope='module')
def retinanet_checkpoint(tmp_path_factory, shapes_root):
    """A checkpoint of the `make demo` RetinaNet as mmengine's runner saves it (random init,
    perturbed so that no tensor equals a fresh init)."""
    from mmdet.registry import MODELS
    cfg = load_config(RETINANET, {'data_root': shapes_root})
    torch.manual_seed(1)
    model = MODELS.build(cfg.model)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    path = tmp_path_factory.mktemp('ckpt') / 'iter_7.pth'
    torch.save({'meta': {'iter': 7}, 'state_dict': model.state_dict()}, path)
    return str(path), model.state_dict()


def _detr(shapes_root: str, checkpoint: str, **options):
    from mmdet.registry import MODELS
    opts = {'data_root': shapes_root, 'model.backbone.init_cfg.checkpoint': checkpoint,
            'model.neck.init_cfg.checkpoint': checkpoint}
    opts.update(options)
    cfg = load_config(PRETRAINED_DETR, opts)
    return cfg, MODELS.build(copy.deepcopy(cfg.model))


def _part(sd, prefix):
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


def test_backbone_and_neck_start_from_the_checkpoint_and_are_reported(shapes_root,
                                                                     retinanet_checkpoint):
    import logging

    from mmengine.logging import MMLogger

    path, sd = retinanet_checkpoint
    _, model = _detr(shapes_root, path)
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore
    logger = MMLogger.get_current_instance()
    logger.addHandler(handler)
    try:
        model.init_weights()
    finally:
        logger.removeHandler(handler)
    for name in ('backbone', 'neck'):
        own = getattr(model, name).state_dict()
        ref = _part(sd, name + '.')
        assert set(own) == set(ref), name
        for k, v in ref.items():
            assert torch.equal(own[k], v), f'{name}.{k}'
    out = '\n'.join(records)
    assert f"backbone: loaded from {path} (prefix 'backbone.') by SwinBackbone (strict)" in out
    num_neck = len(_part(sd, 'neck.'))
    assert (f"neck: loaded {num_neck} tensors from {path} (prefix 'neck.') into FPN (strict: "
            'every key and shape matched)') in out
    # the neck's init_cfg is the config's again after the load
    assert model.neck.init_cfg == dict(type='Pretrained', checkpoint=path, prefix='neck.')


def test_a_neck_that_does_not_match_the_checkpoint_fails_naming_the_keys(
        shapes_root, retinanet_checkpoint):
    path, _ = retinanet_checkpoint
    _, model = _detr(shapes_root, path, **{'model.neck.out_channels': 32,
                                           'model.bbox_head.in_channels': [32] * 3})
    with pytest.raises(CheckpointError, match=re.escape(
            'the neck checkpoint does not match FPN: shape mismatch for 18 keys: '
            'lateral_convs.0.conv.weight: checkpoint (64, 64, 1, 1) vs model '
            '(32, 64, 1, 1)')):
        model.init_weights()


def test_a_wrong_prefix_fails_instead_of_loading_nothing(shapes_root, retinanet_checkpoint):
    path, _ = retinanet_checkpoint
    _, model = _detr(shapes_root, path, **{'model.neck.init_cfg.prefix': 'necks.'})
    with pytest.raises(CheckpointError, match=re.escape(
            "no key of the checkpoint starts with prefix='necks.'; its keys start like "
            'backbone., bbox_head., neck.')):
        model.init_weights()


def test_a_neck_init_cfg_list_keeps_its_other_entries(shapes_root, retinanet_checkpoint):
    path, sd = retinanet_checkpoint
    cfg, _ = _detr(shapes_root, path)
    from mmdet.registry import MODELS
    m = copy.deepcopy(cfg.model)
    entries = [dict(type='Xavier', layer='Conv2d', distribution='uniform'),
               dict(type='Pretrained', checkpoint=path, prefix='neck.')]
    m.neck.init_cfg = copy.deepcopy(entries)
    model = MODELS.build(m)
    model.init_weights()
    assert model.neck.init_cfg == entries
    assert torch.equal(model.neck.state_dict()['fpn_convs.1.conv.weight'],
                       sd['neck.fpn_convs.1.conv.weight'])


def test_frozen_parts_stay_fixed_while_the_head_learns(shapes_root, retinanet_checkpoint):
    from mmdet.registry import DATASETS
    from mmengine.dataset import pseudo_collate
    from mmengine.optim import build_optim_wrapper

    path, sd = retinanet_checkpoint
    cfg, model = _detr(shapes_root, path)
    model.init_weights()
    model.train()
    assert not model.backbone.training and not model.neck.training  # BN statistics fixed
    assert model.bbox_head.training
    assert not any(p.requires_grad for p in model.backbone.parameters())
    assert not any(p.requires_grad for p in model.neck.parameters())
    dataset = DATASETS.build(copy.deepcopy(cfg.train_dataloader.dataset))
    data = pseudo_collate([dataset[i] for i in range(BATCH)])
    head_before = copy.deepcopy(model.bbox_head.state_dict())
    optim_wrapper = build_optim_wrapper(model, copy.deepcopy(cfg.optim_wrapper))
    for _ in range(2):
        model.train_step(data, optim_wrapper)
    for name in ('backbone', 'neck'):  # parameters and BN running statistics alike
        for k, v in getattr(model, name).state_dict().items():
            assert torch.equal(v, sd[f'{name}.{k}']), f'{name}.{k}'
    changed = [k for k, v in model.bbox_head.state_dict().items()
               if not torch.equal(v, head_before[k])]
    assert 'cls_branches.0.weight' in changed and 'decoder.layers.0.ffn.fc1.weight' in changed


def test_pretrained_detr_demo_loss_falls(shapes_root, retinanet_checkpoint):
    """`make demo-detr`'s config learns: its head, on the frozen parts of a checkpoint."""
    import math

    from mmdet.registry import DATASETS
    from mmengine.dataset import pseudo_collate
    from mmengine.optim import build_optim_wrapper

    path, _ = retinanet_checkpoint
    cfg, model = _detr(shapes_root, path)
    dataset = DATASETS.build(copy.deepcopy(cfg.train_dataloader.dataset))
    torch.manual_seed(0)
    data = pseudo_collate([dataset[i] for i in range(BATCH)])
    model.init_weights()
    model.train()
    optim_wrapper = build_optim_wrapper(model, copy.deepcopy(cfg.optim_wrapper))
    losses = [float(model.train_step(data, optim_wrapper)['loss']) for _ in range(STEPS)]
    assert all(math.isfinite(v) for v in losses), losses
    assert sum(losses[-3:]) / 3 < MAX_LOSS_RATIO * losses[0], losses


def test_frozen_parts_errors(shapes_root, retinanet_checkpoint):
    path, _ = retinanet_checkpoint
    with pytest.raises(ValueError, match=re.escape(
            "frozen_parts=('backbone', 'bbox_head'): ['bbox_head'] cannot be frozen; choose "
            "from ('backbone', 'neck')")):
        _detr(shapes_root, path, **{'model.frozen_parts': ('backbone', 'bbox_head')})
    with pytest.raises(TypeError, match=re.escape(
            "frozen_parts must be a sequence of part names, got the string 'neck'; write "
            "frozen_parts=('neck',)")):
        _detr(shapes_root, path, **{'model.frozen_parts': 'neck'})
    from mmdet.registry import MODELS
    cfg, _ = _detr(shapes_root, path)
    m = copy.deepcopy(cfg.model)
    m.neck = None
    m.bbox_head.in_channels = [64, 128, 256]
    with pytest.raises(ValueError, match=re.escape(
            "frozen_parts names 'neck' but the detector has none (neck=None)")):
        MODELS.build(m)

