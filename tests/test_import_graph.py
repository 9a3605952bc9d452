"""Dependencies point one way: functional <- weights <- models (layers <- backbones).

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
    'vitdet_plugin.models.backbones': {'vitdet_plugin.functional', 'vitdet_plugin.weights',
                                       'vitdet_plugin.models.layers'},
    'vitdet_plugin.models.necks': {'vitdet_plugin.functional', 'vitdet_plugin.weights',
                                   'vitdet_plugin.models.layers'},
}


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
    assert not bad, 'imports against the dependency direction:\n' + '\n'.join(sorted(bad))


def test_the_graph_is_read_correctly():
    """The reader resolves relative imports (a reader that found nothing would pass above)."""
    graph = _graph()
    assert 'vitdet_plugin.functional' in graph['vitdet_plugin.weights.swin']
    assert 'vitdet_plugin.weights.target' in graph['vitdet_plugin.models.backbones.swin']
    assert 'vitdet_plugin.models.layers.swin_block' in graph['vitdet_plugin.models.backbones.swin']
    assert 'vitdet_plugin.weights.layouts' in graph['vitdet_plugin.models.necks.simple_fpn']
