"""Dependencies point one way: functional <- weights, functional <- models (layers <-
backbones); the models never import the checkpoint code (``weights/``): they describe themselves
with the contract in ``functional/checkpoint_target.py``, and ``weights/`` plugs its loader in.

Read from the source (no import is executed), so a new import against the direction fails here
even when it happens to work by import order.
"""
import ast
from pathlib import Path
from typing import Dict, Set

PACKAGE = Path(__file__).resolve().parents[1] / 'vitdet_plugin'

#: Module prefix -> the prefixes of ours it may import (itself always allowed).
ALLOWED = {
    'vitdet_plugin.functional': set(),
    'vitdet_plugin.weights': {'vitdet_plugin.functional'},
    'vitdet_plugin.models.layers': {'vitdet_plugin.functional'},
    # backbones import no neck: a pyramid over a backbone is a neck chosen in the config
    'vitdet_plugin.models.backbones': {'vitdet_plugin.functional', 'vitdet_plugin.models.layers'},
    'vitdet_plugin.models.necks': {'vitdet_plugin.functional', 'vitdet_plugin.models.layers'},
    # the deployment runner: numpy + onnxruntime (+ OpenCV), nothing of ours that needs torch;
    # its panoptic fusion is numpy too
    'vitdet_plugin.deploy.runner': {'vitdet_plugin.deploy.panoptic'},
    'vitdet_plugin.deploy.panoptic': set(),
    # the pictures of tools/analysis/visualize.py: read the models, not deploy / engine / checks
    'vitdet_plugin.visualization': {'vitdet_plugin.functional', 'vitdet_plugin.models',
                                    'vitdet_plugin.weights', 'vitdet_plugin.config'},
}


#: Module prefix -> the prefixes of ours it must not import (for layers that may import most
#: of the package): no model reads the checkpoint code.
FORBIDDEN = {'vitdet_plugin.models': {'vitdet_plugin.weights'}}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix('').parts)
    if parts[-1] == '__init__':
        parts.pop()
    return '.'.join(parts)


def _imports(path: Path) -> Set[str]:
    """Absolute names of our modules that ``path`` imports."""
    name = _module_name(path)
    package = name if path.name == '__init__.py' else name.rsplit('.', 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split('.')
                base = base[:len(base) - node.level + 1]
                target = '.'.join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ''
            found.add(target)
            found.update(f'{target}.{a.name}' for a in node.names)  # `from . import x`
    return {m for m in found if m.startswith('vitdet_plugin')}


def _graph() -> Dict[str, Set[str]]:
    modules = {_module_name(p) for p in PACKAGE.rglob('*.py')}
    return {_module_name(p): {m for m in _imports(p) if m in modules}
            for p in PACKAGE.rglob('*.py')}


def test_every_layer_imports_only_what_lies_below_it():
    bad = []
    for module, imported in _graph().items():
        for prefix, allowed in ALLOWED.items():
            if module == prefix or module.startswith(prefix + '.'):
                for target in imported:
                    ok = target == prefix or target.startswith(prefix + '.') or any(
                        target == a or target.startswith(a + '.') for a in allowed)
                    if not ok:
                        bad.append(f'{module} imports {target}')
    for module, imported in _graph().items():
        for prefix, forbidden in FORBIDDEN.items():
            if module == prefix or module.startswith(prefix + '.'):
                bad += [f'{module} imports {target}' for target in imported
                        if any(target == f or target.startswith(f + '.') for f in forbidden)]
    assert not bad, 'imports against the dependency direction:\n' + '\n'.join(sorted(bad))


def test_the_graph_is_read_correctly():
    """The reader resolves relative imports (a reader that found nothing would pass above)."""
    graph = _graph()
    assert 'vitdet_plugin.functional' in graph['vitdet_plugin.weights.swin']
    assert 'vitdet_plugin.functional.checkpoint_target' in graph[
        'vitdet_plugin.models.backbones.swin']
    swin = graph['vitdet_plugin.models.backbones.swin']
    assert 'vitdet_plugin.models.backbones.swin_block' in swin
    assert 'vitdet_plugin.functional.checkpoint_target' in graph['vitdet_plugin.weights.layouts']
    assert 'vitdet_plugin.weights.checkpoint_io' in graph['vitdet_plugin.compat']


# ------------------------------------------------------------------------------------ tools/
TOOLS = PACKAGE.parent / 'tools'


def _private_uses(source: str) -> Set[str]:
    """Names of ours with a private part (``_name``, a ``_module``) that ``source`` imports,
    or reaches as ``vitdet_plugin.<...>._name`` (dunder names such as ``__version__`` are
    public)."""
    def private(dotted: str) -> bool:
        return any(p.startswith('_') and not p.endswith('__') for p in dotted.split('.'))

    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith('vitdet_plugin')
                         and private(a.name))
        elif isinstance(node, ast.ImportFrom) and not node.level and \
                (node.module or '').startswith('vitdet_plugin'):
            found.update(f'{node.module}.{a.name}' for a in node.names
                         if private(f'{node.module}.{a.name}'))
        elif isinstance(node, ast.Attribute):
            chain = [node.attr]
            value = node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id == 'vitdet_plugin':
                dotted = '.'.join(['vitdet_plugin', *reversed(chain)])
                if private(dotted):
                    found.add(dotted)
    return found


def test_tools_import_no_private_name_of_the_package():
    """tools/ uses the package through its public names only: a private one (leading
    underscore) is free to change, and a tool that needs it asks for it to be made public."""
    bad = sorted(f'{path.relative_to(TOOLS.parent)}: {name}' for path in TOOLS.rglob('*.py')
                 for name in _private_uses(path.read_text()))
    assert not bad, 'tools/ imports private names of vitdet_plugin:\n' + '\n'.join(bad)


def test_the_private_name_check_finds_each_form():
    """The check above sees every way of reaching a private name (it could not pass vacuously)."""
    source = '\n'.join([
        'from vitdet_plugin.functional.window import NUM_REGIONS, _region_labels',
        'from vitdet_plugin.models._internal import thing',
        'import vitdet_plugin._hidden',
        'import vitdet_plugin.functional',
        'x = vitdet_plugin.functional.window._build_shift_mask',
        'from vitdet_plugin import __version__',
        'from vitdet_plugin.functional import window_partition',
        'from .local import _fine',           # the tools' own modules are theirs to organise
        'from bench.rows import _train_call'])
    assert _private_uses(source) == {
        'vitdet_plugin.functional.window._region_labels', 'vitdet_plugin.models._internal.thing',
        'vitdet_plugin._hidden', 'vitdet_plugin.functional.window._build_shift_mask'}
    assert any(True for _ in TOOLS.rglob('*.py'))


#: Test modules about the project as a whole (docs, README, import rules, the install's
#: foundation, cross-package error messages): tests/ top level.
CROSS_CUTTING = {'test_docs.py', 'test_readme_snippet.py', 'test_import_graph.py',
                 'test_foundation.py', 'test_errors.py'}


def test_tests_mirror_the_package():
    """A module's tests are found by its name: tests/<path>/ holds the tests of
    vitdet_plugin/<path>/ (tests/tools/ and tests/configs/: of the top-level tools/ and
    configs/); only the cross-cutting modules stay at the top level."""
    tests = PACKAGE.parent / 'tests'
    dirs = {p.parent.relative_to(tests) for p in tests.rglob('test_*.py')} - {Path('.')}
    assert dirs, 'no test directories found'
    unmirrored = sorted(str(d) for d in dirs
                        if not (PACKAGE / d).is_dir()
                        and not (PACKAGE.parent / d.parts[0]).is_dir())
    assert not unmirrored, f'test directories with no package directory: {unmirrored}'
    loose = sorted(p.name for p in tests.glob('test_*.py') if p.name not in CROSS_CUTTING)
    assert not loose, f'move these into the tests/ directory of what they test: {loose}'
