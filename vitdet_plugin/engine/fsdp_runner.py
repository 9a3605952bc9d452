"""``FSDP2Runner``: mmengine's ``Runner`` for a model sharded by :class:`~.fsdp.FSDP2Wrapper`.

Config: ``runner_type='FSDP2Runner'`` (and optionally ``model_wrapper_cfg=dict(type=
'FSDP2Wrapper', ...)``, the default wrapper of this runner). It changes four things of the
stock runner, all through torch's distributed-checkpoint API
(:mod:`torch.distributed.checkpoint.state_dict`):

* **weights init**: right after the model is built, before it is sharded (on every rank the
  same seed gives the same weights); the stock runner's later ``init_weights`` + broadcast of
  every state-dict entry (which has no meaning for DTensor shards) is skipped.
* **saving** (every rank enters :meth:`save_checkpoint`, not only rank 0): the full model and
  optimizer state dicts are gathered to rank 0's CPU (``StateDictOptions(full_state_dict=True,
  cpu_offload=True)``), which writes the usual mmengine file: ``state_dict`` is exactly what a
  DDP run writes (``tools/test.py`` and ``load_from`` read it on one process); ``optimizer``
  is torch's full optimizer state dict keyed by parameter names (``get_optimizer_state_dict``),
  not by position. One file per checkpoint: the choice for models up to a few billion
  parameters (docs/large_models.md); rank 0 needs host memory for the whole state once.
* **loading** (``load_from``, ``--resume``): only rank 0 reads the file's tensors; they reach
  the other ranks shard by shard (``broadcast_from_rank0=True``): no rank materialises a
  second full copy of the model.
* **resume**: model, optimizer (``set_optimizer_state_dict``), schedulers, message hub and
  iteration: continuing gives bit-identically the weights of an uninterrupted run.

EMA: every ``EMAHook`` of ``custom_hooks`` is built as :class:`~.fsdp_ema.FSDP2EMAHook`
(same arguments; averaged weights sharded like the parameters, ``ema_state_dict`` gathered on
rank 0 in the DDP form); other ``*EMAHook`` types are refused.
"""
import copy
import re
from typing import Any, Dict, Optional, Union

from mmengine.dist import broadcast_object_list, get_rank, is_main_process
from mmengine.model import is_model_wrapper
from mmengine.optim import OptimWrapper
from mmengine.registry import MODEL_WRAPPERS, RUNNERS
from mmengine.runner import Runner
from mmengine.runner.checkpoint import _load_checkpoint
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)

from .fsdp import FSDP2Wrapper
from .fsdp_ema import FSDP2EMAHook
from .meta_init import build_with_meta_parts

RUNNER_TYPE = 'FSDP2Runner'
WRAPPER_TYPE = 'FSDP2Wrapper'
#: gathered on rank 0, in host memory
GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
#: the optimizer entries of an ``OptimWrapper`` state dict that are torch's (the rest, e.g.
#: AmpOptimWrapper's ``loss_scaler``, is kept as it is)
OPTIMIZER_KEYS = ('state', 'param_groups')
#: every param group's settings (lr, ...) without its parameters, frozen groups included
GROUP_SETTINGS = 'param_group_settings'
MODULE_PREFIX = re.compile(r'^module\.')
EMA_HOOK = 'FSDP2EMAHook'
#: hook types built as :class:`FSDP2EMAHook` (mmengine's, ours)
EMA_HOOK_TYPES = ('EMAHook', EMA_HOOK)
#: checkpoint entries only rank 0 reads (the others get their shards from it)
FULL_ENTRIES = ('state_dict', 'optimizer', 'ema_state_dict')


def check_fsdp_config(cfg: Any) -> None:
    """A config asking for ``FSDP2Wrapper`` must run under ``FSDP2Runner``, its EMA hook (if
    any, launched distributed) be mmengine's ``EMAHook``; raise a ValueError naming the fix
    otherwise (tools/train.py calls it before building)."""
    wrapper = (cfg.get('model_wrapper_cfg') or {}).get('type')
    runner = cfg.get('runner_type')
    if wrapper != WRAPPER_TYPE and runner != RUNNER_TYPE:
        return
    if runner != RUNNER_TYPE:
        raise ValueError(f"model_wrapper_cfg.type='{WRAPPER_TYPE}' needs runner_type="
                         f"'{RUNNER_TYPE}' in the config (sharded checkpoints and init)")
    if wrapper not in (None, WRAPPER_TYPE):
        raise ValueError(f"runner_type='{RUNNER_TYPE}' shards the model with {WRAPPER_TYPE}; "
                         f'model_wrapper_cfg.type={wrapper!r} is not it: drop model_wrapper_cfg '
                         f"or set type='{WRAPPER_TYPE}'")
    emas = [h for h in cfg.get('custom_hooks') or [] if str(h.get('type')).endswith('EMAHook')
            and h.get('type') not in EMA_HOOK_TYPES]
    optim = cfg.get('optim_wrapper') or {}
    if (optim.get('type') == 'AmpOptimWrapper' and not optim.get('use_fsdp')
            and cfg.get('launcher', 'none') != 'none'):
        raise ValueError("optim_wrapper AmpOptimWrapper with FSDP2Runner needs use_fsdp=True "
                         '(ShardedGradScaler: its inf check is all-reduced over the ranks; '
                         "GradScaler checks only this rank's gradient shards, so ranks could "
                         'skip different steps); or use FSDP2Wrapper(mixed_precision=...)')
    if emas and cfg.get('launcher', 'none') != 'none':  # one process: no shards, stock hooks
        raise ValueError(f'{emas[0]["type"]} is not supported with {RUNNER_TYPE} (only '
                         f"mmengine's EMAHook gets sharded averaged weights, as {EMA_HOOK}); use "
                         "type='EMAHook' or train with DDP")


@RUNNERS.register_module()
class FSDP2Runner(Runner):
    """mmengine ``Runner`` whose model is sharded with FSDP2 (see the module docstring)."""

    @classmethod
    def from_cfg(cls, cfg: Any) -> 'Runner':
        check_fsdp_config(cfg)
        cfg = copy.deepcopy(cfg)
        if cfg.get('launcher', 'none') == 'none':  # one process: no wrapper, stock hooks
            return super().from_cfg(cfg)
        if not cfg.get('model_wrapper_cfg'):
            cfg['model_wrapper_cfg'] = dict(type=WRAPPER_TYPE)
        for hook in cfg.get('custom_hooks') or []:
            if hook.get('type') in EMA_HOOK_TYPES:
                hook['type'] = EMA_HOOK
        return super().from_cfg(cfg)

    @property
    def sharded(self) -> nn.Module:
        """The detector (sharded when wrapped by :class:`FSDP2Wrapper`)."""
        return self.model.module if is_model_wrapper(self.model) else self.model

    def _is_fsdp(self) -> bool:
        return isinstance(self.model, FSDP2Wrapper)

    def build_model(self, model: Union[nn.Module, Dict]) -> nn.Module:
        """The stock build, then ``init_weights`` (random init, ``init_cfg`` pretrained) on the
        whole model, before it is sharded; the same on one process, so a single-process run
        of the same seed starts from the same weights."""
        wrapper_cfg = self.cfg.get('model_wrapper_cfg') or {}
        if self.distributed and wrapper_cfg.get('init_device') == 'meta':  # pretrained on meta
            return build_with_meta_parts(super().build_model, model)
        if self.distributed and wrapper_cfg.get('init_on_rank0') and get_rank() != 0:
            with torch.device('meta'):  # shards only, sent by rank 0 (FSDP2Wrapper)
                return super().build_model(model)
        built = super().build_model(model)
        if hasattr(built, 'init_weights'):
            built.init_weights()
        return built

    def wrap_model(self, model_wrapper_cfg: Optional[Dict], model: nn.Module) -> nn.Module:
        """The stock wrapping, except that a model on the meta device stays there (the
        wrapper allocates its shards)."""
        if not (self.distributed and any(p.is_meta for p in model.parameters())):
            return super().wrap_model(model_wrapper_cfg, model)
        return MODEL_WRAPPERS.build(dict(model_wrapper_cfg or dict(type=WRAPPER_TYPE)),
                                    default_args=dict(module=model))

    def _init_model_weights(self) -> None:
        """Nothing: :meth:`build_model` did it."""

    def save_checkpoint(self, out_dir: str, filename: str, *args: Any,
                        save_optimizer: bool = True, **kwargs: Any) -> None:
        """Every rank: gather the full state dicts on rank 0, which writes the file."""
        if not self._is_fsdp():
            return super().save_checkpoint(out_dir, filename, *args,
                                           save_optimizer=save_optimizer, **kwargs)
        model = self.sharded
        self._full_model_state: Optional[Dict[str, Any]] = get_model_state_dict(
            model, options=GATHER)
        self._full_optim_state: Optional[Dict[str, Any]] = None
        if save_optimizer and isinstance(self.optim_wrapper, OptimWrapper):
            self._full_optim_state = get_optimizer_state_dict(
                model, self.optim_wrapper.optimizer, options=GATHER)
        for hook in self.hooks:
            if isinstance(hook, FSDP2EMAHook) and hook.sharded:
                hook.gather()  # the full ema_state_dict on rank 0
        try:
            if is_main_process():  # the stock save is master-only; its hook call is replaced
                super().save_checkpoint(out_dir, filename, *args,
                                        save_optimizer=save_optimizer, **kwargs)
        finally:
            self._full_model_state = self._full_optim_state = None

    def call_hook(self, fn_name: str, **kwargs: Any) -> None:
        checkpoint = kwargs.get('checkpoint')
        if fn_name == 'before_save_checkpoint' and self._is_fsdp() and checkpoint is not None:
            # the stock save put this rank's shards in; the file holds the gathered tensors
            checkpoint['state_dict'] = self._full_model_state
            if self._full_optim_state is not None:
                extra = {k: v for k, v in checkpoint.get('optimizer', {}).items()
                         if k not in OPTIMIZER_KEYS}
                # torch's full state omits the groups of frozen parameters: their settings
                groups = [{k: v for k, v in g.items() if k != 'params'}
                          for g in self.optim_wrapper.optimizer.param_groups]
                checkpoint['optimizer'] = dict(self._full_optim_state, **extra,
                                               **{GROUP_SETTINGS: groups})
        super().call_hook(fn_name, **kwargs)

    def load_checkpoint(self, filename: str, map_location: Union[str, Any] = 'cpu',
                        strict: bool = False,
                        revise_keys: Optional[list] = None) -> Dict[str, Any]:
        """Load the model weights of a full checkpoint into the sharded model: rank 0 reads the
        tensors, every rank receives its shards (``broadcast_from_rank0``)."""
        if not self._is_fsdp():
            return super().load_checkpoint(filename, map_location, strict,
                                           revise_keys or [(MODULE_PREFIX.pattern, '')])
        checkpoint = self._read_on_rank0(filename)
        self.call_hook('after_load_checkpoint', checkpoint=checkpoint)
        state = checkpoint.get('state_dict', checkpoint) if is_main_process() else {}
        state = {MODULE_PREFIX.sub('', k): v for k, v in state.items()}
        set_model_state_dict(self.sharded, state, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True, strict=strict))
        self._has_loaded = True
        self._loaded: Dict[str, Any] = checkpoint  # the optimizer state, read by resume
        self.logger.info(f'Load checkpoint from {filename} into the {WRAPPER_TYPE} shards')
        return checkpoint

    def _read_on_rank0(self, filename: str) -> Dict[str, Any]:
        """The checkpoint on rank 0; on the others the same dict without tensors of the model
        and optimizer (meta, message hub, schedulers: small)."""
        checkpoint: Dict[str, Any] = {}
        if get_rank() == 0:
            checkpoint = _load_checkpoint(filename, map_location='cpu')
            if not isinstance(checkpoint, dict):
                raise RuntimeError(f'{filename} holds no state dict')
        small = [{k: v for k, v in checkpoint.items() if k not in FULL_ENTRIES}
                 | {'has_optimizer': 'optimizer' in checkpoint}]
        broadcast_object_list(small, src=0)
        if get_rank() != 0:
            checkpoint = small[0]
        else:
            checkpoint['has_optimizer'] = small[0]['has_optimizer']
        return checkpoint

    def resume(self, filename: str, resume_optimizer: bool = True,
               resume_param_scheduler: bool = True,
               map_location: Union[str, Any] = 'default') -> None:
        """The stock resume, with the optimizer state set shard by shard from rank 0's."""
        if not self._is_fsdp():
            return super().resume(filename, resume_optimizer, resume_param_scheduler,
                                  map_location)
        super().resume(filename, resume_optimizer=False,
                       resume_param_scheduler=resume_param_scheduler, map_location='cpu')
        checkpoint, self._loaded = self._loaded, {}
        if resume_optimizer and checkpoint.get('has_optimizer'):
            self._load_optimizer(checkpoint)

    def _load_optimizer(self, checkpoint: Dict[str, Any]) -> None:
        full = checkpoint.pop('optimizer', {}) if is_main_process() else {}
        torch_state = {k: v for k, v in full.items() if k in OPTIMIZER_KEYS}
        set_optimizer_state_dict(self.sharded, self.optim_wrapper.optimizer, torch_state,
                                 options=StateDictOptions(full_state_dict=True,
                                                          broadcast_from_rank0=True))
        extra = [{k: v for k, v in full.items() if k not in OPTIMIZER_KEYS}]
        broadcast_object_list(extra, src=0)
        groups = extra[0].pop(GROUP_SETTINGS, None)
        live = self.optim_wrapper.optimizer.param_groups
        if groups is not None and len(groups) == len(live):
            for group, settings in zip(live, groups):
                group.update(settings)
        if 'base_param_settings' in extra[0]:  # OptimWrapper's own entry (the scheduler's)
            self.optim_wrapper.base_param_settings = extra[0]['base_param_settings']
        if 'loss_scaler' in extra[0] and hasattr(self.optim_wrapper, 'loss_scaler'):
            self.optim_wrapper.loss_scaler.load_state_dict(extra[0]['loss_scaler'])
