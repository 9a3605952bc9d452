"""What the machine is and what got installed (``environment``, ``wheels``, ``stack``).

* :func:`environment_main`: GPU, driver, Python, torch / CUDA / cuDNN, torchvision, timm; written
  and printed before anything is installed; fails when torch sees no CUDA device.
* :func:`wheels_main`: the carried ``.whl/`` holds exactly the wheels of tools/dev/gpu_wheels.txt,
  one version each (two versions of one package stop pip's whole install).
* :func:`stack_main`: after the wheels are installed into the target site and the working tree
  is on ``PYTHONPATH``: ``import vitdet_plugin`` (first: it puts the compile-free ops in place),
  then mmcv / mmengine / mmdet (versions and where they load from), ``mmcv.ops`` and
  ``mmdet.models``, the ops backend; and, in a fresh interpreter, the ``.pth`` line that
  ``pip install`` of the plugin puts in site-packages (read from setup.py), which must make
  ``import mmcv.ops`` work without ``import vitdet_plugin``.
"""
import ast
import importlib.metadata as md
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .results import ENVIRONMENT_PART, STACK_PART, error_line, publish, write_part

ROOT = Path(__file__).resolve().parents[3]
WHEEL_LIST = ROOT / 'tools' / 'dev' / 'gpu_wheels.txt'
SMI_QUERY = ('nvidia-smi', '--query-gpu=name,driver_version,memory.total',
             '--format=csv,noheader')
SMI_TIMEOUT_S = 20
PROBE_TIMEOUT_S = 60
GIB = 2 ** 30
MIB = 2 ** 20
#: Distributions whose versions the environment records (besides torch).
VERSIONED = ('torchvision', 'timm', 'numpy', 'scipy', 'opencv-python-headless', 'onnx',
             'onnxruntime')
#: The setup.py constant that holds the .pth hook's line.
PTH_CONSTANT = 'OPS_PTH_LINE'
#: Run after the .pth line in a fresh interpreter: mmcv.ops must import on the stand-in.
PTH_PROBE = '''
import sys
import mmcv.ops, mmcv._ext
assert 'vitdet_plugin' not in sys.modules, 'the .pth line imported vitdet_plugin'
print(mmcv._ext.BACKEND)
'''


def dist_version(name: str) -> Optional[str]:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def nvidia_smi() -> Dict[str, str]:
    try:
        line = subprocess.run(SMI_QUERY, capture_output=True, text=True, check=True,
                              timeout=SMI_TIMEOUT_S).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError) as e:
        return {'driver': f'unknown ({error_line(e)})'}
    name, driver, memory = (f.strip() for f in (line.split(',') + ['', ''])[:3])
    return {'smi_gpu': name, 'driver': driver, 'smi_memory': memory}


def environment_info() -> Dict[str, Any]:
    info: Dict[str, Any] = {'python': platform.python_version(), 'executable': sys.executable,
                            'platform': platform.platform(), 'cpus': os.cpu_count(),
                            'date': time.strftime('%Y-%m-%d %H:%M:%S %Z')}
    info.update(nvidia_smi())
    import torch
    info.update(torch=torch.__version__, cuda=torch.version.cuda,
                cudnn=torch.backends.cudnn.version(), cuda_available=torch.cuda.is_available())
    info.update({name: dist_version(name) for name in VERSIONED})
    if info['cuda_available']:
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, capability=f'{props.major}.{props.minor}',
                    gpu_memory_gib=round(props.total_memory / GIB, 1),
                    gpus=torch.cuda.device_count(), bf16=torch.cuda.is_bf16_supported())
    return info


def environment_main(results: Path, out: Optional[Path]) -> int:
    try:
        info = environment_info()
    except ImportError as e:
        info = {'python': platform.python_version(), 'error': error_line(e)}
    write_part(results, ENVIRONMENT_PART, info)
    publish(results, out)
    for key, value in info.items():
        print(f'[gpu_check] {key}: {value}')
    if not info.get('cuda_available'):
        print('[gpu_check] torch sees no CUDA device: the GPU steps are skipped', file=sys.stderr)
        return 1
    return 0


def normalize(name: str) -> str:
    """A distribution name as wheel file names spell it (PEP 427 / 503)."""
    return re.sub(r'[-_.]+', '_', name).lower()


def wheel_list(path: Path = WHEEL_LIST) -> Dict[str, str]:
    """tools/dev/gpu_wheels.txt: normalized name -> pinned version."""
    pins: Dict[str, str] = {}
    for line in path.read_text().splitlines():
        spec = line.split('#')[0].split()
        if spec:
            name, _, version = spec[0].partition('==')
            pins[normalize(name)] = version
    return pins


def wheel_problems(wheels: Path, pins: Dict[str, str]) -> Tuple[List[str], List[Path]]:
    """What is wrong with the wheel folder against the pins; the wheels found."""
    files = sorted(wheels.glob('*.whl')) if wheels.is_dir() else []
    found: Dict[str, List[Tuple[str, Path]]] = {}
    for f in files:
        name, version = f.name.split('-')[:2]
        found.setdefault(normalize(name), []).append((version, f))
    problems = []
    for name, version in pins.items():
        have = [v for v, _ in found.get(name, [])]
        if have != [version]:
            problems.append(f'{name}=={version}: found {have or "none"}')
    problems += [f'{name}: not in {WHEEL_LIST.name} ({", ".join(f.name for _, f in got)})'
                 for name, got in found.items() if name not in pins]
    return problems, files


def wheels_main(wheels: Path) -> int:
    problems, files = wheel_problems(wheels, wheel_list())
    size = sum(f.stat().st_size for f in files) / MIB
    print(f'[gpu_check] {len(files)} wheels, {size:.1f} MiB in {wheels}')
    if problems:
        print(f'[gpu_check] {wheels} does not match {WHEEL_LIST.name}: ' + '; '.join(problems)
              + ". Run 'make gpu-wheels' here and name .whl in the device call's carry",
              file=sys.stderr)
        return 1
    return 0


def pth_line(setup_py: Path = ROOT / 'setup.py') -> str:
    """The ``.pth`` line setup.py installs (its :data:`PTH_CONSTANT`), read without running
    setup.py."""
    for node in ast.walk(ast.parse(setup_py.read_text())):
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == PTH_CONSTANT for t in node.targets):
            return str(ast.literal_eval(node.value))
    raise LookupError(f'{setup_py} has no {PTH_CONSTANT}')


def probe_pth_hook(setup_py: Path = ROOT / 'setup.py') -> str:
    """Run the .pth line as site.py would (``exec``), then import mmcv.ops in that fresh
    interpreter: the backend's name, or why not."""
    try:
        code = f'exec({pth_line(setup_py)!r})\n{PTH_PROBE}'
        proc = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S)
    except (OSError, LookupError, SyntaxError, ValueError, subprocess.SubprocessError) as e:
        return f'not run: {error_line(e)}'
    if proc.returncode:
        lines = (proc.stderr or proc.stdout).strip().splitlines() or ['no output']
        return f'FAILED (exit {proc.returncode}): {lines[-1]}'
    return f'ok: mmcv._ext.BACKEND = {proc.stdout.strip()} without importing vitdet_plugin'


def _where(module: Any) -> str:
    return str(Path(module.__file__).resolve().parent)


def stack_info(site: Path) -> Dict[str, Any]:
    import vitdet_plugin  # first: the compile-free ops before anything imports mmcv.ops

    import mmcv
    import mmdet
    import mmengine
    import mmcv.ops
    import mmdet.models  # every mmcv.ops module mmdet uses

    from vitdet_plugin.compat import ops_backend
    lite = dist_version('mmcv-lite')
    info: Dict[str, Any] = {
        'mmcv': f"{mmcv.__version__} ({'mmcv-lite' if lite else 'mmcv'})",
        'mmengine': mmengine.__version__, 'mmdet': mmdet.__version__,
        'vitdet_plugin': vitdet_plugin.__version__, 'ops_backend': ops_backend(),
        'VITDET_MMCV_OPS': os.environ.get('VITDET_MMCV_OPS', 'auto'),
        'site': str(site)}
    for name, module in (('mmcv', mmcv), ('mmdet', mmdet), ('mmengine', mmengine),
                         ('vitdet_plugin', vitdet_plugin)):
        info[f'{name}_from'] = _where(module)
    return info


def stack_main(site: Path, results: Path, out: Optional[Path]) -> int:
    """Record the OpenMMLab stack and the ops backend; fails when the plugin does not import or
    mmcv's ops are not on our backend."""
    info: Dict[str, Any] = {'site': str(site), 'pth_hook': probe_pth_hook()}
    ok = True
    try:
        info.update(stack_info(site))
    except Exception as e:  # recorded: the report says why the later steps were skipped
        import traceback
        traceback.print_exc()
        info['error'], ok = error_line(e), False
    write_part(results, STACK_PART, info)
    publish(results, out)
    for key, value in info.items():
        print(f'[gpu_check] {key}: {value}')
    for name in ('mmcv', 'mmdet', 'mmengine'):
        where = info.get(f'{name}_from', '')
        if where and not where.startswith(str(site.resolve())):
            print(f'[gpu_check] note: {name} loads from {where}, not from {site}')
    return 0 if ok else 1
