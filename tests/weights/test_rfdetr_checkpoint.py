"""RF-DETR's ``.pth`` files load through the layout table into our detector (mmdet's
``SingleStageDetector``: ``DINOv2Backbone`` -> ``RFDETRProjector`` -> ``LWDETRHead``).

The files are the real format, written by rfdetr 1.11.2's own code from its
``RFDETRNano(pretrain_weights=None)`` (built once, every parameter randomised): its
``export_for_roboflow`` (``args`` a ``types.SimpleNamespace``), the pre-Lightning training loop's
``{'model': ..., 'args': argparse.Namespace}``, and the payload of its Lightning callback
(``BestModelCallback._build_checkpoint_payload``: ``args`` a dict, the model also as
``state_dict`` under ``model.``; written here with that method's keys, its module needs
``pytorch_lightning``, rfdetr's training extra). The loaded tensors are compared with
rfdetr's modules themselves.
"""
import argparse
import os
import re
import types
from typing import Dict

import pytest
import torch
from helpers import random_rfdetr, run_tool, save_rfdetr_checkpoint
from mmdet.datasets import CocoDataset
from mmdet.registry import MODELS
from mmdet.utils import register_all_modules
from mmengine.runner.checkpoint import load_checkpoint as mmengine_load_checkpoint

import rfdetr
from rfdetr.assets.coco_classes import COCO_CLASSES

import vitdet_plugin  # noqa: F401
from vitdet_plugin.models.backbones import DINOv2Backbone
from vitdet_plugin.models.backbones.base import state_shapes
from vitdet_plugin.weights import CheckpointError, CheckpointTarget, detect_layout, load_checkpoint
from vitdet_plugin.weights.checkpoint_io import TRUST_ENV
from vitdet_plugin.weights.common import checkpoint_state_dict
from vitdet_plugin.weights.rfdetr import RFDETR, RFDETR_CONFIGS, config_fix, matching_configs
from vitdet_plugin.weights.rfdetr_classes import COCO_CATEGORY_IDS

register_all_modules()
#: RF-DETR N: ViT-S taps of 384 channels, patch 16 at 384 px (grid 24), 2 decoder layers.
TAPS = (384,) * 4
OWNER = 'SingleStageDetector'


def detector(num_classes: int = 91, layers: int = 2, patch: int = 16,
             taps=TAPS, hidden: int = 256, **parts) -> torch.nn.Module:
    """Our RF-DETR N (the sizes of its config) on mmdet's ``SingleStageDetector``."""
    return MODELS.build(dict(
        type='SingleStageDetector', data_preprocessor=dict(type='DetDataPreprocessor'),
        backbone=dict(type='DINOv2Backbone', arch='small', patch_size=patch,
                      pretrain_img_size=384, pretrain_patch_size=16, out_indices=(2, 5, 8, 11),
                      **parts.get('backbone', {})),
        neck=dict(type='RFDETRProjector', in_channels=taps, out_channels=hidden,
                  levels=('P4',), in_stride=patch, **parts.get('neck', {})),
        bbox_head=dict(type='LWDETRHead', num_classes=num_classes, embed_dims=hidden,
                       num_decoder_layers=layers)))


def target(model: torch.nn.Module) -> CheckpointTarget:
    return CheckpointTarget(RFDETR, OWNER, state_shapes(model))


@pytest.fixture(scope='module')
def nano():
    """rfdetr's RF-DETR N, every parameter random, and its ``LWDETR`` module."""
    model = random_rfdetr('RFDETRNano')
    return model, model.model.model


@pytest.fixture(scope='module')
def files(nano, tmp_path_factory) -> Dict[str, str]:
    """The three formats rfdetr writes, each as its own code writes it."""
    model, net = nano
    root = tmp_path_factory.mktemp('rfdetr')
    model.export_for_roboflow(str(root / 'roboflow'))          # args: types.SimpleNamespace
    state = net.state_dict()
    args = vars(model.model.args)
    paths = {'SimpleNamespace': str(root / 'roboflow' / 'weights.pt'),
             'Namespace': str(root / 'engine.pth'), 'dict': str(root / 'lightning.pth')}
    save_rfdetr_checkpoint(model, paths['Namespace'], epoch=3)
    # BestModelCallback._build_checkpoint_payload's keys (its module needs pytorch_lightning,
    # rfdetr's training extra, not installed here)
    torch.save({'model': state, 'epoch': 3, 'state_dict': {f'model.{k}': v for k, v in
                                                           state.items()},
                'global_step': 30, 'optimizer_states': [], 'lr_schedulers': [],
                'args': dict(args), 'model_name': 'RFDETRNano',
                'rfdetr_version': rfdetr.__version__ if hasattr(rfdetr, '__version__')
                else '1.11.2'}, paths['dict'])
    return paths


@pytest.mark.parametrize('variant', ['SimpleNamespace', 'Namespace', 'dict'])
def test_rfdetr_files_load_strictly_into_the_detector(nano, files, variant):
    _, net = nano
    model = detector()
    converted, report = load_checkpoint(files[variant], target(model))
    model.load_state_dict(converted, strict=True)
    assert report.layout == 'RF-DETR rfdetr'
    assert report.dropped == ['backbone.0.encoder.encoder.embeddings.mask_token']
    vit = net.backbone[0].encoder.encoder
    layer = vit.encoder.layer[5]
    attn = layer.attention.attention
    ours = model.backbone
    assert torch.equal(ours.blocks[5].attn.qkv.weight,
                       torch.cat([attn.query.weight, attn.key.weight, attn.value.weight]))
    assert torch.equal(ours.blocks[5].ls2.gamma, layer.layer_scale2.lambda1)
    assert torch.equal(ours.pos_embed, vit.embeddings.position_embeddings)
    assert torch.equal(ours.patch_embed.proj.weight,
                       vit.embeddings.patch_embeddings.projection.weight)
    assert torch.equal(ours.norm.weight, vit.layernorm.weight)
    projector = net.backbone[0].projector
    assert torch.equal(model.neck.fusions[0].blocks[2][1].conv.weight,
                       projector.stages[0][0].m[2].cv2.conv.weight)
    assert torch.equal(model.neck.norms[0].weight, projector.stages[0][1].weight)
    head, decoder = model.bbox_head, net.transformer.decoder
    assert torch.equal(head.decoder.layers[1].self_attn.v_proj.weight,
                       decoder.layers[1].self_attn.in_proj_weight[2 * 256:])
    assert torch.equal(head.decoder.layers[0].cross_attn.sampling_offsets.bias,
                       decoder.layers[0].cross_attn.sampling_offsets.bias)
    assert torch.equal(head.query_feat.weight, net.query_feat.weight)
    assert torch.equal(head.cls_branch.weight, net.class_embed.weight)
    assert torch.equal(head.enc_reg_branches[12][4].bias,
                       net.transformer.enc_out_bbox_embed[12].layers[2].bias)
    # every tensor of rfdetr's model is in ours (but the mask token, the keypoint buffer)
    unused = vit.embeddings.mask_token.numel()
    assert (sum(v.numel() for v in model.state_dict().values())
            == sum(v.numel() for v in net.state_dict().values()) - unused)


def test_the_91_coco_logits_become_mmdets_80_classes(nano, files):
    _, net = nano
    names = CocoDataset.METAINFO['classes']
    assert [COCO_CLASSES[i] for i in COCO_CATEGORY_IDS] == list(names)
    model = detector(num_classes=80)
    converted, _ = load_checkpoint(files['SimpleNamespace'], target(model))
    model.load_state_dict(converted, strict=True)
    rows = torch.tensor(COCO_CATEGORY_IDS)
    head = model.bbox_head
    assert torch.equal(head.cls_branch.weight, net.class_embed.weight[rows])
    assert torch.equal(head.cls_branch.bias, net.class_embed.bias[rows])
    enc = net.transformer.enc_out_class_embed
    for group in (0, 12):
        assert torch.equal(head.enc_cls_branches[group].weight, enc[group].weight[rows])
        assert torch.equal(head.enc_cls_branches[group].bias, enc[group].bias[rows])
    person, toothbrush = names.index('person'), names.index('toothbrush')
    assert torch.equal(head.cls_branch.bias[[person, toothbrush]], net.class_embed.bias[[1, 90]])


def test_the_backbone_part_loads_into_dinov2_backbone(nano, files):
    _, net = nano
    backbone = DINOv2Backbone(arch='small', patch_size=16, pretrain_img_size=384,
                              pretrain_patch_size=16, out_indices=(2, 5, 8, 11),
                              init_cfg=dict(type='Pretrained', checkpoint=files['Namespace']))
    backbone.init_weights()
    report = backbone.init_report
    assert report.layout == 'RF-DETR rfdetr'
    assert len(report.loaded) == len(backbone.state_dict())
    assert 'backbone.0.projector.stages.0.1.weight' in report.dropped
    assert 'transformer.decoder.norm.weight' in report.dropped
    assert torch.equal(backbone.blocks[11].mlp.fc2.weight,
                       net.backbone[0].encoder.encoder.encoder.layer[11].mlp.fc2.weight)


def test_the_projector_loads_from_the_file_through_its_init_cfg(nano, files):
    _, net = nano
    model = detector(neck=dict(init_cfg=dict(type='Pretrained', checkpoint=files['dict'])))
    model.neck.init_weights()
    assert torch.equal(model.neck.fusions[0].conv_in.conv.weight,
                       net.backbone[0].projector.stages[0][0].cv1.conv.weight)


def test_tools_convert_weights_writes_the_detector(nano, files, tmp_path):
    _, net = nano
    out = str(tmp_path / 'rfdetr_n_coco80.pth')
    res = run_tool('convert_weights.py', [files['SimpleNamespace'], out, '--num-classes', '80'])
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == (
        f'{files["SimpleNamespace"]}: an RF-DETR checkpoint (rfdetr layout) -> {out} (424 '
        f"tensors, 1 keys dropped); load it with load_from='{out}' in "
        "configs/rfdetr/rfdetr_nano.py (its head: mmdet's 80 COCO classes, as the configs build "
        'it)')
    model = detector(num_classes=80)
    model.load_state_dict(torch.load(out, weights_only=True)['state_dict'], strict=True)
    assert torch.equal(model.bbox_head.cls_branch.bias[0], net.class_embed.bias[1])


def test_load_from_of_an_unconverted_file_loads_mmdets_80_coco_classes(nano, files):
    """mmengine's load_checkpoint (load_from, tools/test.py) reads the file as rfdetr wrote
    it: every tensor, its 91 COCO logits as mmdet's 80 classes (more of the user's path:
    tests/weights/test_rfdetr_user_path.py)."""
    _, net = nano
    for path in (files['Namespace'], files['dict']):
        model = detector(num_classes=80)
        mmengine_load_checkpoint(model, path)
        rows = torch.tensor(COCO_CATEGORY_IDS)
        assert torch.equal(model.bbox_head.cls_branch.bias, net.class_embed.bias[rows])
        assert torch.equal(model.backbone.blocks[3].mlp.fc1.weight,
                           net.backbone[0].encoder.encoder.encoder.layer[3].mlp.fc1.weight)


def _refusal(model: torch.nn.Module, path: str, message: str) -> None:
    with pytest.raises(CheckpointError, match='^' + re.escape(message) + '$'):
        load_checkpoint(path, target(model))


NANO = ('the checkpoint is an RF-DETR N of patch 16, ViT width 384, position grid 24x24 (384 '
        'px), 1536 projector input channels, 2 decoder layers, decoder width 256, 3900 query rows '
        '(queries x groups)')


def test_a_checkpoint_of_another_size_is_refused_naming_its_config(files):
    path = files['SimpleNamespace']
    fix = ': build it from configs/rfdetr/rfdetr_nano.py'
    _refusal(detector(layers=3), path, f'{NANO}; {OWNER} was built with 3 decoder layers{fix}')
    _refusal(detector(patch=14), path, f'{NANO}; {OWNER} was built with patch 14{fix}')
    _refusal(detector(hidden=128), path, f'{NANO}; {OWNER} was built with decoder width 128{fix}')
    _refusal(detector(taps=(384,) * 3), path,
             f'{NANO}; {OWNER} was built with 1152 projector input channels{fix}')


def test_a_head_of_other_classes_is_refused_naming_num_classes(files):
    _refusal(detector(num_classes=12), files['Namespace'],
             "the checkpoint's classifier has 91 logits, rfdetr's COCO classifier (COCO category "
             f"ids; mmdet's 80 COCO classes); the head of {OWNER} was built with num_classes=12: "
             'build it with num_classes=80 (--cfg-options model.bbox_head.num_classes=80), or, '
             "to fine-tune a head of other classes from it, give it as the detector's init_cfg="
             "dict(type='Pretrained', checkpoint=...) (configs/rfdetr/rfdetr_nano_finetune_custom"
             ".py): the class branches start as rfdetr's reinitialize_detection_head sets them")


def test_a_seg_checkpoint_is_refused_for_a_detection_head_naming_its_config(tmp_path):
    """RF-DETR-Seg N's sizes (patch 12, grid 26, 4 decoder layers) and a mask head (the keys
    that tell them; the other tensors play no part in the refusal). Seg files that load:
    tests/weights/test_rfdetr_seg_checkpoint.py."""
    vit = 'backbone.0.encoder.encoder.embeddings.'
    state = {vit + 'patch_embeddings.projection.weight': torch.zeros(384, 3, 12, 12),
             vit + 'position_embeddings': torch.zeros(1, 1 + 26 * 26, 384),
             'backbone.0.projector.stages.0.1.weight': torch.zeros(256),
             **{f'transformer.decoder.layers.{i}.norm1.weight': torch.zeros(256)
                for i in range(4)},
             'segmentation_head.blocks.0.weight': torch.zeros(2)}
    torch.save({'model': state, 'args': {}}, tmp_path / 'seg.pth')
    _refusal(detector(), str(tmp_path / 'seg.pth'),
             f'the checkpoint is an RF-DETR-Seg (segmentation_head.* keys); the head of {OWNER} '
             'has no mask branch (LWDETRHead): build it from configs/rfdetr/rfdetr_seg_nano.py, '
             "or load the checkpoint's backbone alone (the backbone's init_cfg type='Pretrained')")


class _Tampered:
    """An object whose unpickling would call a function (here a harmless ``os.getcwd``)."""

    def __reduce__(self):
        return os.getcwd, ()


def test_a_tampered_file_is_refused_naming_the_global(tmp_path):
    state = {'class_embed.bias': torch.zeros(91)}
    cases = {'tampered': ({'model': state, 'args': argparse.Namespace(evil=_Tampered())},
                          f'{os.getcwd.__module__}.getcwd'),
             # RF-DETR's namespace is allowed as its args only
             'elsewhere': ({'model': state, 'args': {}, 'meta': [argparse.Namespace()]},
                           'argparse.Namespace'),
             'no model': ({'state_dict': state, 'args': types.SimpleNamespace()},
                          'types.SimpleNamespace')}
    for name, (ckpt, refused) in cases.items():
        path = str(tmp_path / f'{name}.pth')
        torch.save(ckpt, path)
        want = (f'refused to load checkpoint {path!r}: it contains Python objects that are not '
                f'on the weights_only allow-list (refused: {refused}); unpickling it could run '
                'arbitrary code, so nothing was loaded or executed. If you trust this file, '
                f'list it in the environment variable {TRUST_ENV} (e.g. {TRUST_ENV}={path}; '
                f"several files separated by {os.pathsep!r}) and it is read with full "
                'unpickling; or re-save it as tensors and plain containers.')
        with pytest.raises(CheckpointError, match='^' + re.escape(want) + '$'):
            checkpoint_state_dict(path)


def test_the_layout_is_detected_in_every_format(files):
    for path in files.values():
        layout = detect_layout(checkpoint_state_dict(path))
        assert (layout.family, layout.name) == (RFDETR, 'rfdetr')


#: rfdetr's config class of each of our configs (its sizes are the reference).
RFDETR_CONFIG_CLASSES = {'rfdetr_nano.py': 'RFDETRNanoConfig', 'rfdetr_small.py':
                         'RFDETRSmallConfig', 'rfdetr_medium.py': 'RFDETRMediumConfig',
                         'rfdetr_large.py': 'RFDETRLargeConfig',
                         'rfdetr_seg_nano.py': 'RFDETRSegNanoConfig',
                         'rfdetr_seg_small.py': 'RFDETRSegSmallConfig',
                         'rfdetr_seg_medium.py': 'RFDETRSegMediumConfig',
                         'rfdetr_seg_large.py': 'RFDETRSegLargeConfig',
                         'rfdetr_seg_xlarge.py': 'RFDETRSegXLargeConfig',
                         'rfdetr_seg_2xlarge.py': 'RFDETRSeg2XLargeConfig'}


def test_the_configs_are_told_apart_by_rfdetrs_own_sizes():
    from rfdetr import config as sizes
    for c in RFDETR_CONFIGS:
        fields = getattr(sizes, RFDETR_CONFIG_CLASSES[c.config]).model_fields
        want = {k: fields[k].default for k in ('patch_size', 'positional_encoding_size',
                                                'dec_layers', 'segmentation_head')}
        assert want == dict(patch_size=c.patch, positional_encoding_size=c.grid,
                            dec_layers=c.layers, segmentation_head=c.seg), c.config
        size = dict(patch=c.patch, grid=c.grid, layers=c.layers)
        assert matching_configs(size, c.seg)[0] == [c]
    # a medium / large fine-tuned at 640 px: both named, with the grid to set
    assert config_fix(dict(patch=16, grid=40, layers=4)) == (
        'build it from configs/rfdetr/rfdetr_medium.py or configs/rfdetr/rfdetr_large.py with '
        'model.backbone.pretrain_img_size=640, pretrain_patch_size=16')
    assert config_fix(dict(patch=14, grid=37, layers=3)) == (
        'build it with model.backbone.patch_size=14, model.backbone.pretrain_img_size=518, '
        'pretrain_patch_size=14, model.bbox_head.num_decoder_layers=3')
