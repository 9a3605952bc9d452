"""``FSDP2EMAHook``: mmengine's ``EMAHook`` for a model sharded by :class:`~.fsdp.FSDP2Wrapper`.

``FSDP2Runner`` builds it in place of every ``dict(type='EMAHook', ...)`` of the config (same
arguments); on an unsharded model (one process, no wrapper) it is the stock ``EMAHook``.

Sharded, the averaged model is the configured ``ema_type`` (mmengine's
``ExponentialMovingAverage``, ``ExpMomentumEMA``, ...) built over a plain copy of the
detector's module tree whose parameters are clones of the local ``DTensor`` shards: each rank
averages its own shards with the class's own ``update_parameters`` / ``avg_func`` (``lerp_``
etc. on DTensors are local), so ``momentum``, ``interval``, ``update_buffers`` and
``begin_iter`` / ``begin_epoch`` keep their meaning. Validation / test swap the local shards.

Checkpoints: every rank gathers the full averaged tensors (``DTensor.full_tensor``) when
``FSDP2Runner`` saves; rank 0 writes ``ema_state_dict`` exactly as ``EMAHook`` writes it in a
DDP run (``steps`` and ``module.<name>``, the EMA weights swapped into ``state_dict``). Resume:
rank 0 reads it, the shards reach every rank with ``set_model_state_dict(...,
broadcast_from_rank0=True)``. A DCP checkpoint (``checkpoint_format``) holds every rank's
averaged shards as they are, read back in place on resume.
"""
import itertools
from typing import Any, Dict, Optional

from mmengine.dist import broadcast_object_list, is_main_process
from mmengine.hooks import EMAHook
from mmengine.model import is_model_wrapper
from mmengine.registry import HOOKS, MODELS
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

#: ``ema_type`` arguments that have no meaning for shards (they move the averaged copy)
UNSUPPORTED_EMA_ARGS = ('device',)


def plain_copy(module: nn.Module) -> nn.Module:
    """The module tree of ``module`` as plain ``nn.Module`` s holding detached clones of its
    parameters (DTensor shards stay shards) and buffers, names and order unchanged (no
    forward, no FSDP hooks: only what the averaged model reads)."""
    copy = nn.Module()
    for name, param in module.named_parameters(recurse=False):
        copy.register_parameter(name, nn.Parameter(param.detach().clone(),
                                                   requires_grad=False))
    for name, buf in module.named_buffers(recurse=False):
        copy.register_buffer(name, buf.detach().clone(),
                             persistent=name not in module._non_persistent_buffers_set)
    for name, child in module.named_children():
        copy.add_module(name, plain_copy(child))
    return copy


def is_sharded(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


@HOOKS.register_module()
class FSDP2EMAHook(EMAHook):
    """``EMAHook`` whose averaged weights are DTensors sharded like the parameters (see the
    module docstring); the arguments of ``EMAHook``."""

    def __init__(self, ema_type: str = 'ExponentialMovingAverage', strict_load: bool = False,
                 begin_iter: int = 0, begin_epoch: int = 0, **kwargs: Any) -> None:
        given = sorted(set(kwargs) & set(UNSUPPORTED_EMA_ARGS))
        if given:
            raise ValueError(f'EMAHook({given[0]}=...) is not supported with FSDP2Runner: the '
                             'averaged weights are shards on the device of the parameters; '
                             f'drop {given[0]}')
        super().__init__(ema_type, strict_load, begin_iter, begin_epoch, **kwargs)
        self.sharded = False
        #: the gathered ``ema_state_dict`` between ``gather`` and the rank-0 save
        self._full: Optional[Dict[str, torch.Tensor]] = None

    def before_run(self, runner: Any) -> None:
        model = runner.model.module if is_model_wrapper(runner.model) else runner.model
        self.sharded = is_sharded(model)
        if not self.sharded:
            return super().before_run(runner)
        self.src_model = model
        self.ema_model = MODELS.build(self.ema_cfg, default_args=dict(model=plain_copy(model)))

    def _swap_ema_parameters(self) -> None:
        """The stock swap, on the local shards (each FSDP unit resharded first: with
        ``FSDP2Wrapper(reshard_after_forward=False)`` a forward without backward leaves the
        parameters gathered)."""
        if self.sharded:
            for module in self.src_model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        super()._swap_ema_parameters()

    def gather(self, sharded: bool = False) -> None:
        """Every rank (``FSDP2Runner.save_checkpoint``): the full ``ema_state_dict``, kept on
        rank 0 for :meth:`before_save_checkpoint`; ``sharded`` (a DCP checkpoint): every
        rank keeps its own shards."""
        if sharded:
            self._full = dict(self.ema_model.state_dict())
            return
        full = {}
        for name, value in self.ema_model.state_dict().items():
            tensor = value.full_tensor() if isinstance(value, DTensor) else value
            if is_main_process():
                full[name] = tensor.detach().cpu()
        self._full = full if is_main_process() else None

    def before_save_checkpoint(self, runner: Any, checkpoint: dict) -> None:
        if not self.sharded:
            return super().before_save_checkpoint(runner, checkpoint)
        if self._full is None:
            raise RuntimeError('FSDP2EMAHook: the averaged weights were not gathered; save '
                               'with FSDP2Runner.save_checkpoint (every rank)')
        checkpoint['ema_state_dict'], self._full = self._full, None
        self._swap_ema_state_dict(checkpoint)  # EMA weights in state_dict, as EMAHook does

    def after_load_checkpoint(self, runner: Any, checkpoint: dict) -> None:
        """Every rank (``FSDP2Runner.load_checkpoint``, before the model weights are set):
        resume sets the averaged shards from rank 0's ``ema_state_dict``; otherwise (or with
        no ``ema_state_dict``) :meth:`before_train` copies the loaded model's shards, what
        ``EMAHook`` does here."""
        if not self.sharded:
            return super().after_load_checkpoint(runner, checkpoint)
        ema_state = checkpoint.get('ema_state_dict') or {}
        if any(isinstance(v, DTensor) for v in ema_state.values()):  # every rank: its shards
            if runner._resume:  # (a DCP checkpoint; load_from does not read the entry)
                self._swap_ema_state_dict(checkpoint)
                set_model_state_dict(self.ema_model, checkpoint.pop('ema_state_dict'),
                                     options=StateDictOptions(strict=self.strict_load))
            return
        has_ema = [is_main_process() and 'ema_state_dict' in checkpoint]
        broadcast_object_list(has_ema, src=0)
        if not (has_ema[0] and runner._resume):
            return
        full: Dict[str, Any] = {}
        if is_main_process():
            self._swap_ema_state_dict(checkpoint)  # state_dict gets the model's own weights
            full = checkpoint.pop('ema_state_dict')
        set_model_state_dict(self.ema_model, full, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True, strict=self.strict_load))

    def before_train(self, runner: Any) -> None:
        """Sharded and not resumed from averaged weights (``steps`` 0): the averaged shards
        start from the model's (loaded) ones."""
        super().before_train(runner)
        if self.sharded and int(self.ema_model.steps) == 0:
            src = itertools.chain(self.src_model.parameters(), self.src_model.buffers())
            avg = itertools.chain(self.ema_model.module.parameters(),
                                  self.ema_model.module.buffers())
            for p_avg, p_src in zip(avg, src):
                p_avg.data.copy_(p_src.data)
