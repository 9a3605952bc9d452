"""``tools/benchmark.py --fsdp-memory``: per-rank memory of a ViT-L detector training step on
2 CPU ranks (gloo), DDP vs FSDP2 vs FSDP2 + activation checkpointing, and the computed per-GPU
bytes for 8 GPUs (DINOv3 7B / H+ / L).

Measured per rank (each option a fresh ``torchrun`` job of 2 processes, one image per rank):
bytes of the parameters, gradients and AdamW state this rank holds (local DTensor shards
under FSDP2), the peak resident set size of the process (``ru_maxrss``: model build, the step,
allocator caches; the number a job's memory limit sees), and the step's wall time (indicative
only on a shared machine). Run it as ``torchrun ... fsdp_memory.py OPTION JSON`` per rank.
"""
import json
import os
import os.path as osp
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

#: the measured options: (name, wrapper, activation checkpointing)
OPTIONS = (('DDP', 'ddp', False), ('FSDP2', 'fsdp', False), ('FSDP2 + ckpt', 'fsdp', True))
WORLD = 2
IMAGE = 256
#: the computed table: the backbones (DINOv3 presets) and the GPU count
GPU_ARCHS = (('DINOv3 7B', '7b'), ('DINOv3 H+', 'huge_plus'), ('DINOv3 L', 'large'))
NUM_GPUS = 8
#: bytes per parameter: fp32 weights 4 + fp32 gradients 4 + AdamW exp_avg / exp_avg_sq 8
FP32_ADAMW_BYTES = 16
#: FSDP2 with bf16 params: a block's gathered bf16 weights (2 B) for the running and the
#: prefetched block, and its unsharded fp32 gradient (4 B) before the reduce-scatter
GATHERED_BLOCK_BYTES = 2 * 2 + 4
GB = 1e9


def _model_cfg(with_cp: bool) -> Dict[str, Any]:
    return dict(
        type='RetinaNet',
        data_preprocessor=dict(type='DetDataPreprocessor', mean=[123.675, 116.28, 103.53],
                               std=[58.395, 57.12, 57.375], bgr_to_rgb=True,
                               pad_size_divisor=32),
        backbone=dict(type='ViTBackbone', arch='large', img_size=IMAGE, window_size=16,
                      with_cp=with_cp, drop_path_rate=0.0),
        neck=dict(type='ViTSimpleFPN', in_channels=1024, out_channels=256,
                  scale_factors=(2.0, 1.0, 0.5), in_stride=16, num_outs=3),
        bbox_head=dict(
            type='RetinaHead', num_classes=80, in_channels=256, stacked_convs=2,
            feat_channels=256,
            anchor_generator=dict(type='AnchorGenerator', octave_base_scale=4,
                                  scales_per_octave=3, ratios=[0.5, 1.0, 2.0],
                                  strides=[8, 16, 32]),
            bbox_coder=dict(type='DeltaXYWHBBoxCoder', target_means=[.0] * 4,
                            target_stds=[1.0] * 4),
            loss_cls=dict(type='FocalLoss', use_sigmoid=True, gamma=2.0, alpha=0.25,
                          loss_weight=1.0),
            loss_bbox=dict(type='L1Loss', loss_weight=1.0)),
        train_cfg=dict(assigner=dict(type='MaxIoUAssigner', pos_iou_thr=0.5, neg_iou_thr=0.4,
                                     min_pos_iou=0, ignore_iof_thr=-1),
                       sampler=dict(type='PseudoSampler'), allowed_border=-1, pos_weight=-1,
                       debug=False))


def _batch() -> Dict[str, Any]:
    import torch
    from mmdet.structures import DetDataSample
    from mmengine.structures import InstanceData
    g = torch.Generator().manual_seed(int(os.environ['RANK']))
    sample = DetDataSample(metainfo=dict(img_shape=(IMAGE, IMAGE), ori_shape=(IMAGE, IMAGE),
                                         pad_shape=(IMAGE, IMAGE), scale_factor=(1.0, 1.0)))
    sample.gt_instances = InstanceData(
        bboxes=torch.tensor([[16.0, 24.0, 120.0, 200.0], [100.0, 60.0, 230.0, 150.0]]),
        labels=torch.tensor([3, 7]))
    image = torch.randint(0, 256, (3, IMAGE, IMAGE), generator=g, dtype=torch.uint8)
    return dict(inputs=[image], data_samples=[sample])


def _local_bytes(tensors: List[Any]) -> int:
    from torch.distributed.tensor import DTensor
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def measure_rank(option: str, out_path: str) -> None:
    """One rank of one option (run by torchrun): build, wrap, one step, bytes + peak RSS."""
    import torch
    import torch.distributed as dist
    from mmdet.registry import MODELS
    from mmengine.model import MMDistributedDataParallel
    from mmengine.optim import OptimWrapper
    from mmengine.registry import init_default_scope

    import vitdet_plugin  # noqa: F401
    from vitdet_plugin.engine.fsdp import FSDP2Wrapper
    torch.set_num_threads(1)
    init_default_scope('mmdet')
    dist.init_process_group('gloo')
    name, kind, with_cp = next(o for o in OPTIONS if o[0] == option)
    torch.manual_seed(0)
    model = MODELS.build(_model_cfg(False))
    model.init_weights()
    if kind == 'ddp':
        model.backbone.with_cp = with_cp
        wrapped: Any = MMDistributedDataParallel(module=model, device_ids=None,
                                                 broadcast_buffers=False)
    else:
        wrapped = FSDP2Wrapper(model, activation_checkpointing=with_cp)
    params = list(wrapped.parameters())
    optim = OptimWrapper(torch.optim.AdamW(params, lr=1e-4, weight_decay=0.05))
    grads: Dict[str, int] = {}

    def count_grads(opt: Any, args: Any, kwargs: Any) -> None:  # before the step, after clip
        grads['bytes'] = _local_bytes([p.grad for p in params if p.grad is not None])
    optim.optimizer.register_step_pre_hook(count_grads)
    wrapped.train()
    times = []
    for _ in range(2):  # the second step: AdamW state allocated, caches warm
        start = time.perf_counter()
        wrapped.train_step(_batch(), optim)
        times.append(time.perf_counter() - start)
    state = [t for s in optim.optimizer.state.values() for t in s.values()
             if isinstance(t, torch.Tensor) and t.dim() > 0]
    row = dict(option=name, rank=dist.get_rank(), params=_local_bytes(params),
               grads=grads['bytes'], optimizer=_local_bytes(state),
               peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               step_s=times[-1], total_params=sum(p.numel() for p in params))
    with open(f'{out_path}.rank{dist.get_rank()}', 'w') as f:
        json.dump(row, f)
    dist.destroy_process_group()


def measure_all() -> List[Dict[str, Any]]:
    """Every option as its own 2-rank torchrun job; one row per (option, rank)."""
    rows = []
    root = osp.dirname(osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__)))))
    env = dict(os.environ, OMP_NUM_THREADS='1',
               PYTHONPATH=os.pathsep.join([root, os.environ.get('PYTHONPATH', '')]))
    with tempfile.TemporaryDirectory() as tmp:
        for name, _, _ in OPTIONS:
            out = osp.join(tmp, name.replace(' ', '_').replace('+', 'p'))
            cmd = [sys.executable, '-m', 'torch.distributed.run', f'--nproc_per_node={WORLD}',
                   '--standalone', osp.abspath(__file__),
                   name, out]
            subprocess.run(cmd, env=env, check=True)
            for rank in range(WORLD):
                with open(f'{out}.rank{rank}') as f:
                    rows.append(json.load(f))
    return rows


def gpu_table(num_gpus: int = NUM_GPUS) -> List[Dict[str, Any]]:
    """Per-GPU bytes of parameters + gradients + AdamW state (the backbone; activations and
    the detector head excluded), from the presets' parameter counts (built on meta)."""
    import torch

    import vitdet_plugin  # noqa: F401
    from vitdet_plugin.models.backbones import DINOv3Backbone
    rows = []
    for label, arch in GPU_ARCHS:
        with torch.device('meta'):
            bb = DINOv3Backbone(arch=arch)
        total = sum(p.numel() for p in bb.parameters())
        block = sum(p.numel() for p in bb.blocks[0].parameters())
        sharded = FP32_ADAMW_BYTES * total / num_gpus
        rows.append(dict(backbone=label, params=total, ddp=FP32_ADAMW_BYTES * total,
                         fsdp2=sharded + GATHERED_BLOCK_BYTES * block,
                         fsdp2_offload=GATHERED_BLOCK_BYTES * block))
    return rows


def format_tables(measured: List[Dict[str, Any]], computed: List[Dict[str, Any]]) -> List[str]:
    lines = [f'measured: ViT-L RetinaNet step, {WORLD} CPU ranks (gloo), {IMAGE}x{IMAGE}, '
             '1 image per rank, AdamW fp32; per rank (MB = 1e6 bytes)',
             '| option | rank | params MB | grads MB | AdamW MB | sum MB | peak RSS MB | step s |',
             '|---|---|---|---|---|---|---|---|']
    for r in measured:
        total = r['params'] + r['grads'] + r['optimizer']
        lines.append(f"| {r['option']} | {r['rank']} | {r['params'] / 1e6:.0f} | "
                     f"{r['grads'] / 1e6:.0f} | {r['optimizer'] / 1e6:.0f} | {total / 1e6:.0f} | "
                     f"{r['peak_rss'] / 1e6:.0f} | {r['step_s']:.1f} |")
    ddp = [r['step_s'] for r in measured if r['option'] == 'DDP']
    fsdp = [r['step_s'] for r in measured if r['option'] == 'FSDP2']
    if ddp and fsdp:
        lines.append(f'step time FSDP2 / DDP (indicative, shared CPU): '
                     f'{max(fsdp) / max(ddp):.2f}')
    lines += ['', f'computed: per GPU of {NUM_GPUS}, backbone params + grads + AdamW (GB = 1e9 '
              'bytes; activations and heads excluded)',
              '| backbone | params | DDP (fp32 / AMP) | FSDP2 bf16 params | FSDP2 + CPU offload |',
              '|---|---|---|---|---|']
    for r in computed:
        lines.append(f"| {r['backbone']} | {r['params'] / 1e9:.2f}B | {r['ddp'] / GB:.1f} | "
                     f"{r['fsdp2'] / GB:.1f} | {r['fsdp2_offload'] / GB:.2f} |")
    return lines


def run_fsdp_memory() -> Dict[str, Any]:
    """The whole report (printed); returned as a dict for ``--json``."""
    measured, computed = measure_all(), gpu_table()
    for line in format_tables(measured, computed):
        print(line, flush=True)
    return dict(measured=measured, computed=computed)


if __name__ == '__main__':
    measure_rank(sys.argv[1], sys.argv[2])
