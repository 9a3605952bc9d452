"""The newcomer's paths of issue 47, each one run after reading the message: a leftover
``_delete_`` named with its key path and fix, a plain ViT / DINOv2 fed to the stock FPN told to
use ViTSimpleFPN with its values, a wrong image folder named as ``data_prefix.img`` (found by
its images), the tool that ran named in the message, and one report per job (rank 0)."""
import os
import os.path as osp
import shutil
from types import SimpleNamespace

import pytest
from mmengine.config import Config

import vitdet_plugin  # noqa: F401
from vitdet_plugin.checks import (ConfigCheckError, PreflightCheckHook, config_problems,
                                  exit_on_report, preflight)
from vitdet_plugin.checks.config import leftover_deletes
from vitdet_plugin.checks.suggest import options_text, set_fixes
from vitdet_plugin.config import DatasetNotFoundError, load_config, running_tool
from vitdet_plugin.datasets.shapes import ShapesSpec, generate_split
from helpers import REPO_ROOT, parse_cfg_options

ROOT = str(REPO_ROOT)
SHAPES_RETINANET = osp.join(ROOT, 'configs', 'demo', 'swin_retinanet_shapes.py')
OPTIONS_HEAD = "Every fix above as options (our tools/train.py and mmdet's tools/train.py alike):"
#: the tiny shapes images of these tests (the pre-flight check reads files, never trains)
SPEC = ShapesSpec(image_size=64, objects=(1, 2), object_size=(16, 30), lines=(0, 1))


# ----------------------------------------------------------------------------- _delete_
def test_leftover_delete_names_the_key_and_the_fix(tmp_path):
    """A child config whose _delete_ has nothing to replace (no base sets train_cfg), as
    configs/eva02_cascade_mask_rcnn.py had: mmengine keeps the key, IterBasedTrainLoop gets it."""
    from mmengine.runner import IterBasedTrainLoop
    child = tmp_path / 'child.py'
    child.write_text(f"_base_ = [{osp.join(ROOT, 'configs/_base_/default_runtime.py')!r}]\n"
                     "train_cfg = dict(_delete_=True, type='IterBasedTrainLoop', max_iters=8, "
                     'val_interval=4)\n')
    cfg = Config.fromfile(str(child))
    assert cfg.train_cfg._delete_ is True  # mmengine's own merge left it
    with pytest.raises(TypeError, match="unexpected keyword argument '_delete_'"):
        IterBasedTrainLoop(runner=None, dataloader=None, **cfg.train_cfg.to_dict())
    assert leftover_deletes(cfg) == [
        "train_cfg._delete_=True is left in the merged config (no base config has a train_cfg "
        'for it to replace), so what builds train_cfg gets it as an argument (TypeError: '
        "unexpected keyword argument '_delete_'); remove _delete_=True from train_cfg in the "
        "config file, or set train_cfg=dict(type='IterBasedTrainLoop', max_iters=8, "
        'val_interval=4)']


def test_leftover_delete_stops_preflight_before_anything_is_built(tmp_path):
    """In the model too: the checks after it see the config without it (no probe failure)."""
    from dist_worker import make_data, tiny_cfg
    data = make_data(str(tmp_path / 'data'))
    raw = tiny_cfg(data, str(tmp_path / 'work'))
    raw['train_cfg']['_delete_'] = True
    raw['model']['neck']['_delete_'] = True
    cfg = Config(raw)
    with pytest.raises(ConfigCheckError) as e:
        preflight(cfg, ('train',), config_path='tiny.py', log=None)
    lines = str(e.value).splitlines()
    assert lines[0] == 'tiny.py: 2 problems found before training'
    assert [ln.split(' is left')[0] for ln in lines[1:3]] == [
        '  model.neck._delete_=True', '  train_cfg._delete_=True']
    assert lines[3] == OPTIONS_HEAD
    assert lines[4] == (
        '  --cfg-options model.neck._delete_=True model.neck.type=FPN '
        "'model.neck.in_channels=[16,32]' model.neck.out_channels=16 model.neck.start_level=0 "
        'model.neck.add_extra_convs=on_input model.neck.num_outs=3 train_cfg._delete_=True '
        'train_cfg.type=IterBasedTrainLoop train_cfg.max_iters=6 train_cfg.val_interval=1000000')
    cfg.merge_from_dict(parse_cfg_options(lines[4]))  # the next run, as mmdet's tool merges
    assert leftover_deletes(cfg) == []
    assert preflight(cfg, ('train',), log=None)


# ----------------------------------------------------------------------------- ViT into FPN
def _vit_into_fpn(backbone: dict, **options):
    return load_config(SHAPES_RETINANET, {'model.backbone': dict(backbone, _delete_=True),
                                          **options})


def test_dinov2_into_the_stock_fpn_is_told_to_use_vit_simple_fpn():
    """The newcomer's case: a DINOv2 (patch 14) in place of the Swin, the FPN untouched. One
    report: the ViTSimpleFPN with the values, then the anchor strides of that pyramid's real
    levels (7, 14, 28: patch 14 cannot give 8); the options make a config that passes."""
    dinov2 = dict(type='DINOv2Backbone', arch='small')
    problems = config_problems(_vit_into_fpn(dinov2))
    assert problems == [
        'model.neck is FPN, a neck for a pyramid of backbone maps, but the backbone '
        '(DINOv2Backbone: channels [384] at strides [14]) outputs one map: use ViTSimpleFPN on '
        'it, as the README does for the plain ViTs; set model.neck=dict(type=\'ViTSimpleFPN\', '
        'in_channels=384, in_stride=14, out_channels=64, scale_factors=(2.0, 1.0, 0.5), '
        'num_outs=3)',
        'model.bbox_head.anchor_generator.strides=[8, 16, 32] but the neck (ViTSimpleFPN: '
        'channels [64, 64, 64] at strides [7, 14, 28]) outputs 3 levels at strides [7, 14, 28]; '
        'set model.bbox_head.anchor_generator.strides=[7, 14, 28]']
    tail = options_text(set_fixes(problems))
    assert tail == [OPTIONS_HEAD,
                    '  --cfg-options model.neck._delete_=True model.neck.type=ViTSimpleFPN '
                    'model.neck.in_channels=384 model.neck.in_stride=14 '
                    "model.neck.out_channels=64 'model.neck.scale_factors=(2.0,1.0,0.5)' "
                    "model.neck.num_outs=3 'model.bbox_head.anchor_generator.strides=[7,14,28]'"]
    fixed = _vit_into_fpn(dinov2, **parse_cfg_options(tail[1]))
    assert fixed.model.neck.to_dict() == dict(
        type='ViTSimpleFPN', in_channels=384, in_stride=14, out_channels=64,
        scale_factors=(2.0, 1.0, 0.5), num_outs=3)
    assert config_problems(fixed) == []


def test_patch16_vit_gets_the_pyramid_of_the_heads_strides():
    """Patch 16 gives the heads' strides 8, 16, 32: only the neck changes."""
    problems = config_problems(_vit_into_fpn(dict(type='ViTBackbone', arch='base')))
    assert problems == [
        'model.neck is FPN, a neck for a pyramid of backbone maps, but the backbone '
        '(ViTBackbone: channels [768] at strides [16]) outputs one map: use ViTSimpleFPN on it, '
        "as the README does for the plain ViTs; set model.neck=dict(type='ViTSimpleFPN', "
        'in_channels=768, in_stride=16, out_channels=64, scale_factors=(2.0, 1.0, 0.5), '
        'num_outs=3)']


def test_vit_simple_fpn_in_stride_against_the_backbone():
    cfg = load_config(osp.join(ROOT, 'configs', 'demo', 'vit_retinanet_shapes.py'),
                      {'model.neck.in_stride': 16})
    assert config_problems(cfg) == [
        f'model.neck.in_stride=16 but the backbone (ViTBackbone: channels '
        f'[{cfg.model.neck.in_channels}] at strides [8]) outputs stride 8; set '
        'model.neck.in_stride=8']


# ----------------------------------------------------------------------------- image folder
@pytest.fixture(scope='module')
def moved_images(tmp_path_factory) -> str:
    """Shapes data whose annotation files are where the config expects them, the images in
    pics/<split>/ instead of <split>/."""
    root = str(tmp_path_factory.mktemp('own'))
    for split in ('train', 'val'):
        generate_split(root, split, 2, seed=0, spec=SPEC, progress=False)
        os.makedirs(osp.join(root, 'pics'), exist_ok=True)
        shutil.move(osp.join(root, split), osp.join(root, 'pics', split))
    return root + '/'


def test_wrong_image_folder_names_data_prefix_img_and_its_fix(moved_images):
    root = moved_images
    mine = {'data_root': root, 'train_dataloader.batch_size': 2}  # two images a split
    cfg = load_config(SHAPES_RETINANET, mine)
    with pytest.raises(DatasetNotFoundError) as e:
        preflight(cfg, ('train', 'val'), config_path='shapes.py', log=None)
    assert str(e.value).splitlines() == [
        'Dataset not found for shapes.py:',
        f'  missing train_dataloader.dataset.data_prefix.img: {root}train/',
        f'  missing val_dataloader.dataset.data_prefix.img: {root}val/',
        'Found in the expected places instead (the checks below used them):',
        '  train_dataloader.dataset.data_prefix.img=pics/train/',
        '  val_dataloader.dataset.data_prefix.img=pics/val/',
        f"data_root='{root}' exists (its folders: annotations/, pics/), so the keys at fault are "
        'train_dataloader.dataset.data_prefix.img, val_dataloader.dataset.data_prefix.img: set '
        'each to the folder of the images, relative to data_root',
        OPTIONS_HEAD,
        '  --cfg-options train_dataloader.dataset.data_prefix.img=pics/train/ '
        'val_dataloader.dataset.data_prefix.img=pics/val/']
    options = parse_cfg_options(str(e.value).splitlines()[-1])
    assert len(preflight(load_config(SHAPES_RETINANET, {**mine, **options}),
                         ('train', 'val'), log=None)) == 2


def test_the_message_names_the_tool_that_ran(tmp_path, monkeypatch):
    """mmdet's tools/train.py (through PreflightCheckHook): its own name, and the explicit
    override (it does not move the paths derived from data_root)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr('sys.argv', [str(tmp_path / 'tools' / 'train.py'), 'x.py'])
    assert running_tool() == osp.join('tools', 'train.py')
    monkeypatch.setattr('sys.argv', ['/opt/mmdetection/tools/train.py', 'x.py'])
    assert running_tool() == '/opt/mmdetection/tools/train.py'
    cfg = load_config(SHAPES_RETINANET, {'model.backbone.init_cfg': None})
    runner = SimpleNamespace(cfg=cfg, _train_loop={}, logger=SimpleNamespace(info=print))
    with pytest.raises(DatasetNotFoundError) as e:
        PreflightCheckHook().before_run(runner)
    lines = str(e.value).splitlines()
    assert lines[-2] == 'Point the config at your copy with'
    assert lines[-1] == (
        f'  python /opt/mmdetection/tools/train.py {cfg.filename} --cfg-options '
        'data_root=/path/to/data/ train_dataloader.dataset.data_root=/path/to/data/ '
        'val_dataloader.dataset.data_root=/path/to/data/ '
        'test_dataloader.dataset.data_root=/path/to/data/ '
        'val_evaluator.ann_file=/path/to/data/annotations/instances_val.json '
        'test_evaluator.ann_file=/path/to/data/annotations/instances_val.json')
    assert not any("vitdet_plugin's tools" in ln for ln in lines)


def test_one_report_per_job(tmp_path, monkeypatch, capsys):
    """Rank 0 gives the report; every other rank exits with status 1 and no text."""
    monkeypatch.chdir(tmp_path)  # the config's relative data root is missing (not a demo's)
    cfg = load_config(SHAPES_RETINANET, {'model.backbone.init_cfg': None})
    runner = SimpleNamespace(cfg=cfg, _train_loop={}, logger=SimpleNamespace(info=print))
    monkeypatch.setenv('RANK', '1')
    with pytest.raises(SystemExit) as e:
        PreflightCheckHook().before_run(runner)
    assert e.value.code == 1
    with pytest.raises(SystemExit) as e:
        exit_on_report(ValueError('the report'))
    assert e.value.code == 1
    monkeypatch.setenv('RANK', '0')
    with pytest.raises(SystemExit) as e:
        exit_on_report(ValueError('the report'))
    assert e.value.code == 'error: the report'
    assert capsys.readouterr().out == ''
