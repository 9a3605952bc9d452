"""Two checkouts of the plugin, back to back: what a change costs on the CPU.

Runs ``tools/benchmark.py`` of each checkout (``--same-process``, its own ``vitdet_plugin``
first on ``sys.path``, ahead of an installed one) with the same arguments, alternating before /
after for ``--rounds`` rounds, and prints ours' median forward and training-step seconds and
saved activations per checkout, with ours / mmdet (or timm): the reference models in the same
process measure the machine's load.

    git archive main | tar -x -C /tmp/before
    python tools/dev/bench/before_after.py /tmp/before . --rounds 2 -- --model swin \\
        --sizes 512x512 --train-size 512x512 --processes 1
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

#: Columns of a benchmark row: timed (seconds per repeat) and memory (bytes saved for backward).
COLUMNS = ('fwd', 'fwd+bwd', 'mem MB')
#: Runs ``argv[2:]`` as ``ROOT/tools/benchmark.py`` with ROOT (``argv[1]``) first on the path: an
#: editable install's ``.pth`` would otherwise win over ``PYTHONPATH``.
BOOTSTRAP = ('import runpy, sys; root = sys.argv.pop(1); sys.path[:0] = [root, root + "/tools"]; '
             'import vitdet_plugin; assert vitdet_plugin.__file__.startswith(root), '
             'vitdet_plugin.__file__; sys.argv[0] = root + "/tools/benchmark.py"; '
             'runpy.run_path(sys.argv[0], run_name="__main__")')


def run_checkout(root: Path, args: List[str]) -> List[dict]:
    """The rows of ``root``'s ``tools/benchmark.py args --same-process``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, 'rows.json')
        cmd = [sys.executable, '-c', BOOTSTRAP, str(root), *args, '--same-process', '--json', out]
        subprocess.run(cmd, cwd=root, check=True)
        with open(out) as f:
            return json.load(f)['rows']


def summary(rows: List[dict]) -> Dict[str, Dict[str, float]]:
    """``{column: {model: median}}`` over every repeat of every row given (one size)."""
    result: Dict[str, Dict[str, float]] = {}
    for col in COLUMNS:
        values: Dict[str, List[float]] = {}
        for row in rows:
            for model, v in (row.get(col) or {}).items():
                values.setdefault(model, []).extend(v if isinstance(v, list) else [v])
        result[col] = {m: statistics.median(v) for m, v in values.items()}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('before', type=Path)
    parser.add_argument('after', type=Path)
    parser.add_argument('--rounds', type=int, default=2)
    argv = sys.argv[1:]
    cut = argv.index('--') if '--' in argv else len(argv)  # after --: tools/benchmark.py's
    args, bench = parser.parse_args(argv[:cut]), argv[cut + 1:]
    runs: Dict[str, List[dict]] = {'before': [], 'after': []}
    for _ in range(args.rounds):
        for name in runs:
            runs[name] += run_checkout(getattr(args, name).resolve(), bench)
    sizes = sorted({row['size'] for rows in runs.values() for row in rows})
    for size in sizes:
        print(f'size {size}')
        for name, rows in runs.items():
            s = summary([r for r in rows if r['size'] == size])
            cells = []
            for col in COLUMNS:
                ours = s[col].get('ours')
                if ours is None:
                    continue
                refs = ', '.join(f'{ours / v:.2f}x {m}' for m, v in s[col].items()
                                 if m != 'ours' and v)
                cells.append(f'{col} {ours:.3g} ({refs})')
            print(f'  {name:>6}: ' + ' | '.join(cells))


if __name__ == '__main__':
    main()
