"""Sharded data-parallel training (torch FSDP2) under mmengine's ``Runner``.

``model_wrapper_cfg=dict(type='FSDP2Wrapper', ...)`` replaces DDP: every transformer block
(:data:`DEFAULT_BLOCK_TYPES`, by class name) and then the whole detector are sharded with
:func:`torch.distributed.fsdp.fully_shard` (per-parameter sharding, parameters become
``DTensor`` shards of dim 0 with their names unchanged), so each of N ranks holds 1/N of the
parameters, gradients and optimizer state; a block's full parameters exist only while it runs.
Options: a :class:`~torch.distributed.fsdp.MixedPrecisionPolicy` (``mixed_precision=dict(
param_dtype='bfloat16', reduce_dtype='float32')``: bf16 compute / all-gathers, fp32 gradient
reduction and fp32 master weights; norm layers with running statistics (BatchNorm) keep fp32
parameters, :func:`shard_running_stat_norms`; predictions leave the wrapper in fp32,
:func:`predictions_to_fp32`), activation checkpointing per block (it switches on the
backbones' own ``with_cp``: non-reentrant :func:`torch.utils.checkpoint.checkpoint` per
block) and :class:`~torch.distributed.fsdp.CPUOffloadPolicy`.

The optimizer is built by the Runner after wrapping, over the sharded parameters: the layer
decay / no-decay constructors see the same names, AdamW keeps its state per local shard,
``clip_grad`` (``torch.nn.utils.clip_grad_norm_``) reduces the norm over the DTensor shards.
The module must hold its initial weights when it is wrapped (``FSDP2Runner`` initialises
them right after building the model), or, with ``init_device='meta'``, hold its pretrained
parts on the meta device: each rank then copies its shards out of the memory-mapped checkpoint
(:mod:`.meta_init`).

Checkpoints, resume and loading a full checkpoint into a sharded model:
:mod:`.fsdp_runner` (``FSDP2Runner``). Which option when, memory per GPU and the
``torchrun`` commands: docs/large_models.md.
"""
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
from mmengine.optim import OptimWrapper
from mmengine.structures import BaseDataElement
from mmengine.registry import MODEL_WRAPPERS
from torch import nn
from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                    fully_shard)
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import Shard
from torch.nn.modules.batchnorm import _NormBase

from .meta_init import MetaInit, check_init_device

#: Modules sharded one by one (class names, subclasses included): the plain ViT's block (and
#: ViTDet's, derived from it) and the Swin blocks. Every
#: parameter outside them (patch embedding, neck, heads) is sharded once with the whole model.
DEFAULT_BLOCK_TYPES = ('ViTBlock', 'SwinBlock', 'SwinV2Block')
#: dtype names accepted by ``mixed_precision``
DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}
MIXED_PRECISION_KEYS = ('param_dtype', 'reduce_dtype', 'output_dtype', 'cast_forward_inputs')
#: prediction dtypes cast to fp32 on the way out (mmdet's metrics call ``.numpy()``, which has
#: no bf16; visualisers and the export expect fp32)
LOW_PRECISION = (torch.bfloat16, torch.float16)


def _dtype(value: Optional[str], key: str) -> Optional[torch.dtype]:
    if value is None:
        return None
    if value not in DTYPES:
        raise ValueError(f'mixed_precision.{key}={value!r} is not one of {sorted(DTYPES)} '
                         "(e.g. dict(param_dtype='bfloat16', reduce_dtype='float32'))")
    return DTYPES[value]


def mixed_precision_policy(cfg: Optional[Dict[str, Any]]) -> MixedPrecisionPolicy:
    """The :class:`MixedPrecisionPolicy` of ``cfg`` (dtype names); None: full fp32."""
    cfg = dict(cfg or {})
    unknown = sorted(set(cfg) - set(MIXED_PRECISION_KEYS))
    if unknown:
        raise ValueError(f'mixed_precision has unknown keys {unknown}; allowed: '
                         f'{list(MIXED_PRECISION_KEYS)}')
    return MixedPrecisionPolicy(
        param_dtype=_dtype(cfg.get('param_dtype'), 'param_dtype'),
        reduce_dtype=_dtype(cfg.get('reduce_dtype'), 'reduce_dtype'),
        output_dtype=_dtype(cfg.get('output_dtype'), 'output_dtype'),
        cast_forward_inputs=bool(cfg.get('cast_forward_inputs', True)))


def shard_largest_dim(param: nn.Parameter) -> Shard:
    """FSDP2 ``shard_placement_fn``: split each parameter along its largest dimension that the
    world size divides (FSDP2 shards dims other than 0 only evenly), else dim 0 (FSDP2's
    default, which would leave e.g. a ``(1, N, C)`` position embedding on rank 0 alone)."""
    world = torch.distributed.get_world_size()
    even = [d for d in range(1, param.dim()) if param.shape[d] % world == 0]
    best = max(even, key=lambda d: param.shape[d], default=0)
    return Shard(best if param.shape[best] > param.shape[0] else 0)


def shard_running_stat_norms(module: nn.Module, policy: MixedPrecisionPolicy,
                             **shard_kwargs: Any) -> List[nn.Module]:
    """Shard every norm layer with running statistics (BatchNorm, InstanceNorm with
    ``track_running_stats``) and parameters as its own unit whose parameters stay in their
    dtype (fp32): the policy would cast its weight to ``param_dtype`` while its running
    statistics, buffers, stay fp32, which ``batch_norm`` refuses ("expected scalar type
    BFloat16 but found Float"). Its input keeps the compute dtype (``batch_norm`` takes a bf16
    input with fp32 weight and statistics and returns bf16). The units, in order; none when
    ``policy`` keeps the parameters' dtype."""
    if policy.param_dtype in (None, torch.float32):
        return []
    norms: List[nn.Module] = [
        m for m in module.modules() if isinstance(m, _NormBase) and m.track_running_stats
        and next(m.parameters(), None) is not None]
    fp32 = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=policy.reduce_dtype,
                                cast_forward_inputs=False)
    for norm in norms:
        fully_shard(norm, mp_policy=fp32, **shard_kwargs)
    return norms


def predictions_to_fp32(outputs: Any) -> Any:
    """``outputs`` (a list of data samples, dicts, tensors) with every bf16 / fp16 tensor
    cast to fp32; data elements (``DetDataSample``, ``InstanceData``) are changed in place."""
    if isinstance(outputs, torch.Tensor):
        return outputs.float() if outputs.dtype in LOW_PRECISION else outputs
    if isinstance(outputs, BaseDataElement):
        for key in outputs.keys():
            setattr(outputs, key, predictions_to_fp32(getattr(outputs, key)))
        return outputs
    if isinstance(outputs, dict):
        return {k: predictions_to_fp32(v) for k, v in outputs.items()}
    if isinstance(outputs, (list, tuple)):
        return type(outputs)(predictions_to_fp32(v) for v in outputs)
    return outputs


def shard_blocks(module: nn.Module, block_types: Sequence[str]) -> List[nn.Module]:
    """The modules of ``module`` whose class, or a class it derives from, is named in
    ``block_types``, in order (``ViTDetBlock``, a ``ViTBlock``, is sharded as one)."""
    blocks = [m for m in module.modules()
              if any(cls.__name__ in block_types for cls in type(m).__mro__)]
    if not blocks:
        found = sorted({type(m).__name__ for m in module.modules()})
        raise ValueError(f'FSDP2Wrapper: no module of the model is one of block_types='
                         f'{list(block_types)}; give the class name of its transformer block '
                         f'(the model has {found})')
    return blocks


def enable_activation_checkpointing(module: nn.Module) -> int:
    """Switch on ``with_cp`` (activation checkpointing per block) of every submodule that has
    it (our backbones); the number of modules switched. Raises when there is none."""
    switched: List[Any] = [m for m in module.modules()
                           if isinstance(getattr(m, 'with_cp', None), bool)]
    if not switched:
        raise ValueError('FSDP2Wrapper(activation_checkpointing=True): no submodule has a '
                         '`with_cp` switch; use one of our backbones or set it to False')
    for m in switched:
        m.with_cp = True
    return len(switched)


def broadcast_weights_from_rank0(module: nn.Module, full: Dict[str, Any],
                                 on_meta: bool) -> None:
    """Give every rank its shards of rank 0's weights: ``full`` (rank 0's state dict taken
    before sharding; ``{}`` elsewhere) reaches the others shard by shard; ranks whose module is
    on the meta device first allocate their local shards (``to_empty``). Buffers, persistent
    or not, are broadcast whole."""
    if on_meta:
        module.to_empty(device=current_device())
    set_model_state_dict(module, full, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True))
    for buf in module.buffers():
        torch.distributed.broadcast(buf, src=0)


def current_device() -> torch.device:
    """This rank's device: its GPU (``LOCAL_RANK``) when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device('cuda', torch.cuda.current_device())
    return torch.device('cpu')


@MODEL_WRAPPERS.register_module()
class FSDP2Wrapper(nn.Module):
    """mmengine model wrapper sharding ``module`` with FSDP2 (see the module docstring).

    Args:
        module: the detector (built by the Runner, on the CPU or the rank's GPU).
        block_types: class names of the modules sharded one by one.
        mixed_precision: dtype names of a :class:`MixedPrecisionPolicy` (None: fp32).
        activation_checkpointing: recompute each block's activations in backward.
        cpu_offload: keep parameters, gradients and optimizer state on the CPU
            (:class:`CPUOffloadPolicy`; the optimizer step runs on the CPU).
        reshard_after_forward: free each block's gathered parameters after its forward (ZeRO-3;
            False: keep them until backward, ZeRO-2-like, more memory, one all-gather less).
        init_on_rank0: only rank 0 holds the whole initialised model (``FSDP2Runner`` builds it
            on the meta device everywhere else); after sharding the other ranks allocate their
            shards only and receive them from rank 0 (``set_model_state_dict(...,
            broadcast_from_rank0=True)``), buffers by broadcast: one full copy of the model in
            the job instead of one per rank (a 7B model: 27 GB of fp32 host memory).
        init_device: ``'meta'``: no full copy anywhere: every rank builds the pretrained parts
            on the meta device (``FSDP2Runner``), allocates its shards only and copies them out
            of the memory-mapped checkpoint (:mod:`.meta_init`); None: the model arrives
            initialised (or, with ``init_on_rank0``, from rank 0).
    """

    module: Any  # the detector: mmdet's BaseDetector API (data_preprocessor, parse_losses, ...)

    def __init__(self, module: nn.Module,
                 block_types: Sequence[str] = DEFAULT_BLOCK_TYPES,
                 mixed_precision: Optional[Dict[str, Any]] = None,
                 activation_checkpointing: bool = False,
                 cpu_offload: bool = False,
                 reshard_after_forward: bool = True,
                 init_on_rank0: bool = False,
                 init_device: Optional[str] = None) -> None:
        super().__init__()
        check_init_device(init_device, init_on_rank0)
        if not torch.distributed.is_initialized():
            raise RuntimeError("FSDP2Wrapper needs an initialised process group: start the job "
                               'with tools/dist_train.sh CONFIG N (or torchrun ... tools/train.py '
                               "CONFIG --launcher pytorch), also for a single process")
        if cpu_offload and not torch.cuda.is_available():
            raise ValueError('FSDP2Wrapper(cpu_offload=True) moves the shards of a GPU model to '
                             'host memory; without CUDA the model is on the CPU already: set '
                             'cpu_offload=False')
        #: the module arrived on the meta device (``init_on_rank0``, ranks other than 0)
        self.built_on_meta = any(p.is_meta for p in module.parameters())
        if self.built_on_meta and not (init_on_rank0 or init_device == 'meta'):
            raise ValueError('FSDP2Wrapper got a model on the meta device; pass '
                             "init_on_rank0=True (rank 0 then sends the weights) or "
                             "init_device='meta' (its pretrained parts are loaded into the shards)")
        full: Dict[str, Any] = (module.state_dict() if init_on_rank0 and not self.built_on_meta
                                else {})
        meta_init = MetaInit(module) if init_device == 'meta' else None
        if activation_checkpointing:
            enable_activation_checkpointing(module)
        mp_policy = mixed_precision_policy(mixed_precision)
        offload_policy = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
        shard_kwargs: Dict[str, Any] = dict(
            offload_policy=offload_policy, reshard_after_forward=reshard_after_forward,
            shard_placement_fn=shard_largest_dim)
        blocks = shard_blocks(module, tuple(block_types))
        shard_running_stat_norms(module, mp_policy, **shard_kwargs)  # innermost units first
        for unit in [*blocks, module]:  # blocks, then the rest
            fully_shard(unit, mp_policy=mp_policy, **shard_kwargs)
        if init_on_rank0:
            broadcast_weights_from_rank0(module, full, self.built_on_meta)
        if meta_init is not None:
            meta_init.materialise(module, current_device())
        self.module = module

    def train_step(self, data: Union[dict, tuple, list],
                   optim_wrapper: OptimWrapper) -> Dict[str, torch.Tensor]:
        """Preprocess, forward (loss), backward with gradient reduce-scatter, optimizer step:
        the steps of mmengine's ``MMDistributedDataParallel.train_step``."""
        with optim_wrapper.optim_context(self):
            data = self.module.data_preprocessor(data, training=True)
            losses = self._run_forward(data, mode='loss')
        parsed_loss, log_vars = self.module.parse_losses(losses)
        optim_wrapper.update_params(parsed_loss)
        return log_vars

    def val_step(self, data: Union[dict, tuple, list]) -> list:
        """Predictions of a validation batch (every rank runs the sharded forward), fp32."""
        return predictions_to_fp32(self.module.val_step(data))

    def test_step(self, data: Union[dict, tuple, list]) -> list:
        """Predictions of a test batch (every rank runs the sharded forward), fp32."""
        return predictions_to_fp32(self.module.test_step(data))

    def _run_forward(self, data: Union[dict, tuple, list], mode: str) -> Any:
        if isinstance(data, dict):
            return self.module(**data, mode=mode)
        if isinstance(data, (list, tuple)):
            return self.module(*data, mode=mode)
        raise TypeError(f'the output of the data preprocessor must be a dict, list or tuple, '
                        f'got {type(data).__name__}')
