"""tools/: train/test/resume round trip, analysis tools, missing-data errors, TimeBudgetHook."""
import importlib.util
import json
import re
import os
import os.path as osp
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import vitdet_plugin  # noqa: F401
from vitdet_plugin.engine import time_budget
from vitdet_plugin.engine.time_budget import TimeBudgetHook, retarget_scheduler

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
DEMO = osp.join(ROOT, 'configs/demo/swin_retinanet_shapes.py')


def _tool(name: str):
    path = osp.join(ROOT, 'tools', f'{name}.py')
    spec = importlib.util.spec_from_file_location(f'vitdet_tool_{osp.basename(name)}', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- TimeBudgetHook
class _FakeRunner:
    """What TimeBudgetHook touches: a real IterBasedTrainLoop state and real schedulers."""

    def __init__(self, max_iters: int, warmup: int = 10, lr: float = 1.0):
        from mmengine.logging import MessageHub, MMLogger
        from mmengine.optim import CosineAnnealingLR, LinearLR
        from mmengine.runner import IterBasedTrainLoop

        self.param = torch.nn.Parameter(torch.zeros(1))
        self.optimizer = torch.optim.SGD([self.param], lr=lr)
        self.param_schedulers = [
            LinearLR(self.optimizer, start_factor=0.1, by_epoch=False, begin=0, end=warmup),
            CosineAnnealingLR(self.optimizer, by_epoch=False, begin=warmup, end=max_iters,
                              T_max=max_iters - warmup, eta_min=0.0)]
        loop = IterBasedTrainLoop.__new__(IterBasedTrainLoop)
        loop._max_iters, loop._iter = max_iters, 0
        self.train_loop = loop
        self.logger = MMLogger.get_instance('test_time_budget')
        self.message_hub = MessageHub.get_instance('test_time_budget')

    @property
    def iter(self):
        return self.train_loop._iter

    @property
    def lr(self):
        return self.optimizer.param_groups[0]['lr']


def _simulate(monkeypatch, runner, hook, seconds_per_iter):
    clock = [0.0]
    monkeypatch.setattr(time_budget.time, 'perf_counter', lambda: clock[0])
    hook.before_train(runner)
    lrs = []
    while runner.train_loop._iter < runner.train_loop.max_iters:
        clock[0] += seconds_per_iter(runner.iter)
        hook.after_train_iter(runner, runner.iter)
        for s in runner.param_schedulers:  # ParamSchedulerHook runs after (priority LOW)
            s.step()
        lrs.append(runner.lr)
        runner.train_loop._iter += 1
    return clock[0], lrs


def test_time_budget_fits_schedule_to_budget(monkeypatch):
    runner = _FakeRunner(max_iters=100000)
    hook = TimeBudgetHook(minutes=1.0, measure_after=5, replan_interval=10)
    elapsed, lrs = _simulate(monkeypatch, runner, hook, lambda i: 0.5)
    assert runner.train_loop.max_iters == 120  # 60 s / 0.5 s per iteration
    assert elapsed == pytest.approx(60.0)
    cosine = runner.param_schedulers[1]
    assert cosine.end == 120 and cosine.T_max == 110
    assert max(lrs) == pytest.approx(1.0, rel=0.02)  # the warm-up reached the peak
    assert lrs[-1] < 1e-3  # and the cosine decayed to its end within the budget


def test_time_budget_follows_slowdown_and_stops(monkeypatch):
    runner = _FakeRunner(max_iters=100000)
    hook = TimeBudgetHook(minutes=1.0, measure_after=5, replan_interval=10)
    elapsed, lrs = _simulate(monkeypatch, runner, hook, lambda i: 0.25 if i < 60 else 1.0)
    assert elapsed <= 60.0 + 1.0
    assert 60 < runner.train_loop.max_iters < 240
    assert lrs[-1] < 0.05


def test_time_budget_keeps_cap(monkeypatch):
    runner = _FakeRunner(max_iters=50)
    elapsed, _ = _simulate(monkeypatch, runner, TimeBudgetHook(minutes=1.0), lambda i: 0.1)
    assert runner.train_loop.max_iters == 50 and elapsed == pytest.approx(5.0)


def test_time_budget_moves_schedules_past_a_lowered_cap(monkeypatch):
    runner = _FakeRunner(max_iters=100000)
    runner.train_loop._max_iters = 40  # e.g. --cfg-options train_cfg.max_iters=40
    elapsed, lrs = _simulate(monkeypatch, runner, TimeBudgetHook(minutes=10.0), lambda i: 0.1)
    assert runner.param_schedulers[1].end == 40 and len(lrs) == 40
    assert lrs[-1] < 0.01


def test_time_budget_bad_arguments():
    with pytest.raises(ValueError, match=r'minutes=0.*> 0'):
        TimeBudgetHook(minutes=0)
    runner = SimpleNamespace(train_loop=object())
    with pytest.raises(TypeError, match='IterBasedTrainLoop'):
        TimeBudgetHook(minutes=1).before_train(runner)


def test_retarget_leaves_warmup_and_epoch_schedulers():
    from mmengine.optim import LinearLR, MultiStepLR

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    warm = LinearLR(opt, by_epoch=False, begin=0, end=10)
    steps = MultiStepLR(opt, by_epoch=False, begin=0, end=1000, milestones=[500, 800])
    assert not retarget_scheduler(warm, 1000, 200)
    assert retarget_scheduler(steps, 1000, 200)
    assert sorted(steps.milestones) == [100, 160] and steps.end == 200


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


def test_time_budget_resume_continues_the_budget_and_the_planned_end(monkeypatch):
    """An interrupted budgeted run resumed from its checkpoint: the time already used and the
    planned end (the restored schedulers end there) carry over, the cap stays the config's."""
    clock = [0.0]
    monkeypatch.setattr(time_budget.time, 'perf_counter', lambda: clock[0])
    first = _FakeRunner(max_iters=100000)
    hook = TimeBudgetHook(minutes=1.0, measure_after=5, replan_interval=10)
    hook.before_train(first)
    while first.iter < 60:                          # 30 s at 0.5 s/it, then "killed"
        clock[0] += 0.5
        hook.after_train_iter(first, first.iter)
        for s in first.param_schedulers:
            s.step()
        first.train_loop._iter += 1
    assert first.train_loop.max_iters == 120
    ckpt = {'meta': {'iter': 60}}
    hook.before_save_checkpoint(first, ckpt)
    sched_state = [s.state_dict() for s in first.param_schedulers]

    second = _FakeRunner(max_iters=100000)
    for s, state in zip(second.param_schedulers, sched_state):
        s.load_state_dict(state)
    second.train_loop._iter = 60
    hook2 = TimeBudgetHook(minutes=1.0, measure_after=5, replan_interval=10)
    hook2.after_load_checkpoint(second, ckpt)
    elapsed, lrs = _simulate(monkeypatch, second, hook2, lambda i: 0.5)  # a new clock
    assert second.train_loop.max_iters == 120
    assert elapsed == pytest.approx(30.0)  # the 30 s left, not a new minute
    assert second.param_schedulers[1].end == 120 and lrs[-1] < 1e-3


def test_time_budget_state_is_ignored_by_load_from(monkeypatch):
    """load_from (fine-tuning) also calls after_load_checkpoint but starts at iteration 0."""
    runner = _FakeRunner(max_iters=50)
    hook = TimeBudgetHook(minutes=1.0)
    hook.after_load_checkpoint(runner, {'time_budget': dict(seconds_used=59.0, planned_end=20,
                                                            cap=50)})
    elapsed, _ = _simulate(monkeypatch, runner, hook, lambda i: 0.1)
    assert runner.train_loop.max_iters == 50 and elapsed == pytest.approx(5.0)


def test_time_budget_resume_with_a_larger_max_iters_moves_the_schedules(monkeypatch):
    """Trained to its cap of 40, resumed with max_iters=80: the schedulers that ended at 40
    run to 80 (the learning rate would otherwise stay frozen), with the budget left."""
    runner = _FakeRunner(max_iters=100000)
    runner.train_loop._max_iters = 40
    hook = TimeBudgetHook(minutes=10.0)
    _simulate(monkeypatch, runner, hook, lambda i: 0.1)
    ckpt = {}
    hook.before_save_checkpoint(runner, ckpt)
    assert ckpt['time_budget']['planned_end'] == 40 and ckpt['time_budget']['cap'] == 40
    states = [s.state_dict() for s in runner.param_schedulers]

    resumed = _FakeRunner(max_iters=100000)
    resumed.train_loop._max_iters, resumed.train_loop._iter = 80, 40
    for s, state in zip(resumed.param_schedulers, states):
        s.load_state_dict(state)
    hook2 = TimeBudgetHook(minutes=10.0)
    hook2.after_load_checkpoint(resumed, ckpt)
    _, lrs = _simulate(monkeypatch, resumed, hook2, lambda i: 0.1)
    assert resumed.train_loop.max_iters == 80 and len(lrs) == 40
    assert resumed.param_schedulers[1].end == 80 and lrs[0] > lrs[-1]
