"""``python tools/gpu_check.py prune-mmcv SRC | checks | report`` (called by gpu_check.sh)."""
import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from .mmcv_ops import NEEDED_OPS, prune_tree


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog='tools/gpu_check.py', description=__doc__)
    sub = p.add_subparsers(dest='command', required=True)
    prune = sub.add_parser('prune-mmcv', help='keep only the needed CUDA kernels in an '
                                              'unpacked mmcv sdist')
    prune.add_argument('src', type=Path, help='the unpacked mmcv-2.1.0 directory')
    prune.add_argument('--ops', nargs='+', default=list(NEEDED_OPS),
                       help=f'ops to keep, named after their *_cuda.cu files '
                            f'(default: {" ".join(NEEDED_OPS)})')
    checks = sub.add_parser('checks', help='the functional GPU checks')
    checks.add_argument('--device', default='cuda')
    checks.add_argument('--json', type=Path, required=True, help='where to write the results')
    report = sub.add_parser('report', help='print the table; write it to --out too')
    report.add_argument('--work', type=Path, required=True,
                        help='the folder the steps wrote their results to')
    report.add_argument('--out', type=Path, default=None, help='markdown file to write')
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.command == 'prune-mmcv':
        try:
            r = prune_tree(args.src, args.ops)
        except (FileNotFoundError, ValueError) as e:
            print(f'prune-mmcv: {e}', file=sys.stderr)
            return 2
        print(f'[gpu_check] mmcv CUDA kernels kept: {" ".join(r.kept_kernels)} '
              f'({len(r.dropped_kernels)} dropped); registered for CUDA: '
              f'{" ".join(r.kept_impls)}')
        return 0
    if args.command == 'checks':
        from .checks import results_json, run_checks
        results = run_checks(args.device)
        args.json.write_text(json.dumps(results_json(results), indent=1))
        return 0 if all(r.ok for r in results) else 1
    from .report import collect, render
    found = collect(args.work)
    text = render(found['header'], found['steps'], found['checks'], found['benches'])
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0
