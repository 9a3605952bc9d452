"""The GPU check kit's CPU-side parts: the wheel list against the installed stack, the dry run
of tools/gpu_check.sh, the mmcv op pruning, the shared C++20 patch, the report table."""
import importlib.metadata as md
import os
import os.path as osp
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / 'tools'
SCRIPT = TOOLS / 'gpu_check.sh'
STEPS = ['environment', 'install-wheels', 'build-mmcv', 'install-plugin', 'checks',
         'benchmark-swin', 'benchmark-vit', 'report']
#: Python packages the lent GPU machine already has (the device tool's KINDS.md), by the
#: distribution names mmengine / mmdet / mmcv require them under.
ON_GPU_MACHINE = {'torch', 'torchvision', 'timm', 'numpy', 'scipy', 'matplotlib', 'pyyaml',
                  'rich', 'packaging', 'pillow', 'tqdm', 'six', 'regex', 'opencv-python'}
#: setuptools is pinned for the mmcv 2.1.0 build (<70), not to the venv's runtime version.
BUILD_PINS = {'setuptools'}


@pytest.fixture
def kit(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    import gpu_check_kit.cli
    import gpu_check_kit.mmcv_ops
    import gpu_check_kit.report
    return gpu_check_kit


def _wheel_list() -> dict:
    pins = {}
    for line in (TOOLS / 'gpu_wheels.txt').read_text().splitlines():
        if line.strip() and not line.startswith('#'):
            spec = line.split()[0]
            name, _, version = spec.partition('==')
            pins[name.lower()] = version
    return pins


def _requirements(dist: str) -> set:
    names = set()
    for req in md.requires(dist) or []:
        if 'extra ==' in req:
            continue
        names.add(re.split(r'[ ;<>=!~\[(]', req, maxsplit=1)[0].lower().replace('_', '-'))
    return names


def test_wheel_list_pins_the_installed_stack():
    pins = _wheel_list()
    assert pins['mmengine'] == md.version('mmengine') == '0.10.7'
    assert pins['mmdet'] == md.version('mmdet') == '3.3.0'
    for name, version in pins.items():
        if name not in BUILD_PINS:
            assert md.version(name) == version, f'{name}: list {version}, .venv {md.version(name)}'
    assert pins['setuptools'].split('.')[0] < '70'
    assert not set(pins) & ON_GPU_MACHINE, 'the GPU machine has these already'


def test_wheel_list_covers_what_the_gpu_machine_lacks():
    pins = _wheel_list()
    needed = set()
    for dist in ('mmengine', 'mmdet', 'mmcv', 'vitdet_plugin', 'yapf'):
        needed |= _requirements(dist)
    needed -= {'mmengine', 'mmdet', 'mmcv'}
    missing = needed - set(pins) - ON_GPU_MACHINE - {'tomli'}  # tomli: Python < 3.11 only
    assert not missing, f'neither carried nor on the GPU machine: {sorted(missing)}'


def test_dry_run_prints_every_step_in_order():
    res = subprocess.run(['bash', str(SCRIPT), '--dry-run'], capture_output=True, text=True,
                         timeout=60, env={'PATH': '/usr/bin:/bin', 'OUT': '/tmp/out'})
    assert res.returncode == 0, res.stderr
    steps = re.findall(r'^\[gpu_check\] step (\d+)/(\d+): (\S+)$', res.stdout, re.M)
    assert steps == [(str(i + 1), str(len(STEPS)), s) for i, s in enumerate(STEPS)]
    out = res.stdout
    expected = ['TORCH_CUDA_ARCH_LIST=<major.minor of torch.cuda.get_device_capability()>',
                'pip install -q --no-index --no-deps', '--target /tmp/gpu_check/site',
                'mmcv_patch_cxx20 /tmp/gpu_check/mmcv-2.1.0',
                'tools/gpu_check.py prune-mmcv /tmp/gpu_check/mmcv-2.1.0',
                'env MMCV_WITH_OPS=1 FORCE_CUDA=1', 'tools/gpu_check.py checks --json',
                'tools/benchmark.py --model swin --device cuda',
                'tools/benchmark.py --model vit --device cuda',
                'tools/gpu_check.py report --work /tmp/gpu_check --out /tmp/out/gpu_check.md']
    positions = [out.find(e) for e in expected]
    assert -1 not in positions, [e for e, p in zip(expected, positions) if p < 0]
    assert positions == sorted(positions)
    assert not Path('/tmp/out/gpu_check.md').exists()


def test_dry_run_all_ops_skips_pruning_and_bad_arguments_fail():
    res = subprocess.run(['bash', str(SCRIPT), '--dry-run', '--ops', 'all'],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and 'prune-mmcv' not in res.stdout
    res = subprocess.run(['bash', str(SCRIPT), '--bogus'], capture_output=True, text=True)
    assert res.returncode == 2 and 'unknown argument --bogus' in res.stderr


def test_cxx20_patch_shared_with_make_env(tmp_path):
    (tmp_path / 'setup.py').write_text("args = ['-std=c++17']\nnvcc += ['-std=c++17']\n")
    lib = TOOLS / 'mmcv_sdist.sh'
    res = subprocess.run(['bash', '-c', f'source {lib} && mmcv_patch_cxx20 {tmp_path}'],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / 'setup.py').read_text() == \
        "args = ['-std=c++20']\nnvcc += ['-std=c++20']\n"
    (tmp_path / 'setup.py').write_text('nothing to patch\n')
    res = subprocess.run(['bash', '-c', f'source {lib} && mmcv_patch_cxx20 {tmp_path}'],
                         capture_output=True, text=True)
    assert res.returncode == 1 and 'for C++20 failed' in res.stderr
    assert 'mmcv_patch_cxx20' in (TOOLS / 'setup_env.sh').read_text()


BINDINGS = '''#include "pytorch_cpp_helper.hpp"

void NMSCUDAKernelLauncher(Tensor boxes);

Tensor nms_cuda(Tensor boxes) {
  return NMSCUDAKernelLauncher(boxes);
}

Tensor nms_impl(Tensor boxes);
REGISTER_DEVICE_IMPL(nms_impl, CUDA, nms_cuda);

void FooCUDAKernelLauncher(Tensor x);
void foo_cuda(Tensor x) {
  // a comment with a brace {
  FooCUDAKernelLauncher(x);
};

void foo_impl(Tensor x);

REGISTER_DEVICE_IMPL(foo_impl, CUDA,
                     foo_cuda)

void bar_cuda(Tensor x) { foo_cuda(x); }
REGISTER_DEVICE_IMPL(bar_impl, CUDA, bar_cuda);
'''


def test_bindings_keep_only_ops_with_kernels(kit):
    text, kept, dropped = kit.mmcv_ops.prune_bindings(
        BINDINGS, ['Tensor NMSCUDAKernelLauncher(Tensor boxes) { ... }'])
    assert (kept, dropped) == (['nms_impl'], ['foo_impl', 'bar_impl'])
    assert 'Foo' not in text and 'bar_cuda' not in text and 'foo_impl' in text
    assert 'REGISTER_DEVICE_IMPL(nms_impl, CUDA, nms_cuda);' in text


def _mmcv_sdist() -> Path:
    """The mmcv 2.1.0 sdist: `make gpu-wheels`' copy in .whl/, else downloaded from PyPI once
    into the plugin's cache (the same file `make env` builds mmcv from)."""
    carried = ROOT / '.whl' / 'mmcv-2.1.0.tar.gz'
    if carried.is_file():
        return carried
    cache = Path(os.environ.get('VITDET_SDIST_CACHE',
                                Path.home() / '.cache' / 'vitdet_plugin' / 'sdist'))
    sdist = cache / 'mmcv-2.1.0.tar.gz'
    if not sdist.is_file():
        subprocess.run(['bash', '-c', 'source tools/mmcv_sdist.sh && mmcv_download_sdist "$0" "$1"',
                        sys.executable, str(cache)], cwd=ROOT, check=True, capture_output=True)
    return sdist


def test_pruned_mmcv_sdist_registers_exactly_the_needed_ops(kit, tmp_path):
    with tarfile.open(_mmcv_sdist()) as tar:
        tar.extractall(tmp_path, filter='data')
    src = tmp_path / 'mmcv-2.1.0'
    report = kit.mmcv_ops.prune_tree(src)
    assert report.kept_impls == [
        'sigmoid_focal_loss_forward_impl', 'sigmoid_focal_loss_backward_impl',
        'softmax_focal_loss_forward_impl', 'softmax_focal_loss_backward_impl', 'nms_impl',
        'roi_align_forward_impl', 'roi_align_backward_impl']
    cuda = src / kit.mmcv_ops.CUDA_DIR
    assert sorted(p.name for p in cuda.iterdir()) == [
        'cudabind.cpp', 'focal_loss_cuda.cu', 'nms_cuda.cu', 'roi_align_cuda.cu']
    assert len(report.dropped_kernels) == 55
    with pytest.raises(ValueError, match=r'no kernel nope_cuda\.cu'):
        kit.mmcv_ops.prune_tree(src, ['nope'])


def test_cli_arguments(kit):
    parse = kit.cli.build_parser().parse_args
    args = parse(['prune-mmcv', '/x', '--ops', 'nms', 'roi_align'])
    assert (args.command, str(args.src), args.ops) == ('prune-mmcv', '/x', ['nms', 'roi_align'])
    assert parse(['prune-mmcv', '/x']).ops == ['focal_loss', 'nms', 'roi_align']
    args = parse(['report', '--work', '/w', '--out', '/o/gpu_check.md'])
    assert (str(args.work), str(args.out)) == ('/w', '/o/gpu_check.md')
    with pytest.raises(SystemExit):
        parse(['checks'])  # --json is required
    assert kit.cli.main(['prune-mmcv', '/nonexistent']) == 2


def test_report_table(kit, tmp_path):
    (tmp_path / 'steps.tsv').write_text('build-mmcv\t0\t200\nchecks\t1\t60\n')
    (tmp_path / 'checks.json').write_text(
        '[{"name": "nms", "ok": true, "detail": "same", "seconds": 1.0}]')
    (tmp_path / 'bench_swin.json').write_text(
        '{"model": "swin", "arch": "tiny", "rows": [{"size": "800x1216", "batch": 2, '
        '"dtype": "bf16", "with_cp": false, "fwd": {"ours": [1, 2, 3], "mmdet": [4, 4, 4]}, '
        '"mem MB": {"ours": 10, "mmdet": 40}}]}')
    (tmp_path / 'env.txt').write_text('NVIDIA H200 | torch 2.11\n')
    assert kit.cli.main(['report', '--work', str(tmp_path), '--out',
                         str(tmp_path / 'gpu_check.md')]) == 0
    lines = (tmp_path / 'gpu_check.md').read_text().splitlines()
    assert lines[0] == '# GPU check: NVIDIA H200 | torch 2.11'
    assert '| build-mmcv | ok | 200 |' in lines and '| checks | FAILED (exit 1) | 60 |' in lines
    assert '| nms | pass | same |' in lines
    assert '| swin-tiny | 2x800x1216 | bf16 | 0.50x mmdet | - | 0.25x mmdet |' in lines


def test_scripts_have_no_path_edits():
    for path in [TOOLS / 'gpu_check.py', *sorted((TOOLS / 'gpu_check_kit').glob('*.py'))]:
        assert not re.search(r'sys\.path\.(insert|append)', path.read_text()), path
    assert osp.isfile(TOOLS / 'gpu_wheels.sh')
