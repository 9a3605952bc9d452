"""Config tooling for vitdet_plugin's tools: loading a config, one ``data_root`` override,
where a config's datasets lie and clear missing-data errors.

Our configs define one top-level ``data_root`` from which every dataloader's
``dataset.data_root`` and every evaluator's ``ann_file`` are derived. mmengine resolves such
variables when the file is loaded, so ``--cfg-options data_root=X`` alone would only change the
top-level key. :func:`apply_cfg_options` (used by :func:`load_config`, i.e. ``tools/train.py`` /
``tools/test.py``) merges the options and, when ``data_root`` changed, moves every value derived
from the old root to the new one (:func:`propagate_data_root`). :func:`check_data` raises
:class:`DatasetNotFoundError` before any model is built, naming the missing paths, where the
data is expected and the exact override that points the config elsewhere. The dataset walk
(:data:`LOADER_KEYS`, :func:`iter_datasets`) is shared with the preflight checks of
:mod:`vitdet_plugin.checks`.
"""
import os
import os.path as osp
import shlex
import sys
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from mmengine.config import Config

#: sections of a config that hold a dataset (searched recursively for wrapped datasets)
LOADER_KEYS = {'train': ('train_dataloader',), 'val': ('val_dataloader',),
               'test': ('test_dataloader',)}
EVALUATOR_KEYS = {'train': (), 'val': ('val_evaluator',), 'test': ('test_evaluator',)}
PLACEHOLDER_ROOT = '/path/to/data/'
#: the tools that take ``--data DIR`` (:mod:`vitdet_plugin.datasets.data_folder`)
DATA_OPTION_TOOLS = ('tools/train.py', 'tools/test.py')
#: folders of data_root a missing-folder message lists, at most
SHOWN_ENTRIES = 10


class DatasetNotFoundError(FileNotFoundError):
    """A config's dataset files are not where the config expects them."""


# ----------------------------------------------------------------------------- data_root moves
def _under(value: str, root: str) -> bool:
    root = root.rstrip('/')
    return bool(root) and (value.rstrip('/') == root or value.startswith(root + '/'))


def _moved(value: str, old: str, new: str) -> str:
    rest = value[len(old.rstrip('/')):].lstrip('/')
    if not rest:
        return new
    return new.rstrip('/') + '/' + rest


def _walk(node: Any, path: str, seen: Optional[set] = None) -> Iterator[Tuple[Any, Any, str]]:
    """Yield ``(container, key, dotted_path)`` for every leaf below ``node``, each once."""
    seen = set() if seen is None else seen
    if id(node) in seen:  # a dict shared by two keys (test_dataloader = val_dataloader)
        return
    seen.add(id(node))
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in items:
        sub = f'{path}.{key}' if path else str(key)
        if isinstance(value, (dict, list)):
            yield from _walk(value, sub, seen)
        else:
            yield node, key, sub


def data_root_paths(cfg: Config, root: Optional[str] = None) -> List[str]:
    """Dotted keys of every string derived from ``root`` (default: ``cfg.data_root``).

    Covers the ``data_root`` of each dataset and any path below the root (evaluator
    ``ann_file``, ...); the top-level ``data_root`` itself is not listed.
    """
    root = cfg.get('data_root') if root is None else root
    if not isinstance(root, str) or not root:
        return []
    return [p for parent, key, p in _walk(cfg._cfg_dict, '')
            if p != 'data_root' and isinstance(parent[key], str) and _under(parent[key], root)]


def propagate_data_root(cfg: Config, old: str, new: str) -> List[str]:
    """Move every value derived from ``old`` to ``new`` in place; returns the keys changed."""
    changed = []
    for parent, key, path in list(_walk(cfg._cfg_dict, '')):
        value = parent[key]
        if path == 'data_root' or not isinstance(value, str) or not _under(value, old):
            continue
        parent[key] = _moved(value, old, new)
        changed.append(path)
    cfg._cfg_dict['data_root'] = new
    return changed


def apply_cfg_options(cfg: Config, options: Optional[Dict[str, Any]]) -> List[str]:
    """Merge ``--cfg-options`` into ``cfg``; a new ``data_root`` reaches every derived value.

    An option that sets a derived key explicitly (``val_evaluator.ann_file=...``) wins over the
    propagation. Returns the keys moved to the new root.
    """
    if not options:
        return []
    old = cfg.get('data_root')
    cfg.merge_from_dict(options)
    new = cfg.get('data_root')
    if 'data_root' not in options or not isinstance(old, str) or new == old:
        return []
    # the propagation may have moved an explicitly given derived key: re-apply those
    moved = propagate_data_root(cfg, old, new)
    explicit = {k: v for k, v in options.items() if k != 'data_root'}
    if explicit:
        cfg.merge_from_dict(explicit)
    return moved


def data_root_override(cfg: Config, new_root: str = PLACEHOLDER_ROOT) -> str:
    """The ``--cfg-options`` string that moves this config's dataset to ``new_root``.

    Every derived key is spelled out, so the override also works with runners that do not
    propagate ``data_root`` (mmdet's own ``tools/train.py``).
    """
    root = cfg.get('data_root')
    parts = [f'data_root={new_root}']
    if isinstance(root, str):
        for path in data_root_paths(cfg, root):
            parent_value = _lookup(cfg, path)
            parts.append(f'{path}={_moved(parent_value, root, new_root)}')
    return '--cfg-options ' + ' '.join(shlex.quote(p) for p in parts)


def _lookup(cfg: Config, dotted: str) -> Any:
    node: Any = cfg._cfg_dict
    for key in dotted.split('.'):
        node = node[int(key)] if isinstance(node, list) else node[key]
    return node


# ----------------------------------------------------------------------------- existence check
def iter_datasets(node: Any, path: str) -> Iterator[Tuple[dict, str]]:
    """Leaf dataset dicts (with an ``ann_file`` or ``data_root``) below a dataloader cfg."""
    if isinstance(node, dict):
        if 'ann_file' in node or ('data_root' in node and 'type' in node):
            yield node, path
            return
        for key in ('dataset', 'datasets'):
            if key in node:
                yield from iter_datasets(node[key], f'{path}.{key}')
    elif isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            yield from iter_datasets(item, f'{path}.{i}')


def _dataset_paths(ds: dict) -> List[Tuple[str, str]]:
    """``(what, path)`` pairs a dataset needs on disk (local paths only)."""
    root = ds.get('data_root') or ''
    needed = []
    ann = ds.get('ann_file')
    if isinstance(ann, str) and ann:
        needed.append(('ann_file', ann if osp.isabs(ann) else osp.join(root, ann)))
    prefix = ds.get('data_prefix') or {}
    for key in ('img', 'img_path'):
        sub = prefix.get(key) if isinstance(prefix, dict) else None
        if isinstance(sub, str) and sub:
            needed.append((f'data_prefix.{key}', sub if osp.isabs(sub) else osp.join(root, sub)))
    if not needed and root:
        needed.append(('data_root', root))
    return needed


def is_remote(path: str) -> bool:
    return '://' in path


def missing_data(cfg: Config, stages: Sequence[str] = ('train', 'val')) -> List[str]:
    """Human-readable list of the dataset files of ``stages`` that do not exist."""
    missing = []
    for stage in stages:
        for key in LOADER_KEYS[stage]:
            loader = cfg.get(key)
            if not loader:
                continue
            for ds, path in iter_datasets(loader.get('dataset'), f'{key}.dataset'):
                for what, p in _dataset_paths(ds):
                    if not is_remote(p) and not osp.exists(p):
                        missing.append(f'{path}.{what}: {p}')
        for key in EVALUATOR_KEYS[stage]:
            evaluators = cfg.get(key)
            evaluators = evaluators if isinstance(evaluators, list) else [evaluators]
            for i, ev in enumerate(evaluators):
                ann = ev.get('ann_file') if isinstance(ev, dict) else None
                if isinstance(ann, str) and not is_remote(ann) and not osp.exists(ann):
                    where = key if len(evaluators) == 1 else f'{key}.{i}'
                    missing.append(f'{where}.ann_file: {ann}')
    return list(dict.fromkeys(missing))


def running_tool() -> str:
    """The script this process runs, as a command line names it (relative to the working
    directory when below it): ``tools/train.py`` for ours and for mmdet's alike, so a message
    names the tool that ran, not one of ours."""
    script = sys.argv[0] if sys.argv and sys.argv[0] else 'tools/train.py'
    full = osp.abspath(script)
    cwd = os.getcwd()
    return osp.relpath(full, cwd) if full.startswith(cwd + os.sep) else script


def _folder_fixes(missing: Sequence[str], root: str) -> List[str]:
    """For missing ``data_prefix`` folders under a ``data_root`` that exists: the keys at fault
    and what to set them to (moving ``data_root`` would not help)."""
    keys = [m.split(': ', 1)[0] for m in missing]
    entries = sorted(e + '/' for e in os.listdir(root) if osp.isdir(osp.join(root, e)))
    shown = ', '.join(entries[:SHOWN_ENTRIES] + (['...'] if len(entries) > SHOWN_ENTRIES else []))
    one = len(keys) == 1
    return [f"data_root='{root}' exists (its folders: {shown or 'none'}), so the "
            f'{"key" if one else "keys"} at fault {"is" if one else "are"} {", ".join(keys)}: '
            f'set {"it" if one else "each"} to the folder of the images, relative to data_root']


def check_data(cfg: Config, stages: Sequence[str] = ('train', 'val'),
               config_path: Optional[str] = None, tool: str = 'tools/train.py',
               ours: bool = True, root_layout: Optional[str] = None) -> None:
    """Raise :class:`DatasetNotFoundError` when the data ``stages`` need is missing.

    The message names each path the config reads that is missing (its key and the path), the
    expected ``data_root`` (and the working directory relative paths are resolved against), the
    ``--data DIR`` of our train / test tools (a data folder as it is) and the exact
    ``--cfg-options`` that point the config at another directory, as options of
    ``tool`` (``ours``: one of vitdet_plugin's tools, which move every path derived from
    ``data_root``). When ``data_root`` exists and only image folders are missing, the message
    names those keys instead: moving ``data_root`` would not help. ``root_layout``: the data
    folder layout ``data_root`` has (``'Roboflow COCO export'``), when it has one; the
    ``--data`` line then names it and ``data_root``.
    """
    missing = missing_data(cfg, stages)
    if not missing:
        return
    root = cfg.get('data_root')
    name = config_path or cfg.filename or 'the config'
    lines = [f'Dataset not found for {name}:']
    lines += [f'  missing {m}' for m in missing]
    folders_only = all('.data_prefix.' in m.split(': ', 1)[0] for m in missing)
    if isinstance(root, str) and folders_only and osp.isdir(root):
        lines += _folder_fixes(missing, root)
        raise DatasetNotFoundError('\n'.join(lines))
    if isinstance(root, str):
        lines.append(f"The config expects its data under data_root='{root}'"
                     + ('' if osp.isabs(root) else f' (relative to the current directory '
                        f'{os.getcwd()})') + '.')
    if ours and tool in DATA_OPTION_TOOLS and root_layout:
        lines.append(f"data_root='{root}' is a {root_layout}: its splits and classes are taken "
                     'as they are with')
        lines.append(f'  python {tool} {name} --data {root}')
    elif ours and tool in DATA_OPTION_TOOLS:
        lines.append('Your own data as it is (a Roboflow COCO export: train/_annotations.coco.'
                     'json, valid/, test/; or annotations/instances_train.json, instances_val.json '
                     'with train/ and val/): the splits and classes are found there with')
        lines.append(f'  python {tool} {name} --data /path/to/your/data/')
    if not isinstance(root, str):
        lines.append('Set the dataloaders\' dataset.data_root / ann_file with --cfg-options.')
    elif ours:
        lines.append('Point the config at your copy with')
        lines.append(f'  python {tool} {name} --cfg-options data_root={PLACEHOLDER_ROOT}')
        lines.append("(vitdet_plugin's tools move every path derived from data_root), or, with "
                     'any mmengine runner (e.g. mmdet\'s tools/train.py):')
        lines.append(f'  {data_root_override(cfg, PLACEHOLDER_ROOT)}')
    else:  # another runner: only the explicit override moves every path
        lines.append('Point the config at your copy with')
        lines.append(f'  python {tool} {name} {data_root_override(cfg, PLACEHOLDER_ROOT)}')
    raise DatasetNotFoundError('\n'.join(lines))


# ----------------------------------------------------------------------------- tools entry
def load_config(path: str, cfg_options: Optional[Dict[str, Any]] = None) -> Config:
    """Load a config for vitdet_plugin's tools.

    ``--cfg-options`` are merged with :func:`apply_cfg_options` (a ``data_root`` override
    reaches every derived path), ``default_scope`` defaults to ``'mmdet'`` and that scope is
    initialised, so models can be built from the config directly.
    """
    from mmengine.registry import init_default_scope

    if not osp.isfile(path):
        raise FileNotFoundError(f'config file {path!r} does not exist')
    cfg = Config.fromfile(path)
    apply_cfg_options(cfg, cfg_options)
    if cfg.get('default_scope') is None:
        cfg.default_scope = 'mmdet'
    init_default_scope(cfg.default_scope)
    return cfg
