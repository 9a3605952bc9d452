"""Distributed training without GPUs (DDP over gloo on CPU) with mmengine's ``Runner``.

mmengine 0.10.7 assumes CUDA for ``launcher='pytorch'``: ``init_dist`` calls
``torch.cuda.set_device(LOCAL_RANK)`` and ``Runner.wrap_model`` passes
``device_ids=[LOCAL_RANK]`` to ``DistributedDataParallel``; on a CPU-only machine the first
raises "Found no NVIDIA driver" and the second is rejected by DDP for CPU modules.
:func:`prepare_cpu_distributed` fixes a config before the Runner is built: it initialises the
process group itself with gloo (the Runner then skips ``init_dist``) and sets
``model_wrapper_cfg.device_ids=None``. On machines with CUDA it does nothing.
"""
import os
from typing import MutableMapping

import torch
import torch.distributed as torch_dist

#: environment variables torchrun / ``tools/dist_train.sh`` set for every process
TORCHRUN_ENV = ('RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT')


def prepare_cpu_distributed(cfg: MutableMapping, backend: str = 'gloo') -> bool:
    """Make ``cfg`` (launcher ``'pytorch'``) trainable with DDP on CPU; True if it did.

    Call before ``Runner.from_cfg(cfg)`` in every process started by torchrun.
    """
    if cfg.get('launcher', 'none') != 'pytorch' or torch.cuda.is_available():
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
                                      world_size=int(os.environ['WORLD_SIZE']))
    wrapper = cfg.get('model_wrapper_cfg') or dict(
        type='MMDistributedDataParallel',
        find_unused_parameters=cfg.get('find_unused_parameters', False))
    wrapper['device_ids'] = None  # CPU modules: DDP rejects device ids
    wrapper.setdefault('broadcast_buffers', False)  # what mmengine uses for its default DDP
    cfg['model_wrapper_cfg'] = wrapper
    return True
