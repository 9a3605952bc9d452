"""`make env MMCV=compiled`'s cold path on the real mmcv 2.1.0 sdist from PyPI, short of
compiling: the build tools, the download, the C++20 patch and the extension's configuration
under this torch (tools/env/mmcv_sdist.sh, the functions tools/env/setup_env.sh runs)."""
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest
from helpers import REPO_ROOT

ROOT = REPO_ROOT
LIB = ROOT / 'tools' / 'env' / 'mmcv_sdist.sh'
VERSION = '2.1.0'
#: mmcv 2.1.0's setup.py passes '-std=c++17' in three places on Linux (pytorch cxx, MPS, nvcc).
CXX17_FLAGS_IN_SDIST = 3


def _bash(script: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(['bash', '-c', f'source {LIB} && {script}', 'bash', *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope='module')
def sdist(tmp_path_factory) -> Path:
    """Downloaded cold, every run, as `make env MMCV=compiled` does."""
    work = tmp_path_factory.mktemp('mmcv_sdist')
    res = _bash('mmcv_build_tools "$1" "$2/buildtools" && '
                'PYTHONPATH="$2/buildtools" mmcv_download_sdist "$1" "$2"',
                sys.executable, str(work))
    assert res.returncode == 0, res.stdout + res.stderr
    path = work / f'mmcv-{VERSION}.tar.gz'
    assert path.is_file(), sorted(p.name for p in work.iterdir())
    return path


@pytest.fixture
def source(sdist: Path, tmp_path: Path) -> Path:
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path, filter='data')
    return tmp_path / f'mmcv-{VERSION}'


def test_patch_switches_every_linux_flag_and_is_idempotent(source: Path):
    setup = source / 'setup.py'
    original = setup.read_text()
    assert original.count("'-std=c++17'") == CXX17_FLAGS_IN_SDIST
    res = _bash('mmcv_patch_cxx20 "$1"', str(source))
    assert res.returncode == 0, res.stderr
    patched = setup.read_text()
    assert "'-std=c++17'" not in patched
    assert patched.count("'-std=c++20'") == CXX17_FLAGS_IN_SDIST
    # only those flags changed: Windows' /std:c++17 and the comments stay
    assert patched == original.replace("'-std=c++17'", "'-std=c++20'")
    assert "'/std:c++17'" in patched and 'depend on c++17 or higher' in patched
    res = _bash('mmcv_patch_cxx20 "$1"', str(source))
    assert res.returncode == 0 and setup.read_text() == patched


def test_patch_refuses_a_file_that_is_not_the_sdist(tmp_path: Path):
    (tmp_path / 'setup.py').write_text('print("hello")\n')
    res = _bash('mmcv_patch_cxx20 "$1"', str(tmp_path))
    assert res.returncode == 1
    assert res.stderr.strip() == (
        f"patching {tmp_path}/setup.py for C++20 failed (0 '-std=c++17' flags found, 0 "
        f"'-std=c++20' after the edit): is it the mmcv {VERSION} sdist?")
    res = _bash('mmcv_patch_cxx20 "$1"', str(tmp_path / 'nowhere'))
    assert res.returncode == 1
    assert res.stderr.strip() == (f'{tmp_path}/nowhere/setup.py not found: is {tmp_path}/nowhere '
                                  f'the unpacked mmcv {VERSION} sdist?')


CONFIGURE = textwrap.dedent('''
    """Run the sdist's setup.py up to setup(): the extension it would compile, as JSON."""
    import json, sys
    import setuptools
    captured = {}
    setuptools.setup = lambda **kw: captured.update(kw)
    sys.argv = ['setup.py', 'bdist_wheel']
    exec(compile(open('setup.py').read(), 'setup.py', 'exec'), {'__name__': '__main__'})
    (ext,) = captured['ext_modules']
    print(json.dumps({'name': ext.name, 'cxx': ext.extra_compile_args['cxx'],
                      'sources': len(ext.sources), 'version': captured['version']}))
''')


def test_patched_sdist_configures_a_cxx20_extension_under_this_torch(source: Path, sdist: Path):
    assert _bash('mmcv_patch_cxx20 "$1"', str(source)).returncode == 0
    tools = sdist.parent / 'buildtools'  # setuptools<70, as the real build
    res = subprocess.run([sys.executable, '-c', CONFIGURE], cwd=source, capture_output=True,
                         text=True, timeout=300,
                         env={'PATH': '/usr/bin:/bin', 'PYTHONPATH': str(tools),
                              'MMCV_WITH_OPS': '1'})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    import json
    ext = json.loads(res.stdout.strip().splitlines()[-1])
    assert ext['name'] == 'mmcv._ext' and ext['version'] == VERSION
    assert ext['cxx'] == ['-std=c++20']
    # every C++ file of the CPU build: mmcv/ops/csrc/pytorch/*.cpp + pytorch/cpu/*.cpp
    cpp = (list((source / 'mmcv/ops/csrc/pytorch').glob('*.cpp'))
           + list((source / 'mmcv/ops/csrc/pytorch/cpu').glob('*.cpp')))
    assert ext['sources'] == len(cpp) > 0
