"""Save and load time, size on disk and peak RSS of the two checkpoint forms of ``FSDP2Runner``
on 2 CPU ranks (gloo): a DCP directory (every rank writes / reads its shards,
:func:`vitdet_plugin.engine.dcp.save_dcp` / :func:`~vitdet_plugin.engine.dcp.load_dcp`) and the
single file (full state gathered on rank 0, written by it; loaded by rank 0 and sent shard by
shard, ``broadcast_from_rank0``), for a ViT backbone with AdamW state (sharded per block).
The model is built on the meta device and each rank allocates only its shards (as
``init_device='meta'`` does), so the peaks are those of the checkpoint phases, not of a whole
model built first.

    torchrun --nproc_per_node=2 tools/dev/bench/dcp_checkpoint.py [ARCH] [OUT_DIR]

Every rank prints one JSON line per phase: seconds, the process's peak RSS so far (``ru_maxrss``,
MB; the DCP phases run first, so theirs are their own peaks), the part of it above the process's
runtime before the model existed (``baseline_mb``: torch, mmdet, gloo; the same for any model)
over the full copy of the model + AdamW state (``full_state_mb``: parameters, buffers and two
moments per trainable parameter, all ranks together) and, on rank 0, the bytes on disk.
"""
import json
import os
import os.path as osp
import resource
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Dict

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, osp.dirname(osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))))

from vitdet_plugin.engine.dcp import load_dcp, save_dcp, split_tensors
from vitdet_plugin.engine.fsdp_runner import GATHER
from vitdet_plugin.models.backbones.vit import ViTBackbone

MB = 2 ** 20
DEFAULT_ARCH = 'base'
#: std of the random fill of the shards (the values do not matter here)
INIT_STD = 0.02


def _dir_bytes(path: str) -> int:
    if osp.isfile(path):
        return osp.getsize(path)
    return sum(osp.getsize(osp.join(path, f)) for f in os.listdir(path))


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _phase(name: str, fn: Callable[[], Any], path: str, full_mb: float,
           baseline_mb: float) -> None:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    peak = _peak_mb()
    row: Dict[str, Any] = dict(phase=name, rank=dist.get_rank(),
                               seconds=round(time.perf_counter() - start, 2),
                               peak_rss_mb=round(peak), baseline_mb=round(baseline_mb),
                               full_state_mb=round(full_mb),
                               above_baseline_over_full=round((peak - baseline_mb) / full_mb, 2))
    if dist.get_rank() == 0 and osp.exists(path):
        row['disk_mb'] = round(_dir_bytes(path) / MB, 1)
    print(json.dumps(row), flush=True)


def main() -> None:
    arch = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_ARCH
    dist.init_process_group('gloo')
    torch.manual_seed(0)
    dist.barrier()  # gloo's buffers exist
    baseline_mb = _peak_mb()
    with torch.device('meta'):
        model = ViTBackbone(arch=arch, img_size=224, out_indices=(-1,))
    full_mb = sum(4 * t.numel() for t in [*model.parameters(), *model.buffers()]) / MB
    full_mb += sum(2 * 4 * p.numel() for p in model.parameters() if p.requires_grad) / MB
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device='cpu')  # this rank's shards only
    with torch.no_grad():  # any values: memory and time do not depend on them
        for t in [*model.parameters(), *model.buffers()]:
            local = t.to_local() if isinstance(t, DTensor) else t
            local.normal_(0.0, INIT_STD) if local.is_floating_point() else local.zero_()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():  # AdamW's state after a step, without the step's gradients
        # (the runner saves after zero_grad(set_to_none=True): no gradients at save or load)
        optimizer.state[p] = dict(step=torch.tensor(1.0), exp_avg=torch.zeros_like(p),
                                  exp_avg_sq=torch.zeros_like(p))
    out = sys.argv[2] if len(sys.argv) > 2 else tempfile.gettempdir()
    dcp_dir, file = osp.join(out, f'bench_{arch}_dcp'), osp.join(out, f'bench_{arch}.pth')

    def save_sharded() -> None:
        save_dcp(dict(state_dict=get_model_state_dict(model),
                      optimizer=get_optimizer_state_dict(model, optimizer)), dcp_dir)

    def load_sharded() -> None:
        templates: Dict[str, torch.Tensor] = {}
        split_tensors(get_model_state_dict(model), templates, 'state_dict')
        split_tensors(get_optimizer_state_dict(model, optimizer), templates, 'optimizer')
        checkpoint, _ = load_dcp(dcp_dir, templates)
        set_model_state_dict(model, checkpoint['state_dict'])
        set_optimizer_state_dict(model, optimizer, checkpoint['optimizer'])

    def save_file() -> None:
        state = dict(state_dict=get_model_state_dict(model, options=GATHER),
                     optimizer=get_optimizer_state_dict(model, optimizer, options=GATHER))
        if dist.get_rank() == 0:
            torch.save(state, file)

    def load_file() -> None:
        full = torch.load(file, weights_only=True) if dist.get_rank() == 0 else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, full.get('state_dict', {}), options=options)
        set_optimizer_state_dict(model, optimizer, full.get('optimizer', {}), options=options)

    _phase('init', lambda: None, '', full_mb, baseline_mb)
    _phase('dcp save', save_sharded, dcp_dir, full_mb, baseline_mb)
    _phase('dcp load', load_sharded, dcp_dir, full_mb, baseline_mb)
    _phase('file save', save_file, file, full_mb, baseline_mb)
    _phase('file load', load_file, file, full_mb, baseline_mb)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(dcp_dir)
        os.remove(file)
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
