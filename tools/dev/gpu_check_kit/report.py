"""The GPU check's one compact report (markdown), rendered from the merged results
(:func:`.results.merge`): the versions, the steps with their status and times, the functional
checks, and the benchmark (ours, and ours / reference: < 1 is better). Standard library only."""
import statistics
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

#: Benchmark columns: (row key, column title, unit of ours' value, scale to that unit).
MS_PER_S = 1000.0
BENCH_METRICS: Tuple[Tuple[str, str, str, float], ...] = (
    ('fwd', 'forward', 'ms', MS_PER_S), ('fwd+bwd', 'train step', 'ms', MS_PER_S),
    ('mem MB', 'peak memory', 'MB', 1.0))
#: Versions in the header, in order: (part, key, label).
HEADER_FIELDS: Tuple[Tuple[str, str, str], ...] = (
    ('environment', 'gpu', ''), ('environment', 'driver', 'driver '),
    ('environment', 'torch', 'torch '), ('environment', 'cuda', 'CUDA '),
    ('environment', 'torchvision', 'torchvision '), ('environment', 'timm', 'timm '),
    ('stack', 'mmcv', 'mmcv '), ('stack', 'mmengine', 'mmengine '), ('stack', 'mmdet', 'mmdet '),
    ('stack', 'ops_backend', 'ops: '))
#: How each step status reads in the table.
STATUS_TEXT = {'passed': 'ok', 'failed': 'FAILED', 'timeout': 'TIMEOUT', 'skipped': 'skipped',
               'running': 'RUNNING (cut short)', 'interrupted': 'INTERRUPTED'}


def _cell(text: object) -> str:
    """A table cell: one line, no column separators."""
    return ' '.join(str(text).split()).replace('|', '/')


def header(environment: Optional[Mapping[str, Any]], stack: Optional[Mapping[str, Any]]) -> str:
    parts = {'environment': environment or {}, 'stack': stack or {}}
    fields = [f'{label}{parts[part][key]}' for part, key, label in HEADER_FIELDS
              if parts[part].get(key) not in (None, '')]
    return ' | '.join(fields) if fields else 'environment unknown'


def steps_table(steps: Sequence[Mapping[str, Any]]) -> List[str]:
    lines = ['| step | needs | status | seconds | note |', '|---|---|---|---|---|']
    for s in steps:
        status = STATUS_TEXT.get(s.get('status', ''), str(s.get('status')))
        if s.get('status') == 'failed':
            status += f" (exit {s.get('rc')})"
        needs = ', '.join(s.get('needs') or []) or '-'
        secs = '' if s.get('seconds') is None else f"{s['seconds']:.0f}"
        lines.append(f"| {s['name']} | {needs} | {status} | {secs} | "
                     f"{_cell(s.get('reason') or '')} |")
    return lines


def checks_table(checks: Mapping[str, Sequence[Mapping[str, Any]]]) -> List[str]:
    lines = ['| group | check | result | detail | seconds |', '|---|---|---|---|---|']
    for group, results in checks.items():
        for c in results:
            lines.append(f"| {group} | {c['name']} | {'pass' if c['ok'] else 'FAIL'} | "
                         f"{_cell(c['detail'])} | {c.get('seconds', 0):.1f} |")
    return lines


def _median(vals: object) -> float:
    return statistics.median(vals) if isinstance(vals, list) else float(vals)  # type: ignore[arg-type]


def metric_text(row: Mapping[str, Any], metric: str, unit: str, scale: float) -> str:
    """``ours 12.3 ms; 0.50x mmdet, 0.81x timm`` (medians of the timed runs), or ``-``."""
    vals = row.get(metric)
    if not vals or 'ours' not in vals:
        return '-'
    med: Dict[str, float] = {k: _median(v) for k, v in vals.items()}
    ratios = ', '.join(f"{med['ours'] / v:.2f}x {k}" for k, v in med.items()
                       if k != 'ours' and v)
    return f"ours {med['ours'] * scale:.4g} {unit}" + (f'; {ratios}' if ratios else '')


def bench_table(benches: Mapping[str, Mapping[str, Any]]) -> List[str]:
    title = ' | '.join(t for _, t, _, _ in BENCH_METRICS)
    lines = [f'| model | input | dtype | {title} |',
             '|---|---|---|' + '---|' * len(BENCH_METRICS)]
    for bench in benches.values():
        for row in bench.get('rows', []):
            cp = ' with_cp' if row.get('with_cp') else ''
            lead = (f"| {bench.get('model')}-{bench.get('arch')}{cp} | "
                    f"{row.get('batch', '?')}x{row.get('size', '?')} | {row.get('dtype', '?')} |")
            if row.get('error'):
                lines.append(f"{lead} error: {_cell(row['error'])} |"
                             + ' |' * (len(BENCH_METRICS) - 1))
                continue
            cells = ' | '.join(metric_text(row, m, unit, scale)
                               for m, _, unit, scale in BENCH_METRICS)
            lines.append(f'{lead} {cells} |')
    return lines


def render(data: Mapping[str, Any]) -> str:
    """The markdown report of merged results (any part may be missing)."""
    environment, stack = data.get('environment') or {}, data.get('stack') or {}
    parts = [f'# GPU check: {header(environment, stack)}', '']
    notes = [(f'{name}: {value}') for name, value in (
        ('environment error', environment.get('error')), ('stack error', stack.get('error')),
        ('.pth hook (no import vitdet_plugin)', stack.get('pth_hook'))) if value]
    parts += [f'- {_cell(n)}' for n in notes] + ([''] if notes else [])
    steps = data.get('steps') or []
    parts += steps_table(steps) if steps else ['steps: none recorded']
    parts += ['']
    checks = data.get('checks') or {}
    parts += checks_table(checks) if checks else ['checks: no results']
    parts += ['']
    benches = data.get('benchmarks') or {}
    if benches:
        parts += ['Benchmark: ours, and ours / reference (< 1: ours faster or smaller); median '
                  'of the timed runs, peak CUDA memory of a training step above the model:', '']
        parts += bench_table(benches)
    else:
        parts += ['benchmark: no results']
    return '\n'.join(parts) + '\n'
