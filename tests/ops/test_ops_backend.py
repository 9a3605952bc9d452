"""How the compile-free ops take the place of ``mmcv._ext``: the .pth hook at interpreter start,
``import vitdet_plugin``, the ``VITDET_MMCV_OPS`` modes, a compiled extension winning in
``auto``, and the error of an op the backend lacks. Each case in a fresh interpreter."""
import importlib.metadata as md
import json
import re
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
from helpers import REPO_ROOT, subprocess_env

import vitdet_plugin  # noqa: F401
from vitdet_plugin.ops import COMPILED_FIX, IMPLEMENTED, MissingCompiledOpError

ROOT = REPO_ROOT
SITE = sysconfig.get_paths()['purelib']
OURS = 'vitdet_plugin.ops'


def _python(code: str, *, no_site: bool = False) -> subprocess.CompletedProcess:
    """Run ``code`` in a new interpreter of this venv (VITDET_MMCV_OPS unset). ``no_site``:
    ``python -S`` with site-packages and the checkout on PYTHONPATH, so no .pth file runs."""
    cmd = [sys.executable] + (['-S'] if no_site else []) + ['-c', textwrap.dedent(code)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env=subprocess_env(no_site))


REPORT = textwrap.dedent('''
    import json, sys
    import mmcv._ext
    print('REPORT', json.dumps({'backend': getattr(mmcv._ext, 'BACKEND', 'compiled'),
                                'plugin_imported': 'vitdet_plugin' in sys.modules}))
''')


def _report(res: subprocess.CompletedProcess) -> dict:
    assert res.returncode == 0, res.stderr[-3000:]
    (line,) = [ln for ln in res.stdout.splitlines() if ln.startswith('REPORT ')]
    return json.loads(line[len('REPORT '):])


def test_pth_hook_is_installed_with_the_package():
    (info,) = Path(SITE).glob('vitdet_plugin-*.dist-info')  # the installed one, not the
    files = [str(f) for f in md.Distribution.at(info).files or []]  # checkout's egg-info
    assert 'vitdet_plugin-mmcv-ops.pth' in files  # in RECORD: pip uninstall removes it
    line = (Path(SITE) / 'vitdet_plugin-mmcv-ops.pth').read_text()
    assert line.startswith('import ') and "'ops', 'startup.py'" in line and line.count('\n') == 1


def test_interpreter_start_puts_the_ops_in_place_before_any_import_of_ours():
    assert _report(_python(REPORT)) == {'backend': OURS, 'plugin_imported': False}


def test_without_the_hook_mmcv_ext_is_missing_until_import_vitdet_plugin():
    code = '''
        try:
            import mmcv._ext
        except ModuleNotFoundError as e:
            print('WITHOUT', e)
        import vitdet_plugin
    '''
    res = _python(textwrap.dedent(code) + REPORT, no_site=True)
    assert "WITHOUT No module named 'mmcv._ext'" in res.stdout
    assert _report(res) == {'backend': OURS, 'plugin_imported': True}


MODES = textwrap.dedent('''
    """``import mmcv._ext`` under each VITDET_MMCV_OPS value (read when the import is made)."""
    import json, os, sys
    import mmcv
    fake = sys.argv[1]  # holds mmcv/_ext.py: what the path finder finds, like _ext*.so
    seen = {}
    for case, value, compiled in [('off', 'off', False), ('bad', 'fast', False),
                                  ('auto', 'auto', False), ('auto+compiled', 'auto', True),
                                  ('torch+compiled', 'torch', True)]:
        os.environ['VITDET_MMCV_OPS'] = value
        sys.modules.pop('mmcv._ext', None)
        mmcv.__path__[:] = [p for p in mmcv.__path__ if p != fake] + ([fake] if compiled else [])
        try:
            import mmcv._ext as ext
            seen[case] = getattr(ext, 'BACKEND', 'compiled')
        except ImportError as e:
            seen[case] = f'{type(e).__name__}: {e}'
    print('REPORT', json.dumps(seen))
''')


def test_modes_off_bad_auto_and_torch(tmp_path):
    """``off`` leaves mmcv alone, a bad value names the choices, ``auto`` takes an installed
    compiled extension (a stand-in module on mmcv's path) and ours otherwise, ``torch`` takes
    ours even then."""
    fake = tmp_path / 'mmcv'
    fake.mkdir()
    (fake / '_ext.py').write_text("BACKEND = 'compiled-stand-in'\n")
    res = subprocess.run([sys.executable, '-c', MODES, str(fake)], capture_output=True,
                         text=True, timeout=120)
    assert _report(res) == {
        'off': "ModuleNotFoundError: No module named 'mmcv._ext'",
        'bad': "ImportError: VITDET_MMCV_OPS='fast' is not one of auto, torch, off (auto: "
               "compiled mmcv ops when installed, else vitdet_plugin's compile-free ops)",
        'auto': OURS, 'auto+compiled': 'compiled-stand-in', 'torch+compiled': OURS}


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
