"""Up-front checks of COCO-style detection annotations: handled or refused before the model.

:func:`check_annotations` reads the annotation JSON of every ``CocoDataset`` (or registered
subclass of it, ``CocoPanopticDataset`` included) of the chosen stages the way mmdet 3.3 will
(:mod:`.coco_scan`) and either counts what mmdet does with each case (the summary line printed
at start, :meth:`DataSummary.line`) or raises :class:`DataCheckError` naming the config key, the
``ann_file``, the offending ids and the fix; all problems of all datasets are reported together.
Skipped: other dataset types, subclasses that load their file otherwise (LVIS, Objects365),
remote paths (``://``), files that do not exist (:func:`vitdet_plugin.datasets.check_data`
reports those).

Policy, case -> what happens (HANDLED: counted in the summary; REFUSED: :class:`DataCheckError`)::

    annotation with ignore=True                    -> HANDLED: mmdet drops it; counted
    box with no area inside its image (incl. w or  -> HANDLED: mmdet drops it; counted
      h <= 0, box entirely outside)
    box under 1 px wide or high, or area <= 0      -> HANDLED: mmdet drops it; counted
    kept box reaching past the right / bottom edge -> REFUSED (mmdet keeps it unclipped): the sign
      by more than BOX_TOLERANCE_PX (1 px)            of [x1, y1, x2, y2] written for [x, y, w, h];
                                                      ids, file, bbox, image size, the fix
    kept box with x or y < -BOX_TOLERANCE_PX       -> REFUSED
    bbox not 4 finite numbers; id / image_id /     -> REFUSED (mmdet: KeyError / TypeError at
      category_id / bbox / area missing               dataset build)
    category_id not in the json's categories       -> REFUSED (CocoDataset silently drops the
                                                      box, CocoPanopticDataset: bare KeyError)
    category in the json, not in metainfo.classes  -> instances: HANDLED (mmdet drops it: subset
                                                      training), counted; panoptic: REFUSED
                                                      (KeyError)
    name of metainfo.classes (unset: the class's   -> REFUSED (mmdet silently loses the name)
      METAINFO) not among the json's categories
    metainfo.classes in another order than the     -> REFUSED (mmdet numbers labels in json
      json's categories                               order: every name would be wrong)
    annotation whose image_id is not in images     -> REFUSED (never read)
    duplicate annotation / image ids               -> REFUSED (CocoDataset asserts / pycocotools
                                                      keeps the last image of an id)
    image width / height missing or not positive   -> REFUSED
    data_prefix.img not set                        -> REFUSED (KeyError / TypeError in mmdet)
    image file missing under data_prefix.img       -> REFUSED: first 10 and the count (os.path.
                                                      exists of the kept images, no decoding)
    panoptic PNG missing under data_prefix.seg     -> REFUSED
    kept image whose short side is below           -> REFUSED: file, sizes, stride, fix
      min_image_side: the json size, or its size
      after the pipeline's last Resize /
      RandomResize / RandomChoiceResize at its
      smallest scale (mmcv's rescale rule)
    image without an annotation of a class         -> filter_empty_gt=True: HANDLED, mmdet drops
                                                      it, counted; else trained as pure
                                                      background (counted as background images)
    image below filter_cfg.min_size                -> HANDLED: mmdet drops it; counted
    no image left after the filters                -> REFUSED
    grayscale / RGBA / 16-bit / palette file with  -> HANDLED: mmcv decodes it to 3-channel uint8
      LoadImageFromFile color_type='color' (the       (no file is opened)
      default)
    the same with color_type='unchanged'           -> headers read (PIL, lazy; PNG bit depth) of
                                                      the first IMAGE_HEADER_CAP kept images (the
                                                      summary says when capped); not 3-channel
                                                      8-bit: REFUSED (file, mode, fix)
    color_type='grayscale'                         -> REFUSED (every image becomes 1 channel)
    iscrowd=1                                      -> HANDLED: kept as an ignore box, counted
                                                      (panoptic: mmdet keeps a segment, no box)

Sizes come from the JSON's ``width`` / ``height`` only. The counts follow ``CocoDataset``'s own
``parse_data_info`` / ``filter_data``; a subclass overriding them, and ``indices``, are not
modelled.
"""
import json
import os.path as osp
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mmengine.config import Config

from ..config import LOADER_KEYS, is_remote, iter_datasets
from ..datasets.rfdetr_transforms import rfdetr_scales
from .coco_scan import Problems, ScanResult, ScanSettings, scan

#: with a color_type that keeps the file's channels, image headers read at most (per dataset)
IMAGE_HEADER_CAP = 5000
#: LoadImageFromFile color types that always give 3-channel uint8 / always 1 channel
COLOR_3CH = ('color', 'color_ignore_orientation')
COLOR_1CH = ('grayscale', 'grayscale_ignore_orientation')
RESIZE_TYPES = ('Resize', 'RandomResize', 'RandomChoiceResize', 'RFDETRResize', 'RFDETRTrainResize')
#: Of those, the ones that resize exactly as mmdet's ``Resize`` (one given scale or factor).
FIXED_RESIZE_TYPES = ('Resize', 'RFDETRResize')
PNG_SIGNATURE = b'\x89PNG\r\n\x1a\n'
#: the IHDR chunk's bit-depth byte in a PNG file
PNG_BIT_DEPTH_AT = 24
BITS_8 = 8
COLOR_FIX = ("use LoadImageFromFile(color_type='color') (the default: mmcv decodes grayscale, "
             'RGBA, palette and 16-bit files to 3-channel uint8) or convert the files to 8-bit RGB')


class DataCheckError(ValueError):
    """The annotations would crash training or train on wrong boxes.

    The message lists, per dataset (config key and ``ann_file``) and kind of problem, the first
    offending items, their count and the fix.
    """


@dataclass(frozen=True)
class DataSummary:
    """What training gets from one dataset, as mmdet builds it.

    Args:
        key: dotted config path of the dataset (``train_dataloader.dataset``).
        ann_file: the annotation file (``data_root`` joined).
        images: images in the annotation file.
        boxes: annotations kept as boxes in the kept images (instances: crowd included).
        dropped: reason -> count of what mmdet drops (annotations and images).
        kept_images: images the dataset keeps (its length).
        crowd: ``iscrowd=1`` annotations kept (ignore regions; panoptic: segments, no box).
        background: kept images without a box to learn (pure background).
        panoptic: the panoptic layout.
        notes: what was not fully checked.
    """
    key: str
    ann_file: str
    images: int
    boxes: int
    dropped: Dict[str, int]
    kept_images: int
    crowd: int = 0
    background: int = 0
    panoptic: bool = False
    notes: Tuple[str, ...] = ()

    def line(self) -> str:
        """``data KEY (ANN_FILE): N images[ (K kept)], N boxes[ (N crowd, kept as ignore)][, N
        background images (no box)]; dropped: N × reason, ...`` (or ``nothing``), then notes."""
        images = _count(self.images, 'image') + (
            f' ({self.kept_images} kept)' if self.kept_images != self.images else '')
        boxes = _count(self.boxes, 'box', 'boxes')
        if self.crowd and not self.panoptic:
            boxes += f' ({self.crowd} crowd, kept as ignore)'
        parts = [images, boxes]
        if self.crowd and self.panoptic:
            parts.append(_count(self.crowd, 'crowd segment') + ' (no box)')
        if self.background:
            parts.append(_count(self.background, 'background image') + ' (no box)')
        dropped = ', '.join(f'{n} × {reason}' for reason, n in self.dropped.items()) or 'nothing'
        text = f'data {self.key} ({self.ann_file}): ' + ', '.join(parts) + f'; dropped: {dropped}'
        return '; '.join((text, *self.notes))


def _count(n: int, singular: str, plural: str = '') -> str:
    return f'{n} {singular if n == 1 else plural or singular + "s"}'


# ----------------------------------------------------------------------------- config reading
def _type_name(t: Any) -> str:
    kind = t.get('type') if isinstance(t, dict) else type(t)
    if isinstance(kind, type):
        return kind.__name__
    return str(kind).rsplit('.', 1)[-1]


def _coco_class(kind: Any) -> Optional[type]:
    """The dataset class when ``kind`` is ``CocoDataset`` or a subclass that reads its file as
    it does (its ``load_data_list``, mmdet's COCO or COCOPanoptic API; mmdet's DATASETS
    registry, scope mmdet); else None (LVIS and Objects365 load theirs otherwise)."""
    from mmdet.datasets import CocoDataset
    from mmdet.datasets.api_wrappers import COCO, COCOPanoptic
    from mmdet.registry import DATASETS
    cls = DATASETS.get(kind) if isinstance(kind, str) else kind
    if not (isinstance(cls, type) and issubclass(cls, CocoDataset)):
        return None
    standard = getattr(cls, 'load_data_list', None) is CocoDataset.load_data_list
    return cls if standard and getattr(cls, 'COCOAPI', None) in (COCO, COCOPanoptic) else None


def _pipelines(top: Any, top_key: str, leaf_key: str) -> List[Tuple[str, list]]:
    """``(key, pipeline)`` of the leaf dataset and of each wrapper above it, in running order."""
    chain, node, key = [(top_key, top)], top, top_key
    for part in leaf_key[len(top_key):].split('.')[1:]:
        node = node[int(part)] if isinstance(node, (list, tuple)) else node[part]
        key = f'{key}.{part}'
        chain.append((key, node))
    return [(f'{k}.pipeline', n['pipeline']) for k, n in reversed(chain)
            if isinstance(n, dict) and isinstance(n.get('pipeline'), list)]


def _transforms(pipelines: List[Tuple[str, list]], names: Sequence[str]) -> List[Tuple[str, dict]]:
    return [(f'{key}.{i}', t) for key, pipe in pipelines for i, t in enumerate(pipe)
            if isinstance(t, dict) and _type_name(t) in names]


def _join(root: str, path: str) -> str:
    return path if osp.isabs(path) or not root else osp.join(root, path)


def _settings(ds: dict, cls: type, panoptic: bool) -> ScanSettings:
    meta = ds.get('metainfo')
    classes = meta.get('classes') if isinstance(meta, dict) else None
    origin = 'metainfo.classes'
    if isinstance(classes, str):  # mmengine: a file of names, else one name
        if osp.isfile(classes):
            with open(classes) as f:
                classes = [line.rstrip('\r\n') for line in f]
        else:
            classes = [classes]
    if classes is None:
        classes = getattr(cls, 'METAINFO', {}).get('classes', ())
        origin = f"{cls.__name__}.METAINFO['classes'] (metainfo.classes is not set)"
    filter_cfg = ds.get('filter_cfg')
    filtering = isinstance(filter_cfg, dict) and not ds.get('test_mode', False)
    fc: Dict[str, Any] = dict(filter_cfg) if filtering and isinstance(filter_cfg, dict) else {}
    return ScanSettings(tuple(classes), origin, panoptic, filtering,
                        bool(fc.get('filter_empty_gt', False)), fc.get('min_size', 0) or 0)


# ----------------------------------------------------------------------------- resize rule
def _pair(s: Any) -> Tuple[int, int]:
    return (int(s), int(s)) if isinstance(s, (int, float)) else (int(s[0]), int(s[1]))


def _smallest_scales(t: dict) -> List[Tuple[int, int]]:
    """The target scales of a resize transform, reduced to the smallest it can draw."""
    name = _type_name(t)
    if name == 'RandomChoiceResize':
        raw = t['scales']
        return [_pair(s) for s in (raw if isinstance(raw, list) else [raw])]
    if name == 'RFDETRTrainResize':  # a square; the batch scale may shrink it to the smallest
        side = min(rfdetr_scales(t['resolution'], t['block']))
        return [(side, side)]
    if name == 'RandomResize':
        scale, ratio = t['scale'], t.get('ratio_range')
        if ratio is not None:
            w, h = _pair(scale)
            return [(int(w * min(ratio)), int(h * min(ratio)))]
        a, b = _pair(scale[0]), _pair(scale[1])
        return [(min(a[0], b[0]), min(a[1], b[1]))]
    return [_pair(t['scale'])]


def resized_size(width: float, height: float, t: dict) -> Tuple[int, int]:
    """(w, h) of a ``width`` x ``height`` image after the resize transform ``t``; for a random
    one the smallest (short side) result. mmcv's rules: ``keep_ratio`` rescales to fit the scale
    (:func:`mmcv.rescale_size`), else the image is resized to the scale's (w, h)."""
    import mmcv
    if _type_name(t) in FIXED_RESIZE_TYPES and t.get('scale') is None:
        f = t['scale_factor']
        fx, fy = (f, f) if isinstance(f, (int, float)) else (f[0], f[1])
        return int(width * fx + 0.5), int(height * fy + 0.5)
    keep = bool(t.get('keep_ratio', False))
    sizes = [tuple(mmcv.rescale_size((width, height), s)) if keep else s
             for s in _smallest_scales(t)]
    w, h = min(sizes, key=min)
    return int(w), int(h)


def _describe(t: dict) -> str:
    args = ', '.join(f'{k}={v!r}' for k, v in t.items() if k != 'type')
    return f'{_type_name(t)}({args})'


# ----------------------------------------------------------------------------- file checks
def _image_kind(path: str, backend: str) -> Optional[str]:
    """None when LoadImageFromFile(color_type='unchanged') gives 3-channel uint8 for ``path``
    (from the header: PIL's lazy open, the PNG bit depth), else what the file is."""
    from PIL import Image
    with open(path, 'rb') as f:
        head = f.read(PNG_BIT_DEPTH_AT + 1)
    try:
        with Image.open(path) as im:
            mode, transparent = im.mode, 'transparency' in im.info
    except (OSError, ValueError) as e:
        return f'unreadable header ({e})'
    depth = head[PNG_BIT_DEPTH_AT] if head.startswith(PNG_SIGNATURE) else BITS_8
    if mode == 'RGB' and depth == BITS_8:
        return None
    if mode == 'P' and not transparent and backend == 'cv2':  # cv2 expands palettes to BGR
        return None
    return f'mode {mode}' + (' with transparency' if transparent else '') + (
        f', {depth}-bit PNG' if depth > BITS_8 else '')


def _file_checks(ds: dict, key: str, res: ScanResult, panoptic: bool,
                 pipelines: List[Tuple[str, list]], notes: List[str]) -> None:
    """Image files (and panoptic PNGs) of the kept images exist; what LoadImageFromFile's
    color_type makes of them (headers read only when it keeps the file's channels)."""
    p, root = res.problems, ds.get('data_root') or ''
    prefix = ds.get('data_prefix')
    img = prefix.get('img') if isinstance(prefix, dict) else None
    if not isinstance(img, str):
        shown = dict(prefix) if isinstance(prefix, dict) else prefix
        p.add('data_prefix.img not set', f'{key}.data_prefix={shown!r}',
              "CocoDataset joins data_prefix['img'] with each file_name (KeyError / TypeError "
              "without it); set data_prefix=dict(img='<image folder>/')")
        return
    img_dir = _join(root, img)
    if is_remote(img_dir):
        return
    present = []
    for im in res.kept:
        path = osp.join(img_dir, im.file_name)
        if osp.exists(path):
            present.append((im, path))
        else:
            p.add(f'image files missing under data_prefix.img ({img_dir})',
                  f'image {im.id}: {im.file_name}',
                  'LoadImageFromFile raises FileNotFoundError on the first batch that draws one; '
                  "restore the files, or correct data_prefix.img / the images' file_name, or "
                  'remove those images from the json')
    seg = prefix.get('seg') if isinstance(prefix, dict) else None
    if panoptic and isinstance(seg, str) and seg and not is_remote(_join(root, seg)):
        seg_dir = _join(root, seg)
        for im in res.kept:
            name = im.file_name.replace('.jpg', '.png')  # CocoPanopticDataset's rule
            if not osp.exists(osp.join(seg_dir, name)):
                p.add(f'panoptic PNGs missing under data_prefix.seg ({seg_dir})',
                      f'image {im.id}: {name}', 'LoadPanopticAnnotations reads one PNG per image '
                      'at data_prefix.seg + file_name (.jpg -> .png); restore them or correct '
                      'data_prefix.seg')
    loaders = _transforms(pipelines, ('LoadImageFromFile',))
    if not loaders:
        return
    where, loader = loaders[0]
    color = loader.get('color_type', 'color')
    if color in COLOR_3CH:
        return
    if color in COLOR_1CH:
        p.add(f'LoadImageFromFile(color_type={color!r}) decodes every image to 1 channel',
              f'{where}: color_type={color!r}', "the detectors' data_preprocessor and backbones "
              "take 3-channel images; use color_type='color' (the default)")
        return
    if len(present) > IMAGE_HEADER_CAP:
        notes.append(f'image modes: checked the first {IMAGE_HEADER_CAP} of {len(present)} '
                     f'images (IMAGE_HEADER_CAP, {where} color_type={color!r})')
    backend = loader.get('imdecode_backend', 'cv2')
    for im, path in present[:IMAGE_HEADER_CAP]:
        kind = _image_kind(path, backend)
        if kind is not None:
            p.add(f'images that {where} LoadImageFromFile(color_type={color!r}) does not decode '
                  'to 3-channel 8-bit', f'image {im.id}: {path}: {kind}', COLOR_FIX)


def _size_checks(res: ScanResult, pipelines: List[Tuple[str, list]], min_side: int) -> None:
    """Kept images whose short side, after the pipeline's resize, is below ``min_side``."""
    resizes = _transforms(pipelines, RESIZE_TYPES)
    t = resizes[-1][1] if resizes else None  # the last one sets the size (keep_ratio or not)
    after = f' after {resizes[-1][0]} {_describe(t)}' if t else ''
    if t and _type_name(t) not in FIXED_RESIZE_TYPES:
        after += ' (its smallest scale)'
    fix = (f'remove them from the json or raise the smallest scale of {_describe(t)}' if t else
           f'drop them with filter_cfg=dict(min_size={min_side}) (mmdet filters on the json size)'
           ' or add a Resize to the pipeline')
    for im in res.kept:
        size = resized_size(im.width, im.height, t) if t else (im.width, im.height)
        if min(size) < min_side:
            shown = (f'{im.width:g}x{im.height:g}' + (f' -> {size[0]}x{size[1]}' if t else ''))
            res.problems.add(f'images whose short side{after} is below min_image_side='
                             f"{min_side} (the backbone's largest stride)",
                             f'image {im.id} ({im.file_name}): {shown}', fix)


# ----------------------------------------------------------------------------- entry point
def _check_dataset(ds: dict, key: str, cls: type, pipelines: List[Tuple[str, list]],
                   min_side: Optional[int]) -> Tuple[Optional[DataSummary], Problems, str]:
    from mmdet.datasets import CocoPanopticDataset
    ann = ds.get('ann_file')
    ann_file = _join(ds.get('data_root') or '', ann) if isinstance(ann, str) else ''
    if not ann_file or is_remote(ann_file) or not osp.isfile(ann_file):
        return None, Problems(), ann_file
    panoptic = issubclass(cls, CocoPanopticDataset)
    try:
        with open(ann_file) as f:
            data = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        res = ScanResult()
        res.problems.add('the ann_file is not valid JSON', str(e),
                         'rewrite the file (json.dump) or point ann_file at the right one')
        return None, res.problems, ann_file
    res = scan(data, _settings(ds, cls, panoptic))
    notes: List[str] = []
    _file_checks(ds, key, res, panoptic, pipelines, notes)
    if min_side:
        try:
            _size_checks(res, pipelines, min_side)
        except (KeyError, TypeError, ValueError, IndexError) as e:  # a malformed resize
            notes.append(f'min_image_side not checked: cannot read the resize transform ({e!r})')
    summary = DataSummary(key, ann_file, res.images, res.boxes, res.dropped, len(res.kept),
                          res.crowd, res.background, panoptic, tuple(notes))
    return summary, res.problems, ann_file


def check_annotations(cfg: Config, stages: Sequence[str] = ('train',),
                      min_image_side: Optional[int] = None) -> List[DataSummary]:
    """Check the annotations of the COCO-style datasets of ``stages`` (see the module docstring).

    Args:
        cfg: the config; ``stages`` as in :data:`vitdet_plugin.config.LOADER_KEYS`.
        min_image_side: refuse kept images whose short side (after the pipeline's resize) is
            below it; pass the backbone's largest stride. None: not checked.

    Returns one :class:`DataSummary` per dataset checked; raises :class:`DataCheckError` listing
    every problem found in any of them.
    """
    summaries: List[DataSummary] = []
    failed: List[Tuple[str, str, Problems]] = []
    for stage in stages:
        for loader_key in LOADER_KEYS[stage]:
            loader = cfg.get(loader_key)
            top = loader.get('dataset') if isinstance(loader, dict) else None
            if top is None:
                continue
            top_key = f'{loader_key}.dataset'
            for ds, key in iter_datasets(top, top_key):
                cls = _coco_class(ds.get('type'))
                if cls is None:
                    continue
                summary, problems, ann_file = _check_dataset(
                    ds, key, cls, _pipelines(top, top_key, key), min_image_side)
                if problems:
                    failed.append((key, ann_file, problems))
                elif summary is not None:
                    summaries.append(summary)
    if failed:
        # the same problems in several datasets (train and val on the same kind of file): once
        merged: Dict[Tuple[str, ...], List[str]] = {}
        kinds = 0
        for key, ann_file, problems in failed:
            rendered = tuple(problems.render())
            if rendered not in merged:
                kinds += len(problems)
            merged.setdefault(rendered, []).append(f'{key} (ann_file {ann_file})')
        lines = [f"data check failed: {kinds} kind{'s' if kinds > 1 else ''} of problem that "
                 'would crash training or train on wrong boxes:']
        for rendered, where in merged.items():
            lines.append(', '.join(where) + ':')
            lines += rendered
        raise DataCheckError('\n'.join(lines))
    return summaries
