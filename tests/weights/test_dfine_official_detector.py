"""An official DEIMv2 / D-FINE ``.pth`` as a whole detector: ``load_from`` / ``init_detector``
(mmengine's ``load_checkpoint``), the runner's load with the EMA hook, and the fine-tuning start
of a head of other classes (the detector's Pretrained ``init_cfg``).

Files in the official layout are written from the recorded key list of DEIMv2 Atto
(``tests/fixtures/dfine_official_deimv2_atto.json``, seeded random tensors), in both official
containers; where each tensor lands is checked against pairs read from the official model code
(``test_dfine_official.KNOWN_PAIRS``)."""
import json
import os
import re
import types
from typing import Dict

import pytest
import torch
from mmdet.apis import init_detector
from mmdet.registry import MODELS
from mmdet.utils import register_all_modules
from mmengine.config import Config
from mmengine.hooks import EMAHook
from mmengine.logging import MMLogger
from mmengine.runner import Runner
from mmengine.runner.checkpoint import load_checkpoint as mmengine_load_checkpoint
from helpers import load_tool, run_tool
from test_dfine_official import KNOWN_PAIRS, official

import vitdet_plugin  # noqa: F401
from vitdet_plugin.datasets.data_folder import apply_data_folder
from vitdet_plugin.datasets.shapes import ShapesSpec, generate_split
from vitdet_plugin.weights import CheckpointError
from vitdet_plugin.weights.dfine_official import official_to_detector
from vitdet_plugin.weights.model_load import DFINE_CLASS_BRANCHES

register_all_modules()
ATTO = 'configs/deimv2/deimv2_atto.py'
FEMTO = 'configs/deimv2/deimv2_femto.py'
FINETUNE_S = 'configs/deimv2/deimv2_s_finetune_custom.py'
#: Our names of the official Atto's parts (KNOWN_PAIRS' part -> prefix in the detector).
PREFIX = {'backbone': 'backbone.', 'neck': 'neck.', 'head': 'bbox_head.'}
#: The class branches of the Atto head (3 decoder layers).
ATTO_BRANCHES = ['bbox_head.selector.enc_score_head.weight',
                 'bbox_head.selector.enc_score_head.bias',
                 *[f'bbox_head.decoder.cls_branches.{i}.{p}' for i in range(3)
                   for p in ('weight', 'bias')],
                 'bbox_head.dn_label_embed.weight']
#: The shared box head's keys (Atto's ``share_reg_branch``).
SHARED = re.compile(r'^(decoder\.dec_bbox_head\.)\d+\.')


def _shared(sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``sd`` as the official Atto saves it: its one box head, shared by the decoder layers
    (``share_reg_branch``), under each layer's name."""
    return {k: sd[re.sub(SHARED, r'\g<1>0.', k)] for k in sd}


@pytest.fixture(scope='module')
def atto(tmp_path_factory) -> Dict[str, object]:
    """The official Atto state dict and files holding it as ``{'model': sd}`` and as
    ``{'ema': {'module': sd}}`` (the EMA weights; the model weights beside them are others)."""
    root = tmp_path_factory.mktemp('official_atto')
    sd, other = _shared(official('deimv2_atto')[0]), _shared(official('deimv2_atto', seed=1)[0])
    torch.save({'model': sd}, root / 'model.pth')
    torch.save({'model': other, 'ema': {'module': sd}}, root / 'ema.pth')
    return {'sd': sd, 'model': str(root / 'model.pth'), 'ema': str(root / 'ema.pth')}


def _model(config: str = ATTO, detector_init=None, **head) -> torch.nn.Module:
    """The config's detector (seeded), its head with ``head``'s arguments."""
    cfg = Config.fromfile(config)
    torch.manual_seed(0)
    return MODELS.build(dict(cfg.model, init_cfg=detector_init,
                             bbox_head=dict(cfg.model.bbox_head, **head)))


def _assert_is_file(model: torch.nn.Module, sd: Dict[str, torch.Tensor]) -> None:
    """Every tensor of ``model`` is the file's (through the key map), and the pairs read from
    the official code land where they should."""
    state = model.state_dict()
    converted, _ = official_to_detector(sd, {k: v.shape for k, v in state.items()})
    assert converted.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(value, converted[key]), key
    pairs = [p for p in KNOWN_PAIRS if p[0] == 'deimv2_atto']
    assert pairs
    for _, official_key, rows, part, ours in pairs:
        want = sd[official_key] if rows is None else sd[official_key][rows[0]:rows[1]]
        assert torch.equal(state[PREFIX[part] + ours], want), ours
    assert torch.equal(state['bbox_head.selector.enc_score_head.weight'],
                       sd['decoder.enc_score_head.weight'])
    assert torch.equal(state['bbox_head.dn_label_embed.weight'],
                       sd['decoder.denoising_class_embed.weight'])


@pytest.mark.parametrize('container', ['model', 'ema'])
def test_load_from_loads_the_official_file_as_the_whole_detector(atto, container):
    """mmengine's load_checkpoint, what load_from and init_detector run (the EMA weights
    when the file has them)."""
    model = _model()
    mmengine_load_checkpoint(model, atto[container], strict=True)
    _assert_is_file(model, atto['sd'])


def test_init_detector_loads_the_official_file(atto):
    model = init_detector(ATTO, atto['ema'], device='cpu')
    _assert_is_file(model, atto['sd'])


def test_the_export_tools_loader_takes_the_official_file(atto):
    """``tools/export_onnx.py CONFIG FILE``'s model (``deploy.onnx_export.build_model``): the
    official file as ``load_from`` reads it, every key of the model filled."""
    from vitdet_plugin.deploy.onnx_export import build_model

    _assert_is_file(build_model(ATTO, atto['ema'])[1], atto['sd'])


def test_the_runner_load_gives_the_ema_hook_the_converted_state(atto):
    """Runner.load_checkpoint (load_from, tools/test.py) with the configs' EMAHook: its
    after_load_checkpoint copies checkpoint['state_dict'] into the EMA model strictly."""
    model = _model()
    hook = EMAHook(ema_type='ExpMomentumEMA', momentum=1e-4, gamma=1000, update_buffers=True,
                   strict_load=True)
    runner = types.SimpleNamespace(model=model, logger=MMLogger.get_current_instance(),
                                   _resume=False)
    runner.call_hook = lambda name, **kwargs: getattr(hook, name, lambda *a, **k: None)(
        runner, **kwargs)
    hook.before_run(runner)
    Runner.load_checkpoint(runner, atto['model'])  # type: ignore[arg-type]
    _assert_is_file(model, atto['sd'])
    _assert_is_file(hook.ema_model.module, atto['sd'])


def test_a_file_of_another_size_is_refused_naming_its_config(atto):
    model = _model(FEMTO)
    with pytest.raises(CheckpointError, match='^' + re.escape(
            'the official checkpoint is the DEIMv2 size of configs/deimv2/deimv2_atto.py, which '
            'SingleStageDetector does not fit (shape differs: ') + r'.*' + re.escape(
            '): build it with configs/deimv2/deimv2_atto.py') + '$'):
        mmengine_load_checkpoint(model, atto['model'])


def test_load_from_refuses_a_head_of_other_classes_naming_num_classes(atto):
    model = _model(num_classes=5)
    with pytest.raises(CheckpointError, match='^' + re.escape(
            "the checkpoint's head has 80 classes; the head of SingleStageDetector was built "
            'with num_classes=5: build it with num_classes=80 (--cfg-options '
            'model.bbox_head.num_classes=80), or, to fine-tune a head of other classes from it, '
            "give it as the detector's init_cfg=dict(type='Pretrained', checkpoint=...) "
            '(configs/deimv2/deimv2_s_finetune_custom.py)') + '$'):
        mmengine_load_checkpoint(model, atto['model'])


@pytest.mark.parametrize('num_classes', [5, 80])
def test_fine_tuning_start_reinitialises_only_the_class_branches(atto, num_classes):
    """The detector's Pretrained init_cfg (a fine-tuning start): with K != 80 classes the class
    branches keep the model's init (the official load_tuning_state skips tensors of another
    shape); every other tensor is the file's. With the file's 80 classes all of it loads."""
    fresh = _model(num_classes=num_classes)
    fresh.init_weights()
    model = _model(num_classes=num_classes,
                   detector_init=dict(type='Pretrained', checkpoint=atto['ema']))
    model.init_weights()
    state, init = model.state_dict(), fresh.state_dict()
    branches = [k for k in state if DFINE_CLASS_BRANCHES.match(k)]
    assert branches == ATTO_BRANCHES
    assert state['bbox_head.dn_label_embed.weight'].shape[0] == num_classes + 1
    sd = atto['sd']
    if num_classes == 80:
        _assert_is_file(model, sd)
        return
    for key in branches:
        assert torch.equal(state[key], init[key]), key
    reference = _model()
    converted, _ = official_to_detector(sd, {k: v.shape for k, v in
                                             reference.state_dict().items()})
    for key, value in state.items():
        if key not in branches:
            assert torch.equal(value, converted[key]), key
    assert torch.equal(state['bbox_head.decoder.reg_branches.0.layers.2.weight'],
                       sd['decoder.dec_bbox_head.0.layers.2.weight'])


def test_convert_weights_writes_the_detector_of_the_official_file(atto, tmp_path):
    """``tools/convert_weights.py OFFICIAL.pth OUT.pth``: an mmdet checkpoint that loads with
    load_from into the config of its size."""
    out = str(tmp_path / 'ours.pth')
    run = run_tool('convert_weights.py', [atto['ema'], out])
    assert run.returncode == 0, run.stderr
    model = _model()
    tensors = len(model.state_dict())  # every tensor of the detector
    assert run.stdout == (
        f"{atto['ema']}: a DEIMv2 checkpoint (official layout) -> {out} ({tensors} tensors, "
        # the rebuilt buffers: anchors, valid_mask, up and reg_scale twice, 3 num_points_scale
        f"9 keys dropped); load it with load_from='{out}' in a D-FINE / DEIMv2 detector config "
        '(configs/dfine, configs/deimv2) of its sizes and classes\n')
    mmengine_load_checkpoint(model, out, strict=True)
    _assert_is_file(model, atto['sd'])


def test_convert_weights_refuses_a_dinov3_official_file(tmp_path):
    """Meta's DINOv3 layout (L / X) converts for a given model: the file loads with load_from
    in its config instead."""
    sd, _ = official('deimv2_s')
    path = str(tmp_path / 's.pth')
    torch.save({'model': sd}, path)
    run = run_tool('convert_weights.py', [path, str(tmp_path / 'out.pth')])
    assert run.returncode == 1
    assert run.stderr == (
        'error: the DEIMv2 DINOv3 official checkpoint converts for a given model (its DINOv3 '
        'layout): load the file itself with load_from=FILE in configs/deimv2/deimv2_s.py (or '
        "the detector's init_cfg=dict(type='Pretrained', checkpoint=FILE))\n")


def test_the_s_finetune_config_reads_a_data_folder_and_starts_from_the_official_file(tmp_path):
    """configs/deimv2/deimv2_s_finetune_custom.py with --data on a 3-class folder: the head
    takes the folder's classes, starts from the official S file where the config expects it,
    its class branches at their init."""
    classes = ('square', 'circle', 'star')
    data = str(tmp_path / 'data')
    spec = ShapesSpec(image_size=64, classes=classes, objects=(1, 2), object_size=(12, 32),
                      lines=(0, 1))
    for split in ('train', 'val'):
        generate_split(data, split, 2, seed=0, spec=spec, progress=False)
    cfg = Config.fromfile(FINETUNE_S)
    apply_data_folder(cfg, data, ('train', 'val'))
    assert cfg.model.bbox_head.num_classes == 3
    assert tuple(cfg.train_dataloader.dataset.metainfo['classes']) == classes
    assert cfg.model.init_cfg == dict(type='Pretrained',
                                      checkpoint='checkpoints/deimv2_dinov3_s_coco.pth')
    sd, _ = official('deimv2_s')
    path = str(tmp_path / 'deimv2_dinov3_s_coco.pth')
    torch.save({'ema': {'module': sd}}, path)
    cfg.model.init_cfg.checkpoint = path
    model = MODELS.build(cfg.model)
    model.init_weights()
    state = model.state_dict()
    assert state['bbox_head.dn_label_embed.weight'].shape[0] == 4
    assert state['bbox_head.decoder.cls_branches.3.weight'].shape[0] == 3
    assert torch.equal(state['backbone.vit.cls_token'], sd['backbone.dinov3._model.cls_token'])
    assert torch.equal(state['bbox_head.decoder.layers.3.gateway.norm.weight'],
                       sd['decoder.decoder.layers.3.gateway.norm.scale'])
    assert torch.equal(state['bbox_head.selector.enc_bbox_head.layers.2.weight'],
                       sd['decoder.enc_bbox_head.layers.2.weight'])


def test_tools_test_evaluates_the_official_file(atto, tmp_path):
    """``tools/test.py configs/deimv2/deimv2_atto.py OFFICIAL.pth --data DIR`` on a folder of
    COCO's 80 class slots: the file loads (the EMA hook's copy too) and the run scores it."""
    data = str(tmp_path / 'data')
    spec = ShapesSpec(image_size=64, classes=('square', 'circle'), objects=(1, 2),
                      object_size=(12, 32), lines=(0, 1))
    for split in ('train', 'val'):
        coco = generate_split(data, split, 2, seed=0, spec=spec, progress=False)
        coco['categories'] = [dict(id=i + 1, name=f'class{i}') for i in range(80)]
        with open(os.path.join(data, 'annotations', f'instances_{split}.json'), 'w') as f:
            json.dump(coco, f)
    metrics = load_tool('test.py').main([
        ATTO, atto['ema'], '--data', data, '--work-dir', str(tmp_path / 'work'),
        '--cfg-options', 'test_dataloader.num_workers=0',
        'test_dataloader.persistent_workers=False'])
    assert 'coco/bbox_mAP' in metrics


@pytest.mark.parametrize('name,config', [('dfine_n', 'configs/dfine/dfine_n.py'),
                                         ('deimv2_s', 'configs/deimv2/deimv2_s.py'),
                                         ('deimv2_l', 'configs/deimv2/deimv2_l.py')])
def test_load_from_takes_each_familys_official_file(name, config, tmp_path):
    """D-FINE (HGNetV2), DEIMv2 with the distilled ViT-Tiny (S) and with Meta's DINOv3 (L):
    mmengine's load_checkpoint of the official file into the config of its size."""
    sd, _ = official(name)
    path = str(tmp_path / f'{name}.pth')
    torch.save({'ema': {'module': sd}}, path)
    model = _model(config)
    mmengine_load_checkpoint(model, path, strict=True)
    state = model.state_dict()
    converted, _ = official_to_detector(sd, {k: v.shape for k, v in state.items()})
    assert converted.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(value, converted[key]), key
    for fixture, official_key, rows, part, ours in KNOWN_PAIRS:
        if fixture == name:
            want = sd[official_key] if rows is None else sd[official_key][rows[0]:rows[1]]
            assert torch.equal(state[PREFIX[part] + ours], want), ours
    assert torch.equal(state['bbox_head.decoder.cls_branches.0.bias'],
                       sd['decoder.dec_score_head.0.bias'])
