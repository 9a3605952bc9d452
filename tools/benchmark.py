#!/usr/bin/env python
"""Command line of ``tools/benchmark.py``: ours vs the reference implementations, as ratios.

Same config, same weights, the models interleaved on every repeat; results as ratios
(ours / reference, < 1 is better). Ours is the one plain forward of every device (its CPU
figures: docs/speed.md#cpu-inference); CPU inference goes through the end-to-end ONNX graph in
onnxruntime (``tools/export_onnx.py --part detector``, then ``tools/infer.py --backend
onnxruntime``, docs/deploy.md), timed against PyTorch by ``--end-to-end`` below.

    python tools/benchmark.py                       # Swin-T vs mmdet and timm, CPU
    python tools/benchmark.py --model vit           # ViT-B vs timm samvit_base_patch16
    python tools/benchmark.py --model swinv2        # Swin V2-T vs timm swinv2_tiny_window8_256
    python tools/benchmark.py --model eva02         # EVA-02-B vs timm eva02 (also dinov2, dinov3)
    python tools/benchmark.py --device cuda         # GPU: 800x1216 batch 2, fp32 and bf16
    python tools/benchmark.py --model vit --device cuda --json vit.json
    python tools/benchmark.py --model ops           # compile-free mmcv ops vs compiled mmcv
    python tools/benchmark.py --fsdp-memory         # DDP vs FSDP2 per-rank memory, 2 CPU ranks
    python tools/benchmark.py --init-memory         # per-rank host memory of pretrained init
    python tools/benchmark.py --end-to-end CONFIG CKPT det.onnx   # onnxruntime vs PyTorch eval
    python tools/benchmark.py --rfdetr-onnx         # RF-DETR N 384 px: ours vs rfdetr's ONNX
    python tools/benchmark.py --rfdetr-onnx N-Seg   # RF-DETR-Seg N 312 px, the same
    python tools/benchmark.py --rfdetr-train        # RF-DETR N: training step and eval forward
    python tools/benchmark.py --dfine-latency       # D-FINE N 640 px vs transformers' DFine
    python tools/benchmark.py --dfine-latency deimv2_s   # DEIMv2 S (or deimv2_n, a CONFIG)

Swin: ours vs mmdet's ``SwinTransformer`` and timm's swin. ViT: ours vs timm's samvit (its
features before the neck). DINOv2 / DINOv3 / EVA-02 (``--model dinov2|dinov3|eva02``): ours
with global attention in every block vs timm's model (same weights, patch 16, timm's
``forward_intermediates`` of the last block), and ours windowed (the detection configuration)
as a third column. Every option applies to all compared models.

CPU (default): sizes 224, 800x1216, 1024 (ViT: 1024), batch 1, fp32; each table row (size,
with_cp, dtype) runs in ``--processes`` fresh processes (default 3) holding all compared
models, their repeats pooled and the per-process ratios printed under the row: on a shared
2-core VM the references' forward moved by up to 30% between processes. Memory column: the
distinct storages autograd saves for backward in a training forward (parameters excluded).

CUDA: 800x1216 (ViT: 1024x1024), batch 2, fp32 and bf16 autocast, forward and training step
(forward + backward) at the same size, median of at least 10 runs after 3 warm-up calls,
``torch.cuda.synchronize`` around every timed call, one process per row. Memory column: the
peak CUDA allocation of a training forward + backward above the model's own footprint.

``--compile``: the training step only (CPU: 512x512, batch 2), ours compiled vs the reference
eager and compiled the same way (and ours eager): ``tools/dev/bench/compiled.py``.

Columns: ``fwd`` forward seconds (eval, no grad); ``fwd+bwd`` training forward + backward
seconds; ``mem MB`` as above. Before timing, ours is checked against mmdet (Swin) or timm
(ViT) on the same input.

``--end-to-end CONFIG CKPT MODEL.onnx``: an end-to-end detector graph (``tools/export_onnx.py
--part detector``) in onnxruntime vs the checkpoint in PyTorch eval (mmdet's ``predict``), batch
1, CPU, at ``--sizes`` (default 192x192 and 800x1216), ``--repeats`` interleaved runs after an
untimed parity call and ``--warmup`` more: seconds, ratio, file size
(``tools/dev/bench/end_to_end_latency.py``).

``--rfdetr-onnx [N | N-Seg]``: RF-DETR N at 384 px (or RF-DETR-Seg N at 312 px), CPU, batch 1:
our end-to-end graph in onnxruntime,
our model in PyTorch eager, rfdetr's own ONNX export of the same weights in onnxruntime and
rfdetr's PyTorch eager, interleaved (``tools/dev/bench/rfdetr_onnx.py``).

``--rfdetr-train [N | N-Seg]``: RF-DETR N at 384 px (RF-DETR-Seg N at 312 px), CPU, ``--batch``
images (default 2): one training step (each side's whole optimizer step) and one eval forward
(with post-processing), ours vs rfdetr's on the same batch and weights, interleaved, as ratios
(``tools/dev/bench/rfdetr_train.py``).

``--dfine-latency [dfine_n | deimv2_n | deimv2_s | CONFIG]``: D-FINE N (the default), DEIMv2 N
(HGNetV2), DEIMv2 S (DINOv3) or any D-FINE / DEIMv2 config at 640x640, CPU, batch 1, fp32: ours
vs transformers' ``DFineForObjectDetection`` / ``Deimv2ForObjectDetection`` built at the same
size with the same weights (its ``save_pretrained`` folder loaded into ours), PyTorch eager
(predict vs forward + post-processing) and onnxruntime (our end-to-end graph vs transformers'
model in a uint8 -> top-k wrapper at the fixed size, by torch's dynamo exporter or, where that
fails, the TorchScript one), interleaved, as ratios, the top scores and boxes of both sides
checked equal first (``tools/dev/bench/dfine_latency.py``).

This file is the command line; the measuring code is the developer package ``dev.bench``
(``tools/dev/bench/``: plan, models, rows, compiled, ops, fsdp_memory, init_memory,
end_to_end_latency; no entry point of its own), imported with ``tools/`` on the path, which
running this script gives.
"""
import argparse
import json
import os
import sys
import warnings
from typing import Callable, List, Optional, Sequence

import torch

from dev.bench.end_to_end_latency import DEFAULT_SIZES as END_TO_END_SIZES
from dev.bench.end_to_end_latency import check_files, run_end_to_end
from dev.bench.fsdp_memory import run_fsdp_memory
from dev.bench.init_memory import run_init_memory
from dev.bench.compiled import (compile_row_specs, format_compiled_row,
                                measure_compiled_row, resolve_compile)
from dev.bench.ops import run_ops
from dev.bench.rfdetr_onnx import MODELS as RFDETR_MODELS
from dev.bench.rfdetr_train import DEFAULT_BATCH as RFDETR_TRAIN_BATCH
from dev.bench.rfdetr_train import run_rfdetr_train
from dev.bench.plan import (CLOCKS, DEFAULT_ARCH, DTYPES, MODELS, DevicePlan,
                            check_repeats, make_timer, parse_size, plan_for)
from dev.bench.rows import (Row, RowSettings, RowSpec, format_row, measure_row,
                            pool_rows, run_row_in_child, with_cp_line)


def _size(text: str) -> tuple:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog='tools/benchmark.py', description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--model', choices=MODELS, default='swin')
    p.add_argument('--arch', default=None,
                   help='swin: tiny/small/base/large (default tiny); vit: base/large/huge; '
                        'dinov2 / dinov3 / eva02: their presets (small, base, large, ...; '
                        'default base)')
    p.add_argument('--device', default='cpu', help='cpu, cuda or cuda:N')
    p.add_argument('--sizes', nargs='+', type=_size, default=None,
                   help='forward sizes, N or HxW (default: see above)')
    p.add_argument('--train-size', type=_size, default=None,
                   help='size of the training step and memory columns (CPU default 512; CUDA '
                        'default: the forward size)')
    p.add_argument('--batch', type=int, default=None, help='images per batch (CPU 1, CUDA 2)')
    p.add_argument('--dtypes', nargs='+', choices=DTYPES, default=None,
                   help='precisions (CPU fp32; CUDA fp32 bf16); bf16 = autocast')
    p.add_argument('--repeats', type=int, default=None,
                   help='timed runs per model and measurement (CPU 5; CUDA 10, the minimum)')
    p.add_argument('--warmup', type=int, default=None,
                   help='untimed calls per model first (CPU 1, CUDA 3)')
    p.add_argument('--threads', type=int, default=None, help='torch CPU threads')
    p.add_argument('--with-cp', action='store_true',
                   help='also measure with activation checkpointing (ours and mmdet with_cp, '
                        'timm set_grad_checkpointing)')
    p.add_argument('--skip-backward', action='store_true', help='no training-step timing')
    p.add_argument('--compile', action='store_true',
                   help='the training step under torch.compile (inductor): ours compiled vs '
                        'the reference eager and compiled the same way, at --train-size '
                        '(default batch 2); see tools/dev/bench/compiled.py')
    p.add_argument('--clock', choices=CLOCKS, default='wall',
                   help="'cpu': process CPU time (all threads), robust on a shared machine; "
                        'CPU only')
    p.add_argument('--same-process', action='store_true',
                   help='measure every row in this process (default on CPU: each row in fresh '
                        'processes; the models stay interleaved within a row)')
    p.add_argument('--processes', type=int, default=None,
                   help='fresh processes per row, repeats pooled (CPU 3, CUDA 1)')
    p.add_argument('--json', default=None, metavar='PATH', help='also write the rows as JSON')
    p.add_argument('--fsdp-memory', action='store_true',
                   help='per-rank bytes and peak RSS of a ViT-L detector step on 2 CPU ranks, '
                   'DDP vs FSDP2 vs FSDP2 + checkpointing, and the computed 8-GPU table '
                   '(tools/dev/bench/fsdp_memory.py)')
    p.add_argument('--init-memory', action='store_true',
                   help='peak RSS per rank of a DINOv2-L detector initialised from a '
                   "pretrained checkpoint on 2 CPU ranks: whole model vs init_on_rank0 vs "
                   "init_device='meta', and the computed 7B table "
                   '(tools/dev/bench/init_memory.py)')
    p.add_argument('--end-to-end', nargs=3, default=None, metavar=('CONFIG', 'CKPT', 'ONNX'),
                   help='end-to-end detector latency: the graph of tools/export_onnx.py --part '
                        'detector in onnxruntime vs the checkpoint in PyTorch eval, batch 1, '
                        'CPU (tools/dev/bench/end_to_end_latency.py)')
    p.add_argument('--rfdetr-onnx', nargs='?', const='N', default=None, choices=list(RFDETR_MODELS),
                   help='RF-DETR N (384 px; the default) or N-Seg (312 px), CPU: our graph and '
                        'model vs rfdetr\'s own ONNX export of the same weights '
                        '(tools/dev/bench/rfdetr_onnx.py)')
    p.add_argument('--rfdetr-train', nargs='?', const='N', default=None,
                   choices=list(RFDETR_MODELS),
                   help='RF-DETR N (384 px; the default) or N-Seg (312 px), CPU: our training '
                        'step and eval forward vs rfdetr\'s on the same batch '
                        '(tools/dev/bench/rfdetr_train.py)')
    p.add_argument('--dfine-latency', nargs='?', const='dfine_n', default=None,
                   metavar='dfine_n|deimv2_n|deimv2_s|CONFIG',
                   help='D-FINE N (the default), DEIMv2 N / S or a D-FINE / DEIMv2 config at '
                        '640 px, CPU: our eager model and ONNX graph vs transformers\' '
                        'DFineForObjectDetection / Deimv2ForObjectDetection of the same size '
                        'and weights, as ratios (tools/dev/bench/dfine_latency.py)')
    p.add_argument('--row', default=None, help=argparse.SUPPRESS)  # internal: one child row
    return p


def resolve(p: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``argv`` and fill every default from the device's plan; errors name the option."""
    args = p.parse_args(argv)
    try:
        plan = plan_for(args.device, args.model)
        args.repeats = check_repeats(plan, args.repeats)
        args.timer = make_timer(plan, args.clock)
    except ValueError as e:
        p.error(str(e))
    args.plan = plan
    args.arch = args.arch or DEFAULT_ARCH[args.model]
    if args.end_to_end:
        if args.device != 'cpu':
            p.error(f'--end-to-end measures on the CPU only, got --device {args.device}')
        try:
            check_files(*args.end_to_end)
        except ValueError as e:
            p.error(str(e))
    args.sizes = args.sizes or list(END_TO_END_SIZES if args.end_to_end else plan.sizes)
    args.train_size = args.train_size or plan.train_size
    args.dtypes = args.dtypes or list(plan.dtypes)
    for name, least in (('batch', 1), ('warmup', 0), ('processes', 1), ('threads', 1)):
        value = getattr(args, name)
        if value is not None and value < least:
            p.error(f'--{name} must be at least {least}, got {value}')
    if args.compile:
        resolve_compile(p, args)
    args.batch = args.batch or (RFDETR_TRAIN_BATCH if args.rfdetr_train else plan.batch)
    args.warmup = plan.warmup if args.warmup is None else args.warmup
    args.processes = args.processes or plan.processes
    return args


def row_specs(args: argparse.Namespace) -> List[RowSpec]:
    """The rows of a run, in order: per size, per dtype, without then with checkpointing."""
    if args.compile:
        return compile_row_specs(args)
    cps = [False, True] if args.with_cp else [False]
    return [RowSpec(size, cp, dtype) for size in args.sizes for dtype in args.dtypes
            for cp in cps]


#: What ours is compared with, per ``--model`` (the header line).
REFERENCES = {'swin': 'mmdet SwinTransformer, timm swin', 'swinv2': 'timm swinv2',
              'vit': 'timm samvit', 'dinov2': 'timm dinov2 (reg4), ours windowed',
              'dinov3': 'timm dinov3, ours windowed', 'eva02': 'timm eva02, ours windowed'}


def settings_of(args: argparse.Namespace) -> RowSettings:
    return RowSettings(model=args.model, arch=args.arch, plan=args.plan, timer=args.timer,
                       train_size=args.train_size, batch=args.batch, repeats=args.repeats,
                       warmup=args.warmup, skip_backward=args.skip_backward)


def header(args: argparse.Namespace) -> str:
    plan: DevicePlan = args.plan
    device = args.device
    if plan.synchronize:
        device += f' ({torch.cuda.get_device_name(args.device)})'
    refs = REFERENCES[args.model] + (' (--compile: training step)' if args.compile else '')
    return (f'{args.model}-{args.arch} vs {refs} | device={device} batch={args.batch} '
            f'train={args.train_size[0]}x{args.train_size[1]} repeats={args.repeats} '
            f'warmup={args.warmup} clock={args.clock} threads={torch.get_num_threads()} '
            f'torch={torch.__version__} load={os.getloadavg()[0]:.1f}')


def measure_of(args: argparse.Namespace) -> Callable[[RowSettings, RowSpec], Row]:
    """How one row is measured: the eager comparison, or ``--compile``'s."""
    return measure_compiled_row if args.compile else measure_row


def run(args: argparse.Namespace, argv: Sequence[str]) -> List[Row]:
    rows: List[Row] = []
    settings = settings_of(args)
    for spec in row_specs(args):
        if args.same_process:
            row = measure_of(args)(settings, spec)
        else:
            row = pool_rows([run_row_in_child(argv, spec) for _ in range(args.processes)])
        plain = rows[-1] if rows else None
        rows.append(row)
        for line in (format_compiled_row if args.compile else format_row)(row):
            print(line, flush=True)
        extra = with_cp_line(row, plain)
        if extra:
            print(extra, flush=True)
    return rows


def run_rfdetr(args: argparse.Namespace) -> List[Row]:
    """``--rfdetr-onnx [N | N-Seg]`` (tools/dev/bench/rfdetr_onnx.py: its own table, in this
    process)."""
    from dev.bench.rfdetr_onnx import run_rfdetr_onnx
    result = run_rfdetr_onnx(args.rfdetr_onnx, repeats=args.repeats, warmup=args.warmup)
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(rfdetr_onnx=result), f, indent=1)
    return []


def main(argv: Optional[Sequence[str]] = None) -> List[Row]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = resolve(build_parser(), argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # mmdet's SwinTransformer(with_cp=True) calls checkpoint() without use_reentrant
    warnings.filterwarnings('ignore', message='torch.utils.checkpoint: the use_reentrant')
    torch.manual_seed(0)
    if args.model == 'ops':  # tools/dev/bench/ops.py: its own rows, in this process
        return run_ops(args)
    if args.init_memory:  # tools/dev/bench/init_memory.py: 2-rank jobs of its own
        print(f'load average {os.getloadavg()[0]:.1f} (1 min)', flush=True)
        report = run_init_memory()
        if args.json:
            with open(args.json, 'w') as f:
                json.dump(report, f, indent=1)
        return []
    if args.fsdp_memory:  # tools/dev/bench/fsdp_memory.py: 2-rank jobs of its own
        report = run_fsdp_memory()
        if args.json:
            with open(args.json, 'w') as f:
                json.dump(report, f, indent=1)
        return []
    if args.rfdetr_onnx:
        return run_rfdetr(args)
    if args.dfine_latency:  # tools/dev/bench/dfine_latency.py: its own table, in this process
        from dev.bench.dfine_latency import run_dfine_latency
        result = run_dfine_latency(args.dfine_latency, repeats=args.repeats, warmup=args.warmup)
        if args.json:
            with open(args.json, 'w') as f:
                json.dump(dict(dfine_latency=result), f, indent=1)
        return []
    if args.rfdetr_train:  # tools/dev/bench/rfdetr_train.py: its own table, in this process
        result = run_rfdetr_train(args.timer, args.rfdetr_train, repeats=args.repeats,
                                  warmup=args.warmup, batch=args.batch)
        if args.json:
            with open(args.json, 'w') as f:
                json.dump(dict(rfdetr_train=result), f, indent=1)
        return []
    if args.end_to_end:  # tools/dev/bench/end_to_end_latency.py: its own rows, in this process
        print(f'load average {os.getloadavg()[0]:.1f} (1 min)', flush=True)
        config, checkpoint, graph = args.end_to_end
        e2e = run_end_to_end(config, checkpoint, graph, sizes=args.sizes, repeats=args.repeats,
                             warmup=args.warmup)
        if args.json:
            with open(args.json, 'w') as f:
                json.dump(dict(end_to_end=args.end_to_end, rows=e2e), f, indent=1)
        return e2e
    if args.row is not None:  # child process: one row, as JSON on the last stdout line
        print(json.dumps(measure_of(args)(settings_of(args), RowSpec.parse(args.row))),
              flush=True)
        return []
    print(header(args), flush=True)
    rows = run(args, argv)
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(model=args.model, arch=args.arch, device=args.device, rows=rows),
                      f, indent=1)
    return rows


if __name__ == '__main__':
    main()
