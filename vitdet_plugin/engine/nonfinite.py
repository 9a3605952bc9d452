"""NaN / Inf guard for training: :class:`NonFiniteCheckHook` (registered in mmengine's ``HOOKS``).

The check runs *before* the optimizer step, so a non-finite loss, gradient or watched module
output never reaches the weights or the optimizer state:

* forward hooks on the watched modules (default ``backbone`` and ``neck``) and on the model
  itself (its loss dict) record, without synchronising, how many NaN / Inf each output holds;
* a ``register_step_pre_hook`` on every optimizer of ``runner.optim_wrapper`` gathers those
  counts and the infinity norm of all gradients (``torch.nn.utils.get_total_norm``, one fused
  multi-tensor pass) into one small tensor and reads it with **one** host-device sync per step;
* on a non-finite value, ``action='raise'`` raises :class:`NonFiniteError` (the step is not
  taken), ``action='log'`` logs the error and, when the gradients are non-finite, skips the
  step: every gradient is set to ``None``, which torch's optimizers treat as "no update" (no
  weight decay, no moment update), the way ``AmpOptimWrapper``'s loss scaler skips a step with
  overflowed gradients. The skip depends on the gradients only, which DDP has all-reduced, so
  all ranks skip the same steps and their weights stay identical.

The guard works with every optimizer wrapper (``OptimWrapper``, ``AmpOptimWrapper``, layer
decay, gradient accumulation: values recorded in accumulated iterations are checked at the step
that uses them). Under fp16 ``AmpOptimWrapper``, steps the loss scaler skips never reach the
guard, so dynamic loss scaling keeps working unchanged.
"""
import logging
import math
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

import torch
from mmengine.hooks import Hook
from mmengine.logging import print_log
from mmengine.model import is_model_wrapper
from mmengine.registry import HOOKS
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

NONFINITE_ACTIONS = ('raise', 'log')
#: what the model's own forward output (its loss dict) is called in the records
MODEL_OUTPUT = 'losses'
#: how many parameter names a gradient report lists
NAMES_SHOWN = 5


class NonFiniteError(FloatingPointError):
    """A NaN or Inf appeared in a watched module output, a loss or a gradient in training."""


def _tensors(obj: Any, prefix: str = '') -> List[Tuple[str, Tensor]]:
    """``(name, tensor)`` for every floating tensor in nested tuples/lists/dicts."""
    if isinstance(obj, Tensor):
        return [(prefix or 'output', obj)] if obj.is_floating_point() else []
    if isinstance(obj, dict):
        return [t for k, v in obj.items() for t in _tensors(v, f'{prefix}[{k!r}]')]
    if isinstance(obj, (list, tuple)):
        return [t for i, v in enumerate(obj) for t in _tensors(v, f'{prefix}[{i}]')]
    return []


def nonfinite_counts(t: Tensor) -> Tensor:
    """``[number of NaN, number of Inf]`` of ``t`` as a device tensor (no sync)."""
    t = t.detach()
    return torch.stack([torch.isnan(t).sum(), torch.isinf(t).sum()])


def _unwrap(model: nn.Module) -> nn.Module:
    inner = model.module if is_model_wrapper(model) else model
    assert isinstance(inner, nn.Module)
    return inner


def _optimizers(optim_wrapper: Any) -> List[torch.optim.Optimizer]:
    """The torch optimizers of an ``OptimWrapper`` or an ``OptimWrapperDict``."""
    if optim_wrapper is None:
        return []
    if hasattr(optim_wrapper, 'optim_wrappers'):  # OptimWrapperDict
        return [w.optimizer for w in optim_wrapper.optim_wrappers.values()]
    return [optim_wrapper.optimizer]


def _max_abs(tensors: List[Tensor]) -> Tensor:
    """The largest ``|value|`` of all ``tensors`` (NaN if any is NaN) in one fused pass. For
    FSDP2's DTensor shards: of this rank's shards, summed over the ranks (non-finite if any
    rank's is), so every rank takes the same decision."""
    sharded = [t for t in tensors if isinstance(t, DTensor)]
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    local = [t for t in local if t.numel()]  # a rank's shard of a tiny parameter can be empty
    get_total_norm = getattr(torch.nn.utils, 'get_total_norm', None)  # torch >= 2.6
    if not local:
        total = torch.zeros(())
    elif get_total_norm is not None:
        total = get_total_norm(local, norm_type=math.inf)
    else:
        total = torch.stack([torch.linalg.vector_norm(t, math.inf) for t in local]).max()
    if sharded:
        torch.distributed.all_reduce(total, group=sharded[0].device_mesh.get_group())
    return total


class _Record:
    """What one watched output held: where, when, its shape and its NaN/Inf counts."""

    def __init__(self, where: str, iteration: int, shape: Tuple[int, ...], numel: int,
                 counts: Tensor, losses: Optional[dict] = None) -> None:
        self.where, self.iteration, self.shape, self.numel = where, iteration, shape, numel
        self.counts = counts
        self.losses = losses  # detached loss dict (model output only), for the message


@HOOKS.register_module()
class NonFiniteCheckHook(Hook):
    """Stop (or skip) the optimizer step when a loss, gradient or watched output is NaN/Inf.

    Args:
        modules: attribute paths of the (unwrapped) model whose outputs are watched; paths the
            model lacks are skipped (e.g. ``neck`` of a neck-less detector). Reports name the
            first non-finite output, so the module where a NaN appears is found at once.
        check_loss: also watch the losses (the model's loss dict).
        interval: check every ``interval`` iterations. With the default 1 every step is guarded
            (one host-device sync per step); a larger interval only *detects* problems: NaN
            gradients of an unchecked step reach the weights.
        action: ``'raise'`` stops training with :class:`NonFiniteError` naming the module /
            loss / gradient and the iteration, before the step; ``'log'`` logs that message
            and skips the step (the weights and optimizer state stay as they were).
    """

    priority = 'NORMAL'

    def __init__(self, modules: Sequence[str] = ('backbone', 'neck'), check_loss: bool = True,
                 interval: int = 1, action: str = 'raise') -> None:
        if action not in NONFINITE_ACTIONS:
            raise ValueError(f'NonFiniteCheckHook: action={action!r} is not supported; '
                             f'choose one of {NONFINITE_ACTIONS}')
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ValueError(f'NonFiniteCheckHook: interval={interval!r} must be an int >= 1')
        if isinstance(modules, str):
            modules = (modules,)
        self.modules = tuple(modules)
        self.check_loss = check_loss
        self.interval = interval
        self.action = action
        self.skipped_steps = 0
        self._handles: list = []
        self._records: List[_Record] = []
        self._active = False
        self._iter = 0
        self._param_names: dict = {}

    # ------------------------------------------------------------------ installation
    def before_train(self, runner) -> None:
        model = _unwrap(runner.model)
        for path in self.modules:
            module: Any = model
            for part in path.split('.'):
                module = getattr(module, part, None)
                if module is None:
                    break
            if isinstance(module, nn.Module):
                self._handles.append(module.register_forward_hook(self._recorder(
                    f'model.{path} ({type(module).__name__})')))
        if self.check_loss:
            self._handles.append(model.register_forward_hook(self._recorder(MODEL_OUTPUT)))
        self._param_names = {id(p): n for n, p in model.named_parameters()}
        for optimizer in _optimizers(getattr(runner, 'optim_wrapper', None)):
            self._handles.append(optimizer.register_step_pre_hook(self._guard))

    def after_train(self, runner) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._records.clear()

    def before_train_iter(self, runner, batch_idx: int, data_batch: Any = None) -> None:
        self._iter = runner.iter
        self._active = runner.iter % self.interval == 0

    def after_train_iter(self, runner, batch_idx: int, data_batch: Any = None,
                         outputs: Optional[dict] = None) -> None:
        self._active = False

    # ------------------------------------------------------------------ recording (no sync)
    def _recorder(self, where: str) -> Callable:
        def record(module: nn.Module, args: Any, output: Any) -> None:
            if not (self._active and module.training):
                return
            if where == MODEL_OUTPUT:
                if not isinstance(output, dict):  # predict / tensor mode: no losses
                    return
                tensors = [(name, t) for name, t in _tensors(output) if 'loss' in name]
                losses = {k: v for k, v in output.items() if 'loss' in k}
                losses = {k: ([t.detach() for t in v] if isinstance(v, (list, tuple))
                              else v.detach() if isinstance(v, Tensor) else v)
                          for k, v in losses.items()}
                if tensors:
                    counts = torch.stack([nonfinite_counts(t) for _, t in tensors]).sum(0)
                    self._records.append(_Record(where, self._iter, (), 0, counts, losses))
                return
            for name, t in _tensors(output):
                self._records.append(_Record(f'{where} output {name}', self._iter,
                                             tuple(t.shape), t.numel(), nonfinite_counts(t)))
        return record

    # ------------------------------------------------------------------ the guard (one sync)
    @torch.compiler.disable  # host-side decision: eager even inside a compiled train_step
    def _guard(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        records, self._records = self._records, []
        if not (records or self._active):
            return
        grads = [p.grad for g in optimizer.param_groups for p in g['params']
                 if p.grad is not None]
        parts = [r.counts.reshape(-1).float() for r in records]
        if grads and self._active:
            total = _max_abs(grads)
            parts.append(total.reshape(1).float().to(parts[0].device if parts else total.device))
        if not parts:
            return
        values = torch.cat([p.to(parts[0].device) for p in parts]).tolist()  # the one sync
        # gradients are all-reduced under DDP, so this decision is the same on every rank
        grads_bad = len(values) > 2 * len(records) and not math.isfinite(values[-1])
        problem = self._describe(records, values, grads_bad, optimizer)
        if problem is None:
            return
        iteration, what = problem
        msg = (f'non-finite values during training at iteration {iteration + 1}: {what}. '
               'Common causes: a learning rate too high for the batch size (lower optim_wrapper'
               '.optimizer.lr or add optim_wrapper.clip_grad=dict(max_norm=...)), fp16 '
               'overflow (use bf16 or AmpOptimWrapper with a dynamic loss_scale), or '
               'corrupt input data.')
        if self.action == 'raise':
            raise NonFiniteError(msg + ' The optimizer step was not taken.')
        if not grads_bad:
            print_log(msg + ' The gradients are finite: the optimizer step is taken.',
                      logger='current', level=logging.ERROR)
            return
        self.skipped_steps += 1
        print_log(msg + ' The optimizer step is skipped (weights and optimizer state '
                  'unchanged).', logger='current', level=logging.ERROR)
        for g in optimizer.param_groups:  # torch optimizers leave grad-less parameters alone
            for p in g['params']:
                p.grad = None

    def _describe(self, records: List[_Record], values: List[float], grads_bad: bool,
                  optimizer: torch.optim.Optimizer) -> Optional[Tuple[int, str]]:
        """The first problem as ``(iteration, text)``, or None when all is finite."""
        for i, r in enumerate(records):
            nan, inf = int(values[2 * i]), int(values[2 * i + 1])
            if not (nan or inf):
                continue
            if r.losses is not None:
                return r.iteration, f'non-finite losses {_loss_text(r.losses)}'
            return r.iteration, (f'{r.where} has {nan} NaN and {inf} Inf of {r.numel} values, '
                                 f'shape {r.shape}')
        if grads_bad:
            bad = [self._param_names.get(id(p), '?') for g in optimizer.param_groups
                   for p in g['params']
                   if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
            shown = ', '.join(bad[:NAMES_SHOWN]) + (', ...' if len(bad) > NAMES_SHOWN else '')
            return self._iter, (f'non-finite gradients in {len(bad)} parameters ({shown}) with '
                                'finite losses')
        return None


def _loss_text(losses: dict) -> str:
    """``name=value`` of the non-finite loss terms and of their total (``loss``), last."""
    terms = []
    for name, value in losses.items():
        parts: Iterable[Tensor] = value if isinstance(value, (list, tuple)) else [value]
        terms.append((name, float(sum(t.float().mean() for t in parts))))
    total = sum(v for _, v in terms)
    bad = [f'{n}={v}' for n, v in terms if not math.isfinite(v)]
    if not math.isfinite(total):
        bad.append(f'loss={total}')
    return ', '.join(bad)
