"""Every config and data mistake in one pre-flight report (issue 38).

The newcomer's scenario: a stock-style COCO config (configs/swin_retinanet.py) pointed at one's
own data with ``data_root`` alone used to take four runs: the file names, then
``metainfo.classes`` (reported once per split), then ``num_classes``, then training. Here the
first run reports all of it at once, with the ``--cfg-options`` that fix it, and the second run
(those options applied) passes.
"""
import argparse
import os
import os.path as osp
import shlex

import pytest
from mmengine.config import DictAction

import vitdet_plugin  # noqa: F401
from vitdet_plugin.checks import ConfigCheckError, DataCheckError, preflight
from vitdet_plugin.checks.preflight import PreflightError
from vitdet_plugin.config import DatasetNotFoundError, load_config
from vitdet_plugin.datasets.shapes import CLASSES, generate_split
from helpers import REPO_ROOT

ROOT = str(REPO_ROOT)
RETINANET = osp.join(ROOT, 'configs', 'swin_retinanet.py')
COCO_FIRST = ("['person', 'bicycle', 'car', 'motorcycle', 'airplane', 'bus', 'train', 'truck', "
              "'boat', 'traffic light', '...']")


@pytest.fixture(scope='module')
def own_data(tmp_path_factory) -> str:
    """COCO-format data named the way people name theirs: annotations/train.json, train/."""
    root = str(tmp_path_factory.mktemp('mydata'))
    for split, n in (('train', 4), ('val', 2)):
        generate_split(root, split, n, seed=0, progress=False)
        os.rename(osp.join(root, 'annotations', f'instances_{split}.json'),
                  osp.join(root, 'annotations', f'{split}.json'))
    return root


def _cfg(root: str, **options):
    # the weights are not this test's subject (tests build configs offline)
    return load_config(RETINANET, {'data_root': root + '/', 'model.backbone.init_cfg': None,
                                   **options})


def _report(cfg) -> str:
    with pytest.raises(PreflightError) as e:
        preflight(cfg, ('train', 'val'), config_path='swin_retinanet.py', log=None)
    # the one error is each of the single-kind errors, for callers that catch those
    assert isinstance(e.value, (DatasetNotFoundError, ConfigCheckError, DataCheckError))
    return str(e.value)


def test_own_data_every_mistake_in_one_report_and_the_options_fix_it(own_data):
    text = _report(_cfg(own_data))
    root = own_data + '/'
    classes = repr(CLASSES)
    sections = text.split('\n\n')
    assert sections[0] == ('swin_retinanet.py: 2 kinds of problem found before training (data '
                           'files, config, annotations: all of them, in one report)')
    missing = sections[1].splitlines()
    assert missing[0] == 'Dataset not found for swin_retinanet.py:'
    assert missing[1:6] == [
        f'  missing train_dataloader.dataset.ann_file: {root}annotations/instances_train2017.json',
        f'  missing train_dataloader.dataset.data_prefix.img: {root}train2017/',
        f'  missing val_dataloader.dataset.ann_file: {root}annotations/instances_val2017.json',
        f'  missing val_dataloader.dataset.data_prefix.img: {root}val2017/',
        f'  missing val_evaluator.ann_file: {root}annotations/instances_val2017.json']
    assert missing[6:12] == [
        'Found in the expected places instead (the checks below used them):',
        '  train_dataloader.dataset.ann_file=annotations/train.json',
        '  train_dataloader.dataset.data_prefix.img=train/',
        '  val_dataloader.dataset.ann_file=annotations/val.json',
        '  val_dataloader.dataset.data_prefix.img=val/',
        f'  val_evaluator.ann_file={root}annotations/val.json']
    # classes and num_classes in the same report; train and val said once
    assert sections[2].splitlines() == [
        'swin_retinanet.py: 2 problems found before training',
        '  metainfo.classes is not set in train_dataloader.dataset, val_dataloader.dataset: '
        f'CocoDataset then uses its own 80 classes {COCO_FIRST}, which the annotations do not '
        f'have; their categories are {classes}: set metainfo.classes={classes} there (the class '
        'counts below are checked against these)',
        '  model.bbox_head.num_classes=80 but train_dataloader.dataset has 5 classes '
        f'{list(CLASSES)}; set model.bbox_head.num_classes=5']
    names = ','.join(CLASSES)
    assert sections[3].splitlines() == [
        "Every fix above as options (our tools/train.py and mmdet's tools/train.py alike):",
        '  --cfg-options train_dataloader.dataset.ann_file=annotations/train.json '
        'train_dataloader.dataset.data_prefix.img=train/ '
        'val_dataloader.dataset.ann_file=annotations/val.json '
        'val_dataloader.dataset.data_prefix.img=val/ '
        f'val_evaluator.ann_file={root}annotations/val.json '
        f"'train_dataloader.dataset.metainfo.classes=({names})' "
        f"'val_dataloader.dataset.metainfo.classes=({names})' "
        'model.bbox_head.num_classes=5']
    # the second run: the options as a shell passes them to mmengine's DictAction
    parser = argparse.ArgumentParser()
    parser.add_argument('--cfg-options', nargs='+', action=DictAction)
    options = parser.parse_args(shlex.split(sections[3].splitlines()[1])).cfg_options
    lines = []
    summaries = preflight(_cfg(own_data, **options), ('train', 'val'), log=lines.append)
    assert [s.key for s in summaries] == ['train_dataloader.dataset', 'val_dataloader.dataset']
    assert lines[:2] == [s.line() for s in summaries]
    assert lines[2] == 'init backbone (SwinBackbone): random init (no Pretrained init_cfg)'


def test_identical_data_problems_in_train_and_val_are_reported_once(own_data):
    """classes set in another order than the json's: the same problem in both splits."""
    wrong = tuple(reversed(CLASSES))
    cfg = _cfg(own_data, **{
        f'{s}_dataloader.dataset.{k}': v for s in ('train', 'val') for k, v in (
            ('ann_file', f'annotations/{s}.json'), ('data_prefix.img', f'{s}/'),
            ('metainfo.classes', wrong))},
        **{'val_evaluator.ann_file': osp.join(own_data, 'annotations/val.json'),
           'model.bbox_head.num_classes': 5})
    with pytest.raises(DataCheckError) as e:
        preflight(cfg, ('train', 'val'), log=None)
    lines = str(e.value).splitlines()
    assert lines[0] == ('data check failed: 1 kind of problem that would crash training or '
                        'train on wrong boxes:')
    assert lines[1] == (f'train_dataloader.dataset (ann_file {own_data}/annotations/train.json), '
                        f'val_dataloader.dataset (ann_file {own_data}/annotations/val.json):')
    assert lines[2].startswith("  - metainfo.classes not in the json's category order: ")
    assert sum(ln.startswith('  - ') for ln in lines) == 1
