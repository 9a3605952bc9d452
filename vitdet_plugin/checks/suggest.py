"""Fixes the pre-flight check can work out itself, so that one run reports every mistake.

A COCO config pointed at one's own data typically fails on three things in turn: the file names
(``instances_train2017.json``), ``metainfo.classes`` (unset: the dataset type's 80 COCO names)
and then ``num_classes``. :func:`file_suggestions` finds the annotation file / image folder a
missing path most likely means (the one ``.json`` file, or folder, in the expected place whose
name holds the split's word); :func:`class_suggestions` reads the categories of an annotation
file whose dataset sets no ``metainfo.classes``. The pre-flight check applies both to a copy of
the config and checks that copy further, so the class counts are compared with the classes the
data has, in the same report. :func:`options_text` writes every fix as ``--cfg-options``.
"""
import ast
import json
import os
import os.path as osp
import re
import shlex
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from ..config import EVALUATOR_KEYS, LOADER_KEYS, is_remote, iter_datasets

#: words a file or folder name holds for each split (test data is often the val split)
SPLIT_WORDS = {'train': ('train',), 'val': ('val',), 'test': ('test', 'val')}
#: the fix at the end of a config problem line: ``...; set KEY=VALUE`` (or ``..., or set``)
SET_FIX = re.compile(r'(?:;|, or) set ([\w.]+)=(.+?)(?: or fewer.*)?$')
#: mmengine's key that makes a merged dict replace the base's instead of updating it
DELETE_KEY = '_delete_'
#: class names shown in a line, at most
SHOWN_NAMES = 10
#: a missing image folder is looked for this many levels below data_root, by the first
#: SEARCH_IMAGES file names of the annotation file
SEARCH_DEPTH = 3
SEARCH_IMAGES = 3


def _pick(directory: str, stage: str, want_dir: bool, ext: str = '') -> Optional[str]:
    """The one entry of ``directory`` (a folder when ``want_dir``, else a file ending in
    ``ext``) whose name holds a word of ``stage``; None when there is not exactly one."""
    if not osp.isdir(directory):
        return None
    for word in SPLIT_WORDS[stage]:
        found = sorted(n for n in os.listdir(directory)
                       if word in n.lower() and n.endswith(ext)
                       and osp.isdir(osp.join(directory, n)) == want_dir)
        if len(found) > 1:  # COCO-style folders also hold panoptic_<split>.json / folders
            found = [n for n in found if 'panoptic' not in n.lower()]
        if len(found) == 1:
            return found[0]
        if found:
            return None
    return None


def _image_folder(root: str, ann_file: Any, stage: str) -> Optional[str]:
    """The one folder below ``root`` (at most :data:`SEARCH_DEPTH` levels down) that holds the
    first :data:`SEARCH_IMAGES` images of ``ann_file`` (of several, the one whose path holds a
    word of ``stage``); None when not exactly one does."""
    images = [im for im in _json_field(ann_file, 'images')[:SEARCH_IMAGES] if isinstance(im, dict)]
    names = [n for n in (im.get('file_name') for im in images) if isinstance(n, str)]
    if not names or len(names) != len(images) or not osp.isdir(root):
        return None
    found = []
    base = root.rstrip('/').count(os.sep)
    for folder, subs, _ in os.walk(root):
        subs[:] = sorted(d for d in subs if not d.startswith('.'))
        if folder.rstrip('/').count(os.sep) - base >= SEARCH_DEPTH:
            subs[:] = []
        if all(osp.isfile(osp.join(folder, n)) for n in names):
            found.append(folder)
    if len(found) > 1:  # COCO panoptic PNGs share the images' names
        found = [f for f in found if 'panoptic' not in osp.relpath(f, root).lower()]
    if len(found) > 1:  # the same file names in each split's folder: the split's word decides
        found = [f for f in found
                 if any(w in osp.relpath(f, root).lower() for w in SPLIT_WORDS[stage])]
    return found[0] if len(found) == 1 else None


def _relative(found: str, root: str, given: str) -> str:
    return found if osp.isabs(given) or not root else osp.relpath(found, root)


def stage_datasets(cfg: Any, stages: Sequence[str]) -> Iterator[Tuple[str, dict, str]]:
    """``(stage, dataset config, its config path)`` of every dataset of ``stages``' loaders."""
    for stage in stages:
        for key in LOADER_KEYS[stage]:
            loader = cfg.get(key)
            if isinstance(loader, dict):
                for ds, path in iter_datasets(loader.get('dataset'), f'{key}.dataset'):
                    yield stage, ds, path


def file_suggestions(cfg: Any, stages: Sequence[str]) -> Dict[str, str]:
    """``config key -> value`` for each missing ``ann_file`` / ``data_prefix.img`` (and
    evaluator ``ann_file``) of ``stages`` that one file or folder in the expected place fits."""
    out: Dict[str, str] = {}
    for stage, ds, path in stage_datasets(cfg, stages):
        root = ds.get('data_root') or ''
        ann = ds.get('ann_file')
        if isinstance(ann, str) and ann and not is_remote(ann):
            full = ann if osp.isabs(ann) else osp.join(root, ann)
            if not osp.exists(full):
                folder = osp.dirname(full) if osp.isdir(osp.dirname(full)) else root
                name = _pick(folder, stage, False, '.json')
                if name:
                    out[f'{path}.ann_file'] = _relative(
                        osp.join(folder, name), root, ann)
        prefix = ds.get('data_prefix')
        img = prefix.get('img') if isinstance(prefix, dict) else None
        if isinstance(img, str) and img and not is_remote(img):
            full = img if osp.isabs(img) else osp.join(root, img)
            if not osp.exists(full):
                parent = osp.dirname(full.rstrip('/')) or root
                name = _pick(parent, stage, True)
                ann_full = ann if not isinstance(ann, str) or osp.isabs(ann) \
                    else osp.join(root, ann)
                found = osp.join(parent, name) if name else _image_folder(root, ann_full, stage)
                if found:
                    out[f'{path}.data_prefix.img'] = _relative(found, root, img) + '/'
    for stage in stages:
        for key in EVALUATOR_KEYS[stage]:
            ev = cfg.get(key)
            ann = ev.get('ann_file') if isinstance(ev, dict) else None
            if isinstance(ann, str) and ann and not is_remote(ann) and not osp.exists(ann):
                name = _pick(osp.dirname(ann), stage, False, '.json')
                if name:
                    out[f'{key}.ann_file'] = osp.join(osp.dirname(ann), name)
    return out


def with_file_lines(message: str, suggested: Dict[str, str]) -> str:
    """The missing-data ``message`` with, after its ``missing`` lines, what was found in the
    expected places instead."""
    if not suggested:
        return message
    lines = message.splitlines()
    last = max(i for i, ln in enumerate(lines) if ln.startswith('  missing '))
    found = ['Found in the expected places instead (the checks below used them):']
    found += [f'  {key}={value}' for key, value in suggested.items()]
    return '\n'.join(lines[:last + 1] + found + lines[last + 1:])


def _json_field(ann_file: Any, key: str) -> list:
    """The list under ``key`` of a COCO json; [] when unreadable (the annotation check reports
    an unreadable file)."""
    if not isinstance(ann_file, str) or not osp.isfile(ann_file):
        return []
    try:
        with open(ann_file) as f:
            value = json.load(f).get(key)
    except (OSError, ValueError, AttributeError):
        return []
    return value if isinstance(value, list) else []


def _json_categories(ann_file: str) -> Optional[Tuple[str, ...]]:
    cats = _json_field(ann_file, 'categories')
    return tuple(str(c.get('name')) for c in cats if isinstance(c, dict)) or None


ClassNames = Tuple[str, ...]


def class_suggestions(cfg: Any, stages: Sequence[str]) -> Tuple[Dict[str, ClassNames], List[str]]:
    """``metainfo.classes`` for each COCO-style dataset of ``stages`` that sets none while its
    annotation file's categories differ from the dataset type's classes, and the problem lines
    (one per distinct set of categories, naming every dataset it applies to)."""
    from .data import _coco_class
    found: Dict[str, Tuple[str, ...]] = {}
    defaults: Dict[str, Tuple[str, Tuple[str, ...]]] = {}
    for _stage, ds, path in stage_datasets(cfg, stages):
        cls = _coco_class(ds.get('type'))
        meta = ds.get('metainfo')
        if cls is None or (isinstance(meta, dict) and meta.get('classes') is not None):
            continue
        ann = ds.get('ann_file') or ''
        full = ann if osp.isabs(ann) else osp.join(ds.get('data_root') or '', ann)
        names = _json_categories(full) if osp.isfile(full) else None
        own = tuple(getattr(cls, 'METAINFO', {}).get('classes', ()))
        if names and names != own:
            found[f'{path}.metainfo.classes'] = names
            defaults[path] = (cls.__name__, own)
    lines = []
    for names in dict.fromkeys(found.values()):
        paths = [k[:-len('.metainfo.classes')] for k, v in found.items() if v == names]
        cls_name, own = defaults[paths[0]]
        shown = list(own[:SHOWN_NAMES]) + (['...'] if len(own) > SHOWN_NAMES else [])
        lines.append(f'metainfo.classes is not set in {", ".join(paths)}: {cls_name} then uses '
                     f'its own {len(own)} classes {shown}, which the annotations do not have; '
                     f'their categories are {names!r}: set metainfo.classes={names!r} '
                     'there (the class counts below are checked against these)')
    return found, lines


def dict_text(value: Any) -> str:
    """``value`` as a config file writes it: dicts as ``dict(key=...)``, the rest as repr."""
    if isinstance(value, dict):
        return 'dict(' + ', '.join(f'{k}={dict_text(v)}' for k, v in value.items()) + ')'
    if isinstance(value, (list, tuple)):
        items = [dict_text(v) for v in value]
        if isinstance(value, list):
            return '[' + ', '.join(items) + ']'
        return '(' + ', '.join(items) + (',' if len(items) == 1 else '') + ')'
    return repr(value)


def _literal(node: ast.expr) -> Any:
    """A literal, with ``dict(key=...)`` calls read as dicts (what :func:`dict_text` wrote)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id == 'dict' and not node.args:
        return {kw.arg: _literal(kw.value) for kw in node.keywords}
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_literal(n) for n in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    return ast.literal_eval(node)


def set_fixes(problem_lines: Sequence[str]) -> Dict[str, Any]:
    """``key -> value`` of the ``; set KEY=VALUE`` fix that ends a config problem line (a
    ``dict(...)`` value replaces the whole key)."""
    out: Dict[str, Any] = {}
    for line in problem_lines:
        m = SET_FIX.search(line)
        if m:
            try:
                out[m.group(1)] = _literal(ast.parse(m.group(2), mode='eval').body)
            except (ValueError, SyntaxError, TypeError):
                out[m.group(1)] = m.group(2)
    return out


def merge_fixes(cfg: Any, fixes: Dict[str, Any]) -> None:
    """Apply ``fixes`` to ``cfg`` in place as ``--cfg-options`` would: a dict value replaces
    the key's dict (``_delete_``), any other value is set."""
    cfg.merge_from_dict({k: dict(v, **{DELETE_KEY: True}) if isinstance(v, dict) else v
                         for k, v in fixes.items()})


def _flat_options(fixes: Dict[str, Any]) -> Dict[str, Any]:
    """Dict values as ``KEY._delete_=True`` and one option per leaf (mmengine merges the
    dotted keys into one dict, which then replaces the config's)."""
    out: Dict[str, Any] = {}

    def leaves(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                leaves(f'{prefix}.{k}', v)
        else:
            out[prefix] = value
    for key, value in fixes.items():
        if isinstance(value, dict):
            out[f'{key}.{DELETE_KEY}'] = True
        leaves(key, value)
    return out


def _option_value(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        items = ','.join(_option_value(v) for v in value)
        if isinstance(value, list):
            return f'[{items}]'
        return f'({items}{"," if len(value) == 1 else ""})'
    return str(value)


def options_text(fixes: Dict[str, Any]) -> List[str]:
    """The lines that give every fix as ``--cfg-options`` (mmengine's syntax: our tools and
    mmdet's take it alike); a note when a value cannot pass that way (spaces are dropped)."""
    if not fixes:
        return []
    fixes = _flat_options(fixes)
    parts = [shlex.quote(f'{k}={_option_value(v)}') for k, v in fixes.items()]
    lines = ['Every fix above as options (our tools/train.py and mmdet\'s tools/train.py alike):',
             '  --cfg-options ' + ' '.join(parts)]
    spaced = [k for k, v in fixes.items() if ' ' in _option_value(v)]
    if spaced:
        lines.append(f'  ({", ".join(spaced)}: --cfg-options drops the spaces inside names; '
                     'write these in the config file instead)')
    return lines
