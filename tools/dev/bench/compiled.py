"""``--compile``: the training step (forward + backward) under ``torch.compile``.

One row per dtype at the training size (CPU default: 512x512, batch 2, fp32), four timed
calls interleaved on every repeat:

* ``ours``: our backbone compiled (``torch.compile``, inductor, default options);
* ``<ref>``: the reference (mmdet's ``SwinTransformer`` for Swin, timm's samvit for ViT) eager;
* ``<ref>_compiled``: the reference compiled the same way;
* ``ours_eager``: our backbone eager (with its CPU kernels), for scale.

Ratios are ``ours`` (compiled) / each. Every compiled call runs
:data:`COMPILE_WARMUP_STEPS` untimed steps first (the first compiles the forward and backward
graphs; their seconds are reported as ``compile s``), then ``--warmup`` more for all four.
"""
import argparse
import time
from typing import Callable, Dict, List

import torch

from .models import build
from .plan import autocast_for, size_text
from .rows import (PARITY_TOLERANCE, Row, RowSettings, RowSpec, _train_call, format_row,
                   time_calls)

#: Untimed training steps of each compiled model before timing (compile, then a check that
#: the second step reuses the graphs).
COMPILE_WARMUP_STEPS = 2
#: Images per batch of the compiled training step (the issue's measurement: batch 2).
COMPILE_BATCH = 2
#: Name suffixes of the extra columns.
COMPILED, EAGER = '_compiled', '_eager'
COMPILE_SECONDS = 'compile s'


def resolve_compile(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Defaults and checks of ``--compile`` (training step only, at the training size); runs
    before the plan's defaults fill the options left out."""
    if args.with_cp or args.skip_backward:
        p.error('--compile measures the training step without checkpointing: drop '
                '--with-cp / --skip-backward')
    if args.batch is None:
        args.batch = COMPILE_BATCH


def compile_row_specs(args: argparse.Namespace) -> List[RowSpec]:
    """One row per dtype, at the training size."""
    return [RowSpec(args.train_size, False, dtype) for dtype in args.dtypes]


def _timed_once(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_compiled_row(settings: RowSettings, spec: RowSpec) -> Row:
    """Build ours and the reference with the same weights, compile both, check the compiled
    ours against the eager reference, and time the four training steps."""
    device = settings.plan.device
    compared = build(settings.model, settings.arch, spec.size, False)
    ref = compared.parity_ref
    models = {name: compared.models[name].to(device) for name in ('ours', ref)}
    for m in models.values():
        m.train()  # mmdet's SwinTransformer.train() returns None: not chained
    context = autocast_for(device, spec.dtype)
    x = torch.randn(settings.batch, 3, *spec.size, device=device)
    compiled = {name: torch.compile(compared.features[name]) for name in models}
    calls: Dict[str, Callable[[], object]] = {
        'ours': _train_call(models['ours'], compiled['ours'], x, context),
        ref: _train_call(models[ref], compared.features[ref], x, context),
        ref + COMPILED: _train_call(models[ref], compiled[ref], x, context),
        'ours' + EAGER: _train_call(models['ours'], compared.features['ours'], x, context),
    }
    compile_s = {name: sum(_timed_once(calls[name]) for _ in range(COMPILE_WARMUP_STEPS))
                 for name in ('ours', ref + COMPILED)}
    with context():
        ours_out = compiled['ours'](x)[-1].detach().float()
        ref_out = compared.features[ref](x)[-1].detach().float()
    parity = ((ours_out - ref_out).abs().max() / ref_out.abs().max()).item()
    if not parity <= PARITY_TOLERANCE[spec.dtype]:
        raise RuntimeError(f'compiled ours and eager {ref} disagree at {tuple(x.shape)} '
                           f'{spec.dtype}: rel. error {parity:.2e} > '
                           f'{PARITY_TOLERANCE[spec.dtype]:.0e}')
    times = time_calls(calls, settings.repeats, settings.warmup, settings.timer)
    return {'size': size_text(spec.size), 'with_cp': False, 'dtype': spec.dtype,
            'batch': settings.batch, 'train_size': size_text(spec.size), 'parity': parity,
            'fwd+bwd': times, COMPILE_SECONDS: compile_s, 'compiled': True}


def format_compiled_row(row: Row) -> List[str]:
    """:func:`format_row` plus the compile seconds of the compiled models."""
    secs = ', '.join(f'{k} {v:.0f}' for k, v in row[COMPILE_SECONDS].items())
    return format_row(row) + [f"{'':>13} | {COMPILE_SECONDS} (first {COMPILE_WARMUP_STEPS} "
                              f'steps, compile included): {secs}']
