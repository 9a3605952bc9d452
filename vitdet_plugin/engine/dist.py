"""Distributed training without GPUs (DDP over gloo on CPU) and its collective timeout.

mmengine 0.10.7 assumes CUDA for ``launcher='pytorch'``: ``init_dist`` calls
``torch.cuda.set_device(LOCAL_RANK)`` and ``Runner.wrap_model`` passes
``device_ids=[LOCAL_RANK]`` to ``DistributedDataParallel``; on a CPU-only machine the first
raises "Found no NVIDIA driver" and the second is rejected by DDP for CPU modules.
:func:`prepare_cpu_distributed` fixes a config before the Runner is built: it initialises the
process group itself with gloo (the Runner then skips ``init_dist``), with the collective
timeout of ``env_cfg.dist_cfg.timeout`` (:data:`DEFAULT_COLLECTIVE_TIMEOUT_S` if unset), and
sets ``model_wrapper_cfg.device_ids=None`` (DDP; ``FSDP2Wrapper`` is left as it is). On
machines with CUDA it only checks the timeout.

Every process of a multi-rank job also gets :func:`end_distributed` as an ``atexit`` handler:
the process group is destroyed, and gloo's threads joined, while the interpreter is still
whole. Without it a rank that leaves right after its last collective (rank 1 after the
checkpoint gather: rank 0 still writes the file) can reach interpreter finalisation while a
gloo worker thread still drops its references of that collective; a C++ thread that then
needs the GIL is ended by CPython with ``pthread_exit``, whose unwinding through gloo's
``noexcept`` run loop calls ``std::terminate``: "terminate called without an active
exception", SIGABRT, a failed job (docs/training.md#distributed-training). Destroying is not
enough if something else still holds the group: see :data:`PINNING_IMPORTS` and
:func:`release_mesh_groups` (FSDP2).

What happens when a rank dies, and the report of it: :mod:`.dist_faults`.
"""
import atexit
import gc
import importlib
import math
import os
from datetime import timedelta
from typing import MutableMapping

import torch
import torch.distributed as torch_dist

#: environment variables torchrun / ``tools/dist_train.sh`` set for every process
TORCHRUN_ENV = ('RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT')

#: model wrappers that are not DDP (no ``device_ids`` / ``broadcast_buffers``)
NON_DDP_WRAPPERS = ('FSDP2Wrapper',)
TIMEOUT_KEY = 'env_cfg.dist_cfg.timeout'
#: torch modules with a ``group=dist.group.WORLD`` default argument (torch 2.14), evaluated when
#: they are first imported: imported while a group exists, they keep it alive for good, past
#: ``destroy_process_group``, and gloo's threads with it. FSDP2 imports them lazily (the first
#: DTensor imports torch._dynamo, which imports the functional collectives; mmengine's
#: AmpOptimWrapper the scaler; ZeroRedundancyOptimizer): :func:`prepare_cpu_distributed`
#: imports them before any group exists.
PINNING_IMPORTS = ('torch.distributed.nn.functional', 'torch.distributed.fsdp.sharded_grad_scaler',
                   'torch.distributed.optim.zero_redundancy_optimizer')
#: the attribute of a ``DeviceMesh`` holding its process groups (name -> group)
MESH_GROUPS_ATTR = '_pg_registry'
#: how long a collective (all-reduce, broadcast, barrier) waits for the slowest rank before it
#: raises: 30 min, torch's gloo default and mmengine's suggested value. It has to outlast the
#: longest time one rank legitimately keeps the others waiting: rank 0 alone computing COCO /
#: LVIS metrics while the others wait in the broadcast of the results (minutes; LVIS 10-20 min),
#: rank 0 writing a multi-GB checkpoint to network storage, a first iteration under
#: torch.compile. A hung rank (alive, never reaching the collective) is released after it.
DEFAULT_COLLECTIVE_TIMEOUT_S = 1800.0


def collective_timeout(cfg: MutableMapping) -> float:
    """``env_cfg.dist_cfg.timeout`` (seconds) of ``cfg``, or :data:`DEFAULT_COLLECTIVE_TIMEOUT_S`
    if it is unset or None; a non-positive or non-number value raises a ValueError."""
    dist_cfg = (cfg.get('env_cfg') or {}).get('dist_cfg') or {}
    value = dist_cfg.get('timeout')
    if value is None:
        return DEFAULT_COLLECTIVE_TIMEOUT_S
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f'{TIMEOUT_KEY} must be a positive number of seconds, got {value!r}; '
                         f'set e.g. env_cfg = dict(dist_cfg=dict(backend=..., timeout='
                         f'{DEFAULT_COLLECTIVE_TIMEOUT_S:g})) or drop it for the default')
    return float(value)


def end_distributed() -> None:
    """Destroy every process group of this process (torch's "call before exit") and collect
    the runner's reference cycles, so that the backends (gloo's worker and transport threads)
    go down before the interpreter finalises; nothing without a process group. Registered
    with ``atexit`` by :func:`prepare_cpu_distributed`, also on exit by an exception."""
    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.destroy_process_group()
        gc.collect()
        release_mesh_groups()


def release_mesh_groups() -> None:
    """Drop the process groups that live ``DeviceMesh`` es still hold. DTensor's caches (sharding
    propagation, redistribute plans) keep every mesh of an FSDP2 run alive to the end, and a
    mesh keeps its groups in ``_pg_registry`` (torch 2.14): after ``destroy_process_group``
    that is the last reference of the gloo backend, whose threads then outlive the interpreter."""
    from torch.distributed.device_mesh import DeviceMesh
    for obj in gc.get_objects():
        if issubclass(type(obj), DeviceMesh):  # type(): no attribute lookups on the heap
            getattr(obj, MESH_GROUPS_ATTR, {}).clear()
    gc.collect()


def register_end_distributed() -> None:
    """Run :func:`end_distributed` at interpreter exit (once per process)."""
    atexit.unregister(end_distributed)
    atexit.register(end_distributed)


def prepare_cpu_distributed(cfg: MutableMapping, backend: str = 'gloo') -> bool:
    """Make ``cfg`` (launcher ``'pytorch'``) trainable with DDP on CPU; True if it did.

    Call before ``Runner.from_cfg(cfg)`` in every process started by torchrun. Any launcher
    also registers :func:`end_distributed` for the interpreter's exit.
    """
    if cfg.get('launcher', 'none') == 'none':
        return False
    register_end_distributed()
    for module in PINNING_IMPORTS:
        importlib.import_module(module)
    timeout = collective_timeout(cfg)  # checked on GPU machines too (mmengine's init_dist)
    if cfg.get('launcher') != 'pytorch' or torch.cuda.is_available():
        return False
    missing = [k for k in TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise RuntimeError(f"launcher='pytorch' needs the torchrun environment variables "
                           f'{list(TORCHRUN_ENV)}; {missing} are not set. Start the job with '
                           'tools/dist_train.sh CONFIG NUM_PROCS (or torchrun '
                           '--nproc_per_node=N tools/train.py CONFIG --launcher pytorch)')
    env_cfg = cfg.setdefault('env_cfg', {})
    dist_cfg = env_cfg.setdefault('dist_cfg', {})
    dist_cfg['backend'] = backend
    if not torch_dist.is_initialized():
        torch_dist.init_process_group(backend=backend, rank=int(os.environ['RANK']),
                                      world_size=int(os.environ['WORLD_SIZE']),
                                      timeout=timedelta(seconds=timeout))
    wrapper = cfg.get('model_wrapper_cfg') or (
        dict(type='FSDP2Wrapper') if cfg.get('runner_type') == 'FSDP2Runner' else dict(
            type='MMDistributedDataParallel',
            find_unused_parameters=cfg.get('find_unused_parameters', False)))
    if wrapper.get('type') not in NON_DDP_WRAPPERS:
        wrapper['device_ids'] = None  # CPU modules: DDP rejects device ids
        wrapper.setdefault('broadcast_buffers', False)  # what mmengine uses for its default DDP
    cfg['model_wrapper_cfg'] = wrapper
    return True
