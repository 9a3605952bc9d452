"""Training hooks for reliable runs, registered in mmengine's ``HOOKS`` under our own names.

* :class:`RNGStateHook` stores the python / numpy / torch (CPU and CUDA) random states in every
  checkpoint and restores them on resume, so a resumed run draws the same augmentations,
  dropout and drop-path masks as an uninterrupted one. The states are stored as tensors,
  lists and ints only, so checkpoints stay loadable with ``torch.load(weights_only=True)``.
* :class:`NonFiniteCheckHook` watches the backbone (and neck) outputs and the losses during
  training and stops at the first NaN/Inf with a message naming the module, the output and the
  iteration, instead of letting it propagate silently into the weights.

Use them through ``custom_hooks = [dict(type='RNGStateHook'), dict(type='NonFiniteCheckHook')]``.
"""
import logging
import math
import random
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
from mmengine.hooks import Hook
from mmengine.logging import print_log
from mmengine.model import is_model_wrapper
from mmengine.registry import HOOKS
from torch import Tensor, nn

#: checkpoint key holding the RNG states
RNG_STATE_KEY = 'rng_state'
RNG_STATE_VERSION = 1
NONFINITE_ACTIONS = ('raise', 'log')


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


# ----------------------------------------------------------------------------- NaN / Inf
def _tensors(obj: Any, prefix: str = '') -> List[tuple]:
    """``(name, tensor)`` for every floating tensor in nested tuples/lists/dicts."""
    if isinstance(obj, Tensor):
        return [(prefix or 'output', obj)] if obj.is_floating_point() else []
    if isinstance(obj, dict):
        return [t for k, v in obj.items() for t in _tensors(v, f'{prefix}[{k!r}]')]
    if isinstance(obj, (list, tuple)):
        return [t for i, v in enumerate(obj) for t in _tensors(v, f'{prefix}[{i}]')]
    return []


def describe_nonfinite(t: Tensor) -> str:
    nan = int(torch.isnan(t).sum())
    inf = int(torch.isinf(t).sum())
    return f'{nan} NaN and {inf} Inf of {t.numel()} values, shape {tuple(t.shape)}'


class NonFiniteError(FloatingPointError):
    """A NaN or Inf appeared in a watched module output or loss during training."""


@HOOKS.register_module()
class NonFiniteCheckHook(Hook):
    """Detect NaN/Inf in the backbone / neck outputs and the losses during training.

    Args:
        modules: attribute paths of the (unwrapped) model to watch; paths the model lacks are
            skipped (e.g. ``neck`` of a neck-less detector).
        check_loss: also check every loss value after each iteration.
        interval: check every ``interval`` iterations (1: every one; each check synchronises
            with the device).
        action: ``'raise'`` stops training with :class:`NonFiniteError` naming the module,
            output and iteration; ``'log'`` only logs that error and continues.
    """

    priority = 'NORMAL'

    def __init__(self, modules: Sequence[str] = ('backbone', 'neck'), check_loss: bool = True,
                 interval: int = 1, action: str = 'raise') -> None:
        if action not in NONFINITE_ACTIONS:
            raise ValueError(f'NonFiniteCheckHook: action={action!r} is not supported; '
                             f'choose one of {NONFINITE_ACTIONS}')
        if not isinstance(interval, int) or interval < 1:
            raise ValueError(f'NonFiniteCheckHook: interval={interval!r} must be an int >= 1')
        if isinstance(modules, str):
            modules = (modules,)
        self.modules = tuple(modules)
        self.check_loss = check_loss
        self.interval = interval
        self.action = action
        self._handles: list = []
        self._active = False
        self._iter = 0
        self._reported = False

    # hooks on the model -------------------------------------------------------------
    def before_train(self, runner) -> None:
        model = runner.model.module if is_model_wrapper(runner.model) else runner.model
        for path in self.modules:
            module = model
            for part in path.split('.'):
                module = getattr(module, part, None)
                if module is None:
                    break
            if isinstance(module, nn.Module):
                self._handles.append(module.register_forward_hook(self._make_check(path)))

    def after_train(self, runner) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def before_train_iter(self, runner, batch_idx: int, data_batch: Any = None) -> None:
        self._iter = runner.iter
        self._active = runner.iter % self.interval == 0
        self._reported = False

    def after_train_iter(self, runner, batch_idx: int, data_batch: Any = None,
                         outputs: Optional[dict] = None) -> None:
        active, self._active = self._active, False
        if not (active and self.check_loss and outputs):
            return
        bad = []
        for name, value in outputs.items():
            v = value.detach().float() if isinstance(value, Tensor) else value
            finite = (bool(torch.isfinite(v).all()) if isinstance(v, Tensor)
                      else not isinstance(v, float) or math.isfinite(v))
            if not finite:
                bad.append(f'{name}={v.tolist() if isinstance(v, Tensor) else v}')
        if bad:  # the terms first, the total ('loss') last
            bad.sort(key=lambda item: item.startswith('loss='))
            self._report(f'non-finite losses {", ".join(bad)}')

    def _make_check(self, path: str):
        def check(module: nn.Module, args: Any, output: Any) -> None:
            if not self._active or self._reported:
                return
            for name, t in _tensors(output):
                if not bool(torch.isfinite(t.detach()).all()):
                    self._report(f'model.{path} ({type(module).__name__}) output {name} has '
                                 f'{describe_nonfinite(t)}')
                    return
        return check

    def _report(self, what: str) -> None:
        self._reported = True
        msg = (f'non-finite values during training at iteration {self._iter + 1}: {what}. '
               'Common causes: a learning rate too high for the batch size (lower optim_wrapper'
               '.optimizer.lr or add optim_wrapper.clip_grad=dict(max_norm=...)), fp16 '
               'overflow (use bf16 or AmpOptimWrapper with a dynamic loss_scale), or '
               'corrupt input data.')
        if self.action == 'raise':
            raise NonFiniteError(msg)
        print_log(msg, logger='current', level=logging.ERROR)
