"""tools/: train/test/resume round trip, analysis tools, missing-data errors."""
import glob
import json
import os
import os.path as osp
import re
import subprocess
import sys

import pytest
import torch
from helpers import REPO_ROOT, load_tool, subprocess_env

import vitdet_plugin  # noqa: F401

ROOT = str(REPO_ROOT)
DEMO = osp.join(ROOT, 'configs/demo/swin_retinanet_shapes.py')


def _tool(name: str):
    return load_tool(f'{name}.py')


# ----------------------------------------------------------------------------- analysis tools
def test_feature_shapes(capsys):
    rows = _tool('analysis/feature_shapes').main([DEMO, '--shape', '250', '256'])
    out = capsys.readouterr().out
    assert [r[1:] for r in rows] == [
        (64, '8', '(1, 64, 32, 32)'), (128, '16', '(1, 128, 16, 16)'),
        (256, '32', '(1, 256, 8, 8)'),
        (64, '8', '(1, 64, 32, 32)'), (64, '16', '(1, 64, 16, 16)'),
        (64, '32', '(1, 64, 8, 8)')]
    assert [r[0] for r in rows] == ['backbone[0]', 'backbone[1]', 'backbone[2]', 'neck[0]',
                                    'neck[1]', 'neck[2]']
    assert 'padded to (256, 256)' in out and 'backbone.out_strides = (8, 16, 32)' in out


#: fvcore's (and mmengine's FlopAnalyzer's) count of a normalisation: 5 FLOPs per element with
#: an affine transform (mean, variance, normalise, scale, shift), 4 without
NORM_FLOPS_PER_ELEMENT = {True: 5, False: 4}
NORMS = (torch.nn.GroupNorm, torch.nn.BatchNorm2d, torch.nn.LayerNorm)


def _module_flops(module: torch.nn.Module, run) -> int:
    """FLOPs of every Conv2d / Linear / norm inside ``module`` during ``run()``, from their
    recorded output shapes: ``out.numel() * in_channels / groups * kh * kw``,
    ``out.numel() * in_features`` (one multiply-add = 1 FLOP) and NORM_FLOPS_PER_ELEMENT."""
    total = [0]

    def count(m, args, out):
        if isinstance(m, torch.nn.Conv2d):
            total[0] += out.numel() * m.in_channels // m.groups * m.kernel_size[0] \
                * m.kernel_size[1]
        elif isinstance(m, torch.nn.Linear):
            total[0] += out.numel() * m.in_features
        else:
            affine = getattr(m, 'affine', getattr(m, 'elementwise_affine', False))
            total[0] += out.numel() * NORM_FLOPS_PER_ELEMENT[bool(affine)]
    handles = [m.register_forward_hook(count) for m in module.modules()
               if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear) + NORMS)]
    with torch.no_grad():
        run()
    for h in handles:
        h.remove()
    return total[0]


def test_get_flops(capsys):
    """The tool's neck and head FLOPs equal what their convolutions and norms cost, counted
    here from the shapes they produce, plus FPN's nearest upsampling (1 FLOP per output element
    in fvcore's count: the upsampled maps have the shapes of the finer pyramid levels)."""
    tool = _tool('analysis/get_flops')
    flops, params = tool.main([DEMO, '--shape', '256', '256'])
    from mmdet.registry import MODELS

    from vitdet_plugin.config import load_config
    model = MODELS.build(load_config(DEMO).model).eval()
    assert params == sum(p.numel() for p in model.parameters())
    out = capsys.readouterr().out
    assert 'backbone' in out and 'bbox_head' in out and 'total' in out
    inputs, samples = tool.dummy_batch((256, 256), 32)
    total, _, rows = tool.complexity(model, inputs, samples, depth=1)
    assert total == flops
    by_name = {name: f for name, f, _ in rows}
    with torch.no_grad():
        feats = model.backbone(inputs)
        pyramid = model.neck(feats)
    upsampled = sum(p.numel() for p in pyramid[:-1])
    assert by_name['neck'] == _module_flops(model.neck, lambda: model.neck(feats)) + upsampled
    assert by_name['bbox_head'] == _module_flops(model.bbox_head,
                                                 lambda: model.bbox_head(pyramid))
    assert total >= by_name['backbone'] + by_name['neck'] + by_name['bbox_head']


# ----------------------------------------------------------------------------- train / test
def test_missing_dataset_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        _tool('train').main([osp.join(ROOT, 'configs/swin_retinanet.py')])
    msg = str(info.value.code)
    assert 'Dataset not found' in msg
    assert 'data/coco/annotations/instances_train2017.json' in msg
    assert "data_root='data/coco/'" in msg and str(tmp_path) in msg
    assert 'python tools/train.py' in msg and '--cfg-options data_root=/path/to/data/' in msg
    assert 'val_evaluator.ann_file=/path/to/data/annotations/instances_val2017.json' in msg


def test_amp_on_cpu_is_refused(tmp_path):
    if torch.cuda.is_available():
        pytest.skip('a GPU is present')
    with pytest.raises(SystemExit, match='needs a CUDA device'):
        _tool('train').build_cfg(_tool('train').parse_args(
            [osp.join(ROOT, 'configs/swin_mask_rcnn_3x_ms_amp.py')]))


@pytest.fixture(scope='module')
def tiny_shapes(tmp_path_factory):
    from vitdet_plugin.datasets import generate_dataset
    root = tmp_path_factory.mktemp('tiny_shapes')
    generate_dataset(str(root), seed=1, num_train=8, num_val=4, progress=False)
    return str(root) + '/'


def _run(args, cwd):
    """``python -S``: site-packages by PYTHONPATH, so no .pth file runs and the tools' own
    ``import vitdet_plugin`` is what puts the compile-free mmcv ops (NMS at validation and test
    time) in place (tests/ops/test_ops_entry_points.py covers the other entry points)."""
    env = subprocess_env(True, OMP_NUM_THREADS='1')
    proc = subprocess.run([sys.executable, '-S'] + args, cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _train_opts(data_root, max_iters):
    return ['--cfg-options', f'data_root={data_root}', f'train_cfg.max_iters={max_iters}',
            f'train_cfg.val_interval={max_iters}', 'train_dataloader.batch_size=2',
            'train_dataloader.num_workers=0', 'train_dataloader.persistent_workers=False',
            'val_dataloader.num_workers=0', 'val_dataloader.persistent_workers=False',
            'test_dataloader.num_workers=0', 'test_dataloader.persistent_workers=False',
            'default_hooks.checkpoint.interval=2', 'default_hooks.logger.interval=1',
            'model.test_cfg.score_thr=0.0']  # an untrained model scores below the default


def _coco_bbox_stats(ann_file: str, preds_pkl: str) -> dict:
    """COCO box AP of the predictions ``tools/test.py --out`` dumped, computed here with
    pycocotools from the raw boxes (xyxy -> xywh, class index -> category id by name)."""
    import pickle

    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    from vitdet_plugin.datasets import CLASSES
    gt = COCO(ann_file)
    cat_by_name = {c['name']: c['id'] for c in gt.loadCats(gt.getCatIds())}
    cat_ids = [cat_by_name[name] for name in CLASSES]
    with open(preds_pkl, 'rb') as f:
        preds = pickle.load(f)
    dets = []
    for p in preds:
        inst = p['pred_instances']
        for (x1, y1, x2, y2), score, label in zip(inst['bboxes'].tolist(),
                                                  inst['scores'].tolist(),
                                                  inst['labels'].tolist()):
            dets.append(dict(image_id=p['img_id'], category_id=cat_ids[label], score=score,
                             bbox=[x1, y1, x2 - x1, y2 - y1]))
    assert len(preds) == len(gt.getImgIds()) and dets
    ev = COCOeval(gt, gt.loadRes(dets), 'bbox')
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return {'coco/bbox_mAP': ev.stats[0], 'coco/bbox_mAP_50': ev.stats[1],
            'coco/bbox_mAP_75': ev.stats[2]}


def test_train_test_resume_round_trip(tiny_shapes, tmp_path):
    work = str(tmp_path / 'work')
    out = _run([osp.join(ROOT, 'tools/train.py'), DEMO, '--work-dir', work]
               + _train_opts(tiny_shapes, 2), cwd=tmp_path)
    ckpt = osp.join(work, 'iter_2.pth')
    assert osp.isfile(ckpt), out[-2000:]
    assert 'coco/bbox_mAP' in out  # validated after the last iteration

    vis = str(tmp_path / 'vis')
    metrics_file = str(tmp_path / 'metrics.json')
    out = _run([osp.join(ROOT, 'tools/test.py'), DEMO, ckpt, '--work-dir', str(tmp_path / 't'),
                '--show-dir', vis, '--grid', '4', '--metrics-out', metrics_file,
                '--out', str(tmp_path / 'preds.pkl'),
                '--cfg-options', f'data_root={tiny_shapes}', 'model.test_cfg.score_thr=0.0',
                'test_dataloader.num_workers=0',
                'test_dataloader.persistent_workers=False'], cwd=tmp_path)
    metrics = json.load(open(metrics_file))
    expected = _coco_bbox_stats(osp.join(tiny_shapes, 'annotations', 'instances_val.json'),
                                str(tmp_path / 'preds.pkl'))
    for key, value in expected.items():  # mmdet reports 3 decimals
        assert metrics[key] == pytest.approx(value, abs=5e-4), (key, metrics[key], value)
    assert sorted(os.listdir(vis)) == ['000000.png', '000001.png', '000002.png', '000003.png',
                                       'grid.png']

    # resume under torch's weights_only=True default (compat allow-lists mmengine's classes)
    out = _run([osp.join(ROOT, 'tools/train.py'), DEMO, '--work-dir', work, '--resume', ckpt]
               + _train_opts(tiny_shapes, 4), cwd=tmp_path)
    assert 'resumed epoch: 0, iter: 2' in out, out[-3000:]
    assert osp.isfile(osp.join(work, 'iter_4.pth'))
    state = torch.load(osp.join(work, 'iter_4.pth'), map_location='cpu')  # weights_only=True
    assert state['meta']['iter'] == 4


def test_test_tool_prepares_cpu_distributed(monkeypatch, tmp_path):
    """``torchrun tools/test.py CFG CKPT --launcher pytorch`` on CPU: like train.py, test.py
    sets up gloo + the CPU DDP wrapper before building the Runner (mmengine's own init_dist
    calls torch.cuda.set_device and fails with 'Found no NVIDIA driver')."""
    tool = _tool('test')
    seen = []

    def stop(cfg):
        seen.append(cfg.launcher)
        raise SystemExit('stopped before the Runner')

    monkeypatch.setattr(tool, 'preflight', lambda *a, **k: [])
    monkeypatch.setattr(tool, 'prepare_cpu_distributed', stop)
    (tmp_path / 'ckpt.pth').write_bytes(b'')  # only its existence is checked first
    with pytest.raises(SystemExit, match='stopped before the Runner'):
        tool.main([DEMO, str(tmp_path / 'ckpt.pth'), '--launcher', 'pytorch',
                   '--work-dir', str(tmp_path / 'w')])
    assert seen == ['pytorch']


def test_benchmark_runs_at_a_size_below_one_window_per_stage(tmp_path, monkeypatch, capsys):
    """Small inputs (stages smaller than a 7x7 window) used to break the timm model's weight
    load; the tool, run as the script it is (its harness in tools/dev/bench), prints its ratio
    row. Bad --repeats is an argument error (parsed in this process: no second interpreter)."""
    tool = [sys.executable, osp.join(ROOT, 'tools', 'benchmark.py')]
    res = subprocess.run(tool + ['--sizes', '64x96', '--repeats', '1', '--processes', '1',
                                 '--skip-backward', '--train-size', '64x96', '--same-process'],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert re.search(r'64x96 +\| fwd: ours [\d.]+ \(mmdet [\d.]+, timm [\d.]+\) ratio /mmdet '
                     r'[\d.]+x, /timm [\d.]+x', res.stdout), res.stdout
    monkeypatch.syspath_prepend(osp.join(ROOT, 'tools'))  # as running the script gives
    benchmark = _tool('benchmark')
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(['--repeats', '0'])
    assert exit_info.value.code == 2
    assert '--repeats must be at least 1, got 0' in capsys.readouterr().err


#: The user entry points of tools/ (the developer kits are under tools/dev/).
PYTHON_TOOLS = ('train', 'test', 'benchmark', 'convert_weights', 'dcp_convert', 'export_onnx',
                'infer', 'make_shapes', 'analysis/feature_shapes', 'analysis/get_flops',
                'analysis/visualize')
SHELL_TOOLS = ('dist_train.sh', 'demo.sh')


def test_every_user_entry_point_answers_help(monkeypatch, capsys):
    """Each user command of tools/ prints its usage for --help and exits 0 (the Python ones in
    this process, as their scripts would: tools/ and tools/analysis/ on the path)."""
    monkeypatch.syspath_prepend(osp.join(ROOT, 'tools', 'analysis'))
    monkeypatch.syspath_prepend(osp.join(ROOT, 'tools'))
    found = {osp.relpath(p, osp.join(ROOT, 'tools'))[:-len('.py')] for p in
             [*glob.glob(osp.join(ROOT, 'tools', '*.py')),
              *glob.glob(osp.join(ROOT, 'tools', 'analysis', '*.py'))]}
    assert found == set(PYTHON_TOOLS)
    for name in PYTHON_TOOLS:
        with pytest.raises(SystemExit) as exit_info:
            _tool(name).main(['--help'])
        assert exit_info.value.code == 0, name
        assert capsys.readouterr().out.startswith('usage: '), name
    for script in SHELL_TOOLS:
        done = subprocess.run(['bash', osp.join(ROOT, 'tools', script), '--help'],
                              capture_output=True, text=True, timeout=60)
        with open(osp.join(ROOT, 'tools', script)) as f:
            header = f.read().split('\nset -euo pipefail')[0].splitlines()[1:]  # the comment
        assert done.returncode == 0, (script, done.stderr)
        assert done.stdout.splitlines() == [line[2:] for line in header], script
