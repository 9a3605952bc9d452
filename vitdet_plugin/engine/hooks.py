"""Training hooks for reliable runs, registered in mmengine's ``HOOKS`` under our own names.

* :class:`RNGStateHook` stores the python / numpy / torch (CPU and CUDA) random states in every
  checkpoint and restores them on resume, so a resumed run draws the same augmentations,
  dropout and drop-path masks as an uninterrupted one. The states are stored as tensors,
  lists and ints only, so checkpoints stay loadable with ``torch.load(weights_only=True)``.
* :class:`NonFiniteCheckHook` (defined in :mod:`.nonfinite`, re-exported here) guards the
  optimizer step against NaN/Inf losses, gradients and backbone / neck outputs.
* :class:`StepExpMomentumEMA`: mmdet's ``ExpMomentumEMA`` averaged once per optimizer step
  when gradients are accumulated (an ``EMAHook`` ``ema_type``; RF-DETR's EMA).

Use them through ``custom_hooks = [dict(type='RNGStateHook'), dict(type='NonFiniteCheckHook')]``.
"""
import logging
import random
from typing import Any, Dict, Optional

import numpy as np
import torch
from mmdet.models.layers import ExpMomentumEMA
from mmdet.registry import MODELS
from mmengine.hooks import Hook
from mmengine.logging import print_log
from mmengine.registry import HOOKS

from .nonfinite import NONFINITE_ACTIONS, NonFiniteCheckHook, NonFiniteError  # noqa: F401

#: checkpoint key holding the RNG states
RNG_STATE_KEY = 'rng_state'
RNG_STATE_VERSION = 1


# ----------------------------------------------------------------------------- RNG states
def get_rng_state() -> Dict[str, Any]:
    """The global random states as weights_only-loadable objects (tensors, lists, ints)."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    state: Dict[str, Any] = dict(
        version=RNG_STATE_VERSION,
        python=dict(version=py_version, internal=list(py_internal), gauss_next=py_gauss),
        numpy=dict(kind=str(kind), keys=torch.from_numpy(np.asarray(keys, np.int64)),
                   pos=int(pos), has_gauss=int(has_gauss),
                   cached_gaussian=float(cached_gaussian)),
        torch=torch.get_rng_state(),
    )
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state['cuda'] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore states saved by :func:`get_rng_state`."""
    if state.get('version') != RNG_STATE_VERSION:
        raise ValueError(f"RNG state version {state.get('version')!r} is not supported "
                         f'(expected {RNG_STATE_VERSION})')
    py = state['python']
    random.setstate((py['version'], tuple(py['internal']), py['gauss_next']))
    npy = state['numpy']
    np.random.set_state((npy['kind'], npy['keys'].numpy().astype(np.uint32), npy['pos'],
                         npy['has_gauss'], npy['cached_gaussian']))
    torch.set_rng_state(state['torch'])
    cuda = state.get('cuda')
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            print_log(f'checkpoint holds CUDA RNG states of {len(cuda)} devices, this run has '
                      f'{torch.cuda.device_count()}; CUDA random states are not restored',
                      logger='current', level=logging.WARNING)


class _RestoreAfterSkip:
    """Wraps a loop's dataloader iterator: restores RNG states just before batch ``skip + 1``.

    ``IterBasedTrainLoop`` resumes by drawing and discarding the ``skip`` batches already
    trained on; that runs the data pipeline and advances the random states. Restoring after the
    skip makes the next batch (and the forward) draw exactly what the uninterrupted run drew.
    """

    def __init__(self, iterator: Any, skip: int, state: Dict[str, Any]) -> None:
        self._iterator = iterator
        self._skip = skip
        self._state: Optional[Dict[str, Any]] = state

    def __iter__(self) -> '_RestoreAfterSkip':
        return self

    def __next__(self) -> Any:
        if self._state is not None:
            if self._skip <= 0:
                set_rng_state(self._state)
                self._state = None
            self._skip -= 1
        return next(self._iterator)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._iterator, name)


@MODELS.register_module()
class StepExpMomentumEMA(ExpMomentumEMA):
    """``ExpMomentumEMA`` counted in optimizer steps, for gradients accumulated over
    ``interval`` iterations.

    With ``EMAHook(ema_type='StepExpMomentumEMA', interval=k, begin_iter=k, ...)`` and
    ``optim_wrapper.accumulative_counts=k``, the averaged model copies the weights after the
    first optimizer step and then averages right after every later one (iterations ``k - 1``,
    ``2k - 1``, ...); the model's weight after optimizer step ``t`` (from 1) is ``momentum +
    (1 - momentum) * exp(-t / gamma)``: RF-DETR's EMA (``RFDETREMACallback``: ``ema_decay = 1 -
    momentum``, ``ema_tau = gamma``). mmdet's class counts iterations instead, so with ``k > 1``
    it would average half-accumulated steps' weights on another warm-up curve. ``k = 1``: the
    same as ``ExpMomentumEMA``.
    """

    def avg_func(self, averaged_param: torch.Tensor, source_param: torch.Tensor,
                 steps: int) -> None:
        # ``steps`` counts the hook's calls from the first optimizer step, one per iteration
        super().avg_func(averaged_param, source_param, steps // self.interval)


@HOOKS.register_module()
class RNGStateHook(Hook):
    """Save the RNG states in checkpoints and restore them on resume (exact resume).

    Epoch-based loops get the states back before the next epoch starts; iteration-based loops
    right after mmengine has skipped the batches already trained on. In distributed runs the
    checkpoint (written by rank 0) holds rank 0's states, which every rank restores (with the
    default ``diff_rank_seed=False`` all ranks share them anyway); with ``diff_rank_seed=True``
    only rank 0 restores them.
    """

    priority = 'VERY_LOW'

    def __init__(self) -> None:
        self._pending: Optional[Dict[str, Any]] = None

    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        checkpoint[RNG_STATE_KEY] = get_rng_state()

    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        state = checkpoint.get(RNG_STATE_KEY)
        if state is None:
            print_log('the checkpoint has no RNG states (saved without RNGStateHook); the '
                      'resumed run will not draw the same random numbers', logger='current',
                      level=logging.WARNING)
            return
        self._pending = state

    def before_train_epoch(self, runner) -> None:
        if self._pending is None:
            return
        state, self._pending = self._pending, None
        randomness = runner.cfg.get('randomness') or {}
        if runner.world_size > 1 and randomness.get('diff_rank_seed') and runner.rank != 0:
            print_log('randomness.diff_rank_seed=True: the checkpoint holds rank 0\'s RNG '
                      'states only, so this rank keeps its own seeded states',
                      logger='current', level=logging.WARNING)
            return
        loop = runner.train_loop
        skip = getattr(loop, 'iter', 0)
        if hasattr(loop, 'dataloader_iterator') and skip > 0:
            loop.dataloader_iterator = _RestoreAfterSkip(loop.dataloader_iterator, skip, state)
        else:
            set_rng_state(state)
