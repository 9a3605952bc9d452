"""The GPU check kit on CPU: the wheel list against the installed stack and its dependency
closure, the dry run of tools/dev/gpu_check.sh, the runner's step skipping, budget and kill logic
(the real runner with stub commands: ``--fake``, ``GPU_CHECK_FAKE_FAIL``), the incremental
result writing of checks and benchmark rows, the report table, the CLI."""
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Set

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from helpers import REPO_ROOT

ROOT = REPO_ROOT
TOOLS = ROOT / 'tools' / 'dev'  # the developer kits: the GPU check
SCRIPT = TOOLS / 'gpu_check.sh'
KIT = TOOLS / 'gpu_check.py'
STEPS = ['environment', 'install-wheels', 'install-plugin', 'checks-ops', 'checks-backbones',
         'checks-detectors', 'checks-dino', 'benchmark-swin', 'benchmark-vit', 'report']
GPU_STEPS = STEPS[3:9]
#: Distributions the lent GPU machine already has (the device tool's KINDS.md).
ON_GPU_MACHINE = {'torch', 'torchvision', 'timm', 'numpy', 'scipy', 'matplotlib', 'pyyaml',
                  'rich', 'packaging', 'pillow', 'tqdm', 'six', 'regex', 'wheel', 'ninja',
                  'opencv-python-headless', 'onnx', 'onnxruntime'}
#: Requirements the machine meets under another distribution name (the same import).
ALIASES = {'opencv-python': 'opencv-python-headless'}
#: What the kit installs: mmcv's Python code, the OpenMMLab stack, the plugin (from the tree).
ROOTS = ('mmcv-lite', 'mmengine', 'mmdet', 'vitdet-plugin')
#: The GPU machine's interpreter and platform, for requirement markers.
TARGET_ENV = {'python_version': '3.12', 'python_full_version': '3.12.3', 'sys_platform': 'linux',
              'platform_system': 'Linux', 'platform_machine': 'x86_64', 'os_name': 'posix',
              'implementation_name': 'cpython', 'platform_python_implementation': 'CPython',
              'extra': ''}
#: The device tool returns at most this many files from $OUT.
MAX_OUT_FILES = 8
OUT_FILES = ['gpu_check.json', 'gpu_check.log', 'gpu_check.md']


@pytest.fixture
def kit(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    import gpu_check_kit.bench
    import gpu_check_kit.env
    import gpu_check_kit.report
    import gpu_check_kit.results
    import gpu_check_kit.steps
    return gpu_check_kit


@pytest.fixture
def cli(kit):
    """tools/dev/gpu_check.py, the command line, as a module (tools/dev/ on the path)."""
    import gpu_check
    return gpu_check


def _pins() -> Dict[str, str]:
    pins = {}
    for line in (TOOLS / 'gpu_wheels.txt').read_text().splitlines():
        if line.strip() and not line.startswith('#'):
            name, _, version = line.split()[0].partition('==')
            pins[canonicalize_name(name)] = version
    return pins


def _on_machine(name: str) -> bool:
    return ALIASES.get(name, name) in ON_GPU_MACHINE


def _requirements(dist: str) -> Set[str]:
    names = set()
    for text in md.requires(dist) or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate(TARGET_ENV):
            names.add(canonicalize_name(req.name))
    return names


def test_wheel_list_pins_the_installed_stack():
    pins = _pins()
    assert pins['mmcv-lite'] == '2.1.0' and pins['mmengine'] == '0.10.7'
    assert pins['mmdet'] == '3.3.0'
    for name, version in pins.items():
        assert md.version(name) == version, f'{name}: list {version}, .venv {md.version(name)}'
    assert int(pins['setuptools'].split('.')[0]) < 81, 'mmengine needs pkg_resources'
    assert not {n for n in pins if _on_machine(n)}, 'the GPU machine has these already'
    assert 'mmcv' not in pins and not (TOOLS / 'gpu_check_kit' / 'mmcv_ops.py').exists()


def test_wheel_list_is_the_dependency_closure_less_the_machine():
    """From the installed metadata (markers evaluated for CPython 3.12 on Linux): every
    distribution the kit's roots need, recursively, is on the machine or carried, and nothing
    else is carried."""
    needed: Set[str] = set()
    todo: List[str] = list(ROOTS)
    while todo:
        dist = todo.pop()
        if dist in needed or _on_machine(dist):
            continue
        needed.add(dist)
        todo += sorted(_requirements(dist))
    needed.discard('vitdet-plugin')  # from the working tree
    assert needed == set(_pins()), (f'missing: {sorted(needed - set(_pins()))}, '
                                    f'not needed: {sorted(set(_pins()) - needed)}')


def test_wheels_check_finds_missing_duplicate_and_stray_wheels(kit, tmp_path):
    env = kit.env
    pins = env.wheel_list()
    assert pins == {env.normalize(k): v for k, v in _pins().items()}
    for name, version in pins.items():
        (tmp_path / f'{name}-{version}-py3-none-any.whl').touch()
    assert env.wheel_problems(tmp_path, pins)[0] == []
    assert env.wheels_main(tmp_path) == 0
    (tmp_path / 'mmdet-3.2.0-py3-none-any.whl').touch()
    (tmp_path / 'extra_pkg-1.0-py3-none-any.whl').touch()
    (tmp_path / f"addict-{pins['addict']}-py3-none-any.whl").unlink()
    problems = sorted(env.wheel_problems(tmp_path, pins)[0])
    assert problems == [f"addict=={pins['addict']}: found none",
                        'extra_pkg: not in gpu_wheels.txt (extra_pkg-1.0-py3-none-any.whl)',
                        "mmdet==3.3.0: found ['3.2.0', '3.3.0']"]
    assert env.wheels_main(tmp_path) == 1
    assert env.wheels_main(tmp_path / 'none') == 1


def _dry_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {'PATH': f'{Path(sys.executable).parent}:/usr/bin:/bin', 'OUT': str(tmp_path / 'out'),
           'GPU_CHECK_WORK': str(tmp_path / 'work')}
    return subprocess.run(['bash', str(SCRIPT), '--dry-run', *args], capture_output=True,
                          text=True, timeout=60, env=env)


def test_dry_run_prints_every_step_in_order(tmp_path):
    res = _dry_run(tmp_path)
    assert res.returncode == 0, res.stderr
    steps = re.findall(r'^\[gpu_check\] step (\d+)/(\d+): (\S+) \(needs: ([^;]*);', res.stdout,
                       re.M)
    assert [(int(i), int(n), s) for i, n, s, _ in steps] == [
        (i + 1, len(STEPS), s) for i, s in enumerate(STEPS)]
    needs = {s: n for _, _, s, n in steps}
    assert needs['install-plugin'] == 'install-wheels' and needs['report'] == '-'
    assert all(needs[s] == 'environment, install-plugin' for s in GPU_STEPS)
    work, out = tmp_path / 'work', tmp_path / 'out'
    expected = [f'PYTHONPATH={work}/site:{ROOT}',
                f'gpu_check.py environment --results {work}/results --out {out}',
                f'gpu_check.py wheels --wheels {ROOT}/.whl',
                'pip install -q --no-index --no-deps --no-build-isolation',
                f'--target {work}/site',
                f'gpu_check.py stack --site {work}/site',
                'gpu_check.py checks ops', 'gpu_check.py checks backbones',
                'gpu_check.py checks detectors', 'gpu_check.py checks dino',
                'gpu_check.py bench swin', '-- --model swin --device cuda --repeats 10',
                'gpu_check.py bench vit', '-- --model vit --device cuda',
                f'{out}/gpu_check.md']
    positions = [res.stdout.find(e) for e in expected]
    assert -1 not in positions, [e for e, p in zip(expected, positions) if p < 0]
    assert positions == sorted(positions)
    assert 'mmcv_sdist' not in res.stdout and 'MMCV_WITH_OPS' not in res.stdout
    assert not work.exists() and not out.exists(), 'the dry run wrote files'


def test_bad_arguments_fail(tmp_path):
    res = subprocess.run(['bash', str(SCRIPT), '--bogus'], capture_output=True, text=True)
    assert res.returncode == 2 and '--bogus' in res.stderr
    res = _dry_run(tmp_path, '--only', 'checks-ops,nope')
    assert res.returncode == 2 and 'unknown step(s) nope' in res.stderr


def _fake_run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, OUT=str(tmp_path / 'out'), GPU_CHECK_WORK=str(tmp_path / 'work'))
    full.pop('GPU_CHECK_FAKE_FAIL', None)
    full.update(env)
    return subprocess.run([sys.executable, str(KIT), 'run', '--fake', *args],
                          capture_output=True, text=True, timeout=60, env=full)


def _statuses(tmp_path: Path) -> Dict[str, str]:
    data = json.loads((tmp_path / 'out' / 'gpu_check.json').read_text())
    return {s['name']: s['status'] + (f": {s['reason']}" if s.get('reason') else '')
            for s in data['steps']}


def test_a_failed_step_skips_the_steps_that_need_it(tmp_path):
    res = _fake_run(tmp_path, GPU_CHECK_FAKE_FAIL='install-wheels')
    assert res.returncode == 1, res.stdout + res.stderr
    status = _statuses(tmp_path)
    assert status.pop('environment') == status.pop('report') == 'passed'
    assert status.pop('install-wheels') == 'failed'
    assert status.pop('install-plugin') == 'skipped: needs install-wheels (failed)'
    assert status == dict.fromkeys(GPU_STEPS, 'skipped: needs install-plugin (skipped)')
    out = tmp_path / 'out'
    assert sorted(p.name for p in out.iterdir()) == OUT_FILES
    assert len(OUT_FILES) <= MAX_OUT_FILES
    report = (out / 'gpu_check.md').read_text()
    assert '| install-wheels | - | FAILED (exit 1) |' in report
    assert '| checks-dino | environment, install-plugin | skipped |  | needs install-plugin' \
        in report
    assert report in res.stdout  # printed by the report step
    log = (out / 'gpu_check.log').read_text()
    assert 'fake environment' in log and 'fake checks-ops' not in log


def test_no_cuda_skips_only_the_gpu_steps(tmp_path):
    res = _fake_run(tmp_path, GPU_CHECK_FAKE_FAIL='environment')
    assert res.returncode == 1
    status = _statuses(tmp_path)
    assert [status[s] for s in ('install-wheels', 'install-plugin', 'report')] == ['passed'] * 3
    assert {status[s] for s in GPU_STEPS} == {'skipped: needs environment (failed)'}


def test_only_runs_the_named_steps_and_keeps_earlier_results(tmp_path):
    assert _fake_run(tmp_path).returncode == 0
    assert set(_statuses(tmp_path).values()) == {'passed'}
    parts = tmp_path / 'work' / 'results'
    (parts / 'checks-ops.json').write_text('[{"name": "nms", "ok": true, "detail": "same", '
                                           '"seconds": 1.0}]')
    res = _fake_run(tmp_path, '--only', 'benchmark-vit,report', '--fake-fail', 'benchmark-vit')
    assert res.returncode == 1
    status = _statuses(tmp_path)
    assert status.pop('benchmark-vit') == 'failed' and status.pop('report') == 'passed'
    assert set(status.values()) == {'skipped: not selected (--only)'}
    assert '| ops | nms | pass | same | 1.0 |' in (tmp_path / 'out' / 'gpu_check.md').read_text()


def test_an_exhausted_budget_skips_every_step_but_the_report(tmp_path):
    res = _fake_run(tmp_path, '--budget', '0')
    assert res.returncode == 1
    status = _statuses(tmp_path)
    assert status.pop('report') == 'passed'
    for name in ('environment', 'install-wheels'):  # the others: skipped as they need these
        assert status.pop(name).startswith('skipped: no time left in the budget')
    assert all(v.startswith('skipped: needs ') for v in status.values())


def _alive(pid: int) -> bool:
    """Is ``pid`` running (a zombie waiting for its reaper is not)?"""
    try:
        os.kill(pid, 0)
        stat = Path(f'/proc/{pid}/stat').read_text()
    except (ProcessLookupError, FileNotFoundError):
        return False
    return stat.rsplit(')', 1)[1].split()[0] != 'Z'


def test_a_step_past_its_limit_is_killed_with_its_children(kit, tmp_path):
    pid_file = tmp_path / 'child.pid'
    code = ('import subprocess, sys, time; '
            'p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]); '
            f'open({str(pid_file)!r}, "w").write(str(p.pid)); print("started", flush=True); '
            'time.sleep(60)')
    log = kit.steps.Log(tmp_path / 'log.txt')
    start = time.monotonic()
    rc = kit.steps.run_command([sys.executable, '-c', code], dict(os.environ), 1.0, log)
    log.close()
    assert rc == kit.steps.TIMEOUT_RC and time.monotonic() - start < 10
    assert 'started' in (tmp_path / 'log.txt').read_text()
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), 'the step\'s child outlived it'
    assert kit.steps.run_command([sys.executable, '-c', 'raise SystemExit(3)'],
                                 dict(os.environ), 10, kit.steps.Log(None)) == 3


def test_check_results_are_published_after_every_check(kit, tmp_path):
    results_mod = kit.results
    parts, out = tmp_path / 'parts', tmp_path / 'out'
    seen: List[List[str]] = []

    def record(rs):
        results_mod.write_part(parts, 'checks-ops', results_mod.results_json(rs))
        results_mod.publish(parts, out)

    def published() -> str:
        data = json.loads((out / 'gpu_check.json').read_text())
        seen.append([c['name'] for c in data['checks']['ops']])
        return 'looked'

    def parity_miss() -> str:
        raise AssertionError('nms: 3 boxes differ\nsecond line')

    rs = results_mod.run_checks([('a', lambda: 'fine'), ('b', parity_miss), ('c', published)],
                                record)
    assert [(r.name, r.ok, r.detail) for r in rs] == [
        ('a', True, 'fine'), ('b', False, 'AssertionError: nms: 3 boxes differ'),
        ('c', True, 'looked')]
    assert seen == [['a', 'b']]  # c saw a and b on disk while it ran
    report = (out / 'gpu_check.md').read_text()
    assert '| ops | b | FAIL | AssertionError: nms: 3 boxes differ |' in report


def test_benchmark_rows_are_written_after_every_row(kit, tmp_path):
    on_disk: List[int] = []

    def measure(spec: str) -> dict:
        if spec == 'bf16':
            raise RuntimeError('ours and mmdet disagree: rel. error 3e-01')
        return {'size': '800x1216', 'dtype': spec, 'batch': 2, 'fwd': {'ours': [1.0]}}

    def record(rows: List[dict]) -> None:
        kit.results.write_part(tmp_path, 'bench-swin', {'model': 'swin', 'rows': rows})
        on_disk.append(len(json.loads((tmp_path / 'bench-swin.json').read_text())['rows']))

    rows = kit.bench.run_rows(['fp32', 'bf16', 'fp16'], measure,
                              lambda s: {'size': '800x1216', 'dtype': s, 'batch': 2}, record,
                              lambda row: [f"row {row['dtype']}"])
    assert on_disk == [1, 2, 3]
    assert rows[1] == {'size': '800x1216', 'dtype': 'bf16', 'batch': 2,
                       'error': 'RuntimeError: ours and mmdet disagree: rel. error 3e-01'}
    assert 'error' not in rows[2]


def test_report_table(kit):
    parts = {
        'environment': {'gpu': 'NVIDIA H200', 'driver': '580.1', 'torch': '2.11.0',
                        'cuda': '13.0', 'torchvision': '0.26.0', 'timm': '1.0.20'},
        'stack': {'mmcv': '2.1.0 (mmcv-lite)', 'mmengine': '0.10.7', 'mmdet': '3.3.0',
                  'ops_backend': 'vitdet_plugin.ops', 'pth_hook': 'ok'},
        'steps': [{'name': 'install-wheels', 'needs': [], 'status': 'passed', 'rc': 0,
                   'seconds': 12.3},
                  {'name': 'checks-ops', 'needs': ['environment', 'install-plugin'],
                   'status': 'failed', 'rc': 1, 'seconds': 20.0},
                  {'name': 'benchmark-vit', 'needs': ['install-plugin'], 'status': 'timeout',
                   'rc': 124, 'seconds': 75.0, 'reason': 'ran past its 75 s'}],
        'checks-ops': [{'name': 'nms', 'ok': True, 'detail': 'same | order', 'seconds': 1.0}],
        'bench-swin': {'model': 'swin', 'arch': 'tiny', 'rows': [
            {'size': '800x1216', 'batch': 2, 'dtype': 'bf16', 'with_cp': False,
             'fwd': {'ours': [0.001, 0.002, 0.003], 'mmdet': [0.004] * 3},
             'mem MB': {'ours': 10, 'mmdet': 40}},
            {'size': '800x1216', 'batch': 2, 'dtype': 'fp32', 'error': 'RuntimeError: x'}]},
    }
    lines = kit.report.render(kit.results.merge(parts)).splitlines()
    assert lines[0] == ('# GPU check: NVIDIA H200 | driver 580.1 | torch 2.11.0 | CUDA 13.0 | '
                        'torchvision 0.26.0 | timm 1.0.20 | mmcv 2.1.0 (mmcv-lite) | '
                        'mmengine 0.10.7 | mmdet 3.3.0 | ops: vitdet_plugin.ops')
    assert lines[2] == '- .pth hook (no import vitdet_plugin): ok'
    assert '| install-wheels | - | ok | 12 |  |' in lines
    assert '| checks-ops | environment, install-plugin | FAILED (exit 1) | 20 |  |' in lines
    assert '| benchmark-vit | install-plugin | TIMEOUT | 75 | ran past its 75 s |' in lines
    assert '| ops | nms | pass | same / order | 1.0 |' in lines
    assert ('| swin-tiny | 2x800x1216 | bf16 | ours 2 ms; 0.50x mmdet | - | '
            'ours 10 MB; 0.25x mmdet |') in lines
    assert '| swin-tiny | 2x800x1216 | fp32 | error: RuntimeError: x | | |' in lines
    empty = kit.report.render(kit.results.merge({}))
    assert empty.startswith('# GPU check: environment unknown\n')
    assert 'checks: no results' in empty and 'benchmark: no results' in empty


def test_cli_arguments(kit, cli, monkeypatch, tmp_path):
    parse = cli.build_parser().parse_args
    args = parse(['run', '--dry-run', '--only', 'checks-ops,report', '--budget', '100'])
    monkeypatch.setenv('OUT', str(tmp_path / 'o'))
    monkeypatch.setenv('GPU_CHECK_FAKE_FAIL', 'environment')
    monkeypatch.delenv('GPU_CHECK_WORK', raising=False)
    s = cli.settings(args)
    assert (s.only, s.budget_s, s.out, s.work) == (frozenset({'checks-ops', 'report'}), 100,
                                                   tmp_path / 'o', Path('/tmp/gpu_check'))
    assert s.fake and s.fake_fail == frozenset({'environment'})
    assert s.site == Path('/tmp/gpu_check/site') and s.wheels == ROOT / '.whl'
    monkeypatch.setenv('GPU_CHECK_BUDGET', 'soon')
    with pytest.raises(SystemExit):
        cli.settings(parse(['run']))
    own, extra = cli.split_at_dashes(['bench', 'vit', '--results', 'r', '--', '--model', 'vit'])
    args = parse(own)
    assert (args.command, args.name, str(args.results), extra) == ('bench', 'vit', 'r',
                                                                   ['--model', 'vit'])
    assert parse(['checks', 'dino', '--results', 'r']).device == 'cuda'
    for bad in (['checks', 'nope', '--results', 'r'], ['checks', 'ops'], ['bench', 'swinv2']):
        with pytest.raises(SystemExit):
            parse(bad)
    steps = kit.steps
    assert [st.name for st in steps.plan(s)] == STEPS
    assert set(steps.CAPS_S) == set(steps.WHAT) == set(STEPS)


def test_pth_line_is_read_from_setup_py_and_probed(kit, tmp_path):
    """The .pth line of setup.py, read without running it; the probe (run in full on the GPU
    machine, where no .pth file is installed) reports a line that fails, or none."""
    line = kit.env.pth_line()
    assert line.startswith('import ') and line.endswith('_m.install()\n')
    assert '\n' not in line[:-1] and "'ops', 'startup.py'" in line
    fake = tmp_path / 'setup.py'
    fake.write_text('OPS_PTH_LINE = ("import sys; "\n    "sys.exit(3)\\n")\n')
    assert kit.env.pth_line(fake) == 'import sys; sys.exit(3)\n'
    assert kit.env.probe_pth_hook(fake).startswith('FAILED (exit 3)')
    fake.write_text('setup()\n')
    assert kit.env.probe_pth_hook(fake).startswith('not run: LookupError')


def test_scripts_have_no_path_edits():
    for path in [KIT, *sorted((TOOLS / 'gpu_check_kit').glob('*.py'))]:
        assert not re.search(r'sys\.path\.(insert|append)|sys\.path\[', path.read_text()), path
    for path in sorted((TOOLS / 'gpu_check_kit').glob('*.py')):
        assert len(path.read_text().splitlines()) <= 500, path
