"""tools/: train/test/resume round trip, analysis tools, missing-data errors."""
import importlib.util
import json
import re
import os
import os.path as osp
import subprocess
import sys

import pytest
import torch

import vitdet_plugin  # noqa: F401

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
DEMO = osp.join(ROOT, 'configs/demo/swin_retinanet_shapes.py')


def _tool(name: str):
    path = osp.join(ROOT, 'tools', f'{name}.py')
    spec = importlib.util.spec_from_file_location(f'vitdet_tool_{osp.basename(name)}', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def test_get_flops(capsys):
    flops, params = _tool('analysis/get_flops').main([DEMO, '--shape', '256', '256'])
    from mmdet.registry import MODELS
    from vitdet_plugin.datasets import load_config
    model = MODELS.build(load_config(DEMO).model)
    assert params == sum(p.numel() for p in model.parameters())
    out = capsys.readouterr().out
    assert 'backbone' in out and 'bbox_head' in out and 'total' in out
    # more than the backbone's patch embedding alone: 64 x 3 x 8 x 8 MACs per 32 x 32 tokens
    assert flops > 64 * 3 * 64 * 32 * 32


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
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''),
               OMP_NUM_THREADS='1')
    proc = subprocess.run([sys.executable] + args, cwd=cwd, env=env, capture_output=True,
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
                '--cfg-options', f'data_root={tiny_shapes}', 'model.test_cfg.score_thr=0.0',
                'test_dataloader.num_workers=0',
                'test_dataloader.persistent_workers=False'], cwd=tmp_path)
    metrics = json.load(open(metrics_file))
    assert 0.0 <= metrics['coco/bbox_mAP'] <= 1.0 and 'coco/bbox_mAP_50' in metrics
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

    monkeypatch.setattr(tool, 'check_data', lambda *a, **k: None)
    monkeypatch.setattr(tool, 'prepare_cpu_distributed', stop)
    (tmp_path / 'ckpt.pth').write_bytes(b'')  # only its existence is checked first
    with pytest.raises(SystemExit, match='stopped before the Runner'):
        tool.main([DEMO, str(tmp_path / 'ckpt.pth'), '--launcher', 'pytorch',
                   '--work-dir', str(tmp_path / 'w')])
    assert seen == ['pytorch']


def test_benchmark_runs_at_a_size_below_one_window_per_stage(tmp_path):
    """Small inputs (stages smaller than a 7x7 window) used to break the timm model's weight
    load; the tool prints its ratio row. Bad --repeats is an argument error."""
    tool = [sys.executable, osp.join(ROOT, 'tools', 'benchmark.py')]
    res = subprocess.run(tool + ['--sizes', '64x96', '--repeats', '1', '--processes', '1',
                                 '--skip-backward', '--train-size', '64x96', '--same-process'],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert re.search(r'64x96 +\| fwd: ours [\d.]+ \(mmdet [\d.]+, timm [\d.]+\) ratio /mmdet '
                     r'[\d.]+x, /timm [\d.]+x', res.stdout), res.stdout
    res = subprocess.run(tool + ['--repeats', '0'], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and '--repeats must be at least 1, got 0' in res.stderr
