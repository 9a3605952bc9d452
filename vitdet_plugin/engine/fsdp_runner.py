"""``FSDP2Runner``: mmengine's ``Runner`` for a model sharded by :class:`~.fsdp.FSDP2Wrapper`.

Config: ``runner_type='FSDP2Runner'`` (and optionally ``model_wrapper_cfg=dict(type=
'FSDP2Wrapper', ...)``, the default wrapper of this runner). It changes four things of the
stock runner, all through torch's distributed-checkpoint API
(:mod:`torch.distributed.checkpoint.state_dict`):

* **weights init**: right after the model is built, before it is sharded (on every rank the
  same seed gives the same weights); the stock runner's later ``init_weights`` + broadcast of
  every state-dict entry (which has no meaning for DTensor shards) is skipped.
* **saving** (every rank enters :meth:`save_checkpoint`, not only rank 0), in the form of
  the config's ``checkpoint_format`` (:data:`CHECKPOINT_FORMATS`; ``'auto'``: DCP above
  :data:`DCP_MIN_STATE_BYTES`). DCP: every rank writes its shards of the model, optimizer and
  EMA state into a directory ``iter_N`` (:func:`~.dcp.save_dcp`; nothing gathered), rank 0
  the rest of the checkpoint. File: the full model and optimizer state dicts are gathered to
  rank 0's CPU (``StateDictOptions(full_state_dict=True, cpu_offload=True)``), which writes
  the usual mmengine file: ``state_dict`` is exactly what a DDP run writes (``tools/test.py``
  and ``load_from`` read it on one process); ``optimizer`` is torch's full optimizer state
  dict keyed by parameter names (``get_optimizer_state_dict``), not by position. Both hold
  the same entries (``tools/dcp_convert.py`` turns one into the other).
* **loading** (``load_from``, ``--resume``): a DCP directory: every rank reads its own shards,
  resharded from any world size; a file: only rank 0 reads the tensors, they reach the other
  ranks shard by shard (``broadcast_from_rank0=True``): no rank materialises a second full
  copy of the model.
* **resume**: model, optimizer (``set_optimizer_state_dict``), schedulers, message hub and
  iteration: continuing gives bit-identically the weights of an uninterrupted run. An
  epoch-based run continues at its epoch times this run's iterations per epoch, so a
  checkpoint written on another number of ranks starts whole accumulation windows.

EMA: every ``EMAHook`` of ``custom_hooks`` is built as :class:`~.fsdp_ema.FSDP2EMAHook`
(same arguments; averaged weights sharded like the parameters, ``ema_state_dict`` gathered on
rank 0 in the DDP form, or its shards in a DCP checkpoint); other ``*EMAHook`` types are
refused.
"""
import copy
import os.path as osp
import re
import time
from typing import Any, Dict, List, Optional, Union

import mmengine
from mmengine.dist import broadcast_object_list, get_rank, is_main_process
from mmengine.hooks import CheckpointHook
from mmengine.model import is_model_wrapper
from mmengine.optim import OptimWrapper
from mmengine.registry import MODEL_WRAPPERS, RUNNERS
from mmengine.runner import EpochBasedTrainLoop, Runner
from mmengine.runner.checkpoint import _load_checkpoint, _load_checkpoint_to_model
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)

from .dcp import is_dcp_checkpoint, load_dcp, read_dcp, save_dcp, split_tensors
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
#: entries of a DCP checkpoint only a resume reads (``load_from`` leaves them on disk)
RESUME_ENTRIES = ('optimizer', 'ema_state_dict')
#: ``checkpoint_format`` values: ``'dcp'`` every rank writes its shards into a DCP directory;
#: ``'file'`` rank 0 gathers and writes one file; ``'auto'`` DCP above :data:`DCP_MIN_STATE_BYTES`
CHECKPOINT_FORMATS = ('auto', 'dcp', 'file')
#: the model + optimizer state from which ``'auto'`` writes DCP directories: 1 GiB (ViT-L with
#: AdamW is ~3.6 GB: a full copy on rank 0 would cost that much host memory at every save)
DCP_MIN_STATE_BYTES = 1 << 30
#: AdamW's state per trainable parameter (``exp_avg``, ``exp_avg_sq``), in parameter copies
ADAMW_STATE_COPIES = 2
PTH_SUFFIX = '.pth'


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
    fmt = cfg.get('checkpoint_format', 'auto')
    if fmt not in CHECKPOINT_FORMATS:
        raise ValueError(f'checkpoint_format={fmt!r} is not one of {list(CHECKPOINT_FORMATS)}; '
                         "set 'auto' (DCP directories above 1 GiB of model + AdamW state), "
                         "'dcp' or 'file'")
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

    def register_hooks(self, *args: Any, **kwargs: Any) -> None:
        """The stock hooks; with DCP checkpoints the checkpoint hooks name directories
        (``iter_{}``, ``epoch_{}``: their ``.pth`` suffix dropped)."""
        super().register_hooks(*args, **kwargs)
        if self.checkpoint_format != 'dcp':
            return
        for hook in self.hooks:
            if isinstance(hook, CheckpointHook) and hook.filename_tmpl.endswith(PTH_SUFFIX):
                hook.filename_tmpl = hook.filename_tmpl[:-len(PTH_SUFFIX)]

    @property
    def checkpoint_format(self) -> str:
        """``'dcp'`` or ``'file'``: the config's ``checkpoint_format`` (``'auto'``: DCP when
        :func:`checkpoint_state_bytes` exceeds :data:`DCP_MIN_STATE_BYTES`); one process
        (no wrapper): always the file."""
        if not self._is_fsdp():
            return 'file'
        fmt = self.cfg.get('checkpoint_format', 'auto')
        if fmt == 'auto':
            big = checkpoint_state_bytes(self.sharded) > DCP_MIN_STATE_BYTES
            return 'dcp' if big else 'file'
        return fmt

    def save_checkpoint(self, out_dir: str, filename: str, *args: Any,
                        save_optimizer: bool = True, **kwargs: Any) -> None:
        """Every rank: a DCP directory of the shards (:meth:`_save_dcp`), or the full state
        dicts gathered on rank 0, which writes the file."""
        if not self._is_fsdp():
            return super().save_checkpoint(out_dir, filename, *args,
                                           save_optimizer=save_optimizer, **kwargs)
        if self.checkpoint_format == 'dcp':
            return self._save_dcp(out_dir, filename, save_optimizer=save_optimizer, **kwargs)
        model = self.sharded
        self._full_model_state: Optional[Dict[str, Any]] = get_model_state_dict(
            model, options=GATHER)
        self._full_optim_state: Optional[Dict[str, Any]] = None
        if save_optimizer and isinstance(self.optim_wrapper, OptimWrapper):
            self._full_optim_state = get_optimizer_state_dict(
                model, self.optim_wrapper.optimizer, options=GATHER)
        for hook in self._ema_hooks():
            hook.gather()  # the full ema_state_dict on rank 0
        try:
            if is_main_process():  # the stock save is master-only; its hook call is replaced
                super().save_checkpoint(out_dir, filename, *args,
                                        save_optimizer=save_optimizer, **kwargs)
        finally:
            self._full_model_state = self._full_optim_state = None

    def _ema_hooks(self) -> List[FSDP2EMAHook]:
        return [h for h in self.hooks if isinstance(h, FSDP2EMAHook) and h.sharded]

    def _save_dcp(self, out_dir: str, filename: str, save_optimizer: bool = True,
                  save_param_scheduler: bool = True, meta: Optional[dict] = None,
                  by_epoch: bool = True, **unused: Any) -> None:
        """Every rank writes its shards of the model, optimizer and EMA state into the DCP
        directory ``out_dir/filename`` (:func:`~.dcp.save_dcp`); rank 0 adds the rest of the
        checkpoint (meta, message hub, schedulers): the entries of the stock file, with
        ``DTensor`` s in place of full tensors."""
        meta = dict(meta or {})
        meta.setdefault('epoch', self.epoch + 1 if by_epoch else self.epoch)
        meta.setdefault('iter', self.iter if by_epoch else self.iter + 1)
        meta.update(cfg=self.cfg.pretty_text, seed=self.seed,
                    experiment_name=self.experiment_name,
                    time=time.strftime('%Y%m%d_%H%M%S', time.localtime()),
                    mmengine_version=mmengine.__version__)
        if hasattr(self.train_dataloader.dataset, 'metainfo'):
            meta.update(dataset_meta=self.train_dataloader.dataset.metainfo)
        checkpoint: Dict[str, Any] = dict(meta=meta,
                                          state_dict=get_model_state_dict(self.sharded),
                                          message_hub=self.message_hub.state_dict())
        if save_optimizer and isinstance(self.optim_wrapper, OptimWrapper):
            checkpoint['optimizer'] = self._optimizer_entry(
                get_optimizer_state_dict(self.sharded, self.optim_wrapper.optimizer),
                self.optim_wrapper.state_dict())
        if save_param_scheduler and self.param_schedulers is not None:
            schedulers: Any = self.param_schedulers
            checkpoint['param_schedulers'] = (
                {k: [s.state_dict() for s in v] for k, v in schedulers.items()}
                if isinstance(schedulers, dict) else [s.state_dict() for s in schedulers])
        for hook in self._ema_hooks():
            hook.gather(sharded=True)  # its shards, on every rank
        self._dcp_saving = True
        try:
            self.call_hook('before_save_checkpoint', checkpoint=checkpoint)
        finally:
            self._dcp_saving = False
        save_dcp(checkpoint, osp.join(out_dir, filename))

    def _optimizer_entry(self, torch_state: Dict[str, Any],
                         wrapper_state: Dict[str, Any]) -> Dict[str, Any]:
        """torch's optimizer state keyed by parameter names, the wrapper's own entries (e.g.
        AmpOptimWrapper's ``loss_scaler``) and every group's settings (torch's state omits
        the groups of frozen parameters)."""
        extra = {k: v for k, v in wrapper_state.items() if k not in OPTIMIZER_KEYS}
        groups = [{k: v for k, v in g.items() if k != 'params'}
                  for g in self.optim_wrapper.optimizer.param_groups]
        return dict(torch_state, **extra, **{GROUP_SETTINGS: groups})

    def call_hook(self, fn_name: str, **kwargs: Any) -> None:
        checkpoint = kwargs.get('checkpoint')
        if (fn_name == 'before_save_checkpoint' and self._is_fsdp() and checkpoint is not None
                and not getattr(self, '_dcp_saving', False)):
            # the stock save put this rank's shards in; the file holds the gathered tensors
            checkpoint['state_dict'] = self._full_model_state
            if self._full_optim_state is not None:
                checkpoint['optimizer'] = self._optimizer_entry(
                    self._full_optim_state, checkpoint.get('optimizer', {}))
        super().call_hook(fn_name, **kwargs)

    def load_checkpoint(self, filename: str, map_location: Union[str, Any] = 'cpu',
                        strict: bool = False,
                        revise_keys: Optional[list] = None) -> Dict[str, Any]:
        """Load the model weights of a checkpoint into the sharded model: from a DCP
        directory every rank reads its own shards (:meth:`_read_dcp_shards`); from a file
        rank 0 reads the tensors, every rank receives its shards (``broadcast_from_rank0``).
        One process (no wrapper) reads a DCP directory whole."""
        if not self._is_fsdp():
            if not is_dcp_checkpoint(filename):
                return super().load_checkpoint(filename, map_location, strict,
                                               revise_keys or [(MODULE_PREFIX.pattern, '')])
            checkpoint = read_dcp(filename)
            self.call_hook('after_load_checkpoint', checkpoint=checkpoint)
            _load_checkpoint_to_model(self.sharded, checkpoint, strict,
                                      revise_keys or [(MODULE_PREFIX.pattern, '')])
            self._has_loaded = True
            self.logger.info(f'Load checkpoint from the DCP directory {filename}')
            return checkpoint
        sharded = is_dcp_checkpoint(filename)
        checkpoint = (self._read_dcp_shards(filename) if sharded
                      else self._read_on_rank0(filename))
        self.call_hook('after_load_checkpoint', checkpoint=checkpoint)
        state = checkpoint.get('state_dict', checkpoint) if sharded or is_main_process() else {}
        state = {MODULE_PREFIX.sub('', k): v for k, v in state.items()}
        set_model_state_dict(self.sharded, state, options=StateDictOptions(
            full_state_dict=not sharded, broadcast_from_rank0=not sharded, strict=strict))
        self._has_loaded = True
        self._loaded: Dict[str, Any] = checkpoint  # the optimizer state, read by resume
        self._loaded_sharded = sharded
        form = 'DCP directory' if sharded else 'checkpoint'
        self.logger.info(f'Load {form} {filename} into the {WRAPPER_TYPE} shards')
        return checkpoint

    def _read_dcp_shards(self, path: str) -> Dict[str, Any]:
        """Every rank: the DCP checkpoint ``path``, this rank's shards of the model (and,
        resuming, of the optimizer and EMA state) read in place into the live ``DTensor`` s
        (any world size wrote it; no second copy of the shards); ``load_from`` leaves
        optimizer and EMA state unread."""
        templates: Dict[str, Any] = {}
        model_state = get_model_state_dict(self.sharded)
        split_tensors(model_state, templates, 'state_dict')
        if self._resume:
            for hook in self._ema_hooks():
                # EMAHook's swap: the file's state_dict holds the averaged weights, its
                # ema_state_dict the trained ones; its after_load_checkpoint swaps them back
                ema_state = hook.ema_model.state_dict()
                for key, value in ema_state.items():
                    trained = key.removeprefix('module.')
                    if key != trained and trained in model_state:
                        templates[f'ema_state_dict.{key}'] = model_state[trained]
                        templates[f'state_dict.{trained}'] = value
                    else:
                        templates[f'ema_state_dict.{key}'] = value
            if isinstance(self.optim_wrapper, OptimWrapper):
                split_tensors(get_optimizer_state_dict(self.sharded, self.optim_wrapper.optimizer),
                              templates, 'optimizer')
        skip = () if self._resume else RESUME_ENTRIES
        checkpoint, mismatched = load_dcp(path, templates, skip)
        if mismatched:
            self.logger.warning(f'{path}: shapes differ from the model, not loaded: '
                                f'{mismatched}')
        checkpoint['has_optimizer'] = 'optimizer' in checkpoint
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
        """The stock resume, with the optimizer state set shard by shard: from rank 0's (a
        file) or from each rank's own (a DCP directory); an epoch-based run continues at
        :meth:`_epoch_start_iter`."""
        if not self._is_fsdp():
            super().resume(filename, resume_optimizer, resume_param_scheduler, map_location)
        else:
            super().resume(filename, resume_optimizer=False,
                           resume_param_scheduler=resume_param_scheduler, map_location='cpu')
            checkpoint, self._loaded = self._loaded, {}
            if resume_optimizer and checkpoint.get('has_optimizer'):
                self._load_optimizer(checkpoint, self._loaded_sharded)
        if isinstance(self.train_loop, EpochBasedTrainLoop):
            self.train_loop._iter = self._epoch_start_iter()

    def load_or_resume(self) -> None:
        """The stock ``load_from`` / resume, then a warning where checkpoints would fall inside
        a gradient-accumulation window (a run resumed from one loses the window's gradients):
        an epoch-based run whose epochs are not whole windows, an iteration-based one whose
        checkpoint interval is not."""
        super().load_or_resume()
        counts = getattr(self.optim_wrapper, '_accumulative_counts', 1)
        loop = self.train_loop
        if isinstance(loop, EpochBasedTrainLoop):
            every, unit = len(loop.dataloader), 'an epoch is'
        else:
            hook = next((h for h in self.hooks if isinstance(h, CheckpointHook)), None)
            if hook is None or hook.by_epoch:
                return
            every, unit = hook.interval, 'checkpoints are every'
        if every % counts:
            self.logger.warning(
                f'{unit} {every} iterations, not a multiple of optim_wrapper.'
                f'accumulative_counts={counts}: checkpoints fall inside accumulation windows '
                f'and a run resumed from one loses the partial window\'s gradients; make it a '
                f'multiple (batch size, number of GPUs, checkpoint interval) or accumulate '
                f'less with a larger batch')

    def _epoch_start_iter(self) -> int:
        """The iteration at which a resumed epoch-based run starts: its epoch times this run's
        iterations per epoch. The checkpoint's own count is per rank of the run that wrote it:
        resumed on another number of ranks (or batch size), it would put this run's iteration
        count, its ``max_iters`` and the gradient-accumulation windows (counted from iteration
        0 by ``OptimWrapper``) out of step with its epochs."""
        loop = self.train_loop
        return loop.epoch * len(loop.dataloader)

    def _load_optimizer(self, checkpoint: Dict[str, Any], sharded: bool) -> None:
        if sharded:  # every rank holds its shards and the same small entries
            full = checkpoint.pop('optimizer')
        else:
            full = checkpoint.pop('optimizer', {}) if is_main_process() else {}
        torch_state = {k: v for k, v in full.items() if k in OPTIMIZER_KEYS}
        set_optimizer_state_dict(self.sharded, self.optim_wrapper.optimizer, torch_state,
                                 options=StateDictOptions(full_state_dict=not sharded,
                                                          broadcast_from_rank0=not sharded))
        extra = [{k: v for k, v in full.items() if k not in OPTIMIZER_KEYS}]
        if not sharded:
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


def checkpoint_state_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (whole, not this rank's shards) plus
    AdamW's state of its trainable parameters: what a checkpoint holds, for ``'auto'``."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return params + buffers + ADAMW_STATE_COPIES * trainable
