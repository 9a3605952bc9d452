"""``tools/dev/gpu_check.py bench NAME -- <tools/benchmark.py arguments>``: the benchmark's
rows, measured by the benchmark's own code (tools/benchmark.py and tools/dev/bench/: argument
defaults, models, parity check, timing, memory), one row at a time in this process, each
written to disk as soon as it is measured.

This differs from ``tools/benchmark.py`` in three ways, all for the GPU check: ``import
vitdet_plugin`` comes first (the compile-free mmcv ops must be in place before mmdet's Swin
imports ``mmcv.ops``; the kit installs the plugin on ``PYTHONPATH``, without the ``.pth``
hook), the rows run in this process (benchmark.py's per-row child processes would start without
the ops), and a row that fails (a parity miss raises there) is recorded with its error while the
other rows still run.
"""
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from .results import BENCH_PREFIX, error_line, publish, write_part

Row = Dict[str, Any]


def run_rows(specs: Sequence[Any], measure: Callable[[Any], Row],
             describe: Callable[[Any], Row], record: Callable[[List[Row]], None],
             show: Callable[[Row], List[str]]) -> List[Row]:
    """Measure each row spec in turn; ``record`` gets the rows so far after every row. A row
    that raises is kept as ``describe(spec)`` plus its ``error``."""
    rows: List[Row] = []
    for spec in specs:
        try:
            row = measure(spec)
            lines = show(row)
        except Exception as e:  # recorded; the next rows still run
            traceback.print_exc()
            row = dict(describe(spec), error=error_line(e))
            lines = [f"[gpu_check] row {row.get('size')} {row.get('dtype')} failed: "
                     f"{row['error']}"]
        rows.append(row)
        record(rows)
        for line in lines:
            print(line, flush=True)
    return rows


def main(name: str, argv: Sequence[str], results: Path, out: Optional[Path]) -> int:
    import vitdet_plugin  # noqa: F401  (first: the compile-free ops, before mmdet's imports)

    import torch
    # tools/benchmark.py (the command line) and its dev.bench package: tools/ is on the steps'
    # PYTHONPATH (steps.child_env)
    from benchmark import build_parser, header, measure_of, resolve, row_specs, settings_of
    from dev.bench.plan import size_text
    from dev.bench.rows import format_row

    args = resolve(build_parser(), list(argv))
    if args.compile:
        raise SystemExit('bench: --compile is not supported by the GPU check')
    if args.threads:
        torch.set_num_threads(args.threads)
    # mmdet's SwinTransformer(with_cp=True) calls checkpoint() without use_reentrant
    warnings.filterwarnings('ignore', message='torch.utils.checkpoint: the use_reentrant')
    torch.manual_seed(0)
    head = header(args)
    print(head, flush=True)
    part: Dict[str, Any] = dict(model=args.model, arch=args.arch, device=args.device,
                                header=head, argv=list(argv), rows=[])
    settings, measure = settings_of(args), measure_of(args)

    def record(rows: List[Row]) -> None:
        part['rows'] = rows
        write_part(results, f'{BENCH_PREFIX}{name}', part)
        publish(results, out)

    def describe(spec: Any) -> Row:
        return {'size': size_text(spec.size), 'with_cp': spec.with_cp, 'dtype': spec.dtype,
                'batch': args.batch}

    record([])
    rows = run_rows(row_specs(args), lambda spec: measure(settings, spec), describe, record,
                    format_row)
    return 1 if any('error' in r for r in rows) or not rows else 0
