"""One pass over a COCO-style annotation JSON, reading it the way mmdet 3.3 does.

:func:`scan` follows ``CocoDataset.load_data_list`` / ``parse_data_info`` / ``filter_data``
(instances layout) and ``CocoPanopticDataset``'s (panoptic layout: ``segments_info`` per
image) step by step: the same drop rules in the same order, the same class mapping
(``coco.get_cat_ids(cat_names=classes)``: json category order) and the same filters, so its
counts are the ones the built dataset has. It also collects what would crash mmdet or train on
wrong boxes (:class:`Problems`). The policy is documented in :mod:`vitdet_plugin.checks.data`.
"""
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

#: a kept box may reach past its image by this much (px) before it is refused
BOX_TOLERANCE_PX = 1.0
#: mmdet's ``parse_data_info`` drops boxes narrower or lower than this (px)
MIN_BOX_SIDE_PX = 1.0
#: COCO bbox ``[x, y, width, height]``
BBOX_LEN = 4
#: offending items listed per kind of problem (the count covers all of them)
MAX_LISTED = 10
#: categories named in a fix, at most
MAX_KNOWN_CATEGORIES = 100

# drop reasons, in the order mmdet applies them (keys of DataSummary.dropped)
DROP_IGNORE = 'annotation with ignore=True'
DROP_OUTSIDE = 'box with no area inside its image'
DROP_SMALL = f'box under {MIN_BOX_SIDE_PX:g} px or with area <= 0'
DROP_SEGMENT_SMALL = f'segment under {MIN_BOX_SIDE_PX:g} px or with area <= 0'
DROP_CLASS = 'annotation of a category not in metainfo.classes'
DROP_EMPTY = 'image without annotations (filter_empty_gt=True)'
DROP_EMPTY_PANOPTIC = 'image without thing segments (filter_empty_gt=True)'
DROP_MIN_SIZE = 'image smaller than filter_cfg.min_size={min_size}'
DROP_ORDER = (DROP_IGNORE, DROP_OUTSIDE, DROP_SMALL, DROP_SEGMENT_SMALL, DROP_CLASS,
              DROP_EMPTY, DROP_EMPTY_PANOPTIC, DROP_MIN_SIZE)

XYXY_FIX = 'COCO bbox is [x, y, width, height]; convert x2,y2 to width=x2-x1, height=y2-y1'
#: the fields mmdet reads from every annotation (pycocotools' index, parse_data_info)
ANN_FIELDS_ORDER = ('id', 'image_id', 'category_id', 'bbox', 'area')
ANN_FIELDS = frozenset(ANN_FIELDS_ORDER)
ANN_FIELDS_IGNORED = frozenset(ANN_FIELDS_ORDER[:3])  # ignore=True: skipped before bbox / area
FIELD_FIX = ('mmdet reads these fields unconditionally (KeyError / TypeError at dataset build); '
             'complete or remove these entries')


class Problems:
    """Problems grouped by kind (its title): the fix, the first items and the count."""

    def __init__(self) -> None:
        self._kinds: Dict[str, Tuple[str, List[str], List[int]]] = {}

    def add(self, title: str, item: str, fix: str) -> None:
        """Record one offending ``item`` of kind ``title``."""
        _, items, count = self._kinds.setdefault(title, (fix, [], [0]))
        count[0] += 1
        if len(items) < MAX_LISTED:
            items.append(item)

    def __bool__(self) -> bool:
        return bool(self._kinds)

    def __len__(self) -> int:
        return len(self._kinds)

    def render(self, indent: str = '  ') -> List[str]:
        """``- title: count``, the first :data:`MAX_LISTED` items, ``... and N more``, the fix."""
        out = []
        for title, (fix, items, count) in self._kinds.items():
            out.append(f'{indent}- {title}: {count[0]}')
            out += [f'{indent}    {item}' for item in items]
            if count[0] > len(items):
                out.append(f'{indent}    ... and {count[0] - len(items)} more')
            out.append(f'{indent}  fix: {fix}')
        return out


@dataclass(frozen=True)
class ScanSettings:
    """What the dataset config makes of the JSON.

    Args:
        classes: mmdet's ``metainfo['classes']``.
        classes_from: where they come from, for messages (``metainfo.classes``, or the class's
            ``METAINFO`` when the config sets none).
        panoptic: the JSON has the panoptic layout (``segments_info`` per image).
        filtering: ``filter_data`` filters (``filter_cfg`` set and not ``test_mode``).
        filter_empty_gt: ``filter_cfg.filter_empty_gt``.
        min_size: ``filter_cfg.min_size``.
    """
    classes: Tuple[str, ...]
    classes_from: str = 'metainfo.classes'
    panoptic: bool = False
    filtering: bool = False
    filter_empty_gt: bool = False
    min_size: float = 0


@dataclass
class ImageEntry:
    """An image of the JSON (valid id, file name and size)."""
    id: Any
    file_name: str
    width: float
    height: float
    boxes: int = 0       # kept boxes (crowd included in the instances layout)
    crowd: int = 0       # kept crowd annotations / thing segments
    has_gt: bool = False  # survives filter_empty_gt

    def label(self) -> str:
        return f'image {self.id}, {self.file_name}, {_num(self.width)}x{_num(self.height)}'


@dataclass
class ScanResult:
    """Counts as the built dataset has them, the images it keeps and the problems found."""
    images: int = 0
    kept: List[ImageEntry] = field(default_factory=list)
    boxes: int = 0
    crowd: int = 0
    background: int = 0
    dropped: Dict[str, int] = field(default_factory=dict)
    problems: Problems = field(default_factory=Problems)

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


def _num(v: Any) -> str:
    return f'{v:.10g}' if isinstance(v, (int, float)) else repr(v)


_NUMBER = (int, float)  # exact types: a JSON bool is no number


def _finite(v: Any) -> bool:
    return type(v) in _NUMBER and math.isfinite(v)


def _bbox(v: Any) -> Optional[Tuple[float, float, float, float]]:
    if type(v) in (list, tuple) and len(v) == BBOX_LEN:
        x, y, w, h = v
        if (type(x) in _NUMBER and type(y) in _NUMBER and type(w) in _NUMBER
                and type(h) in _NUMBER and math.isfinite(x + y + w + h)):
            return x, y, w, h
    return None


def _box_text(b: Tuple[float, ...]) -> str:
    return '[' + ', '.join(_num(x) for x in b) + ']'


def _known(cats: Dict[Any, dict]) -> str:
    listed = [f"{cid} '{c.get('name')}'" for cid, c in list(cats.items())[:MAX_KNOWN_CATEGORIES]]
    more = len(cats) - len(listed)
    return ', '.join(listed) + (f' and {more} more' if more > 0 else '')


# ----------------------------------------------------------------------------- shared parts
def _categories(data: dict, s: ScanSettings, res: ScanResult) -> Tuple[Dict[Any, dict], Set]:
    """Json categories by id and the ids mmdet maps to labels (``cat_ids``)."""
    p = res.problems
    raw = data.get('categories')
    if not isinstance(raw, list) or not raw:
        p.add("no 'categories' list in the json", f'categories: {raw!r:.60}',
              'mmdet maps category ids through the categories; add them ([{id, name}, ...])')
        return {}, set()
    cats: Dict[Any, dict] = {}
    for i, c in enumerate(raw):
        need = ('id', 'name', 'isthing') if s.panoptic else ('id', 'name')
        lacking = [k for k in need if not isinstance(c, dict) or k not in c]
        if lacking:
            p.add('categories without a required field', f'categories[{i}]: no '
                  + ', '.join(repr(k) for k in lacking), FIELD_FIX)
        if isinstance(c, dict) and 'id' in c:
            cats[c['id']] = c
    names = [c.get('name') for c in cats.values()]
    # pycocotools getCatIds(catNms=classes): json order; an empty list selects all
    mapped = [cid for cid, c in cats.items() if not s.classes or c.get('name') in s.classes]
    missing = [n for n in s.classes if n not in names]
    for n in missing:
        p.add(f"names in {s.classes_from} missing from the json's categories", repr(n),
              f'mmdet maps classes to the json categories by name (coco.get_cat_ids(cat_names='
              f'classes)) and silently loses a name it does not find; the json has: '
              f'{_known(cats)}; correct the names in metainfo.classes or add the categories')
    order = [cats[cid].get('name') for cid in mapped]
    if not missing and s.classes and order != list(s.classes) and len(order) == len(s.classes):
        for k, (want, got) in enumerate(zip(s.classes, order)):
            if want != got:
                p.add(f"{s.classes_from} not in the json's category order",
                      f"label {k}: named '{want}' but holds category '{got}'",
                      "mmdet numbers labels in the json's category order, whatever the order of "
                      f'metainfo.classes; list them in that order: {tuple(order)!r}')
    return cats, set(mapped)


def _images(data: dict, res: ScanResult) -> Tuple[Dict[Any, ImageEntry], Set]:
    """Valid images by id, and the ids of those refused (their annotations are not scanned)."""
    p = res.problems
    raw = data.get('images')
    bad: Set = set()
    if not isinstance(raw, list):
        p.add("no 'images' list in the json", f'images: {raw!r:.60}',
              'add the images ([{id, file_name, width, height}, ...])')
        return {}, bad
    images: Dict[Any, ImageEntry] = {}
    for i, im in enumerate(raw):
        lacking = [k for k in ('id', 'file_name') if not isinstance(im, dict) or k not in im]
        if lacking:
            p.add('images without a required field',
                  f'images[{i}]: no ' + ', '.join(repr(k) for k in lacking), FIELD_FIX)
            continue
        if im['id'] in images:
            p.add('duplicate image ids', f"image id {im['id']!r} ({im['file_name']})",
                  'pycocotools keeps only the last image of an id; give every image its own id')
        w, h = im.get('width'), im.get('height')
        if not (_finite(w) and _finite(h) and w > 0 and h > 0):
            p.add('images without a positive width and height',
                  f"image {im['id']} ({im['file_name']}): width={w!r} height={h!r}",
                  "mmdet reads the image size from the json ('width', 'height' in pixels); set "
                  'them to the real size of the file')
            bad.add(im['id'])
            continue
        images[im['id']] = ImageEntry(im['id'], str(im['file_name']), w, h)
    res.images = len(raw)
    return images, bad


def _geometry(b: Tuple[float, float, float, float], what: str, img: ImageEntry,
              p: Problems) -> None:
    """Refuse a kept box that sticks out of its image by more than the tolerance."""
    x, y, w, h = b
    tol = BOX_TOLERANCE_PX
    if x + w > img.width + tol or y + h > img.height + tol:
        p.add(f'boxes reaching past the right or bottom edge of their image by more than '
              f'{tol:g} px (mmdet keeps them unclipped)',
              f'{what} ({img.label()}): bbox {_box_text(b)} reaches x={_num(x + w)}, '
              f'y={_num(y + h)}', XYXY_FIX)
    if x < -tol or y < -tol:
        p.add(f'boxes starting more than {tol:g} px left of or above their image',
              f'{what} ({img.label()}): bbox {_box_text(b)}',
              'COCO bbox is [x, y, width, height] with x, y >= 0 in image pixels; clip the box '
              'to the image or correct its coordinates')


def _unmapped(p: Problems, title: str, fix: str, unknown: Dict[Any, List],
              cats: Dict[Any, dict], unit: str) -> None:
    for cid, (count, example) in sorted(unknown.items(), key=lambda kv: str(kv[0])):
        where = (f"'{cats[cid].get('name')}', not in metainfo.classes" if cid in cats
                 else "not in the json's categories")
        units = unit if count == 1 else unit + 's'
        p.add(title, f'category_id {cid!r} ({where}): {count} {units} (first: {example})',
              fix.format(known=_known(cats)))


def _finish(images: Dict[Any, ImageEntry], s: ScanSettings, res: ScanResult, empty: str) -> None:
    """``filter_data``: drop images without ground truth / below ``min_size``; count the rest."""
    for img in images.values():
        if s.filtering and s.filter_empty_gt and not img.has_gt:
            res.drop(empty)
            continue
        if s.filtering and min(img.width, img.height) < s.min_size:
            res.drop(DROP_MIN_SIZE.format(min_size=_num(s.min_size)))
            continue
        res.kept.append(img)
        res.boxes += img.boxes
        res.crowd += img.crowd
        res.background += img.boxes - (0 if s.panoptic else img.crowd) == 0
    order = {r: i for i, r in enumerate(DROP_ORDER)}
    res.dropped = dict(sorted(res.dropped.items(),
                              key=lambda kv: order.get(kv[0], order[DROP_MIN_SIZE])))
    if not res.kept and not res.problems:
        res.problems.add('no image left to train on', f'{res.images} images in the json, '
                         'dropped: ' + ', '.join(f'{n} × {r}' for r, n in res.dropped.items()),
                         'mmengine fails on an empty dataset; fix the annotations or filter_cfg')


def _crowd(v: Any, what: str, p: Problems) -> bool:
    """Whether ``iscrowd`` value ``v`` marks a crowd region; refuse values other than 0 / 1."""
    if v in (0, 1) and _finite(v):
        return bool(v)
    p.add('iscrowd values other than 0 or 1', f'{what}: iscrowd={v!r}',
          'iscrowd is 1 for a crowd region (trained as ignore), else 0')
    return False


# ----------------------------------------------------------------------------- layouts
def scan(data: Any, s: ScanSettings) -> ScanResult:
    """Read ``data`` (the loaded JSON) as mmdet would; see the module docstring."""
    res = ScanResult()
    if not isinstance(data, dict):
        res.problems.add('the json is not a COCO dict', f'top level: {type(data).__name__}',
                         'COCO json is {"images": [...], "annotations": [...], '
                         '"categories": [...]}')
        return res
    cats, mapped = _categories(data, s, res)
    images, bad = _images(data, res)
    anns = data.get('annotations', [])
    if not isinstance(anns, list):
        res.problems.add("'annotations' is not a list", f'annotations: {anns!r:.60}',
                         'COCO annotations are a list of dicts')
        anns = []
    if s.panoptic:
        _panoptic(anns, cats, mapped, images, bad, res)
        _finish(images, s, res, DROP_EMPTY_PANOPTIC)
    else:
        _instances(anns, cats, mapped, images, bad, res)
        _finish(images, s, res, DROP_EMPTY)
    return res


def _instances(anns: List[Any], cats: Dict[Any, dict], mapped: Set, images: Dict[Any, ImageEntry],
               bad: Set, res: ScanResult) -> None:
    p = res.problems
    seen: Set = set()
    unknown: Dict[Any, List] = {}
    for i, ann in enumerate(anns):
        ignored = isinstance(ann, dict) and bool(ann.get('ignore', False))
        need = ANN_FIELDS_IGNORED if ignored else ANN_FIELDS
        if not (isinstance(ann, dict) and ann.keys() >= need):
            lacking = [k for k in sorted(need, key=ANN_FIELDS_ORDER.index)
                       if not isinstance(ann, dict) or k not in ann]
            p.add('annotations without a required field', f"annotations[{i}] (id "
                  f"{ann.get('id') if isinstance(ann, dict) else None!r}): no "
                  + ', '.join(repr(k) for k in lacking), FIELD_FIX)
            continue
        aid, cid = ann['id'], ann['category_id']
        what = f'annotation {aid}'
        if aid in seen:
            p.add('duplicate annotation ids', f'annotation id {aid!r}',
                  'CocoDataset asserts that annotation ids are unique; renumber them')
        seen.add(aid)
        img = images.get(ann['image_id'])
        if img is None and ann['image_id'] in bad:
            continue
        if img is None:
            p.add("annotations whose image_id is not in 'images'",
                  f"{what}: image_id {ann['image_id']!r}", "pycocotools never reads them (the "
                  "boxes are lost); add the image to 'images' or fix the image_id")
            continue
        if cid not in cats:
            entry = unknown.setdefault(cid, [0, f'{what}, image {img.id}'])
            entry[0] += 1
        if cid in mapped:
            img.has_gt = True  # filter_data's cat_img_map: any annotation of a class
        if ignored:  # parse_data_info skips it before reading anything else
            res.drop(DROP_IGNORE)
            continue
        box = _bbox(ann['bbox'])
        if box is None or not _finite(ann['area']):
            p.add('annotations whose bbox is not 4 finite numbers or area not a number',
                  f"{what} ({img.label()}): bbox={ann['bbox']!r} area={ann['area']!r}",
                  'COCO bbox is [x, y, width, height] in pixels and area a number; fix or remove '
                  'these annotations')
            continue
        crowd = _crowd(ann.get('iscrowd', 0), what, p)
        x, y, w, h = box
        inter_w = max(0, min(x + w, img.width) - max(x, 0))
        inter_h = max(0, min(y + h, img.height) - max(y, 0))
        if inter_w * inter_h == 0:
            res.drop(DROP_OUTSIDE)
        elif ann['area'] <= 0 or w < MIN_BOX_SIDE_PX or h < MIN_BOX_SIDE_PX:
            res.drop(DROP_SMALL)
        elif cid not in mapped:
            if cid in cats:
                res.drop(DROP_CLASS)
        else:
            img.boxes += 1
            img.crowd += crowd
            _geometry(box, what, img, p)
    _unmapped(p, "annotations whose category_id is not in the json's categories", (
        'CocoDataset silently drops them (the boxes are lost) and CocoPanopticDataset raises '
        "KeyError; the json's categories are: {known}; add the category to the json (and "
        'metainfo.classes) or correct the category_id'), unknown, cats, 'annotation')


def _panoptic(anns: List[Any], cats: Dict[Any, dict], mapped: Set, images: Dict[Any, ImageEntry],
              bad: Set, res: ScanResult) -> None:
    p = res.problems
    unknown: Dict[Any, List] = {}
    for i, entry in enumerate(anns):
        if not isinstance(entry, dict) or 'image_id' not in entry or not isinstance(
                entry.get('segments_info'), list):
            p.add("panoptic annotations without image_id or a 'segments_info' list",
                  f'annotations[{i}]', FIELD_FIX)
            continue
        img = images.get(entry['image_id'])
        if img is None and entry['image_id'] in bad:
            continue
        if img is None:
            p.add("panoptic annotations whose image_id is not in 'images'",
                  f"annotations[{i}]: image_id {entry['image_id']!r}",
                  "mmdet never reads them (the segments are lost); add the image to 'images' or "
                  'fix the image_id')
            continue
        ids: Set = set()
        for k, seg in enumerate(entry['segments_info']):
            lacking = [f for f in ('id', 'category_id', 'bbox', 'area')
                       if not isinstance(seg, dict) or f not in seg]
            if lacking:
                p.add('segments without a required field', f'image {img.id} segments_info[{k}]: '
                      'no ' + ', '.join(repr(f) for f in lacking), FIELD_FIX)
                continue
            what = f"segment {seg['id']}"
            if seg['id'] in ids:
                p.add('segment ids repeated within an image', f'{what} ({img.label()})',
                      'the panoptic PNG encodes every segment by its id; give each segment of an '
                      'image its own id')
            ids.add(seg['id'])
            cid = seg['category_id']
            if cid not in mapped:
                slot = unknown.setdefault(cid, [0, f'image {img.id}, {what}'])
                slot[0] += 1
            box = _bbox(seg['bbox'])
            if box is None or not _finite(seg['area']):
                p.add('segments whose bbox is not 4 finite numbers or area not a number',
                      f"{what} ({img.label()}): bbox={seg['bbox']!r} area={seg['area']!r}",
                      'COCO bbox is [x, y, width, height] in pixels and area a number; fix these '
                      'segments')
                continue
            crowd = _crowd(seg.get('iscrowd', 0), what, p)
            if seg['area'] <= 0 or box[2] < MIN_BOX_SIDE_PX or box[3] < MIN_BOX_SIDE_PX:
                res.drop(DROP_SEGMENT_SMALL)
                continue
            if cid not in mapped or not cats[cid].get('isthing'):
                continue  # stuff: a segment, no box
            if crowd:
                img.crowd += 1  # mmdet's panoptic parse turns crowd things into stuff
                continue
            img.boxes += 1
            img.has_gt = True
            _geometry(box, what, img, p)
    _unmapped(p, 'segments whose category_id mmdet does not map', (
        'CocoPanopticDataset raises a bare KeyError on them at dataset build; the json\'s '
        'categories are: {known}; add the class to metainfo.classes (and thing_classes / '
        'stuff_classes) or correct the category_id'), unknown, cats, 'segment')
