"""How the compile-free ops take the place of ``mmcv._ext``: the .pth hook at interpreter start,
``import vitdet_plugin``, the ``VITDET_MMCV_OPS`` modes, a compiled extension winning in
``auto``, and the error of an op the backend lacks. Each case in a fresh interpreter."""
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

import vitdet_plugin  # noqa: F401
from vitdet_plugin.ops import COMPILED_FIX, IMPLEMENTED, MissingCompiledOpError

ROOT = Path(__file__).resolve().parent.parent
SITE = sysconfig.get_paths()['purelib']
OURS = 'vitdet_plugin.ops'


def _python(code: str, *, mode: str = '', no_site: bool = False,
            extra_path: str = '') -> subprocess.CompletedProcess:
    """Run ``code`` in a new interpreter of this venv. ``no_site``: ``python -S`` with
    site-packages and the checkout on PYTHONPATH, so no .pth file runs."""
    env = {k: v for k, v in os.environ.items() if k not in ('VITDET_MMCV_OPS', 'PYTHONPATH')}
    if mode:
        env['VITDET_MMCV_OPS'] = mode
    paths = [p for p in (extra_path, SITE if no_site else '', str(ROOT) if no_site else '') if p]
    if paths:
        env['PYTHONPATH'] = os.pathsep.join(paths)
    cmd = [sys.executable] + (['-S'] if no_site else []) + ['-c', textwrap.dedent(code)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


REPORT = textwrap.dedent('''
    import json, sys
    import mmcv.ops, mmcv._ext
    print(json.dumps({'backend': getattr(mmcv._ext, 'BACKEND', 'compiled'),
                      'plugin_imported': 'vitdet_plugin' in sys.modules}))
''')


def _report(res: subprocess.CompletedProcess) -> dict:
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_pth_hook_is_installed_with_the_package():
    (info,) = Path(SITE).glob('vitdet_plugin-*.dist-info')  # the installed one, not the
    files = [str(f) for f in md.Distribution.at(info).files or []]  # checkout's egg-info
    assert 'vitdet_plugin-mmcv-ops.pth' in files  # in RECORD: pip uninstall removes it
    line = (Path(SITE) / 'vitdet_plugin-mmcv-ops.pth').read_text()
    assert line.startswith('import ') and "'ops', 'startup.py'" in line and line.count('\n') == 1


def test_interpreter_start_puts_the_ops_in_place_before_any_import_of_ours():
    assert _report(_python(REPORT)) == {'backend': OURS, 'plugin_imported': False}


def test_without_the_hook_mmcv_ops_fails_and_import_vitdet_plugin_fixes_it():
    res = _python('import mmcv.ops', no_site=True)
    assert res.returncode == 1 and "No module named 'mmcv._ext'" in res.stderr
    assert _report(_python('import vitdet_plugin\n' + REPORT, no_site=True)) == {
        'backend': OURS, 'plugin_imported': True}


def test_off_leaves_mmcv_alone_and_a_bad_mode_names_the_choices():
    res = _python('import mmcv.ops', mode='off')
    assert res.returncode == 1 and "No module named 'mmcv._ext'" in res.stderr
    res = _python('import mmcv.ops', mode='fast')
    assert res.returncode == 1
    assert ("ImportError: VITDET_MMCV_OPS='fast' is not one of auto, torch, off (auto: compiled "
            "mmcv ops when installed, else vitdet_plugin's compile-free ops)") in res.stderr


def test_auto_prefers_an_installed_compiled_extension_and_torch_overrides_it(tmp_path):
    """A stand-in for a compiled ``mmcv/_ext`` on mmcv's path (a module the path finder finds,
    as it finds ``_ext.cpython-*.so``): ``auto`` takes it, ``torch`` takes ours."""
    fake = tmp_path / 'mmcv'
    fake.mkdir()
    (fake / '_ext.py').write_text("BACKEND = 'compiled-stand-in'\n"
                                  "def __getattr__(name):\n"
                                  "    return lambda *a, **k: None\n")
    prefix = f'import mmcv; mmcv.__path__.insert(0, {str(fake)!r})\n'
    assert _report(_python(prefix + REPORT, mode='auto'))['backend'] == 'compiled-stand-in'
    assert _report(_python(prefix + REPORT, mode='torch'))['backend'] == OURS


def test_an_op_the_backend_lacks_names_itself_and_the_fix():
    from mmcv import _ext as ext
    assert ext.BACKEND == OURS
    with pytest.raises(MissingCompiledOpError, match=re.escape(
            "mmcv op 'nms_rotated' (mmcv._ext.nms_rotated) is not in the compile-free backend "
            f"of vitdet_plugin (it provides: {', '.join(sorted(IMPLEMENTED))}); "
            f"{COMPILED_FIX}")):
        ext.nms_rotated()
    with pytest.raises(AttributeError, match=re.escape(
            "module 'mmcv._ext' has no attribute '__wrapped__'")):
        ext.__wrapped__  # noqa: B018  (introspection sees no op behind dunder names)


def test_every_op_mmcv_ops_loads_resolves():
    """Each name mmcv's modules ask ``load_ext`` for is either implemented or raises the
    error above at call time; the implemented ones are real functions of ours."""
    import mmcv.ops  # noqa: F401
    from vitdet_plugin.ops.registry import resolve
    for name in IMPLEMENTED:
        fn = resolve(name)
        assert fn.__module__.startswith(OURS + '.'), (name, fn.__module__)
        assert fn.__name__ == name
