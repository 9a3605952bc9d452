"""TimeBudgetHook: the schedule fitted to a wall-clock budget, resume, and which parameter
schedulers can be re-targeted (a named list; anything else is refused by name)."""
from types import SimpleNamespace

import pytest
import torch
from mmengine.optim.scheduler import CosineRestartLR, OneCycleLR

import vitdet_plugin  # noqa: F401
from vitdet_plugin.engine import time_budget
from vitdet_plugin.engine.time_budget import TimeBudgetHook, retarget_scheduler


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
    monkeypatch.setattr(time_budget, 'now', lambda: clock[0])
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


def test_time_budget_resume_continues_the_budget_and_the_planned_end(monkeypatch):
    """An interrupted budgeted run resumed from its checkpoint: the time already used and the
    planned end (the restored schedulers end there) carry over, the cap stays the config's."""
    clock = [0.0]
    monkeypatch.setattr(time_budget, 'now', lambda: clock[0])
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


# ----------------------------------------------------------------------------- retargeting
BASE_LR, SPAN, RETARGET_AT, NEW_END = 1.0, 100, 40, 60
END_FACTOR, ETA_MIN = 0.1, 0.05


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=BASE_LR)


#: mmengine's cosine reaches eta_min at step T_max = end - begin, one step after the last one
#: taken, so its last value lies just above eta_min (a cosine planned for NEW_END from the
#: start ends 0.0014 of the range above it); chainable linear and poly end exactly
COSINE_END_TOL = 0.01 * (BASE_LR - ETA_MIN)


def _decays():
    """Schedulers running 0..SPAN, their final lr from their definitions and its tolerance."""
    from mmengine.optim import CosineAnnealingLR, LinearLR, PolyLR
    return {
        'linear': (lambda o: LinearLR(o, start_factor=1.0, end_factor=END_FACTOR,
                                      by_epoch=False, begin=0, end=SPAN),
                   BASE_LR * END_FACTOR, 1e-12),
        'poly': (lambda o: PolyLR(o, eta_min=ETA_MIN, power=1.0, by_epoch=False, begin=0,
                                  end=SPAN), ETA_MIN, 1e-12),
        'cosine': (lambda o: CosineAnnealingLR(o, eta_min=ETA_MIN, by_epoch=False, begin=0,
                                               end=SPAN), ETA_MIN, COSINE_END_TOL),
    }


@pytest.mark.parametrize('kind', ['linear', 'poly', 'cosine'])
def test_retarget_mid_run_completes_the_schedule_at_the_new_end(kind):
    """Shortened from SPAN to NEW_END after RETARGET_AT steps, the schedule continues from its
    current value (no jump) and reaches its final value exactly at the new end."""
    build, final, tol = _decays()[kind]
    opt = _optimizer()
    sched = build(opt)
    lrs = [opt.param_groups[0]['lr']]
    for _ in range(RETARGET_AT):
        sched.step()
        lrs.append(opt.param_groups[0]['lr'])
    before = lrs[-1]
    assert retarget_scheduler(sched, SPAN, NEW_END) and sched.end == NEW_END
    assert opt.param_groups[0]['lr'] == before
    for _ in range(NEW_END - 1 - RETARGET_AT):  # the last step taken is at NEW_END - 1
        sched.step()
        lrs.append(opt.param_groups[0]['lr'])
    assert opt.param_groups[0]['lr'] == pytest.approx(final, abs=tol)
    steps = [a - b for a, b in zip(lrs, lrs[1:])]
    assert all(s >= -1e-12 for s in steps), 'the decay must stay monotonic'


def test_retarget_scales_milestones_and_leaves_warmups_and_epoch_schedulers():
    from mmengine.optim import LinearLR, MultiStepLR

    opt = _optimizer()
    warm = LinearLR(opt, by_epoch=False, begin=0, end=10)
    steps = MultiStepLR(opt, by_epoch=False, begin=0, end=1000, milestones=[500, 800])
    epochs = MultiStepLR(opt, by_epoch=True, begin=0, end=1000, milestones=[500])
    assert not retarget_scheduler(warm, 1000, 200) and warm.end == 10
    assert not retarget_scheduler(epochs, 1000, 200) and epochs.end == 1000
    assert retarget_scheduler(steps, 1000, 200)
    assert sorted(steps.milestones) == [100, 160] and steps.end == 200


def test_scheduler_without_an_end_keeps_its_absolute_milestones(monkeypatch):
    """MultiStepLR(milestones=[30]) with mmengine's default end=INF counts absolute steps: a
    budget that shortens training must not scale its milestones (to 30 * 60 / 1e9 = 0)."""
    from mmengine.optim import MultiStepLR

    runner = _FakeRunner(max_iters=100)
    runner.optimizer = opt = _optimizer()  # the fake runner's warm-up already scaled its lr
    runner.param_schedulers = [MultiStepLR(opt, by_epoch=False, milestones=[30], gamma=0.1)]
    _, lrs = _simulate(monkeypatch, runner, TimeBudgetHook(minutes=1.0, measure_after=5,
                                                           replan_interval=10), lambda i: 1.0)
    assert runner.train_loop.max_iters == 60
    assert sorted(runner.param_schedulers[0].milestones) == [30]
    assert lrs[28] == BASE_LR and lrs[29] == pytest.approx(0.1 * BASE_LR)


@pytest.mark.parametrize('name, build', [
    ('OneCycleLR', lambda o: OneCycleLR(o, eta_max=1.0, total_steps=100, by_epoch=False,
                                        begin=0, end=100)),
    ('CosineRestartLR', lambda o: CosineRestartLR(o, periods=[50, 50],
                                                  restart_weights=[1.0, 0.5], eta_min=0.0,
                                                  by_epoch=False, begin=0, end=100)),
])
def test_unsupported_scheduler_running_to_the_end_is_refused_by_name(name, build):
    runner = _FakeRunner(max_iters=100)
    runner.param_schedulers = [runner.param_schedulers[0], build(runner.optimizer)]
    supported = ("['ConstantParamScheduler', 'CosineAnnealingParamScheduler', "
                 "'ExponentialParamScheduler', 'LinearParamScheduler', 'MultiStepParamScheduler', "
                 "'PolyParamScheduler', 'StepParamScheduler']")
    msg = (f'TimeBudgetHook cannot re-target {name} (begin=0, end=100): its length is not '
           "(only) its end (e.g. OneCycle's total_steps, CosineRestart's periods). Schedulers "
           f'that run to the end of training must be one of {supported} (or their LR / '
           'Momentum variants); schedulers that end earlier (warm-up) may be of any type')
    with pytest.raises(TypeError) as info:
        TimeBudgetHook(minutes=1.0).before_train(runner)
    assert str(info.value) == msg
    with pytest.raises(TypeError, match=name):
        retarget_scheduler(runner.param_schedulers[1], 100, 60)


def test_unsupported_scheduler_as_warmup_is_accepted():
    from mmengine.optim import OneCycleLR

    runner = _FakeRunner(max_iters=100)
    runner.param_schedulers[0] = OneCycleLR(runner.optimizer, eta_max=1.0, total_steps=10,
                                            by_epoch=False, begin=0, end=10)
    TimeBudgetHook(minutes=1.0).before_train(runner)  # ends before training does: never moved
    assert not retarget_scheduler(runner.param_schedulers[0], 100, 60)


def test_cosine_with_several_cycles_is_refused():
    from mmengine.optim import CosineAnnealingLR

    sched = CosineAnnealingLR(_optimizer(), T_max=25, by_epoch=False, begin=0, end=100)
    with pytest.raises(TypeError, match=r'TimeBudgetHook cannot re-target CosineAnnealingLR '
                                        r'with T_max=25 != end - begin = 100 \(several cosine '
                                        r'cycles\); leave T_max unset'):
        retarget_scheduler(sched, 100, 60)


def test_scheduler_beginning_after_the_new_end_is_left_alone():
    """A cap below the warm-up (e.g. max_iters=2 for a smoke run) leaves the cosine that would
    begin later untouched, so the checkpoint resumes with a larger max_iters."""
    from mmengine.optim import CosineAnnealingLR

    sched = CosineAnnealingLR(_optimizer(), by_epoch=False, begin=50, end=1000, eta_min=0.0)
    assert not retarget_scheduler(sched, 1000, 2)
    assert (sched.begin, sched.end, sched.T_max) == (50, 1000, 950)
    assert retarget_scheduler(sched, 1000, 400) and (sched.end, sched.T_max) == (400, 350)
