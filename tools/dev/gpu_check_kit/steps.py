"""The steps of ``tools/dev/gpu_check.sh`` and the runner (``tools/dev/gpu_check.py run``).

Each step is a list of commands with the steps it needs and an upper bound on its time. The
runner goes through them in order under one budget: a step whose needed step did not pass is
skipped (recorded with the reason), every step gets at most what is left of the budget (less
the time kept for the report) and is killed, with its process group, when it runs over. The
step list is written before and after every step, and the merged results and the report are
published to the output folder then too (:func:`.results.publish`), so a run cut short still
leaves what it did. ``--dry-run`` prints every step's commands; ``--fake`` (and
``GPU_CHECK_FAKE_FAIL`` / ``--fake-fail``, ``--fake-hang``) replaces each command by a stub
that passes, fails or hangs, to exercise this logic anywhere. Standard library only.
"""
import os
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Dict, FrozenSet, List, Optional, Sequence, Tuple

from .results import LOG_NAME, REPORT_NAME, STEPS_PART, publish, write_part

#: Whole-run budget in seconds (``GPU_CHECK_BUDGET``) and the part of it kept for the report
#: (``GPU_CHECK_RESERVE``): the device gives 15 minutes in all, the machine's start included.
DEFAULT_BUDGET_S = 270
DEFAULT_RESERVE_S = 10
DEFAULT_WORK = '/tmp/gpu_check'
#: A step is not started with less than this left.
MIN_STEP_S = 5
#: After SIGTERM, a timed-out step's process group gets this long before SIGKILL.
KILL_GRACE_S = 5
TIMEOUT_RC = 124
SIGTERM_RC = 128 + int(signal.SIGTERM)
#: tools/benchmark.py options of both benchmark steps: the CUDA minimum of timed runs, and
#: warm-up calls (cuDNN autotuning, allocator growth).
BENCH_REPEATS = 10
BENCH_WARMUP = 3
#: Step statuses.
PASSED, FAILED, TIMEOUT, SKIPPED = 'passed', 'failed', 'timeout', 'skipped'
RUNNING, INTERRUPTED = 'running', 'interrupted'
NOT_SELECTED = 'not selected (--only)'
#: ``checks GROUP`` groups (tools/dev/gpu_check_kit/checks.py), one step each.
CHECK_GROUPS = ('ops', 'backbones', 'detectors', 'dino')
#: Seconds each step may take at most (the budget may give it less).
CAPS_S: Dict[str, int] = {
    'environment': 60, 'install-wheels': 90, 'install-plugin': 60, 'checks-ops': 60,
    'checks-backbones': 75, 'checks-detectors': 110, 'checks-dino': 60, 'benchmark-swin': 75,
    'benchmark-vit': 75, 'report': 20}
PIP_FLAGS = ('-q', '--no-index', '--no-deps', '--no-build-isolation', '--no-compile',
             '--no-cache-dir', '--disable-pip-version-check', '--upgrade')
#: What each step is for (the dry run and the report's step table).
WHAT: Dict[str, str] = {
    'environment': 'GPU, driver, Python, torch / CUDA / torchvision / timm versions',
    'install-wheels': 'the carried wheels (.whl/) into the target site, pip --no-index --no-deps',
    'install-plugin': 'working tree on PYTHONPATH (nothing built); import vitdet_plugin, '
                      'mmcv.ops on the compile-free ops, mmdet.models; the .pth hook',
    'checks-ops': 'nms, batched_nms, roi_align, focal losses, ms_deform_attn, deform conv: '
                  'CUDA vs CPU, bf16',
    'checks-backbones': 'SwinBackbone / ViTBackbone CUDA vs CPU fp32, bf16 fwd+bwd',
    'checks-detectors': 'RetinaNet and Mask R-CNN: bf16 AMP train step + inference; '
                        'FSDP2Wrapper on a world of 1 (bf16 params, checkpointing); their '
                        'end-to-end export modules, GPU vs CPU',
    'checks-dino': 'shrunk DINO: fp32 and bf16 AMP train step + inference (deformable '
                   'attention on CUDA)',
    'benchmark-swin': 'tools/benchmark.py --model swin --device cuda (row by row)',
    'benchmark-vit': 'tools/benchmark.py --model vit --device cuda (row by row)',
    'report': 'merge the results, write and print the report',
}


@dataclass(frozen=True)
class Step:
    name: str
    needs: Tuple[str, ...]
    cap_s: int
    commands: Tuple[Tuple[str, ...], ...]


@dataclass(frozen=True)
class Settings:
    root: Path
    work: Path
    out: Path
    wheels: Path
    python: str
    budget_s: int = DEFAULT_BUDGET_S
    reserve_s: int = DEFAULT_RESERVE_S
    only: Optional[FrozenSet[str]] = None
    fake: bool = False
    fake_fail: FrozenSet[str] = frozenset()
    fake_hang: FrozenSet[str] = frozenset()
    bench_repeats: int = BENCH_REPEATS
    bench_warmup: int = BENCH_WARMUP

    @property
    def site(self) -> Path:
        return self.work / 'site'

    @property
    def results(self) -> Path:
        return self.work / 'results'


def plan(s: Settings) -> List[Step]:
    """The steps, in order."""
    kit = (s.python, str(s.root / 'tools' / 'dev' / 'gpu_check.py'))
    io = ('--results', str(s.results), '--out', str(s.out))
    wheels = tuple(sorted(str(p) for p in s.wheels.glob('*.whl'))) or (str(s.wheels / '*.whl'),)
    pip = (s.python, '-m', 'pip', 'install', *PIP_FLAGS, '--target', str(s.site), *wheels)
    gpu = ('environment', 'install-plugin')
    bench = ('--device', 'cuda', '--repeats', str(s.bench_repeats), '--warmup',
             str(s.bench_warmup))
    commands: Dict[str, Tuple[Tuple[str, ...], ...]] = {
        'environment': ((*kit, 'environment', *io),),
        'install-wheels': ((*kit, 'wheels', '--wheels', str(s.wheels)), pip),
        'install-plugin': ((*kit, 'stack', '--site', str(s.site), *io),),
        **{f'checks-{g}': ((*kit, 'checks', g, *io),) for g in CHECK_GROUPS},
        **{f'benchmark-{m}': ((*kit, 'bench', m, *io, '--', '--model', m, *bench),)
           for m in ('swin', 'vit')},
        'report': (),  # in the runner itself: publish, then print the report
    }
    needs: Dict[str, Tuple[str, ...]] = {'environment': (), 'install-wheels': (),
                                         'install-plugin': ('install-wheels',), 'report': ()}
    return [Step(name, needs.get(name, gpu), CAPS_S[name], cmds)
            for name, cmds in commands.items()]


def child_env(s: Settings) -> Dict[str, str]:
    """The steps' environment: the target site, then the working tree, then ``tools/`` (the
    benchmark steps import ``tools/benchmark.py`` and ``dev.bench``, the op checks
    ``dev.op_parity``) on PYTHONPATH."""
    env = dict(os.environ)
    paths = [str(s.site), str(s.root), str(s.root / 'tools')] + (
        [env['PYTHONPATH']] if env.get('PYTHONPATH') else [])
    env.update(PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED='1')
    return env


def fake_command(s: Settings, name: str) -> Tuple[str, ...]:
    if name in s.fake_hang:
        code = 'import time; time.sleep(3600)'
    else:
        code = f'print("fake {name}"); raise SystemExit({int(name in s.fake_fail)})'
    return (s.python, '-c', code)


def commands_of(step: Step, s: Settings) -> Tuple[Tuple[str, ...], ...]:
    if s.fake and step.commands:
        return (fake_command(s, step.name),)
    return step.commands


class Log:
    """Lines to stdout and to the output folder's log file."""

    def __init__(self, path: Optional[Path]) -> None:
        self.file: Optional[IO[str]] = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = path.open('a')
        self.lock = threading.Lock()

    def line(self, text: str) -> None:
        with self.lock:
            print(text, flush=True)
            if self.file is not None:
                self.file.write(text + '\n')
                self.file.flush()

    def say(self, text: str) -> None:
        self.line(f'[gpu_check] {text}')

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


class Interrupted(Exception):
    """The runner got SIGTERM (the device tool's own time limit)."""


def _on_sigterm(signum: int, frame: Optional[FrameType]) -> None:
    raise Interrupted()


def _pump(stream: IO[str], log: Log) -> None:
    for line in stream:
        log.line(line.rstrip('\n'))


def _kill_group(proc: 'subprocess.Popen[str]') -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            continue


def run_command(cmd: Sequence[str], env: Dict[str, str], limit_s: float, log: Log) -> int:
    """Run ``cmd`` in its own process group, its output to ``log``; :data:`TIMEOUT_RC` when
    it ran past ``limit_s`` (then its whole group is killed)."""
    proc = subprocess.Popen(list(cmd), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors='replace',
                            preexec_fn=os.setpgrp)
    assert proc.stdout is not None
    reader = threading.Thread(target=_pump, args=(proc.stdout, log), daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=max(limit_s, 0))
    except subprocess.TimeoutExpired:
        rc = TIMEOUT_RC
    finally:
        _kill_group(proc)  # also what the step left running in its group
        reader.join(timeout=KILL_GRACE_S)
    return rc


def skip_reason(step: Step, status: Dict[str, str], only: Optional[FrozenSet[str]]
                ) -> Optional[str]:
    """Why ``step`` does not run: not selected, or a step it needs did not pass (a step
    left out by ``--only`` counts as done by an earlier run)."""
    if only is not None and step.name not in only:
        return NOT_SELECTED
    bad = [n for n in step.needs if status.get(n, PASSED) not in (PASSED, NOT_SELECTED)]
    if bad:
        return 'needs ' + ', '.join(f'{n} ({status[n]})' for n in bad)
    return None


def print_dry_run(steps: Sequence[Step], s: Settings, log: Log) -> None:
    log.say('dry run: the commands of each step, none run')
    log.say(f'budget {s.budget_s} s ({s.reserve_s} s kept for the report); work {s.work}; '
            f'out {s.out}')
    log.say(f'steps run with PYTHONPATH={child_env(s)["PYTHONPATH"]}')
    for i, step in enumerate(steps, 1):
        log.say(f'step {i}/{len(steps)}: {step.name} (needs: {", ".join(step.needs) or "-"}; '
                f'at most {step.cap_s} s): {WHAT[step.name]}')
        for cmd in commands_of(step, s):
            log.line('  $ ' + shlex.join(cmd))
        if not step.commands:
            log.line(f'  (in the runner: {s.out / "gpu_check.json"}, {s.out / REPORT_NAME}, '
                     'printed)')


class Runner:
    def __init__(self, steps: Sequence[Step], s: Settings, log: Log) -> None:
        self.steps, self.s, self.log = list(steps), s, log
        self.start = time.monotonic()
        self.records: List[Dict[str, object]] = []
        self.status: Dict[str, str] = {}

    def left(self) -> float:
        return self.s.budget_s - (time.monotonic() - self.start)

    def save(self) -> None:
        write_part(self.s.results, STEPS_PART, self.records)
        publish(self.s.results, self.s.out)

    def set(self, i: int, step: Step, status: str, **fields: object) -> None:
        self.status[step.name] = status
        record: Dict[str, object] = {'name': step.name, 'needs': list(step.needs),
                                     'status': status, **fields}
        if i < len(self.records):
            self.records[i] = record
        else:
            self.records.append(record)
        self.save()

    def limit(self, step: Step) -> float:
        reserve = 0 if not step.commands else self.s.reserve_s
        return min(step.cap_s, self.left() - reserve)

    def run_step(self, i: int, step: Step) -> None:
        reason = skip_reason(step, self.status, self.s.only)
        limit = self.limit(step)
        if reason is None and step.commands and limit < MIN_STEP_S:
            reason = f'no time left in the budget ({max(self.left(), 0):.0f} s left)'
        if reason is not None:
            self.log.say(f'step {step.name} skipped: {reason}')
            self.set(i, step, SKIPPED, reason=reason)
            if reason == NOT_SELECTED:  # its dependents run: an earlier run did it
                self.status[step.name] = NOT_SELECTED
            return
        started = time.monotonic()
        self.set(i, step, RUNNING, limit_s=round(limit))
        if not step.commands:  # the report
            self.set(i, step, PASSED, rc=0, seconds=round(time.monotonic() - started, 1))
            self.log.line((self.s.out / REPORT_NAME).read_text())
            return
        env, rc = child_env(self.s), 0
        try:
            for cmd in commands_of(step, self.s):
                self.log.line('  $ ' + shlex.join(cmd))
                rc = run_command(cmd, env, limit - (time.monotonic() - started), self.log)
                if rc:
                    break
        except Interrupted:
            self.set(i, step, INTERRUPTED, rc=SIGTERM_RC,
                     seconds=round(time.monotonic() - started, 1), reason='SIGTERM')
            raise
        status = PASSED if rc == 0 else TIMEOUT if rc == TIMEOUT_RC else FAILED
        reason = f'ran past its {limit:.0f} s' if status == TIMEOUT else None
        self.set(i, step, status, rc=rc, seconds=round(time.monotonic() - started, 1),
                 limit_s=round(limit), **({'reason': reason} if reason else {}))
        if status != PASSED:
            self.log.say(f'step {step.name} {status} (exit {rc})')

    def run(self) -> int:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            for i, step in enumerate(self.steps):
                self.log.say(f'step {i + 1}/{len(self.steps)}: {step.name} '
                             f'(needs: {", ".join(step.needs) or "-"}; '
                             f'{max(self.left(), 0):.0f} s of the budget left)')
                self.run_step(i, step)
        except Interrupted:
            self.log.say('interrupted (SIGTERM): results so far are in ' + str(self.s.out))
            return SIGTERM_RC
        finally:
            signal.signal(signal.SIGTERM, previous)
        counts = {k: list(self.status.values()).count(k) for k in (PASSED, FAILED, TIMEOUT,
                                                                   SKIPPED)}
        self.log.say(f'done in {time.monotonic() - self.start:.0f} s: '
                     + ', '.join(f'{v} {k}' for k, v in counts.items())
                     + f'; report {self.s.out / REPORT_NAME}')
        bad = [r for r in self.records
               if r['status'] != PASSED and r.get('reason') != NOT_SELECTED]
        return 1 if bad else 0


def run_all(s: Settings, dry_run: bool = False) -> int:
    steps = plan(s)
    unknown = sorted((s.only or frozenset()) - {st.name for st in steps})
    if unknown:
        raise ValueError(f'unknown step(s) {", ".join(unknown)}; the steps: '
                         + ', '.join(st.name for st in steps))
    if dry_run:
        print_dry_run(steps, s, Log(None))
        return 0
    s.results.mkdir(parents=True, exist_ok=True)
    if s.only is None:  # a full run starts afresh; --only adds to what an earlier run left
        for old in s.results.glob('*.json'):
            old.unlink()
        (s.out / LOG_NAME).unlink(missing_ok=True)
    log = Log(s.out / LOG_NAME)
    try:
        return Runner(steps, s, log).run()
    finally:
        log.close()
