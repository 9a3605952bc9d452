"""The static import closure of a model file: what a reader of it has to read.

Follows every ``import`` / ``from ... import`` of package files (absolute and relative, at any
depth of the file, ``TYPE_CHECKING`` blocks included) from the given files, leaving out the
rooms that are not the model's (``--exclude``); a package counts its ``__init__.py``
when it is imported from by name (``from ..layers import Mlp``), not when a module inside it is
(``from ..layers.mlp import Mlp``). Counts all lines of each file in the closure.

    python tools/dev/reading_set.py vitdet_plugin/models/backbones/swin.py [-v]
"""
import argparse
import ast
from pathlib import Path
from typing import Iterator, List, Optional, Set

PACKAGE = 'vitdet_plugin'
#: Rooms left out of a model's reading set (the issue's method).
DEFAULT_EXCLUDE = ('weights', 'checks', 'ops', 'engine', 'compat', 'config')


def module_file(root: Path, dotted: str) -> Optional[Path]:
    """The file of ``vitdet_plugin.x.y``: ``x/y.py`` or ``x/y/__init__.py``; None if neither."""
    base = root.joinpath(*dotted.split('.'))
    for path in (base.with_suffix('.py'), base / '__init__.py'):
        if path.is_file():
            return path
    return None


def imported_files(root: Path, path: Path) -> Iterator[Path]:
    """Package files named by the imports of ``path``."""
    package = path.relative_to(root).parts[:-1]  # what a relative import of level 1 names
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: List[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = list(package[:len(package) - node.level + 1]) if node.level else []
            stem = '.'.join(parts + ([node.module] if node.module else []))
            names = [stem] + [f'{stem}.{a.name}' for a in node.names]
        for dotted in names:
            found = module_file(root, dotted) if dotted.split('.')[0] == PACKAGE else None
            if found is not None:
                yield found


def closure(root: Path, starts: List[Path], exclude: Set[str]) -> Set[Path]:
    """Every package file reachable from ``starts``, minus the excluded rooms."""
    def excluded(p: Path) -> bool:
        rel = p.relative_to(root / PACKAGE).parts
        return Path(rel[0]).stem in exclude  # a package or a module
    seen: Set[Path] = set()
    todo = [p.resolve() for p in starts]
    while todo:
        path = todo.pop()
        if path in seen or excluded(path):
            continue
        seen.add(path)
        todo.extend(imported_files(root, path))
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('files', nargs='+', type=Path)
    parser.add_argument('--exclude', nargs='*', default=list(DEFAULT_EXCLUDE))
    parser.add_argument('-v', '--verbose', action='store_true', help='list the files')
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[2]
    files = closure(root, args.files, set(args.exclude))
    lines = {p: len(p.read_text().splitlines()) for p in files}
    if args.verbose:
        for p in sorted(lines, key=lines.get):  # type: ignore[arg-type]
            print(f'{lines[p]:6d} {p.relative_to(root)}')
    print(f'{sum(lines.values())} lines in {len(lines)} files')


if __name__ == '__main__':
    main()
