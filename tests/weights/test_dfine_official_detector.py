"""An official DEIMv2 / D-FINE ``.pth`` as a whole detector: ``load_from`` / ``init_detector``
(mmengine's ``load_checkpoint``), the runner's load with the EMA hook, and the fine-tuning start
of a head of other classes (the detector's Pretrained ``init_cfg``).

Files in the official layout are written from the recorded key list of DEIMv2 Atto
(``tests/fixtures/dfine_official_deimv2_atto.json``, seeded random tensors), in both official
containers; where each tensor lands is checked against pairs read from the official model code
(``test_dfine_official.KNOWN_PAIRS``)."""
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
from test_dfine_official import KNOWN_PAIRS, official

import vitdet_plugin  # noqa: F401
from vitdet_plugin.weights import CheckpointError
from vitdet_plugin.weights.dfine_official import official_to_detector
from vitdet_plugin.weights.model_load import DFINE_CLASS_BRANCHES

register_all_modules()
ATTO = 'configs/deimv2/deimv2_atto.py'
FEMTO = 'configs/deimv2/deimv2_femto.py'
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
