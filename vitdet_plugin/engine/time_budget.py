"""``TimeBudgetHook``: bound an iteration-based training run by wall-clock time.

The configured ``train_cfg.max_iters`` becomes a cap. After ``measure_after`` iterations (which
absorb data-loader start-up and first-call overheads) the hook measures the time per iteration
and shrinks the run's ``max_iters`` so that training ends inside the budget; it re-plans every
``replan_interval`` iterations, so a machine that gets busier or idler mid-run is followed. The
parameter schedulers that run to the end of training (``end >= max_iters``, e.g. the cosine
decay after a warm-up) are re-targeted to the new end, so the learning rate still completes its
schedule; mmengine's cosine scheduler is chainable, so a re-plan continues from the current
value without a jump (schedulers configured to end after ``max_iters`` are first moved to it).
If the budget is exhausted anyway, the current iteration becomes the last
one: the final checkpoint and validation still run as for a normal end of training.

Only schedulers in :data:`SUPPORTED_SCHEDULERS` can run to the end of training (cosine, linear,
poly, multi-step, step, exponential, constant, and their LR / Momentum variants); any other
(OneCycle, CosineRestart, ReduceOnPlateau, custom ones) is refused in ``before_train`` with an
error naming it. Warm-ups that end earlier may be of any type.

Distributed training: rank 0 alone measures and plans; after every iteration its planned end
is broadcast (one int64) and every rank applies it, so all ranks stop at the same iteration
and follow the same learning rates.

Checkpoints record the time used, the planned end and the cap (key ``'time_budget'``): a
resumed run continues with the budget that is left and the planned end its restored schedulers
follow, rather than a fresh budget and the configured cap; resumed with another ``max_iters``,
the schedulers that ran to the saved end are moved to the new one.
"""
import time
from collections import Counter, deque
from typing import Deque, List, Optional, Tuple

import mmengine.dist as mmengine_dist
import torch
from mmengine.hooks import Hook
from mmengine.optim.scheduler.param_scheduler import (INF, ConstantParamScheduler,
                                                      CosineAnnealingParamScheduler,
                                                      ExponentialParamScheduler,
                                                      LinearParamScheduler,
                                                      MultiStepParamScheduler,
                                                      PolyParamScheduler, StepParamScheduler)
from mmengine.registry import HOOKS
from mmengine.runner import IterBasedTrainLoop

SECONDS_PER_MINUTE = 60.0


def now() -> float:
    """The clock the hook measures with (a module function, so tests can simulate one)."""
    return time.perf_counter()

#: checkpoint key of the hook's state
CHECKPOINT_KEY = 'time_budget'


@HOOKS.register_module()
class TimeBudgetHook(Hook):
    """Stop an ``IterBasedTrainLoop`` after ``minutes`` of training, schedule included.

    Args:
        minutes: wall-clock budget of the training loop (validation at the end not included).
        measure_after: iterations excluded from the speed estimate (start-up costs).
        replan_interval: re-estimate the speed and the end every this many iterations.
        speed_window: the speed is measured over the last ``speed_window`` re-plan intervals
            (recent enough to follow a machine that slows down, long enough to average noise).
        log_change: log a re-plan when the planned end moves by more than this fraction.
    """
    # Before ParamSchedulerHook (LOW), LoggerHook (BELOW_NORMAL) and CheckpointHook (VERY_LOW),
    # so they all see the re-planned end in the same iteration.
    priority = 'NORMAL'

    def __init__(self, minutes: float, measure_after: int = 10, replan_interval: int = 20,
                 speed_window: int = 3, log_change: float = 0.05) -> None:
        if not minutes > 0:
            raise ValueError(f'TimeBudgetHook(minutes={minutes!r}): the budget must be > 0 '
                             'minutes')
        if measure_after < 1 or replan_interval < 1 or speed_window < 1:
            raise ValueError(f'TimeBudgetHook(measure_after={measure_after!r}, replan_interval='
                             f'{replan_interval!r}, speed_window={speed_window!r}): all must be '
                             '>= 1')
        self.budget_s = float(minutes) * SECONDS_PER_MINUTE
        self.measure_after = int(measure_after)
        self.replan_interval = int(replan_interval)
        self.log_change = float(log_change)
        self._t0 = 0.0
        self._start_iter = 0
        # (iterations done, time) at the last re-plans; the speed window starts at marks[0]
        self._marks: Deque[Tuple[int, float]] = deque(maxlen=int(speed_window) + 1)
        self._cap = 0
        self._last_logged = 0
        # (seconds used, planned end, cap) of a resumed checkpoint
        self._resumed: Optional[Tuple[float, int, int]] = None

    # ------------------------------------------------------------------ hook API
    def before_train(self, runner) -> None:
        loop = runner.train_loop
        if not isinstance(loop, IterBasedTrainLoop):
            raise TypeError(f'TimeBudgetHook needs train_cfg type IterBasedTrainLoop (got '
                            f'{type(loop).__name__}): set train_cfg=dict(type='
                            "'IterBasedTrainLoop', max_iters=<cap>) with by_epoch=False "
                            'schedulers')
        for scheduler in _iter_schedulers(runner.param_schedulers):  # fail now, not mid-run
            if runs_to_end(scheduler, loop.max_iters):
                check_retargetable(scheduler)
        self._t0 = now()
        self._start_iter = runner.iter
        self._marks.clear()
        self._cap = loop.max_iters
        # continue an interrupted run's budget and plan; mmengine also calls
        # after_load_checkpoint for load_from (fine-tuning), which starts at iteration 0
        resumed, self._resumed = self._resumed, None
        if resumed is not None and runner.iter > 0:
            used, planned, cap = resumed
            self._t0 -= used
            if cap == loop.max_iters and runner.iter <= planned < cap:
                set_loop_max_iters(runner, planned)  # its schedulers were saved re-targeted
            elif planned != loop.max_iters:
                # resumed with another max_iters: the schedulers that ran to the saved end run
                # to the new one (the budget re-plans from there)
                for scheduler in _iter_schedulers(runner.param_schedulers):
                    retarget_scheduler(scheduler, planned, loop.max_iters)
            runner.logger.info(f'TimeBudgetHook: resumed with {used / SECONDS_PER_MINUTE:.1f} '
                               f'of {self.budget_s / SECONDS_PER_MINUTE:g} min used, training '
                               f'ends at iteration {loop.max_iters} (cap {self._cap})')
        self._last_logged = loop.max_iters
        # schedulers configured past the end of training (max_iters lowered by an override)
        # end with it
        for scheduler in _iter_schedulers(runner.param_schedulers):
            if runs_to_end(scheduler, loop.max_iters + 1):
                retarget_scheduler(scheduler, scheduler.end, loop.max_iters)

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        loop = runner.train_loop
        done = runner.iter + 1                      # iterations completed, this one included
        # Rank 0 decides from its own clock and every rank follows its plan: ranks timing
        # themselves would stop at different iterations (the others then block in DDP's
        # all-reduce) or run different learning rates. One int64 broadcast per iteration.
        decided = self._plan(runner, done) if mmengine_dist.get_rank() == 0 else loop.max_iters
        if mmengine_dist.get_world_size() > 1:
            decided = _broadcast_from_rank0(decided)
        if decided != loop.max_iters:
            self._set_max_iters(runner, decided)

    def _plan(self, runner, done: int) -> int:
        """The end of training rank 0 plans after ``done`` iterations (logs its changes)."""
        t = now()
        elapsed = t - self._t0
        planned_now = runner.train_loop.max_iters
        if elapsed >= self.budget_s:
            if done < planned_now:
                runner.logger.info(f'TimeBudgetHook: {self.budget_s / SECONDS_PER_MINUTE:g} min '
                                   f'budget used up, stopping after iteration {done}')
                return done
            return planned_now
        ran = done - self._start_iter
        if ran < self.measure_after or (ran - self.measure_after) % self.replan_interval:
            return planned_now
        self._marks.append((done, t))
        if len(self._marks) < 2:
            return planned_now
        sec_per_iter = (t - self._marks[0][1]) / (done - self._marks[0][0])
        planned = done + int((self.budget_s - elapsed) / sec_per_iter)
        planned = max(done, min(self._cap, planned))
        if planned != planned_now and \
                abs(planned - self._last_logged) > self.log_change * self._last_logged:
            self._last_logged = planned
            runner.logger.info(
                f'TimeBudgetHook: {1.0 / sec_per_iter:.2f} it/s, '
                f'{(self.budget_s - elapsed) / SECONDS_PER_MINUTE:.1f} min left of '
                f'{self.budget_s / SECONDS_PER_MINUTE:g}: training ends at iteration '
                f'{planned} (cap {self._cap})')
        return planned

    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        checkpoint[CHECKPOINT_KEY] = dict(seconds_used=now() - self._t0,
                                          planned_end=int(runner.train_loop.max_iters),
                                          cap=int(self._cap))

    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is not None:
            self._resumed = (float(state['seconds_used']), int(state['planned_end']),
                             int(state['cap']))

    # ------------------------------------------------------------------ helpers
    def _set_max_iters(self, runner, new_end: int) -> None:
        old_end = runner.train_loop.max_iters
        for scheduler in _iter_schedulers(runner.param_schedulers):
            retarget_scheduler(scheduler, old_end, new_end)
        set_loop_max_iters(runner, new_end)


def _broadcast_from_rank0(value: int) -> int:
    """``value`` of rank 0 on every rank (a one-element int64 tensor over the process group's
    device: CPU for gloo, the current GPU for NCCL)."""
    t = torch.tensor([value], dtype=torch.int64)
    mmengine_dist.broadcast(t, src=0)
    return int(t.item())


def set_loop_max_iters(runner, max_iters: int) -> None:
    """Move the end of ``runner.train_loop`` (an ``IterBasedTrainLoop``) to ``max_iters``.

    mmengine 0.10 has no public way to change a running loop's length: ``max_iters`` is a
    read-only property over ``_max_iters``. This is the one place that writes it; the message
    hub's ``max_iters`` (read by the logger's ETA) is updated with it.
    """
    runner.train_loop._max_iters = int(max_iters)
    runner.message_hub.update_info('max_iters', int(max_iters))


def _iter_schedulers(schedulers) -> List:
    if schedulers is None:
        return []
    if isinstance(schedulers, dict):  # one list per optimizer
        return [s for group in schedulers.values() for s in group]
    return list(schedulers)


#: schedulers whose end can be moved (their LR/momentum variants included): the value either
#: follows a formula of the span (cosine, linear, poly: re-targeted so the schedule completes at
#: the new end), milestones scaled with the span (multi-step), or does not depend on the end at
#: all (step, exponential, constant: the same per-iteration decay simply runs longer / shorter)
SUPPORTED_SCHEDULERS = {
    'CosineAnnealingParamScheduler': CosineAnnealingParamScheduler,
    'LinearParamScheduler': LinearParamScheduler,
    'PolyParamScheduler': PolyParamScheduler,
    'MultiStepParamScheduler': MultiStepParamScheduler,
    'StepParamScheduler': StepParamScheduler,
    'ExponentialParamScheduler': ExponentialParamScheduler,
    'ConstantParamScheduler': ConstantParamScheduler,
}


def runs_to_end(scheduler, end: int) -> bool:
    """Whether ``scheduler`` is iteration-based and runs to (or past) ``end``. Schedulers left
    without an end (mmengine's default ``end=INF``) run by absolute steps and are never moved."""
    return not scheduler.by_epoch and end <= scheduler.end < INF


def check_retargetable(scheduler) -> None:
    """Raise ``TypeError`` when :func:`retarget_scheduler` cannot move ``scheduler``'s end."""
    name = type(scheduler).__name__
    if not isinstance(scheduler, tuple(SUPPORTED_SCHEDULERS.values())):
        raise TypeError(
            f'TimeBudgetHook cannot re-target {name} (begin={scheduler.begin}, '
            f'end={scheduler.end}): its length is not (only) its end (e.g. OneCycle\'s '
            f"total_steps, CosineRestart's periods). Schedulers that run to the end of training "
            f'must be one of {sorted(SUPPORTED_SCHEDULERS)} (or their LR / Momentum '
            f'variants); schedulers that end earlier (warm-up) may be of any type')
    if isinstance(scheduler, CosineAnnealingParamScheduler) and \
            scheduler.T_max != scheduler.end - scheduler.begin:
        raise TypeError(f'TimeBudgetHook cannot re-target {name} with T_max={scheduler.T_max} '
                        f'!= end - begin = {scheduler.end - scheduler.begin} (several cosine '
                        'cycles); leave T_max unset so the cosine spans begin..end')


def retarget_scheduler(scheduler, old_end: int, new_end: int) -> bool:
    """Move the end of an iteration-based scheduler that runs to ``old_end`` to ``new_end``.

    Schedulers that end earlier (warm-up), count epochs or begin at or after ``new_end`` (they
    would not run) are left alone (returns False);
    schedulers not in :data:`SUPPORTED_SCHEDULERS` raise ``TypeError`` naming them. Returns
    whether the scheduler was changed. A re-target mid-run continues from the current value and
    still reaches the schedule's final value at ``new_end`` (mmengine's schedulers are
    chainable: each step scales the current value).
    """
    if not runs_to_end(scheduler, old_end) or new_end <= scheduler.begin:
        return False  # ends earlier, counts epochs, or would not start before the new end
    check_retargetable(scheduler)
    span_old = scheduler.end - scheduler.begin
    span_new = new_end - scheduler.begin
    step = max(scheduler.last_step, 0)   # steps taken since begin
    if isinstance(scheduler, CosineAnnealingParamScheduler):
        scheduler.T_max = max(1, span_new)
    elif isinstance(scheduler, LinearParamScheduler):
        _retarget_linear(scheduler, step, span_new - 1)
    elif isinstance(scheduler, (PolyParamScheduler, ConstantParamScheduler)):
        scheduler.total_iters = span_new - 1
    elif isinstance(scheduler, MultiStepParamScheduler) and span_old > 0:
        scaled = [round(m * span_new / span_old) for m in scheduler.milestones.elements()]
        scheduler.milestones = Counter(scaled)
    scheduler.end = new_end
    return True


def _retarget_linear(scheduler, step: int, total_new: int) -> None:
    """Re-target a chainable linear ramp at ``step`` so it ends at ``end_factor`` after
    ``total_new`` steps: mmengine multiplies the current value by
    ``(s + k d / T) / (s + (k - 1) d / T)`` at step ``k`` (``d = end - s``); the product from
    ``step + 1`` to ``T`` is ``end / (s + step d / T)``, so with the current factor ``f``
    the new start ``s' = (f T' - step * end) / (T' - step)`` ends exactly at ``end``."""
    start, end, total = scheduler.start_factor, scheduler.end_factor, scheduler.total_iters
    current = start + min(step, total) * (end - start) / total if total > 0 else end
    if total_new > step:
        scheduler.start_factor = (current * total_new - step * end) / (total_new - step)
    scheduler.total_iters = max(1, total_new)
