"""The GPU check's one compact table (markdown): steps and their times, the functional checks,
and the benchmark as ratios (ours / reference; < 1 is better)."""
import json
from pathlib import Path
from typing import Any, List, Optional, Sequence, TypedDict

#: Benchmark columns: (row key, column title).
BENCH_METRICS = (('fwd', 'forward'), ('fwd+bwd', 'train step'), ('mem MB', 'peak memory'))


def _median(values: Sequence[float]) -> float:
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def _ratio_text(row: dict, metric: str) -> str:
    vals = row.get(metric)
    if not vals:
        return '-'
    med = {k: _median(v) if isinstance(v, list) else float(v) for k, v in vals.items()}
    return ', '.join(f"{med['ours'] / v:.2f}x {k}" for k, v in med.items() if k != 'ours' and v)


def steps_table(steps: Sequence[Sequence[str]]) -> List[str]:
    lines = ['| step | status | seconds |', '|---|---|---|']
    lines += [f'| {name} | {"ok" if status == "0" else f"FAILED (exit {status})"} | {secs} |'
              for name, status, secs in steps]
    return lines


def checks_table(checks: Sequence[dict]) -> List[str]:
    lines = ['| check | result | detail |', '|---|---|---|']
    lines += [f"| {c['name']} | {'pass' if c['ok'] else 'FAIL'} | {c['detail']} |"
              for c in checks]
    return lines


def bench_table(benches: Sequence[dict]) -> List[str]:
    title = ' | '.join(t for _, t in BENCH_METRICS)
    lines = [f'| model | input | dtype | {title} |', '|---|---|---|' + '---|' * len(BENCH_METRICS)]
    for bench in benches:
        for row in bench['rows']:
            cells = ' | '.join(_ratio_text(row, m) for m, _ in BENCH_METRICS)
            cp = ' with_cp' if row.get('with_cp') else ''
            lines.append(f"| {bench['model']}-{bench['arch']}{cp} | {row['batch']}x"
                         f"{row['size']} | {row['dtype']} | {cells} |")
    return lines


def render(header: str, steps: Sequence[Sequence[str]], checks: Optional[Sequence[dict]],
           benches: Sequence[dict]) -> str:
    parts = [f'# GPU check: {header}', '']
    parts += steps_table(steps) + ['']
    parts += checks_table(checks) if checks is not None else ['checks: no results']
    parts += ['']
    if benches:
        parts += ['Benchmark, ours / reference (< 1: ours faster or smaller); median of the '
                  'timed runs, peak CUDA memory of a training step:', '']
        parts += bench_table(benches)
    else:
        parts += ['benchmark: no results']
    return '\n'.join(parts) + '\n'


def read_steps(path: Path) -> List[List[str]]:
    if not path.is_file():
        return []
    return [line.split('\t') for line in path.read_text().splitlines() if line.strip()]


def load_json(path: Path) -> Any:
    """The JSON in ``path`` (any shape), or None when there is no such file."""
    return json.loads(path.read_text()) if path.is_file() else None


class Collected(TypedDict):
    """:func:`collect`'s result: :func:`render`'s arguments."""
    steps: List[List[str]]
    checks: Optional[List[dict]]
    benches: List[dict]
    header: str


def collect(work: Path) -> Collected:
    """What the steps left in ``work``: steps.tsv, checks.json, bench_*.json, env.txt."""
    benches = [load_json(p) for p in sorted(work.glob('bench_*.json'))]
    env = work / 'env.txt'
    return Collected(steps=read_steps(work / 'steps.tsv'),
                     checks=load_json(work / 'checks.json'), benches=[b for b in benches if b],
                     header=env.read_text().strip() if env.is_file() else 'environment unknown')
