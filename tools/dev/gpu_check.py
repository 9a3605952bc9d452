#!/usr/bin/env python
"""``python tools/dev/gpu_check.py run | environment | wheels | stack | checks | bench | report``.

``run`` (what ``bash tools/dev/gpu_check.sh`` calls) goes through every step
(``gpu_check_kit/steps.py``); the
other commands are the steps' own, run by it in fresh interpreters. Imports stay lazy: ``run``,
``wheels`` and ``report`` need the standard library only.
"""
import argparse
import os
import sys
from pathlib import Path
from typing import FrozenSet, List, Optional, Sequence, Tuple

from gpu_check_kit.steps import (BENCH_REPEATS, BENCH_WARMUP, CHECK_GROUPS, DEFAULT_BUDGET_S,
                                 DEFAULT_RESERVE_S, DEFAULT_WORK, Settings, run_all)

ROOT = Path(__file__).resolve().parents[2]
BENCH_NAMES = ('swin', 'vit')
RUN_EPILOG = """environment:
  OUT                 output folder: gpu_check.json, gpu_check.md, gpu_check.log (default
                      <work>/out); the device tool returns what is there, also after a timeout
  GPU_CHECK_WORK      scratch folder: target site, results parts (default /tmp/gpu_check)
  GPU_CHECK_WHEELS    carried wheels (default: .whl in the repository)
  GPU_CHECK_BUDGET    seconds for the whole run (default 270); each step gets what is left
  GPU_CHECK_RESERVE   seconds of it kept for the report (default 10)
  GPU_CHECK_FAKE_FAIL steps whose stub fails, comma-separated (implies --fake)
"""


def _names(text: Optional[str]) -> FrozenSet[str]:
    return frozenset(n.strip() for n in (text or '').split(',') if n.strip())


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, '').strip()
    try:
        return int(value) if value else default
    except ValueError:
        raise SystemExit(f'{name}={value!r} is not a number of seconds') from None


def _add_io(p: argparse.ArgumentParser) -> None:
    p.add_argument('--results', type=Path, required=True,
                   help='the results folder (one JSON part per writer)')
    p.add_argument('--out', type=Path, default=None,
                   help='publish the merged results and the report there')


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog='tools/dev/gpu_check.py', description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest='command', required=True)
    run = sub.add_parser('run', help='every step (tools/dev/gpu_check.sh)', epilog=RUN_EPILOG,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument('--dry-run', action='store_true', help="print every step's commands")
    run.add_argument('--only', default=None,
                     help='comma-separated steps to run; the others count as done (a rerun)')
    run.add_argument('--budget', type=int, default=None, help='GPU_CHECK_BUDGET')
    run.add_argument('--work', type=Path, default=None, help='GPU_CHECK_WORK')
    run.add_argument('--wheels', type=Path, default=None, help='GPU_CHECK_WHEELS')
    run.add_argument('--out', type=Path, default=None, help='OUT')
    run.add_argument('--bench-repeats', type=int, default=BENCH_REPEATS,
                     help='timed runs per benchmark measurement (CUDA minimum 10)')
    run.add_argument('--bench-warmup', type=int, default=BENCH_WARMUP,
                     help='warm-up calls per benchmark model')
    run.add_argument('--fake', action='store_true',
                     help='replace every command by a stub that passes (tests the runner)')
    run.add_argument('--fake-fail', default=None,
                     help='comma-separated steps whose stub fails (implies --fake)')
    run.add_argument('--fake-hang', default=None,
                     help='comma-separated steps whose stub hangs (implies --fake)')
    env = sub.add_parser('environment', help='GPU, driver, torch stack versions')
    _add_io(env)
    wheels = sub.add_parser('wheels', help='the wheel folder matches tools/dev/gpu_wheels.txt')
    wheels.add_argument('--wheels', type=Path, required=True)
    stack = sub.add_parser('stack', help='the installed OpenMMLab stack and the ops backend')
    stack.add_argument('--site', type=Path, required=True, help='the target site')
    _add_io(stack)
    checks = sub.add_parser('checks', help='one group of functional checks')
    checks.add_argument('group', choices=CHECK_GROUPS)
    checks.add_argument('--device', default='cuda')
    _add_io(checks)
    bench = sub.add_parser('bench', help='tools/benchmark.py row by row: bench NAME ... -- '
                                         'BENCHMARK_ARGS (the arguments after --)')
    bench.add_argument('name', choices=BENCH_NAMES)
    _add_io(bench)
    report = sub.add_parser('report', help='merge the results, print (and publish) the report')
    _add_io(report)
    return p


def settings(args: argparse.Namespace) -> Settings:
    work = args.work or Path(os.environ.get('GPU_CHECK_WORK') or DEFAULT_WORK)
    out = args.out or (Path(os.environ['OUT']) if os.environ.get('OUT') else work / 'out')
    fail = _names(args.fake_fail) | _names(os.environ.get('GPU_CHECK_FAKE_FAIL'))
    hang = _names(args.fake_hang)
    return Settings(
        root=ROOT, work=work, out=out, python=sys.executable,
        wheels=args.wheels or Path(os.environ.get('GPU_CHECK_WHEELS') or ROOT / '.whl'),
        budget_s=(args.budget if args.budget is not None
                  else _env_int('GPU_CHECK_BUDGET', DEFAULT_BUDGET_S)),
        reserve_s=_env_int('GPU_CHECK_RESERVE', DEFAULT_RESERVE_S),
        only=_names(args.only) if args.only is not None else None,
        fake=bool(args.fake or fail or hang), fake_fail=fail, fake_hang=hang,
        bench_repeats=args.bench_repeats, bench_warmup=args.bench_warmup)


def split_at_dashes(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """``argv`` before the first ``--`` and after it (tools/benchmark.py's arguments)."""
    argv = list(argv)
    if '--' not in argv:
        return argv, []
    i = argv.index('--')
    return argv[:i], argv[i + 1:]


def main(argv: Optional[Sequence[str]] = None) -> int:
    own, extra = split_at_dashes(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(own)
    if args.command == 'run':
        try:
            return run_all(settings(args), dry_run=args.dry_run)
        except ValueError as e:
            print(f'gpu_check: {e}', file=sys.stderr)
            return 2
        except BrokenPipeError:  # e.g. `--dry-run | head`: the reader left
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
    if args.command == 'wheels':
        from gpu_check_kit.env import wheels_main
        return wheels_main(args.wheels)
    if args.command == 'report':
        from gpu_check_kit.results import publish
        from gpu_check_kit.report import render
        print(render(publish(args.results, args.out)))
        return 0
    if args.command == 'environment':
        from gpu_check_kit.env import environment_main
        return environment_main(args.results, args.out)
    if args.command == 'stack':
        from gpu_check_kit.env import stack_main
        return stack_main(args.site, args.results, args.out)
    if args.command == 'checks':
        from gpu_check_kit.checks import main as checks_main
        return checks_main(args.group, args.device, args.results, args.out)
    from gpu_check_kit.bench import main as bench_main
    return bench_main(args.name, extra, args.results, args.out)


if __name__ == '__main__':
    sys.exit(main())
