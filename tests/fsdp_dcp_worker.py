"""Per-rank entry point of tests/engine/test_fsdp_dcp.py:
``torchrun tests/fsdp_dcp_worker.py MODE DATA WORK``.

The tiny ViT RetinaNet of tests/fsdp_worker.py (EMA hook included) under ``FSDP2Runner``.
Modes:

* ``train`` (2 ranks): ``fsdp``: 3 iterations with DCP checkpoints after each
  (``checkpoint_format='dcp'``, ``max_keep_ckpts`` :data:`MAX_KEEP`); ``resume``: resumes
  automatically (``resume=True``, no ``load_from``: the test wrote ``last_checkpoint``
  pointing at ``fsdp/iter_2``) and trains iteration 3; ``file``: the same 2 iterations with
  ``checkpoint_format='auto'`` (the tiny model is under the threshold: one file);
  then :func:`load` of ``fsdp/iter_3``.
* ``load`` (any world size): resumes from the DCP directory ``sys.argv[4]`` at its last
  iteration (nothing left to train) and writes the gathered model, averaged model and
  optimizer state as rank 0 sees them (``loaded{WORLD}.pt``).
"""
import json
import os
import os.path as osp
import sys
from typing import List

from fsdp_worker import _recorder, _runner, register_recorder, vit_cfg

ITERS = 3
#: checkpoints kept by the DCP run: iter_1 is removed when iter_3 is written
MAX_KEEP = 2


def dcp_cfg(data_root: str, work_dir: str, **overrides) -> dict:
    cfg = vit_cfg(data_root, work_dir, ITERS, 1, 1, 'pytorch', **overrides)
    cfg['default_hooks']['checkpoint']['max_keep_ckpts'] = MAX_KEEP
    return cfg


def load(data_root: str, work: str, path: str) -> None:
    """Resume from ``path`` with nothing left to train; rank 0 writes what was loaded."""
    import torch
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict)

    from vitdet_plugin.engine.fsdp_runner import GATHER
    world = int(os.environ['WORLD_SIZE'])
    runner = _runner(dcp_cfg(data_root, osp.join(work, f'load{world}'), resume=True,
                             load_from=path, experiment_name=f'load{world}'))
    runner.train()
    ema = next(h for h in runner.hooks if 'EMA' in type(h).__name__)
    loaded = dict(
        iter=runner.iter,
        model=get_model_state_dict(runner.model.module, options=GATHER),
        ema={k: v.full_tensor() if hasattr(v, 'full_tensor') else v
             for k, v in ema.ema_model.state_dict().items()},
        optimizer=get_optimizer_state_dict(runner.model.module,
                                           runner.optim_wrapper.optimizer, options=GATHER),
        lr=[g['lr'] for g in runner.optim_wrapper.optimizer.param_groups],
        schedulers=[s.state_dict() for s in runner.param_schedulers])
    if int(os.environ['RANK']) == 0:
        torch.save(loaded, osp.join(work, f'loaded{world}.pt'))


def train(data_root: str, work: str) -> None:
    rank = int(os.environ['RANK'])
    result = {}
    for name, overrides in (('fsdp', dict(checkpoint_format='dcp')),
                            ('resume', dict(checkpoint_format='dcp', resume=True)),
                            ('file', dict(checkpoint_format='auto'))):
        runner = _runner(dcp_cfg(data_root, osp.join(work, name), experiment_name=name,
                                 **overrides))
        runner.train()
        result[name] = dict(losses=_recorder(runner).losses,
                            format=runner.checkpoint_format)
    load(data_root, work, osp.join(work, 'fsdp', f'iter_{ITERS}'))
    with open(osp.join(work, f'rank{rank}.json'), 'w') as f:
        json.dump(result, f)


def main(argv: List[str]) -> None:
    import torch

    import vitdet_plugin  # noqa: F401
    torch.set_num_threads(1)
    register_recorder()
    mode, data_root, work = argv[:3]
    if mode == 'train':
        train(data_root, work)
    else:
        load(data_root, work, argv[3])


if __name__ == '__main__':
    main(sys.argv[1:])
