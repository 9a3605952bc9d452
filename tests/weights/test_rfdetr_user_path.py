"""An RF-DETR user's files, on the user's path: checkpoints written by rfdetr 1.11.2's own code
(``export_for_roboflow`` of ``RFDETRNano(pretrain_weights=None, num_classes=K)`` with its class
names; ``RFDETRSmall``; the COCO-sized default) through ``tools/convert_weights.py``,
``tools/test.py`` (a subprocess, on the tiny shapes set), ``load_from`` / mmengine's
``load_checkpoint`` and the shipped fine-tune config's ``init_cfg``.

* a file fine-tuned on ``K`` classes (``K + 1`` logits) loads into a head of ``K`` in rfdetr's
  class order (its no-object slot, the last logit, dropped), and the converter says which
  config, ``num_classes`` and class names to use;
* a file whose shapes do not fit the model is refused on every path, naming the fix (the
  ``num_classes`` of its head; the config of its size);
* fine-tuning from a file equals rfdetr's own ``load_pretrain_weights`` for the same classes:
  every tensor of our detector after the fine-tune config's init equals rfdetr's model (names
  mapped by our key map), class branches included (rfdetr's re-initialised rows without the
  no-object slot).
"""
import os
import re
import subprocess
import sys
import types
from typing import Dict

import pytest
import torch
from helpers import REPO_ROOT, randomize_, run_tool, subprocess_env
from mmdet.registry import MODELS
from mmdet.utils import register_all_modules
from mmengine.config import Config
from mmengine.logging import MMLogger
from mmengine.runner import Runner
from mmengine.runner.checkpoint import load_checkpoint as mmengine_load_checkpoint

import rfdetr

import vitdet_plugin  # noqa: F401
from vitdet_plugin.datasets import CLASSES as SHAPES
from vitdet_plugin.weights import CheckpointError
from vitdet_plugin.weights.rfdetr import rfdetr_to_detector
from vitdet_plugin.weights.rfdetr_classes import COCO_CATEGORY_IDS

register_all_modules()
FINETUNE = 'configs/rfdetr/rfdetr_nano_finetune_custom.py'
#: The classes of the 3-class file (rfdetr's order: its dataset's categories sorted by id).
FRUIT = ('apple', 'banana', 'cherry')


def _export(name: str, root: str, classes=None, seed: int = 0, **kwargs) -> str:
    """rfdetr's ``name`` model (random weights) written by its own ``export_for_roboflow``,
    with ``classes`` as its class names (the names rfdetr's training records)."""
    model = getattr(rfdetr, name)(pretrain_weights=None, **kwargs)
    randomize_(model.model.model, seed)
    if classes is not None:
        model.model.class_names = list(classes)
    model.export_for_roboflow(root)
    return os.path.join(root, 'weights.pt')


@pytest.fixture(scope='module')
def files(tmp_path_factory) -> Dict[str, str]:
    root = tmp_path_factory.mktemp('rfdetr_user')
    return {'coco': _export('RFDETRNano', str(root / 'coco'), seed=1),
            'fruit': _export('RFDETRNano', str(root / 'fruit'), FRUIT, seed=2, num_classes=3),
            'shapes': _export('RFDETRNano', str(root / 'shapes'), SHAPES, seed=3,
                              num_classes=len(SHAPES)),
            'small': _export('RFDETRSmall', str(root / 'small'), seed=4)}


def _saved(path: str) -> Dict[str, torch.Tensor]:
    """The file's model as saved, in our names (the classifier as it is in the file)."""
    sd = torch.load(path, map_location='cpu', weights_only=False)['model']
    return rfdetr_to_detector(sd, as_saved=True)[0]


def _finetune_model(checkpoint: str, num_classes: int) -> torch.nn.Module:
    cfg = Config.fromfile(str(REPO_ROOT / FINETUNE))
    cfg.model.init_cfg.checkpoint = checkpoint
    cfg.model.bbox_head.num_classes = num_classes
    return MODELS.build(cfg.model)


def test_the_converter_takes_a_fine_tuned_files_own_classes(files, tmp_path):
    src, out = files['fruit'], str(tmp_path / 'fruit_ours.pth')
    res = run_tool('convert_weights.py', [src, out])
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == (
        f'{src}: an RF-DETR checkpoint (rfdetr layout) -> {out} (424 tensors, 1 keys dropped); '
        f"load it with load_from='{out}' in configs/rfdetr/rfdetr_nano.py with --cfg-options "
        "model.bbox_head.num_classes=3 (the checkpoint's classes, in rfdetr's order: 'apple', "
        "'banana', 'cherry')")
    saved = torch.load(out, weights_only=True)
    assert saved['meta']['dataset_meta'] == {'classes': FRUIT}
    file = _saved(src)
    for key in ('bbox_head.cls_branch.weight', 'bbox_head.enc_cls_branches.12.bias'):
        assert file[key].shape[0] == 4
        assert torch.equal(saved['state_dict'][key], file[key][:3])  # the no-object slot: 3
    res = run_tool('convert_weights.py', [src, out, '--num-classes', '5'])
    assert res.returncode == 1
    assert res.stderr.strip() == (
        "error: the checkpoint's classifier has 4 logits, rfdetr's num_classes=3 ('apple', "
        "'banana', 'cherry') plus its no-object slot; --num-classes 5 fits neither: give "
        '--num-classes 3 (its own classes; the default) or 4 (its logits as saved). To '
        "fine-tune a head of other classes from it, give the file itself as the detector's "
        "init_cfg=dict(type='Pretrained', checkpoint=...) "
        '(configs/rfdetr/rfdetr_nano_finetune_custom.py)')


def test_load_from_takes_rfdetrs_files_with_their_own_classes(files):
    """mmengine's load_checkpoint (what load_from and tools/test.py run) of the files as
    rfdetr wrote them: the fine-tuned file's 3 classes, the COCO file's 80."""
    for name, num_classes, rows in (('fruit', 3, list(range(3))),
                                    ('coco', 80, list(COCO_CATEGORY_IDS))):
        model = _finetune_model('unused.pth', num_classes)
        mmengine_load_checkpoint(model, files[name])
        file, ours = _saved(files[name]), model.state_dict()
        assert ours.keys() == file.keys()
        for key, value in ours.items():
            want = file[key][rows] if 'cls_branch' in key else file[key]
            assert torch.equal(value, want), key


def test_the_export_tools_loader_takes_rfdetrs_files_and_refuses_another_size(files):
    """``tools/export_onnx.py CONFIG FILE``'s model (``deploy.onnx_export.build_model``) loads
    rfdetr's file as ``load_from`` does (its own 3 classes), and refuses the S file for the N
    config naming the S config."""
    from vitdet_plugin.deploy.onnx_export import build_model

    options = {'model.bbox_head.num_classes': 3}
    _, model = build_model(str(REPO_ROOT / 'configs/rfdetr/rfdetr_nano.py'), files['fruit'],
                           cfg_options=options)
    file, ours = _saved(files['fruit']), model.state_dict()
    assert ours.keys() == file.keys()
    for key, value in ours.items():  # the file's 3 + 1 logits: its 3 classes' rows
        assert torch.equal(value, file[key][:3] if 'cls_branch' in key else file[key]), key
    with pytest.raises(CheckpointError, match=r'rfdetr_small\.py'):
        build_model(str(REPO_ROOT / 'configs/rfdetr/rfdetr_nano.py'), files['small'])


def _runner_load(model: torch.nn.Module, path: str) -> None:
    """mmengine's ``Runner.load_checkpoint`` (what ``load_from`` and ``tools/test.py`` run)
    on a stand-in runner holding ``model`` (its hooks: none)."""
    runner = types.SimpleNamespace(model=model, logger=MMLogger.get_current_instance(),
                                   call_hook=lambda *args, **kwargs: None)
    Runner.load_checkpoint(runner, path)  # type: ignore[arg-type]


def test_runner_load_checkpoint_loads_a_fine_tuned_file_and_refuses_other_classes(files):
    model = _finetune_model('unused.pth', len(SHAPES))
    _runner_load(model, files['shapes'])
    file = _saved(files['shapes'])
    assert torch.equal(model.bbox_head.cls_branch.weight,
                       file['bbox_head.cls_branch.weight'][:len(SHAPES)])
    with pytest.raises(CheckpointError, match='^' + re.escape(FRUIT_INTO_FIVE) + '$'):
        _runner_load(model, files['fruit'])


#: What a head of 5 classes says of the 3-class file.
FRUIT_INTO_FIVE = (
    "the checkpoint's head has 3 classes ('apple', 'banana', 'cherry'); the head of "
    'SingleStageDetector was built with num_classes=5: build it with num_classes=3 '
    '(--cfg-options model.bbox_head.num_classes=3), or, to fine-tune a head of other '
    "classes from it, give it as the detector's init_cfg=dict(type='Pretrained', "
    'checkpoint=...) (configs/rfdetr/rfdetr_nano_finetune_custom.py)')


def test_load_from_refuses_a_head_of_other_classes_naming_num_classes(files):
    model = _finetune_model('unused.pth', 5)
    with pytest.raises(CheckpointError, match='^' + re.escape(FRUIT_INTO_FIVE) + '$'):
        mmengine_load_checkpoint(model, files['fruit'])


SMALL = ('the checkpoint is an RF-DETR S of patch 16, ViT width 384, position grid 32x32 '
         '(512 px)')


#: What the N config's detector says of a converted RF-DETR S file.
SMALL_INTO_NANO = (f'{SMALL}, 1536 projector input channels, 3 decoder layers, decoder width '
                   '256, 3900 query rows (queries x groups); SingleStageDetector was built with '
                   'position grid 24x24 (384 px), 2 decoder layers: build it from '
                   'configs/rfdetr/rfdetr_small.py')


def test_load_from_refuses_another_size_naming_its_config(files, tmp_path):
    """The S file converted, then given to the N config's detector (mmengine's
    load_checkpoint, as load_from): refused, not loaded with size-mismatch lines."""
    small = str(tmp_path / 'small_ours.pth')
    assert run_tool('convert_weights.py', [files['small'], small]).returncode == 0
    for path in (small, files['small']):
        with pytest.raises(CheckpointError, match='^' + re.escape(SMALL_INTO_NANO) + '$'):
            mmengine_load_checkpoint(_finetune_model('unused.pth', 80), path)


def test_the_backbone_init_refuses_another_size_naming_its_config(files):
    cfg = Config.fromfile(str(REPO_ROOT / FINETUNE))
    backbone = MODELS.build(dict(cfg.model.backbone, init_cfg=dict(
        type='Pretrained', checkpoint=files['small'])))
    want = (f'{SMALL}; DINOv2Backbone was built with position grid 24x24 (384 px): build it '
            'from configs/rfdetr/rfdetr_small.py')
    with pytest.raises(CheckpointError, match='^' + re.escape(want) + '$'):
        backbone.init_weights()


@pytest.mark.parametrize('name,num_classes', [('coco', 5), ('fruit', 5), ('shapes', 5),
                                              ('fruit', 2)])
def test_fine_tuning_starts_where_rfdetrs_load_pretrain_weights_does(files, name,
                                                                     num_classes):
    """rfdetr's ``RFDETRNano(pretrain_weights=FILE, num_classes=K)`` (its
    ``load_pretrain_weights``: the whole model, the class head re-initialised by
    ``reinitialize_detection_head``) against the shipped fine-tune config's init from FILE:
    every tensor equal; our class branches are rfdetr's without its no-object slot."""
    reference = rfdetr.RFDETRNano(pretrain_weights=files[name], num_classes=num_classes)
    theirs = rfdetr_to_detector(reference.model.model.state_dict(), as_saved=True)[0]
    model = _finetune_model(files[name], num_classes)
    model.init_weights()
    ours = model.state_dict()
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        want = theirs[key][:num_classes] if 'cls_branch' in key else theirs[key]
        assert theirs['bbox_head.cls_branch.bias'].shape[0] == num_classes + 1
        assert torch.equal(value, want), key


def test_the_fine_tune_configs_init_lines_name_the_file():
    """The pre-flight summary of the fine-tune config: every part starts from the file."""
    from vitdet_plugin.checks.init_sources import planned_init_lines
    cfg = Config.fromfile(str(REPO_ROOT / FINETUNE))
    assert planned_init_lines(cfg) == [
        f'init {part}: loads checkpoints/rf-detr-nano.pth (init_cfg Pretrained)'
        for part in ('backbone (DINOv2Backbone)', 'neck (RFDETRProjector)',
                     'bbox_head (LWDETRHead)')]


# ----------------------------------------------------------------------------- tools/test.py
@pytest.fixture(scope='module')
def tiny_shapes(tmp_path_factory) -> str:
    from vitdet_plugin.datasets import generate_dataset
    root = tmp_path_factory.mktemp('tiny_shapes')
    generate_dataset(str(root), seed=1, num_train=2, num_val=2, progress=False)
    return str(root) + '/'


def _test_tool(checkpoint: str, data_root: str, work_dir: str) -> subprocess.CompletedProcess:
    """``tools/test.py`` of the shipped fine-tune config (the shapes classes) on ``data_root``."""
    args = [sys.executable, '-S', str(REPO_ROOT / 'tools' / 'test.py'), FINETUNE, checkpoint,
            '--work-dir', work_dir, '--cfg-options', f'data_root={data_root}',
            'test_dataloader.num_workers=0', 'test_dataloader.persistent_workers=False']
    return subprocess.run(args, cwd=REPO_ROOT, env=subprocess_env(True, OMP_NUM_THREADS='1'),
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # a tools/test.py run (~35 s); in-process: the Runner.load_checkpoint test
def test_tools_test_evaluates_a_fine_tuned_file_as_rfdetr_wrote_it(files, tiny_shapes,
                                                                   tmp_path):
    res = _test_tool(files['shapes'], tiny_shapes, str(tmp_path))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert 'size mismatch' not in res.stdout + res.stderr
    assert '"coco/bbox_mAP"' in res.stdout


@pytest.mark.slow  # two tools/test.py runs (~60 s); in-process: the refusal tests above
def test_tools_test_refuses_other_classes_and_another_size(files, tiny_shapes, tmp_path):
    res = _test_tool(files['fruit'], tiny_shapes, str(tmp_path / 'fruit'))
    assert res.returncode == 1
    assert res.stderr.strip().endswith(f'CheckpointError: {FRUIT_INTO_FIVE}')
    small = str(tmp_path / 'small_ours.pth')
    assert run_tool('convert_weights.py', [files['small'], small]).returncode == 0
    res = _test_tool(small, tiny_shapes, str(tmp_path / 'small'))
    assert res.returncode == 1
    assert res.stderr.strip().endswith(f'CheckpointError: {SMALL_INTO_NANO}')
