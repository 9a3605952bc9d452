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

Checkpoints record the time used, the planned end and the cap (key ``'time_budget'``): a
resumed run continues with the budget that is left and the planned end its restored schedulers
follow, rather than a fresh budget and the configured cap; resumed with another ``max_iters``,
the schedulers that ran to the saved end are moved to the new one.
"""
import time
from collections import Counter, deque
from typing import Deque, Iterable, List, Tuple

from mmengine.hooks import Hook
from mmengine.registry import HOOKS
from mmengine.runner import IterBasedTrainLoop

SECONDS_PER_MINUTE = 60.0
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
        self._resumed = None  # (seconds used, planned end, cap) of a resumed checkpoint

    # ------------------------------------------------------------------ hook API
    def before_train(self, runner) -> None:
        loop = runner.train_loop
        if not isinstance(loop, IterBasedTrainLoop):
            raise TypeError(f'TimeBudgetHook needs train_cfg type IterBasedTrainLoop (got '
                            f'{type(loop).__name__}): set train_cfg=dict(type='
                            "'IterBasedTrainLoop', max_iters=<cap>) with by_epoch=False "
                            'schedulers')
        self._t0 = time.perf_counter()
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
                loop._max_iters = planned  # its schedulers were saved re-targeted to it
                runner.message_hub.update_info('max_iters', planned)
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
            if not scheduler.by_epoch and scheduler.end > loop.max_iters:
                retarget_scheduler(scheduler, scheduler.end, loop.max_iters)

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        now = time.perf_counter()
        done = runner.iter + 1                      # iterations completed, this one included
        elapsed = now - self._t0
        loop = runner.train_loop
        if elapsed >= self.budget_s:
            if done < loop.max_iters:
                self._set_max_iters(runner, done)
                runner.logger.info(f'TimeBudgetHook: {self.budget_s / SECONDS_PER_MINUTE:g} min '
                                   f'budget used up, stopping after iteration {done}')
            return
        ran = done - self._start_iter
        if ran < self.measure_after or (ran - self.measure_after) % self.replan_interval:
            return
        self._marks.append((done, now))
        if len(self._marks) < 2:
            return
        sec_per_iter = (now - self._marks[0][1]) / (done - self._marks[0][0])
        planned = done + int((self.budget_s - elapsed) / sec_per_iter)
        planned = max(done, min(self._cap, planned))
        if planned != loop.max_iters:
            self._set_max_iters(runner, planned)
            if abs(planned - self._last_logged) > self.log_change * self._last_logged:
                self._last_logged = planned
                runner.logger.info(
                    f'TimeBudgetHook: {1.0 / sec_per_iter:.2f} it/s, '
                    f'{(self.budget_s - elapsed) / SECONDS_PER_MINUTE:.1f} min left of '
                    f'{self.budget_s / SECONDS_PER_MINUTE:g}: training ends at iteration '
                    f'{planned} (cap {self._cap})')

    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        checkpoint[CHECKPOINT_KEY] = dict(seconds_used=time.perf_counter() - self._t0,
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
        runner.train_loop._max_iters = new_end
        runner.message_hub.update_info('max_iters', new_end)


def _iter_schedulers(schedulers) -> Iterable:
    if schedulers is None:
        return []
    if isinstance(schedulers, dict):  # one list per optimizer
        return [s for group in schedulers.values() for s in group]
    return list(schedulers)


def retarget_scheduler(scheduler, old_end: int, new_end: int) -> bool:
    """Move the end of an iteration-based scheduler that runs to ``old_end`` to ``new_end``.

    Schedulers that end earlier (warm-up) or count epochs are left alone. Returns whether the
    scheduler was changed.
    """
    if scheduler.by_epoch or scheduler.end < old_end:
        return False
    span_old = scheduler.end - scheduler.begin
    scheduler.end = new_end
    span_new = new_end - scheduler.begin
    if hasattr(scheduler, 'T_max'):                       # cosine
        scheduler.T_max = max(1, span_new)
    if hasattr(scheduler, 'total_iters'):                 # poly, linear
        scheduler.total_iters = max(1, scheduler.total_iters + span_new - span_old)
    milestones = getattr(scheduler, 'milestones', None)  # multi-step (relative to begin)
    if milestones and span_old > 0:
        scaled: List[int] = [round(m * span_new / span_old) for m in milestones.elements()]
        scheduler.milestones = Counter(scaled)
    return True
