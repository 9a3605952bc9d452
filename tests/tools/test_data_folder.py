"""``--data DIR``: your data folder as it is, for tools/train.py, tools/test.py, tools/infer.py.

The folders are made here from the shapes generator in the two layouts users have: a Roboflow
COCO export (``train/_annotations.coco.json``, ``valid/``, ``test/``, the images beside each
json, Roboflow's parent category at id 0 and the classes at 1..K) and mmdet's
``annotations/instances_<split>.json`` + ``<split>/``. The classes are checked against RF-DETR's
own readers of the same folder (``RFDETR._load_classes``, ``CocoDetection.cat2label``), the
tools run as subprocesses on the shipped configs.
"""
import copy
import json
import os.path as osp
import shutil
import subprocess
import sys

import pytest
from helpers import (REPO_ROOT, load_tool, random_rfdetr, save_rfdetr_checkpoint,
                     subprocess_env)

from vitdet_plugin.config import load_config
from vitdet_plugin.datasets.data_folder import (DataFolderError, apply_data_folder,
                                                find_data_folder)
from vitdet_plugin.datasets.shapes import ShapesSpec, generate_split

ROOT = str(REPO_ROOT)
DEMO = osp.join(ROOT, 'configs/demo/swin_retinanet_shapes.py')
FINETUNE = osp.join(ROOT, 'configs/rfdetr/rfdetr_nano_finetune_custom.py')
MASK_RCNN = osp.join(ROOT, 'configs/demo/swin_mask_rcnn_shapes.py')
#: three classes (the shipped configs have five), small images, few objects
CLASSES = ('square', 'circle', 'star')
SPEC = ShapesSpec(image_size=64, classes=CLASSES, objects=(1, 2), object_size=(12, 32),
                  lines=(0, 1))
SPLITS = {'train': 4, 'val': 2, 'test': 2}
ROBOFLOW_NAMES = {'train': 'train', 'val': 'valid', 'test': 'test'}
#: Roboflow's parent category: id 0, the supercategory of every class, no annotation
PARENT = dict(id=0, name='shapes', supercategory='none')
#: tools/train.py options of a 2-iteration run without worker processes
QUICK = ['train_cfg.max_iters=2', 'train_cfg.val_interval=2', 'train_dataloader.batch_size=2',
         'train_dataloader.num_workers=0', 'train_dataloader.persistent_workers=False',
         'val_dataloader.num_workers=0', 'val_dataloader.persistent_workers=False',
         'test_dataloader.num_workers=0', 'test_dataloader.persistent_workers=False',
         'model.test_cfg.score_thr=0.0']  # an untrained model scores below the default


@pytest.fixture(scope='module')
def folders(tmp_path_factory):
    """``{'mmdet': DIR, 'roboflow': DIR}``: the same images and boxes in both layouts."""
    base = tmp_path_factory.mktemp('data')
    mm, rf = base / 'mmdet', base / 'roboflow'
    for split, n in SPLITS.items():
        generate_split(str(mm), split, n, seed=0, spec=SPEC, progress=False)
    for split, name in ROBOFLOW_NAMES.items():
        coco = json.loads((mm / 'annotations' / f'instances_{split}.json').read_text())
        coco['categories'] = [PARENT] + [dict(c, supercategory=PARENT['name'])
                                         for c in coco['categories']]
        shutil.copytree(mm / split, rf / name)
        (rf / name / '_annotations.coco.json').write_text(json.dumps(coco))
    return {'mmdet': str(mm) + '/', 'roboflow': str(rf) + '/'}


def _run(args, cwd):
    """The tool in a fresh ``python -S`` (this checkout's vitdet_plugin, as tests/tools/
    test_tools.py runs them); it must succeed."""
    env = subprocess_env(True, OMP_NUM_THREADS='1')
    proc = subprocess.run([sys.executable, '-S'] + args, cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


# ----------------------------------------------------------------------------- finding
def test_roboflow_export_classes_are_rfdetrs(folders):
    """Roboflow's parent category is no class; names and label order are RF-DETR's."""
    from rfdetr.datasets.coco import CocoDetection
    from rfdetr.detr import RFDETR

    rf = folders['roboflow']
    found = find_data_folder(rf)
    assert found.layout == 'Roboflow COCO export'
    assert found.classes == tuple(RFDETR._load_classes(rf)) == CLASSES
    theirs = CocoDetection(rf + 'train', rf + 'train/_annotations.coco.json', transforms=None,
                           remap_category_ids=True)
    assert {cat: label for label, cat in enumerate(found.category_ids)} == theirs.cat2label
    assert found.skipped == ((0, 'shapes'),)
    assert found.line() == (
        f'data {rf} (Roboflow COCO export): train train/_annotations.coco.json, val '
        'valid/_annotations.coco.json, test test/_annotations.coco.json; 3 classes from '
        'train/_annotations.coco.json: square, circle, star; not a class (an unannotated parent '
        "category): 0 'shapes'")


def test_mmdet_layout(folders):
    found = find_data_folder(folders['mmdet'])
    assert (found.layout, found.classes, found.category_ids) == ('mmdet layout', CLASSES,
                                                                 (1, 2, 3))
    assert {s: (v.ann_file, v.img_dir) for s, v in found.splits.items()} == {
        'train': ('annotations/instances_train.json', 'train/'),
        'val': ('annotations/instances_val.json', 'val/'),
        'test': ('annotations/instances_test.json', 'test/')}


def test_an_annotated_parent_category_stays_a_class(tmp_path, folders):
    """RF-DETR keeps a parent category that annotations use (a hierarchical dataset)."""
    rf = tmp_path / 'rf'
    shutil.copytree(folders['roboflow'], rf)
    ann = rf / 'train' / '_annotations.coco.json'
    coco = json.loads(ann.read_text())
    coco['annotations'][0]['category_id'] = 0
    ann.write_text(json.dumps(coco))
    from rfdetr.detr import RFDETR
    assert find_data_folder(str(rf)).classes == tuple(RFDETR._load_classes(str(rf))) == (
        'shapes',) + CLASSES


# ----------------------------------------------------------------------------- the config
@pytest.mark.parametrize('layout', ['roboflow', 'mmdet'])
def test_every_data_key_of_the_config_follows_the_folder(folders, layout):
    root = folders[layout]
    cfg = load_config(DEMO)
    found = apply_data_folder(cfg, root, ('train', 'val'))
    split = {s: found.splits[s] for s in ('train', 'val', 'test')}
    for stage in ('train', 'val', 'test'):
        ds = cfg[f'{stage}_dataloader'].dataset
        assert (ds.data_root, ds.ann_file, ds.data_prefix, ds.metainfo) == (
            root, split[stage].ann_file, {'img': split[stage].img_dir}, {'classes': CLASSES})
    assert cfg.val_evaluator.ann_file == root + split['val'].ann_file
    assert cfg.test_evaluator.ann_file == root + split['test'].ann_file
    assert cfg.model.bbox_head.num_classes == 3 and cfg.data_root == root
    assert (cfg.num_classes, cfg.classes, cfg.metainfo) == (3, CLASSES, {'classes': CLASSES})


def test_mask_heads_and_rpn(folders):
    """Box and mask heads get the classes, the RPN keeps its one objectness class."""
    cfg = load_config(MASK_RCNN)
    apply_data_folder(cfg, folders['roboflow'], ('train', 'val'))
    roi = cfg.model.roi_head
    assert (roi.bbox_head.num_classes, roi.mask_head.num_classes) == (3, 3)
    assert cfg.model.rpn_head == load_config(MASK_RCNN).model.rpn_head


@pytest.mark.parametrize('config', ['configs/swin_mask2former_instance.py',
                                    'configs/eva02_cascade_mask_rcnn.py',
                                    'configs/rfdetr/rfdetr_seg_nano.py', 'configs/swin_dino.py'])
def test_class_counts_of_other_heads(folders, config):
    """Mask2Former (things, its no-object class weight), cascade heads, RF-DETR-Seg, DINO: the
    preflight class-count check finds nothing left to set."""
    from vitdet_plugin.checks.config import check_num_classes
    cfg = load_config(osp.join(ROOT, config))
    coco_model = copy.deepcopy(cfg.model)
    apply_data_folder(cfg, folders['roboflow'], ('train', 'val'))
    assert check_num_classes(cfg, ('train',)) == []
    cfg.model = coco_model
    assert check_num_classes(cfg, ('train',))  # the check sees the 80 COCO classes


def test_explicit_options_win(folders):
    options = {'train_dataloader.dataset.data_prefix.img': 'elsewhere/'}
    cfg = load_config(DEMO, options)
    apply_data_folder(cfg, folders['mmdet'], ('train',), options)
    assert cfg.train_dataloader.dataset.data_prefix.img == 'elsewhere/'


def test_a_missing_validation_split_is_named(tmp_path, folders):
    shutil.copytree(folders['roboflow'], tmp_path / 'rf', ignore=shutil.ignore_patterns('valid'))
    with pytest.raises(DataFolderError, match=(
            r'--data .*/rf/ \(Roboflow COCO export\) has no val split \(looked for '
            r'valid/_annotations.coco.json, val/_annotations.coco.json\); this run needs it')):
        apply_data_folder(load_config(DEMO), str(tmp_path / 'rf'), ('train', 'val'))


def test_a_missing_image_folder_is_named(tmp_path, folders):
    shutil.copytree(folders['mmdet'], tmp_path / 'mm', ignore=shutil.ignore_patterns('val'))
    with pytest.raises(DataFolderError) as e:
        find_data_folder(str(tmp_path / 'mm'))
    assert str(e.value) == (
        f"--data {tmp_path / 'mm'}/ (mmdet layout): missing image folder val/ (the images of "
        "annotations/instances_val.json); put the images of each split there (the annotation "
        "file's file_name values are relative to it)")


# ----------------------------------------------------------------------------- the tools
def test_neither_layout_is_refused_listing_both(tmp_path, monkeypatch):
    (tmp_path / 'mine' / 'images').mkdir(parents=True)
    (tmp_path / 'mine' / 'labels.json').write_text('{}')
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        load_tool('train.py').main([DEMO, '--data', 'mine'])
    assert str(e.value.code).splitlines() == [
        'error: --data mine/: not a data folder of a layout vitdet_plugin reads (it holds: '
        'images/, labels.json); expected one of:',
        '  Roboflow COCO export: train/_annotations.coco.json, valid/_annotations.coco.json '
        '(or val/), optional test/_annotations.coco.json, the images beside each json',
        '  mmdet layout: annotations/instances_train.json, annotations/instances_val.json, '
        'optional annotations/instances_test.json, the images in train/, val/, test/']


def test_train_on_a_roboflow_export_test_on_the_mmdet_layout(folders, tmp_path):
    """The user's path: a non-RF-DETR config trains on the Roboflow export with --data alone
    (3 classes where the config has 5), tools/test.py scores the checkpoint on the mmdet
    layout's test split, tools/infer.py writes the dataset's category ids."""
    work = str(tmp_path / 'work')
    proc = _run([osp.join(ROOT, 'tools/train.py'), DEMO, '--data', folders['roboflow'],
                 '--work-dir', work, '--cfg-options', *QUICK], tmp_path)
    assert proc.stdout.splitlines()[0] == find_data_folder(folders['roboflow']).line()
    assert 'coco/bbox_mAP' in proc.stdout + proc.stderr
    ckpt = osp.join(work, 'iter_2.pth')
    metrics = str(tmp_path / 'metrics.json')
    out = _run([osp.join(ROOT, 'tools/test.py'), DEMO, ckpt, '--data', folders['mmdet'],
                '--work-dir', str(tmp_path / 'test'), '--metrics-out', metrics,
                '--cfg-options', 'test_dataloader.num_workers=0',
                'test_dataloader.persistent_workers=False', 'model.test_cfg.score_thr=0.0'],
               tmp_path).stdout
    test_ann = folders['mmdet'] + 'annotations/instances_test.json'
    assert f'data test_dataloader.dataset ({test_ann}): 2 images' in out
    assert 'coco/bbox_mAP' in json.load(open(metrics))
    rf_test = folders['roboflow'] + 'test/'
    assert load_tool('infer.py').main([  # in-process: the third interpreter start costs most
        rf_test, '--out-dir', str(tmp_path / 'inf'), '--backend', 'pytorch', '--config', DEMO,
        '--checkpoint', ckpt, '--data', folders['roboflow'], '--no-draw']) == 0
    predictions = json.load(open(tmp_path / 'inf' / 'predictions.json'))
    assert predictions['categories'] == [dict(id=1, name='square'), dict(id=2, name='circle'),
                                         dict(id=3, name='star')]
    gt = json.load(open(rf_test + '_annotations.coco.json'))
    assert [im['id'] for im in predictions['images']] == [im['id'] for im in gt['images']]


def test_rfdetr_finetune_config_reads_the_export(folders, tmp_path, monkeypatch, capsys):
    """The fine-tune config with --data alone: the data and the class count pass the checks
    (only the detector's checkpoint, not downloaded here, is reported), and without --data the
    report names the paths the config reads and offers --data."""
    monkeypatch.chdir(tmp_path)
    train = load_tool('train.py')
    with pytest.raises(SystemExit) as e:
        train.main([FINETUNE, '--data', folders['roboflow']])
    assert capsys.readouterr().out.splitlines()[0] == find_data_folder(folders['roboflow']).line()
    report = str(e.value.code).splitlines()
    assert report == [
        f'error: {FINETUNE}: 1 problem found before training',
        f"  model.init_cfg.checkpoint='checkpoints/rf-detr-nano.pth' does not exist "
        f'(relative paths are read from {tmp_path}); download the weights there or point the '
        'key at your copy (random init instead: model.init_cfg=None)']

    with pytest.raises(SystemExit) as e:
        train.main([FINETUNE])
    lines = str(e.value.code).split('\n\n')[1].splitlines()
    assert lines[:10] == [
        f'Dataset not found for {FINETUNE}:',
        '  missing train_dataloader.dataset.ann_file: data/shapes/annotations/instances_train.json',
        '  missing train_dataloader.dataset.data_prefix.img: data/shapes/train/',
        '  missing val_dataloader.dataset.ann_file: data/shapes/annotations/instances_val.json',
        '  missing val_dataloader.dataset.data_prefix.img: data/shapes/val/',
        '  missing val_evaluator.ann_file: data/shapes/annotations/instances_val.json',
        "The config expects its data under data_root='data/shapes/' (relative to the current "
        f'directory {tmp_path}).',
        'Your own data as it is (a Roboflow COCO export: train/_annotations.coco.json, valid/, '
        'test/; or annotations/instances_train.json, instances_val.json with train/ and val/): '
        'the splits and classes are found there with',
        f'  python tools/train.py {FINETUNE} --data /path/to/your/data/',
        'Point the config at your copy with']


def test_data_root_on_an_export_points_to_data(folders, tmp_path, monkeypatch):
    """The old way (data_root moved to the export): the report says what the folder is and
    gives the --data command for it."""
    monkeypatch.chdir(tmp_path)
    rf = folders['roboflow']
    with pytest.raises(SystemExit) as e:
        load_tool('train.py').main([FINETUNE, '--cfg-options', f'data_root={rf}'])
    lines = str(e.value.code).splitlines()
    at = lines.index(f"data_root='{rf}' is a Roboflow COCO export: its splits and classes are "
                     'taken as they are with')
    assert lines[at + 1] == f'  python tools/train.py {FINETUNE} --data {rf}'
    assert ('  missing train_dataloader.dataset.ann_file: '
            f'{rf}annotations/instances_train.json') in lines


@pytest.mark.slow
def test_rfdetr_finetune_trains_on_the_export(folders, tmp_path):
    """One epoch of the fine-tune config on the Roboflow export, from an RF-DETR N checkpoint
    in rfdetr's format (random weights) where the config expects it."""
    (tmp_path / 'checkpoints').mkdir()
    save_rfdetr_checkpoint(random_rfdetr('RFDETRNano'),
                           str(tmp_path / 'checkpoints' / 'rf-detr-nano.pth'))
    work = str(tmp_path / 'work')
    out = _run([osp.join(ROOT, 'tools/train.py'), FINETUNE, '--data', folders['roboflow'],
                '--work-dir', work, '--cfg-options', 'train_cfg.max_epochs=1',
                *[o for o in QUICK if not o.startswith(('train_cfg', 'model'))]], tmp_path)
    assert 'coco/bbox_mAP' in out.stdout + out.stderr
    assert osp.isfile(osp.join(work, 'epoch_1.pth'))


# ----------------------------------------------------------------------------- predictions.json
def _ground_truth_detector(coco, classes):
    """A stand-in for the ONNX detector: each image's ground truth boxes (score 0.9) as label
    indices of ``classes`` (the ids of ``coco`` mapped by name)."""
    import numpy as np

    from vitdet_plugin.deploy.runner import Detections
    name_of = {c['id']: c['name'] for c in coco['categories']}
    by_file = {im['file_name']: im['id'] for im in coco['images']}

    def run(files, model):
        dets = []
        for path in files:
            anns = [a for a in coco['annotations'] if a['image_id'] == by_file[osp.basename(path)]]
            boxes = np.array([[x, y, x + w, y + h] for x, y, w, h in (a['bbox'] for a in anns)],
                             np.float32).reshape(-1, 4)
            dets.append(Detections(boxes=boxes, scores=np.full(len(anns), 0.9),
                                   labels=np.array([classes.index(name_of[a['category_id']])
                                                    for a in anns], np.int64)))
        return dets, list(classes)
    return run


def _coco_eval(ann_file, results):
    """pycocotools' bbox mAP of a results list against ``ann_file``."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval
    gt = COCO(ann_file)
    ev = COCOeval(gt, gt.loadRes(results), 'bbox')
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return ev.stats[0]


@pytest.mark.parametrize('option', ['--ann-file', '--data'])
def test_predictions_take_the_roboflow_ids(folders, tmp_path, monkeypatch, option):
    """Roboflow's ids (classes at 1..K, the parent at 0, images from 0): predictions.json's
    annotations are a results list pycocotools loads against the export's own file, mAP 1."""
    ann = folders['roboflow'] + 'test/_annotations.coco.json'
    coco = json.load(open(ann))
    tool = load_tool('infer.py')
    monkeypatch.setattr(tool, 'run_onnxruntime', _ground_truth_detector(coco, CLASSES))
    source = ann if option == '--ann-file' else folders['roboflow']
    assert tool.main([folders['roboflow'] + 'test', '--out-dir', str(tmp_path), '--onnx',
                      'm.onnx', '--no-draw', option, source]) == 0
    predictions = json.load(open(tmp_path / 'predictions.json'))
    assert predictions['categories'] == [dict(id=1, name='square'), dict(id=2, name='circle'),
                                         dict(id=3, name='star')]
    assert _coco_eval(ann, predictions['annotations']) == pytest.approx(1.0)


def test_predictions_take_sparse_ids_and_say_when_they_cannot(folders, tmp_path, monkeypatch,
                                                              capsys):
    """COCO-style sparse ids in another order than the model's classes; without an annotation
    file the label indices stay, and the tool says so."""
    coco = json.load(open(folders['mmdet'] + 'annotations/instances_val.json'))
    sparse = {1: 90, 2: 17, 3: 44}
    coco['categories'] = [dict(c, id=sparse[c['id']]) for c in coco['categories']]
    for a in coco['annotations']:
        a['category_id'] = sparse[a['category_id']]
    coco['images'] = [dict(im, id=im['id'] + 1000) for im in coco['images']]
    for a in coco['annotations']:
        a['image_id'] += 1000
    ann = tmp_path / 'sparse.json'
    ann.write_text(json.dumps(coco))
    tool = load_tool('infer.py')
    classes = ('star', 'square', 'circle')
    monkeypatch.setattr(tool, 'run_onnxruntime', _ground_truth_detector(coco, classes))
    images = folders['mmdet'] + 'val'
    assert tool.main([images, '--out-dir', str(tmp_path / 'a'), '--onnx', 'm.onnx', '--no-draw',
                      '--ann-file', str(ann)]) == 0
    predictions = json.load(open(tmp_path / 'a' / 'predictions.json'))
    assert predictions['categories'] == [dict(id=44, name='star'), dict(id=90, name='square'),
                                         dict(id=17, name='circle')]
    assert _coco_eval(str(ann), predictions['annotations']) == pytest.approx(1.0)
    assert 'COCO bbox mAP 1.0000 (onnxruntime, 2 images)' in capsys.readouterr().out

    assert tool.main([images, '--out-dir', str(tmp_path / 'b'), '--onnx', 'm.onnx',
                      '--no-draw']) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        'predictions.json: category_id is the label index and image_id the position of the '
        "image (no --ann-file or --data to take the dataset's ids from)")
    predictions = json.load(open(tmp_path / 'b' / 'predictions.json'))
    assert predictions['categories'] == [dict(id=i, name=n) for i, n in enumerate(classes)]
