"""``tools/benchmark.py --init-memory``: peak host memory per rank while a ViT-L detector
(DINOv2 ``large`` backbone with a timm-layout pretrained checkpoint, 304M parameters) is built,
loaded and sharded over 2 CPU ranks (gloo), for each way of initialising it, against the size
of a full copy of the model + AdamW state; and the computed per-rank host memory of the
DINOv3 7B preset (init, load, save; single file and DCP).

Measured per rank, each option a fresh ``torchrun`` job of 2 processes: the resident set
after the imports (``base``), its peak (``ru_maxrss``: everything the process touched,
file-backed pages of a memory-mapped checkpoint included) and the bytes of the local shards.
Options: ``whole`` (every rank builds and initialises the whole model, then shards: the
default), ``init_on_rank0`` (rank 0 alone; the others on the meta device, their shards sent),
``meta`` (``init_device='meta'``: the backbone on the meta device everywhere, each rank copies
its shards out of the memory-mapped ``.safetensors`` / ``.pth``). Run it as ``torchrun ...
init_memory.py OPTION CHECKPOINT JSON`` per rank; ``init_memory.py setup DIR`` writes the
checkpoints.
"""
import json
import os
import os.path as osp
import resource
import subprocess
import sys
import tempfile
from typing import Any, Dict, List

#: the measured runs: (name, option, checkpoint suffix)
RUNS = (('whole, .pth', 'whole', 'pth'), ('init_on_rank0, .pth', 'init_on_rank0', 'pth'),
        ('meta, .safetensors', 'meta', 'safetensors'), ('meta, .pth', 'meta', 'pth'))
WORLD = 2
#: timm's DINOv2-L: the layout of the hub's files (converted by the table)
TIMM_MODEL = 'vit_large_patch14_dinov2'
IMAGE = 224
#: bytes per parameter of a full copy of the model + AdamW state: fp32 weights 4 + exp_avg 4
#: + exp_avg_sq 4
FULL_COPY_BYTES = 12
#: the same without gradients, and for the 7B table: fp32 weights only
WEIGHT_BYTES = 4
#: the 7B table's ranks: one node of 8 GPUs
NUM_RANKS = 8
MB, GB = 1e6, 1e9


def _model_cfg(checkpoint: str) -> Dict[str, Any]:
    from dev.bench.fsdp_memory import _model_cfg as retinanet_cfg
    cfg = retinanet_cfg(with_cp=False)
    cfg['backbone'] = dict(type='DINOv2Backbone', arch='large', img_size=IMAGE,
                           drop_path_rate=0.0,
                           init_cfg=dict(type='Pretrained', checkpoint=checkpoint))
    return cfg


def _rss() -> int:
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith('VmRSS'))


def measure_rank(option: str, checkpoint: str, out_path: str) -> None:
    """One rank of one option (run by torchrun): build, load, shard; peak RSS."""
    import torch
    import torch.distributed as dist
    from mmdet.registry import MODELS
    from mmengine.registry import init_default_scope
    from torch.distributed.tensor import DTensor

    import vitdet_plugin  # noqa: F401
    from vitdet_plugin.engine.fsdp import FSDP2Wrapper
    from vitdet_plugin.engine.meta_init import build_with_meta_parts
    torch.set_num_threads(1)
    init_default_scope('mmdet')
    dist.init_process_group('gloo')
    base = _rss()
    torch.manual_seed(0)
    cfg = _model_cfg(checkpoint)
    if option == 'meta':
        wrapped = FSDP2Wrapper(build_with_meta_parts(MODELS.build, cfg), init_device='meta')
    elif option == 'init_on_rank0' and dist.get_rank() != 0:
        with torch.device('meta'):
            model = MODELS.build(cfg)
        wrapped = FSDP2Wrapper(model, init_on_rank0=True)
    else:
        model = MODELS.build(cfg)
        model.init_weights()
        wrapped = FSDP2Wrapper(model, init_on_rank0=option == 'init_on_rank0')
        del model
    params = list(wrapped.parameters())
    row = dict(option=option, rank=dist.get_rank(), base_rss=base,
               peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               local=sum((p.to_local() if isinstance(p, DTensor) else p).nbytes
                         for p in params),
               total_params=sum(p.numel() for p in params),
               backbone_params=sum(p.numel() for n, p in wrapped.named_parameters()
                                   if n.startswith('module.backbone.')))
    with open(f'{out_path}.rank{dist.get_rank()}', 'w') as f:
        json.dump(row, f)
    dist.destroy_process_group()


def write_checkpoints(folder: str) -> Dict[str, str]:
    """timm's DINOv2-L (random weights) as ``.safetensors`` and ``.pth`` in ``folder``."""
    import timm
    import torch
    from safetensors.torch import save_file
    model = timm.create_model(TIMM_MODEL, pretrained=False, num_classes=0)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    paths = {ext: osp.join(folder, f'dinov2_l.{ext}') for ext in ('safetensors', 'pth')}
    save_file(sd, paths['safetensors'])
    torch.save(sd, paths['pth'])
    return paths


def measure_all() -> List[Dict[str, Any]]:
    """Every run as its own 2-rank torchrun job; one row per (run, rank)."""
    rows = []
    root = osp.dirname(osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__)))))
    tools = osp.join(root, 'tools')
    env = dict(os.environ, OMP_NUM_THREADS='1',
               PYTHONPATH=os.pathsep.join([root, tools, os.environ.get('PYTHONPATH', '')]))
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, osp.abspath(__file__), 'setup', tmp], env=env,
                       check=True)
        for name, option, ext in RUNS:
            out = osp.join(tmp, f'{option}_{ext}')
            cmd = [sys.executable, '-m', 'torch.distributed.run', f'--nproc_per_node={WORLD}',
                   '--standalone', osp.abspath(__file__), option,
                   osp.join(tmp, f'dinov2_l.{ext}'), out]
            subprocess.run(cmd, env=env, check=True)
            for rank in range(WORLD):
                with open(f'{out}.rank{rank}') as f:
                    rows.append(dict(json.load(f), run=name))
    return rows


def dinov3_7b_table(num_ranks: int = NUM_RANKS) -> Dict[str, Any]:
    """Per-rank host memory of the DINOv3 7B preset (built on meta for its parameter count)
    during init, load and save, single file vs sharded (computed, see :func:`format_tables`)."""
    import torch

    import vitdet_plugin  # noqa: F401
    from vitdet_plugin.models.backbones import DINOv3Backbone
    with torch.device('meta'):
        bb = DINOv3Backbone(arch='7b')
    params = sum(p.numel() for p in bb.parameters())
    block = max(p.numel() for p in bb.parameters())
    full_w, full_state = WEIGHT_BYTES * params, FULL_COPY_BYTES * params
    shard_w, shard_state = full_w / num_ranks, full_state / num_ranks
    return dict(params=params, largest_tensor=block, ranks=num_ranks, rows=[
        # (stage, single-file / whole-model form on rank 0, sharded form on every rank)
        ('init (pretrained)', full_w + full_w + shard_w, shard_w + WEIGHT_BYTES * block),
        ('load (resume)', full_state + shard_state, shard_state),
        ('save', full_state + shard_state, shard_state)])


def format_tables(measured: List[Dict[str, Any]], computed: Dict[str, Any]) -> List[str]:
    total = measured[0]['total_params']
    full = FULL_COPY_BYTES * total
    lines = [f'measured: RetinaNet with a DINOv2-L backbone ({total / 1e6:.0f}M parameters, '
             f'{measured[0]["backbone_params"] / 1e6:.0f}M pretrained, timm layout), {WORLD} '
             f'CPU ranks (gloo); full copy of model + AdamW state = {FULL_COPY_BYTES} B x '
             f'params = {full / MB:.0f} MB (MB = 1e6 bytes)',
             '| init | rank | base RSS MB | peak RSS MB | peak - base MB | shards MB | '
             'peak / full copy |',
             '|---|---|---|---|---|---|---|']
    for r in measured:
        lines.append(f"| {r['run']} | {r['rank']} | {r['base_rss'] / MB:.0f} | "
                     f"{r['peak_rss'] / MB:.0f} | {(r['peak_rss'] - r['base_rss']) / MB:.0f} | "
                     f"{r['local'] / MB:.0f} | {r['peak_rss'] / full:.2f} |")
    lines += ['', f"computed: DINOv3 7B ({computed['params'] / 1e9:.2f}B parameters), "
              f"{computed['ranks']} ranks, per rank, GB = 1e9 bytes",
              '| stage | single file / whole model (rank 0) | sharded (every rank) |',
              '|---|---|---|']
    for stage, single, sharded in computed['rows']:
        lines.append(f'| {stage} | {single / GB:.1f} | {sharded / GB:.1f} |')
    return lines


def run_init_memory() -> Dict[str, Any]:
    """The whole report (printed); returned as a dict for ``--json``."""
    measured, computed = measure_all(), dinov3_7b_table()
    for line in format_tables(measured, computed):
        print(line, flush=True)
    return dict(measured=measured, computed=computed)


if __name__ == '__main__':
    if sys.argv[1] == 'setup':
        write_checkpoints(sys.argv[2])
    else:
        measure_rank(*sys.argv[1:4])
