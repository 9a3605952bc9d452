"""Save and load time, size on disk and peak RSS of the two checkpoint forms of ``FSDP2Runner``
on 2 CPU ranks (gloo): a DCP directory (every rank writes / reads its shards,
:func:`vitdet_plugin.engine.dcp.save_dcp` / :func:`~vitdet_plugin.engine.dcp.load_dcp`) and the
single file (full state gathered on rank 0, written by it; loaded by rank 0 and sent shard by
shard, ``broadcast_from_rank0``), for a ViT backbone with AdamW state (sharded per block).

    torchrun --nproc_per_node=2 tools/dev/bench/dcp_checkpoint.py [ARCH] [OUT_DIR]

Every rank prints one JSON line per phase: seconds, the process's peak RSS so far (``ru_maxrss``,
MB; the DCP phases run first, so theirs are their own peaks) and, on rank 0, the bytes on disk.
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

sys.path.insert(0, osp.dirname(osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))))

from vitdet_plugin.engine.dcp import load_dcp, save_dcp, split_tensors
from vitdet_plugin.engine.fsdp_runner import GATHER
from vitdet_plugin.models.backbones.vit import ViTBackbone

MB = 2 ** 20
DEFAULT_ARCH = 'base'


def _dir_bytes(path: str) -> int:
    if osp.isfile(path):
        return osp.getsize(path)
    return sum(osp.getsize(osp.join(path, f)) for f in os.listdir(path))


def _phase(name: str, fn: Callable[[], Any], path: str) -> None:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    row: Dict[str, Any] = dict(phase=name, rank=dist.get_rank(),
                               seconds=round(time.perf_counter() - start, 2),
                               peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                               // 1024)
    if dist.get_rank() == 0 and osp.exists(path):
        row['disk_mb'] = round(_dir_bytes(path) / MB, 1)
    print(json.dumps(row), flush=True)


def main() -> None:
    arch = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_ARCH
    dist.init_process_group('gloo')
    torch.manual_seed(0)
    model = ViTBackbone(arch=arch, img_size=224, out_indices=(-1,))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():  # AdamW's moments exist after a first step
        p.grad = torch.zeros_like(p)
    optimizer.step()
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

    _phase('init', lambda: None, '')
    _phase('dcp save', save_sharded, dcp_dir)
    _phase('dcp load', load_sharded, dcp_dir)
    _phase('file save', save_file, file)
    _phase('file load', load_file, file)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(dcp_dir)
        os.remove(file)
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
