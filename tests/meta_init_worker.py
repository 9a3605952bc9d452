"""Per-rank entry point of tests/engine/test_fsdp_meta_init.py:
``torchrun tests/meta_init_worker.py DATA WORK CHECKPOINT...``.

``FSDP2Runner`` s build the tiny ViT RetinaNet of tests/fsdp_worker.py with the backbone's
``init_cfg`` Pretrained on a checkpoint (a timm ViT in the ``timm_vit`` layout, the same tensors
as ``.safetensors`` and ``.pth``): the existing path (the whole model built and initialised on
every rank, then sharded) from the first file, and ``init_device='meta'`` from each. Each
run's sharded weights are gathered (``get_model_state_dict``, full) and rank 0 saves them as
``WORK/<run>.pt``; every rank writes what its model held (``WORK/<run>.rank<r>.json``). The
meta run of the first checkpoint then trains one iteration (its loss in the JSON).
"""
import json
import os
import os.path as osp
import sys
from typing import Any, Dict, List

from fsdp_worker import _runner, register_recorder, vit_cfg


def meta_cfg(data_root: str, work: str, name: str, checkpoint: str, meta: bool) -> dict:
    """The tiny ViT RetinaNet (no relative positions: a timm ViT has none) loading
    ``checkpoint`` into its backbone; ``meta``: ``init_device='meta'``."""
    cfg = vit_cfg(data_root, osp.join(work, name), 1, 1, 1, 'pytorch', experiment_name=name)
    cfg['model']['backbone'].update(
        use_rel_pos=False, init_cfg=dict(type='Pretrained', checkpoint=checkpoint))
    cfg['custom_hooks'] = [h for h in cfg['custom_hooks'] if h['type'] != 'EMAHook']
    if meta:
        cfg['model_wrapper_cfg'] = dict(type='FSDP2Wrapper', init_device='meta')
    return cfg


def gathered(runner: Any) -> Dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from vitdet_plugin.engine.fsdp_runner import GATHER
    return get_model_state_dict(runner.model.module, options=GATHER)


def main(argv: List[str]) -> None:
    import torch

    import vitdet_plugin  # noqa: F401
    torch.set_num_threads(1)
    register_recorder()
    data_root, work, *checkpoints = argv
    rank = int(os.environ['RANK'])
    for i, checkpoint in enumerate(checkpoints):
        fmt = checkpoint.rsplit('.', 1)[1]
        for meta in (False, True) if i == 0 else (True,):
            name = f"{fmt}_{'meta' if meta else 'whole'}"
            runner = _runner(meta_cfg(data_root, work, name, checkpoint, meta))
            backbone = runner.model.module.backbone
            result: Dict[str, Any] = dict(
                bytes=local_bytes_of(runner), report=list(backbone.init_report.loaded),
                built_on_meta=runner.model.built_on_meta)
            state = gathered(runner)
            if rank == 0:
                torch.save(state, osp.join(work, f'{name}.pt'))
            if meta and i == 0:
                runner.train()
                result['losses'] = next(h for h in runner.hooks
                                        if type(h).__name__ == 'FsdpRecorder').losses
            with open(osp.join(work, f'{name}.rank{rank}.json'), 'w') as f:
                json.dump(result, f)


def local_bytes_of(runner: Any) -> Dict[str, int]:
    """Bytes of this rank's parameter shards and of the whole model (before training)."""
    from torch.distributed.tensor import DTensor
    params = list(runner.model.module.parameters())
    return dict(local_params=sum(p.to_local().nbytes if isinstance(p, DTensor) else p.nbytes
                                 for p in params),
                total_params=sum(p.numel() * p.element_size() for p in params))


if __name__ == '__main__':
    main(sys.argv[1:])
