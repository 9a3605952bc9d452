"""Your data as it is: a COCO-format folder found by its layout, and a config pointed at it.

``tools/train.py CONFIG --data DIR`` (and ``tools/test.py``, ``tools/infer.py``) take a folder
in one of two layouts (:data:`LAYOUTS`), the way RF-DETR takes ``dataset_dir``:

* Roboflow's COCO export: ``train/_annotations.coco.json``, ``valid/`` (or ``val/``) and
  ``test/`` likewise, each split's images beside its JSON;
* mmdet's: ``annotations/instances_<split>.json`` with the images in ``<split>/`` (splits
  ``train``, ``val``, ``test``; COCO 2017's ``train2017`` / ``val2017`` too).

The classes are the categories of the train annotation file, as RF-DETR counts them: an
unannotated category that another category names as its ``supercategory`` is no class (the
parent Roboflow's exports put at id 0; ``rfdetr.datasets.coco.filter_parent_categories``), and
label ``i`` is the ``i``-th category kept, in the file's order (mmdet's ``CocoDataset`` and
``CocoMetric`` number them so; it is RF-DETR's id order for files that list their categories by
id, as Roboflow's and COCO's do). :func:`apply_data_folder` rewrites a loaded config for the
folder: each dataloader's dataset (``data_root``, ``ann_file``, ``data_prefix``,
``metainfo.classes``), the evaluators' ``ann_file`` and every class count of the model.
"""
import copy
import json
import os
import os.path as osp
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from mmengine.config import Config

from ..config import LOADER_KEYS, iter_datasets

#: Roboflow's annotation file, in each split folder
ROBOFLOW_JSON = '_annotations.coco.json'
#: split -> folder names tried, in order (Roboflow export / mmdet layout)
ROBOFLOW_SPLITS = {'train': ('train',), 'val': ('valid', 'val'), 'test': ('test',)}
MMDET_SPLITS = {'train': ('train', 'train2017'), 'val': ('val', 'val2017'), 'test': ('test',)}
#: the two layouts, as error messages list them
LAYOUTS = ('Roboflow COCO export: train/_annotations.coco.json, valid/_annotations.coco.json '
           '(or val/), optional test/_annotations.coco.json, the images beside each json',
           'mmdet layout: annotations/instances_train.json, annotations/instances_val.json, '
           'optional annotations/instances_test.json, the images in train/, val/, test/')
#: entries of a folder an error message lists, at most
SHOWN_ENTRIES = 12
#: the COCO supercategory values that mean "no parent" (RF-DETR's list)
NO_PARENT = ('', 'none', 'null', None)
#: model keys whose class counts --data leaves alone: the RPN's one objectness class, the
#: semantic heads of panoptic models
SKIPPED_HEADS = ('rpn_head', 'semantic_head', 'seg_head')


class DataFolderError(ValueError):
    """``--data DIR`` is not a layout :func:`find_data_folder` understands, lacks a split the
    run needs, or the config cannot take it; the message says what was looked for and found."""


@dataclass(frozen=True)
class Split:
    """One split of a data folder: its annotation file and image folder, relative to the root."""
    ann_file: str
    img_dir: str


@dataclass(frozen=True)
class DataFolder:
    """A data folder as :func:`find_data_folder` read it.

    Args:
        root: the folder (ends with ``/``).
        layout: ``'Roboflow COCO export'`` or ``'mmdet layout'``.
        splits: ``'train'`` / ``'val'`` / ``'test'`` -> :class:`Split`, those present.
        classes: class names, label order.
        category_ids: the annotation file's category id of each class.
        skipped: ``(id, name)`` of the parent categories that are no class.
        classes_from: the annotation file the classes were read from (relative to ``root``).
    """
    root: str
    layout: str
    splits: Dict[str, Split]
    classes: Tuple[str, ...]
    category_ids: Tuple[int, ...]
    skipped: Tuple[Tuple[int, str], ...]
    classes_from: str

    def split_for(self, stage: str) -> Optional[str]:
        """The split a run's ``stage`` reads: test falls back to val (a Roboflow export
        without test/ is evaluated on valid/); None when the folder has none."""
        wanted = ('test', 'val') if stage == 'test' else (stage,)
        return next((s for s in wanted if s in self.splits), None)

    def line(self) -> str:
        """``data DIR (LAYOUT): train ANN, val ANN[, test ANN]; N classes from ANN: a, b, ...``."""
        splits = ', '.join(f'{s} {self.splits[s].ann_file}' for s in ('train', 'val', 'test')
                           if s in self.splits)
        text = (f'data {self.root} ({self.layout}): {splits}; {len(self.classes)} classes from '
                f'{self.classes_from}: {", ".join(self.classes)}')
        if self.skipped:
            text += '; not a class (an unannotated parent category): ' + ', '.join(
                f'{i} {n!r}' for i, n in self.skipped)
        return text


# ----------------------------------------------------------------------------- finding
def _roboflow_splits(root: str) -> Dict[str, Split]:
    found = {}
    for split, names in ROBOFLOW_SPLITS.items():
        for name in names:
            if osp.isfile(osp.join(root, name, ROBOFLOW_JSON)):
                found[split] = Split(f'{name}/{ROBOFLOW_JSON}', f'{name}/')
                break
    return found


def _mmdet_splits(root: str) -> Dict[str, Split]:
    found = {}
    for split, names in MMDET_SPLITS.items():
        for name in names:
            if osp.isfile(osp.join(root, 'annotations', f'instances_{name}.json')):
                found[split] = Split(f'annotations/instances_{name}.json', f'{name}/')
                break
    return found


def _listing(root: str) -> str:
    entries = sorted(e + ('/' if osp.isdir(osp.join(root, e)) else '') for e in os.listdir(root))
    shown = entries[:SHOWN_ENTRIES] + (['...'] if len(entries) > SHOWN_ENTRIES else [])
    return ', '.join(shown) or 'nothing'


def kept_categories(coco: Dict[str, Any]) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """``(classes, skipped)``: the categories of a COCO dict in file order, without those that
    another category names as its ``supercategory`` and that no annotation uses (RF-DETR's
    rule; a category whose supercategory is its own name is not its own parent)."""
    categories = list(coco.get('categories') or [])
    parents = {c.get('supercategory') for c in categories
               if c.get('supercategory') not in NO_PARENT and c.get('supercategory') != c['name']}
    used = {int(a['category_id']) for a in coco.get('annotations') or []}
    kept = [c for c in categories if not (c['name'] in parents and int(c['id']) not in used)]
    if not kept:  # every category a parent: keep them all, as RF-DETR does
        return categories, []
    return kept, [c for c in categories if c not in kept]


def find_data_folder(root: str) -> DataFolder:
    """Read ``root`` as a Roboflow COCO export or an mmdet ``annotations/`` layout
    (:data:`LAYOUTS`); raises :class:`DataFolderError` when it is neither or has no train
    annotation file, or the classes cannot be read."""
    if not osp.isdir(root):
        raise DataFolderError(f'--data {root}: no such folder')
    root = osp.join(root, '')
    layout, splits = 'Roboflow COCO export', _roboflow_splits(root)
    if not splits:
        layout, splits = 'mmdet layout', _mmdet_splits(root)
    if 'train' not in splits:
        raise DataFolderError('\n'.join(
            [f'--data {root}: not a data folder of a layout vitdet_plugin reads (it holds: '
             f'{_listing(root)}); expected one of:']
            + [f'  {layout_text}' for layout_text in LAYOUTS]))
    missing = [f'{s.img_dir} (the images of {s.ann_file})' for s in splits.values()
               if not osp.isdir(osp.join(root, s.img_dir))]
    if missing:
        raise DataFolderError(f'--data {root} ({layout}): missing image folder '
                              + ', '.join(missing) + '; put the images of each split there '
                              "(the annotation file's file_name values are relative to it)")
    classes_from = splits['train'].ann_file
    try:
        with open(osp.join(root, classes_from)) as f:
            coco = json.load(f)
        kept, skipped = kept_categories(coco)
        category_ids = tuple(int(c['id']) for c in kept)
        classes = tuple(str(c['name']) for c in kept)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DataFolderError(f'--data {root}: cannot read the categories of {classes_from} '
                              f'({e!r}); it needs a COCO "categories" list of {{"id", "name"}}'
                              ) from e
    if not classes:
        raise DataFolderError(f'--data {root}: {classes_from} has no categories; COCO files '
                              'list their classes as "categories": [{"id": 1, "name": ...}]')
    return DataFolder(root, layout, dict(splits), classes, category_ids,
                      tuple((int(c['id']), str(c['name'])) for c in skipped), classes_from)


# ----------------------------------------------------------------------------- the config
def _coco_instances(kind: Any) -> bool:
    """Whether the dataset type reads COCO instance annotations (``CocoDataset`` or a
    subclass other than the panoptic one)."""
    from mmdet.datasets import CocoDataset, CocoPanopticDataset
    from mmdet.registry import DATASETS
    cls = DATASETS.get(kind) if isinstance(kind, str) else kind
    return (isinstance(cls, type) and issubclass(cls, CocoDataset)
            and not issubclass(cls, CocoPanopticDataset))


def _class_nodes(node: Any, path: str) -> Iterator[Tuple[dict, str]]:
    """Every dict below the model config that may hold a class count, with its path."""
    if isinstance(node, dict):
        yield node, path
        for key, value in node.items():
            if key not in SKIPPED_HEADS:
                yield from _class_nodes(value, f'{path}.{key}')
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from _class_nodes(value, f'{path}.{i}')


def _class_weight(weights: Any, old: int, new: int) -> Any:
    """A per-class weight list (``old`` classes + the no-object weight) for ``new`` classes,
    when every class had the same weight; else unchanged (the config check names it)."""
    if (isinstance(weights, list) and len(weights) == old + 1
            and len(set(weights[:old])) == 1):
        return weights[:1] * new + weights[-1:]
    return weights


def set_num_classes(model: dict, num: int) -> List[str]:
    """Set every class count of the model config to ``num`` (``num_classes``,
    ``num_things_classes`` with no stuff classes; the RPN and semantic heads left alone) and
    resize uniform ``class_weight`` lists; returns the keys set."""
    changed = []
    for node, path in _class_nodes(model, 'model'):
        old = node.get('num_classes')
        if isinstance(old, int) and 'num_things_classes' not in node:
            node['num_classes'] = num
            changed.append(f'{path}.num_classes')
        things = node.get('num_things_classes')
        if isinstance(things, int) and not node.get('num_stuff_classes'):
            node['num_things_classes'] = num
            if isinstance(old, int):
                node['num_classes'] = num
            changed.append(f'{path}.num_things_classes')
            old = things if old is None else old
        if isinstance(old, int):
            for loss in [node] + [v for v in node.values() if isinstance(v, dict)]:
                if 'class_weight' in loss:
                    loss['class_weight'] = _class_weight(loss['class_weight'], old, num)
    return changed


def _point_dataset(cfg: Config, key: str, folder: DataFolder, split: str) -> None:
    loader = copy.deepcopy(cfg[key])  # test_dataloader = val_dataloader: one dict, two splits
    found = list(iter_datasets(loader.get('dataset'), f'{key}.dataset'))
    if len(found) != 1:
        raise DataFolderError(f'--data sets the one dataset of each dataloader; {key} has '
                              f'{len(found)} ({", ".join(p for _, p in found) or "none"}): set '
                              'their ann_file / data_prefix with --cfg-options instead')
    ds, path = found[0]
    if not _coco_instances(ds.get('type')):
        raise DataFolderError(f'--data reads COCO instance annotations (CocoDataset); {path} '
                              f"is a {ds.get('type')!r}: set its paths with --cfg-options "
                              'instead')
    chosen = folder.splits[split]
    ds['data_root'] = folder.root
    ds['ann_file'] = chosen.ann_file
    ds['data_prefix'] = dict(img=chosen.img_dir)
    ds['metainfo'] = dict(classes=folder.classes)
    cfg[key] = loader


def _point_evaluator(cfg: Config, key: str, ann_file: str) -> None:
    evaluators = copy.deepcopy(cfg[key])
    for ev in evaluators if isinstance(evaluators, list) else [evaluators]:
        if isinstance(ev, dict) and ('ann_file' in ev or ev.get('type') == 'CocoMetric'):
            ev['ann_file'] = ann_file
    cfg[key] = evaluators


def apply_data_folder(cfg: Config, root: str, stages: Sequence[str],
                      options: Optional[Dict[str, Any]] = None) -> DataFolder:
    """Point a loaded config at the data folder ``root`` (:func:`find_data_folder`), in place.

    Each dataloader of the config reads its split (train; val: ``valid/`` or ``val/``; test:
    ``test/``, else val) with the folder's classes, the evaluators score against that split's
    annotation file, ``data_root`` is the folder and every class count of the model is the
    number of classes. ``stages``: the splits the run needs (``('train', 'val')`` for training,
    ``('test',)`` to test); a missing one raises :class:`DataFolderError`, as does a dataloader
    with more than one dataset or another kind of dataset than COCO instances. ``options``
    (the tool's ``--cfg-options``) are merged again afterwards: an option given explicitly
    wins over the folder.
    """
    folder = find_data_folder(root)
    roboflow = folder.layout.startswith('Roboflow')
    for stage in stages:
        if folder.split_for(stage) is None:
            splits = ('test', 'val') if stage == 'test' else (stage,)
            names = [n for s in splits for n in (ROBOFLOW_SPLITS if roboflow else MMDET_SPLITS)[s]]
            files = [f'{n}/{ROBOFLOW_JSON}' if roboflow else f'annotations/instances_{n}.json'
                     for n in names]
            raise DataFolderError(f'--data {folder.root} ({folder.layout}) has no {stage} split '
                                  f'(looked for {", ".join(files)}); this run needs it')
    for stage, keys in LOADER_KEYS.items():
        split = folder.split_for(stage)
        for key in keys:
            if split is None or not cfg.get(key):
                continue
            _point_dataset(cfg, key, folder, split)
            if cfg.get(f'{stage}_evaluator'):
                _point_evaluator(cfg, f'{stage}_evaluator',
                                 osp.join(folder.root, folder.splits[split].ann_file))
    cfg.data_root = folder.root
    # the config's own variables too, so the config dumped to the work dir reads as it runs
    for key, value in (('classes', folder.classes), ('metainfo', dict(classes=folder.classes)),
                       ('num_classes', len(folder.classes))):
        if key in cfg:
            cfg[key] = value
    if isinstance(cfg.get('model'), dict):
        set_num_classes(cfg.model, len(folder.classes))
    if options:
        cfg.merge_from_dict(options)
    return folder
