"""One table row: the compared models built, checked, interleaved and measured; rows pooled
over processes and printed as ratios (ours / reference)."""
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager, Dict, List, Optional, Sequence

import torch
from torch import Tensor

from .models import Compared, Features, build
from .plan import DevicePlan, Size, Timer, autocast_for, memory_bytes, parse_size, size_text

#: The script that runs a row in a fresh process (``--row``).
BENCHMARK_SCRIPT = Path(__file__).resolve().parents[2] / 'benchmark.py'  # tools/
#: Timed columns (lists of seconds per model); ``MEMORY`` holds one number per model.
TIMED = ('fwd', 'fwd+bwd')
MEMORY = 'mem MB'
#: Largest |ours - reference| / max|reference| of the last feature map before timing: same
#: weights, same function (fp32 allows TF32 convolutions on CUDA; bf16 rounds every GEMM).
PARITY_TOLERANCE: Dict[str, float] = {'fp32': 1e-3, 'bf16': 5e-2}
MIB = 2 ** 20

Row = dict


@dataclass(frozen=True)
class RowSpec:
    """What one row measures (the ``--row`` argument of a child process)."""

    size: Size
    with_cp: bool
    dtype: str

    def text(self) -> str:
        return f'{size_text(self.size)}:{"cp" if self.with_cp else "nocp"}:{self.dtype}'

    @classmethod
    def parse(cls, text: str) -> 'RowSpec':
        size, cp, dtype = text.split(':')
        return cls(parse_size(size), cp == 'cp', dtype)


@dataclass(frozen=True)
class RowSettings:
    """The command line's choices that every row shares."""

    model: str
    arch: str
    plan: DevicePlan
    timer: Timer
    train_size: Size
    batch: int
    repeats: int
    warmup: int
    skip_backward: bool


def time_calls(calls: Dict[str, Callable[[], object]], repeats: int, warmup: int,
               timer: Timer) -> Dict[str, List[float]]:
    """Seconds of every timed call per model, the models interleaved on every repeat, after
    ``warmup`` untimed calls of each."""
    for _ in range(warmup):
        for call in calls.values():
            call()
    times: Dict[str, List[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            times[name].append(timer(call))
    return times


def check_parity(compared: Compared, x: Tensor, dtype: str,
                 context: Callable[[], ContextManager[object]]) -> float:
    """Relative difference of ours and the parity reference on ``x`` (eval, no grad);
    raises when they do not compute the same function at a size where they must."""
    with torch.no_grad(), context():
        ours = compared.features['ours'](x)[-1].float()
        ref = compared.features[compared.parity_ref](x)[-1].float()
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    size = tuple(x.shape[-2:])
    strict = compared.parity_sizes is None or size in compared.parity_sizes
    if strict and not err <= PARITY_TOLERANCE[dtype]:
        raise RuntimeError(f'ours and {compared.parity_ref} disagree at {tuple(x.shape)} '
                           f'{dtype}: rel. error {err:.2e} > {PARITY_TOLERANCE[dtype]:.0e}; '
                           'the weights were not transferred, or a model changed')
    return err


def _forward_call(features: Features, x: Tensor,
                  context: Callable[[], ContextManager[object]]) -> Callable[[], object]:
    def call() -> object:
        with torch.no_grad(), context():
            return features(x)
    return call


def _train_call(model: torch.nn.Module, features: Features, x: Tensor,
                context: Callable[[], ContextManager[object]]) -> Callable[[], object]:
    def call() -> None:
        model.zero_grad(set_to_none=True)
        with context():
            out = features(x)
        torch.stack([o.float().mean() for o in out]).sum().backward()
    return call


def measure_row(settings: RowSettings, spec: RowSpec) -> Row:
    """Build the models for ``spec``, check them against each other, time and measure them."""
    plan, device = settings.plan, settings.plan.device
    compared = build(settings.model, settings.arch, spec.size, spec.with_cp)
    for m in compared.models.values():
        m.to(device)
    context = autocast_for(device, spec.dtype)
    row: Row = {'size': size_text(spec.size), 'with_cp': spec.with_cp, 'dtype': spec.dtype,
                'batch': settings.batch, 'train_size': size_text(settings.train_size)}
    if not spec.with_cp:  # checkpointing changes nothing in an inference forward
        for m in compared.models.values():
            m.eval()
        x = torch.randn(settings.batch, 3, *spec.size, device=device)
        row['parity'] = check_parity(compared, x, spec.dtype, context)
        calls = {k: _forward_call(f, x, context) for k, f in compared.features.items()}
        row['fwd'] = time_calls(calls, settings.repeats, settings.warmup, settings.timer)
    xt = torch.randn(settings.batch, 3, *settings.train_size, device=device)
    for m in compared.models.values():
        m.train()
    trains = {k: _train_call(compared.models[k], f, xt, context)
              for k, f in compared.features.items()}
    if not settings.skip_backward:
        row['fwd+bwd'] = time_calls(trains, plan.train_repeats(settings.repeats),
                                    settings.warmup, settings.timer)

    def forward(features: Features) -> Callable[[], object]:
        return lambda: _with(context, lambda: features(xt))

    row[MEMORY] = {k: memory_bytes(plan, forward(f), trains[k],
                                   list(compared.models[k].parameters())) / MIB
                   for k, f in compared.features.items()}
    row['memory'] = plan.memory
    return row


def _with(context: Callable[[], ContextManager[object]], fn: Callable[[], object]) -> object:
    with context():
        return fn()


def run_row_in_child(argv: Sequence[str], spec: RowSpec) -> Row:
    """:func:`measure_row` in a fresh interpreter, so that no row inherits the allocator
    state (glibc's mmap/trim thresholds, a fragmented heap) that earlier rows left behind."""
    cmd = [sys.executable, str(BENCHMARK_SCRIPT), *argv, '--row', spec.text()]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f'benchmark row {spec.text()} failed (exit {proc.returncode}); its '
                         'error is printed above')
    return json.loads(proc.stdout.strip().splitlines()[-1])


def pool_rows(rows: Sequence[Row]) -> Row:
    """One row from the same row measured in several processes: the timing samples of all of
    them pooled (medians over every repeat), the per-process rows kept under ``'processes'``;
    memory is deterministic and taken from the first."""
    pooled = dict(rows[0])
    for metric in TIMED:
        if metric in pooled:
            pooled[metric] = {name: [t for row in rows for t in row[metric][name]]
                              for name in rows[0][metric]}
    pooled['processes'] = list(rows)
    return pooled


def summarise(vals: Dict[str, object]) -> Dict[str, float]:
    """Median of each model's samples (a timed column) or the value itself (memory)."""
    return {k: statistics.median(v) if isinstance(v, list) else float(v)  # type: ignore[arg-type]
            for k, v in vals.items()}


def ratios(row: Row, metric: str) -> Dict[str, float]:
    """``{reference: ours / reference}`` of a row's metric (medians for timed columns)."""
    vals = summarise(row[metric])
    return {k: vals['ours'] / v for k, v in vals.items() if k != 'ours' and v}


def row_head(row: Row) -> str:
    dtype = '' if row.get('dtype', 'fp32') == 'fp32' else f" {row['dtype']}"
    return f"{row['size']:>10}{' cp' if row.get('with_cp') else '   '}{dtype}"


def format_row(row: Row) -> List[str]:
    """The printed lines of a row: medians and ratios per metric, then per-process ratios."""
    parts = []
    for metric in TIMED + (MEMORY, ):
        if not row.get(metric):
            continue
        vals = summarise(row[metric])
        refs = ', '.join(f'{k} {v:.3g}' for k, v in vals.items() if k != 'ours')
        text = ', '.join(f'/{k} {r:.2f}x' for k, r in ratios(row, metric).items())
        parts.append(f"{metric}: ours {vals['ours']:.3g} ({refs}) ratio {text}")
    lines = [row_head(row) + ' | ' + ' | '.join(parts)]
    procs = row.get('processes', [])
    if len(procs) > 1:
        for metric in TIMED:
            if not row.get(metric):
                continue
            each = [ratios(p, metric) for p in procs]
            text = '; '.join(f'/{k} ' + ' '.join(f'{r[k]:.2f}' for r in each) for k in each[0])
            lines.append(f"{'':>13} | {metric} per process (median of its repeats): {text}")
    return lines


def with_cp_line(row: Row, plain: Optional[Row]) -> Optional[str]:
    """Ours with checkpointing against the first reference without it (memory)."""
    if not row.get('with_cp') or plain is None or plain.get('with_cp'):
        return None
    ours = row[MEMORY]['ours']
    ref_name = next(k for k in plain[MEMORY] if k != 'ours')
    ref = plain[MEMORY][ref_name]
    return (f"{'':>13} | {MEMORY}: ours with_cp {ours:.3g} / {ref_name} without {ref:.3g} = "
            f"{ours / ref:.2f}x")
