"""Up-front annotation checks (vitdet_plugin.checks.data): every case handled (counted exactly as
mmdet's real CocoDataset / CocoPanopticDataset count it) or refused with its exact message."""
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import cv2
import numpy as np
import pytest
from mmengine.config import Config
from PIL import Image

from vitdet_plugin.checks import data as data_checks
from vitdet_plugin.checks.data import DataCheckError, DataSummary, check_annotations, resized_size
from vitdet_plugin.config import apply_cfg_options
from vitdet_plugin.datasets import CLASSES, ShapesSpec, generate_split
from helpers import REPO_ROOT

REPO = REPO_ROOT
KEY = 'train_dataloader.dataset'
W, H = 48, 32
XYXY_FIX = 'COCO bbox is [x, y, width, height]; convert x2,y2 to width=x2-x1, height=y2-y1'
FIELD_FIX = ('mmdet reads these fields unconditionally (KeyError / TypeError at dataset build); '
             'complete or remove these entries')
PIPELINE = [dict(type='LoadImageFromFile'), dict(type='LoadAnnotations', with_bbox=True)]
SHAPES_SPEC = ShapesSpec(image_size=64, objects=(1, 3), object_size=(16, 40), lines=(0, 1))


# ----------------------------------------------------------------------------- fixtures
def _png(path: Path, w: int = W, h: int = H, mode: str = 'RGB') -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, (w, h)).save(path)


def _ann(aid: int, image_id: int, bbox: Any, cat: int = 1, **extra: Any) -> Dict[str, Any]:
    area = bbox[2] * bbox[3] if isinstance(bbox, list) and len(bbox) == 4 else 1
    ann = dict(id=aid, image_id=image_id, category_id=cat, bbox=bbox, area=area, iscrowd=0)
    ann.update(extra)
    return ann


def _coco(root: Path, anns: List[dict], images: Optional[List[dict]] = None,
          cats: Optional[List[dict]] = None, write: Optional[Sequence[int]] = None) -> str:
    """Write ``root/ann.json`` (two 48x32 images by default) and a PNG per image (only those
    whose id is in ``write`` when given)."""
    images = images if images is not None else [
        dict(id=i, file_name=f'{i}.png', width=W, height=H) for i in (1, 2)]
    cats = cats if cats is not None else [dict(id=1, name='a'), dict(id=2, name='b')]
    for im in images:
        if write is None or im['id'] in write:
            _png(root / 'img' / im['file_name'], int(im.get('width') or W),
                 int(im.get('height') or H))
    (root / 'ann.json').write_text(json.dumps(dict(images=images, annotations=anns,
                                                   categories=cats)))
    return str(root)


def _cfg(root: str, **ds: Any) -> Config:
    dataset = dict(type='CocoDataset', data_root=root, ann_file='ann.json',
                   data_prefix=dict(img='img/'), metainfo=dict(classes=('a', 'b')),
                   filter_cfg=dict(filter_empty_gt=True), pipeline=PIPELINE)
    dataset.update(ds)
    return Config(dict(train_dataloader=dict(batch_size=1, dataset=dataset)))


def _mmdet(ds_cfg: Any) -> Tuple[int, int, int, int]:
    """The independent reference: mmdet's own dataset built from the same config.

    Returns (images kept, instances, ignore-flagged instances, images without a positive box).
    """
    from mmdet.registry import DATASETS
    cfg = ds_cfg.to_dict() if hasattr(ds_cfg, 'to_dict') else dict(ds_cfg)
    ds = DATASETS.build(dict(cfg, pipeline=[], lazy_init=False))
    infos = [ds.get_data_info(i) for i in range(len(ds))]
    inst = [i['instances'] for i in infos]
    return (len(ds), sum(map(len, inst)), sum(x['ignore_flag'] for i in inst for x in i),
            sum(all(x['ignore_flag'] for x in i) for i in inst))


def _failure(ann_file: str, *kinds: str, key: str = KEY) -> str:
    head = (f"data check failed: {len(kinds)} kind{'s' if len(kinds) > 1 else ''} of problem "
            'that would crash training or train on wrong boxes:')
    return '\n'.join([head, f'{key} (ann_file {ann_file}):', *kinds])


def _kind(title: str, items: Sequence[str], fix: str, count: Optional[int] = None) -> str:
    count = len(items) if count is None else count
    lines = [f'  - {title}: {count}', *[f'      {i}' for i in items]]
    if count > len(items):
        lines.append(f'      ... and {count - len(items)} more')
    return '\n'.join(lines + [f'    fix: {fix}'])


def _refused(cfg: Config, **kwargs: Any) -> str:
    with pytest.raises(DataCheckError) as e:
        check_annotations(cfg, **kwargs)
    return str(e.value)


def _one(cfg: Config, **kwargs: Any) -> DataSummary:
    (summary,) = check_annotations(cfg, **kwargs)
    return summary


# ----------------------------------------------------------------------------- handled cases
def test_project_shapes_data_passes(tmp_path: Path) -> None:
    generate_split(str(tmp_path), 'train', 4, seed=0, spec=SHAPES_SPEC, progress=False)
    cfg = _cfg(str(tmp_path), ann_file='annotations/instances_train.json',
               data_prefix=dict(img='train/'), metainfo=dict(classes=CLASSES))
    s = _one(cfg, min_image_side=32)
    assert s.line() == (f'data {KEY} ({tmp_path}/annotations/instances_train.json): 4 images, '
                        '7 boxes; dropped: nothing')
    assert (s.kept_images, s.boxes, 0, s.background) == _mmdet(cfg.train_dataloader.dataset)


@pytest.mark.parametrize('filter_empty_gt', [True, False])
def test_dropped_counts_match_mmdet(tmp_path: Path, filter_empty_gt: bool) -> None:
    images = [dict(id=i, file_name=f'{i}.png', width=W, height=H) for i in (1, 2, 3, 4)]
    images.append(dict(id=5, file_name='5.png', width=40, height=20))  # below min_size
    anns = [_ann(1, 1, [0, 0, 0, 5]), _ann(2, 1, [0, 0, 0.5, 5]), _ann(3, 1, [0, 0, 5, 5], area=0),
            _ann(4, 1, [10, 10, -5, 5]), _ann(5, 1, [50, 0, 5, 5]),
            dict(id=6, image_id=1, category_id=1, ignore=True),  # no bbox: never read
            _ann(7, 1, [1, 1, 9, 9], iscrowd=1),
            _ann(8, 1, [2, 2, 20, 20]), _ann(9, 1, [2, 2, 20, 20], cat=2),
            _ann(10, 2, [0, 0, 0, 0]), _ann(11, 4, [3, 3, 9, 9], cat=2), _ann(12, 5, [1, 1, 5, 5])]
    # image 2: only a zero-size box; 3: no annotation; 4: only a box of a class not trained
    root = _coco(tmp_path, anns, images)
    cfg = _cfg(root, metainfo=dict(classes=('a',)),
               filter_cfg=dict(filter_empty_gt=filter_empty_gt, min_size=24))
    s = _one(cfg)
    dropped = ('1 × annotation with ignore=True, 4 × box with no area inside its image, '
               '2 × box under 1 px or with area <= 0, 2 × annotation of a category not in '
               'metainfo.classes')
    if filter_empty_gt:
        tail = (f'2 kept), 2 boxes (1 crowd, kept as ignore), 1 background image (no box); '
                f'dropped: {dropped}, 2 × image without annotations (filter_empty_gt=True), '
                '1 × image smaller than filter_cfg.min_size=24')
    else:
        tail = (f'4 kept), 2 boxes (1 crowd, kept as ignore), 3 background images (no box); '
                f'dropped: {dropped}, 1 × image smaller than filter_cfg.min_size=24')
    assert s.line() == f'data {KEY} ({root}/ann.json): 5 images ({tail}'
    assert (s.kept_images, s.boxes, s.crowd, s.background) == _mmdet(cfg.train_dataloader.dataset)


def test_no_image_left_refused(tmp_path: Path) -> None:
    root = _coco(tmp_path, [_ann(1, 1, [1, 1, 5, 5], cat=2)])
    cfg = _cfg(root, metainfo=dict(classes=('a',)))
    assert _refused(cfg) == _failure(f'{root}/ann.json', _kind('no image left to train on', [
        '2 images in the json, dropped: 1 × annotation of a category not in metainfo.classes, '
        '2 × image without annotations (filter_empty_gt=True)'],
        'mmengine fails on an empty dataset; fix the annotations or filter_cfg'))
    with pytest.raises(ValueError, match='need at least one array to concatenate'):
        _mmdet(cfg.train_dataloader.dataset)


# ----------------------------------------------------------------------------- refused cases
def test_box_outside_image_refused(tmp_path: Path) -> None:
    anns = [_ann(1, 1, [10, 10, 40, 30]), _ann(2, 2, [5, 5, 10, 10]),
            _ann(3, 2, [0, 0, 48.5, 32.5]), _ann(4, 2, [-0.5, -1, 5, 5]),  # within 1 px: kept
            _ann(5, 2, [-3, 2, 10, 10])]
    root = _coco(tmp_path, anns)
    cfg = _cfg(root)
    assert _refused(cfg) == _failure(
        f'{root}/ann.json',
        _kind('boxes reaching past the right or bottom edge of their image by more than 1 px '
              '(mmdet keeps them unclipped)',
              ['annotation 1 (image 1, 1.png, 48x32): bbox [10, 10, 40, 30] reaches x=50, y=40'],
              XYXY_FIX),
        _kind('boxes starting more than 1 px left of or above their image',
              ['annotation 5 (image 2, 2.png, 48x32): bbox [-3, 2, 10, 10]'],
              'COCO bbox is [x, y, width, height] with x, y >= 0 in image pixels; clip the box '
              'to the image or correct its coordinates'))
    # the refusal is justified: mmdet trains on the box as it is, unclipped
    from mmdet.datasets import CocoDataset
    ds = CocoDataset(ann_file=f'{root}/ann.json', data_prefix=dict(img=f'{root}/img/'),
                     metainfo=dict(classes=('a', 'b')))
    assert ds.get_data_info(0)['instances'][0]['bbox'] == [10, 10, 50, 40]


def test_malformed_annotations_refused(tmp_path: Path) -> None:
    anns = [_ann(1, 1, [1, 2, 3]), _ann(2, 1, 'x'), _ann(3, 1, [1, float('nan'), 2, 2]),
            dict(id=4, image_id=1, category_id=1, bbox=[1, 1, 2, 2]),
            _ann(5, 1, [1, 1, 5, 5], iscrowd=2)]
    root = _coco(tmp_path, anns)
    assert _refused(_cfg(root)) == _failure(
        f'{root}/ann.json',
        _kind('annotations whose bbox is not 4 finite numbers or area not a number', [
            'annotation 1 (image 1, 1.png, 48x32): bbox=[1, 2, 3] area=1',
            "annotation 2 (image 1, 1.png, 48x32): bbox='x' area=1",
            'annotation 3 (image 1, 1.png, 48x32): bbox=[1, nan, 2, 2] area=4'],
            'COCO bbox is [x, y, width, height] in pixels and area a number; fix or remove '
            'these annotations'),
        _kind('annotations without a required field', ["annotations[3] (id 4): no 'area'"],
              FIELD_FIX),
        _kind('iscrowd values other than 0 or 1', ['annotation 5: iscrowd=2'],
              'iscrowd is 1 for a crowd region (trained as ignore), else 0'))
    # justified: mmdet's parse_data_info crashes on a missing area
    _coco(tmp_path, [anns[3]])
    with pytest.raises(KeyError, match='area'):
        _mmdet(_cfg(root).train_dataloader.dataset)


def test_unknown_category_refused(tmp_path: Path) -> None:
    anns = [_ann(1, 1, [1, 1, 5, 5]), _ann(2, 1, [1, 1, 5, 5], cat=9),
            _ann(3, 2, [1, 1, 5, 5], cat=9), _ann(4, 2, [1, 1, 5, 5], cat=7)]
    root = _coco(tmp_path, anns)
    cfg = _cfg(root)
    assert _refused(cfg) == _failure(f'{root}/ann.json', _kind(
        "annotations whose category_id is not in the json's categories", [
            "category_id 7 (not in the json's categories): 1 annotation (first: annotation 4, "
            'image 2)',
            "category_id 9 (not in the json's categories): 2 annotations (first: annotation 2, "
            'image 1)'],
        'CocoDataset silently drops them (the boxes are lost) and CocoPanopticDataset raises '
        "KeyError; the json's categories are: 1 'a', 2 'b'; add the category to the json (and "
        'metainfo.classes) or correct the category_id'))
    # mmdet 3.3's CocoDataset raises nothing: it silently keeps 1 box of the 4
    # (CocoPanopticDataset's KeyError: test_panoptic_layout)
    assert _mmdet(cfg.train_dataloader.dataset)[1] == 1


def test_class_names_refused(tmp_path: Path) -> None:
    from mmdet.datasets import CocoDataset
    root = _coco(tmp_path, [_ann(1, 1, [1, 1, 5, 5]), _ann(2, 2, [1, 1, 5, 5], cat=2)])
    ann_file = f'{root}/ann.json'
    names_fix = ('mmdet maps classes to the json categories by name (coco.get_cat_ids(cat_names='
                 "classes)) and silently loses a name it does not find; the json has: 1 'a', "
                 "2 'b'; correct the names in metainfo.classes or add the categories")
    assert _refused(_cfg(root, metainfo=dict(classes=('a', 'dog')))) == _failure(
        ann_file, _kind("names in metainfo.classes missing from the json's categories",
                        ["'dog'"], names_fix))
    coco = CocoDataset.METAINFO['classes']
    assert _refused(_cfg(root, metainfo=None)) == _failure(ann_file, _kind(
        "names in CocoDataset.METAINFO['classes'] (metainfo.classes is not set) missing from "
        "the json's categories", [repr(n) for n in coco[:10]], names_fix, count=len(coco)))
    cfg = _cfg(root, metainfo=dict(classes=('b', 'a')))
    assert _refused(cfg) == _failure(ann_file, _kind(
        "metainfo.classes not in the json's category order",
        ["label 0: named 'b' but holds category 'a'", "label 1: named 'a' but holds category 'b'"],
        "mmdet numbers labels in the json's category order, whatever the order of "
        "metainfo.classes; list them in that order: ('a', 'b')"))
    ds = CocoDataset(ann_file=ann_file, data_prefix=dict(img=f'{root}/img/'),
                     metainfo=dict(classes=('b', 'a')))
    assert ds.metainfo['classes'][0] == 'b' and ds.cat2label == {1: 0, 2: 1}  # 'a' is label 0


def test_ids_refused(tmp_path: Path) -> None:
    images = [dict(id=i, file_name=f'{i}.png', width=W, height=H) for i in (1, 2)]
    images.append(dict(id=2, file_name='2b.png', width=W, height=H))
    anns = [_ann(1, 1, [1, 1, 5, 5]), _ann(1, 2, [1, 1, 5, 5]), _ann(3, 7, [1, 1, 5, 5])]
    root = _coco(tmp_path, anns, images)
    assert _refused(_cfg(root)) == _failure(
        f'{root}/ann.json',
        _kind('duplicate image ids', ['image id 2 (2b.png)'],
              'pycocotools keeps only the last image of an id; give every image its own id'),
        _kind('duplicate annotation ids', ['annotation id 1'],
              'CocoDataset asserts that annotation ids are unique; renumber them'),
        _kind("annotations whose image_id is not in 'images'", ['annotation 3: image_id 7'],
              "pycocotools never reads them (the boxes are lost); add the image to 'images' or "
              'fix the image_id'))


def test_image_fields_refused(tmp_path: Path) -> None:
    images: List[dict] = [dict(id=1, file_name='1.png', width=W, height=H),
              dict(id=2, file_name='2.png', height=H), dict(id=3, file_name='3.png', width=W,
                                                            height=0), dict(file_name='4.png')]
    anns = [_ann(1, 1, [1, 1, 5, 5]), _ann(2, 2, [1, 1, 5, 5])]
    root = _coco(tmp_path, anns, images)
    assert _refused(_cfg(root)) == _failure(
        f'{root}/ann.json',
        _kind('images without a positive width and height', [
            'image 2 (2.png): width=None height=32', 'image 3 (3.png): width=48 height=0'],
            "mmdet reads the image size from the json ('width', 'height' in pixels); set them to "
            'the real size of the file'),
        _kind('images without a required field', ["images[3]: no 'id'"], FIELD_FIX))
    assert _refused(_cfg(root, data_prefix=dict(img_path='img/'))).endswith(_kind(
        'data_prefix.img not set', [f"{KEY}.data_prefix={{'img_path': 'img/'}}"],
        "CocoDataset joins data_prefix['img'] with each file_name (KeyError / TypeError without "
        "it); set data_prefix=dict(img='<image folder>/')"))


def test_missing_image_files_refused(tmp_path: Path) -> None:
    images = [dict(id=i, file_name=f'{i}.png', width=W, height=H) for i in range(1, 13)]
    root = _coco(tmp_path, [], images, write=[1])
    assert _refused(_cfg(root, filter_cfg=None)) == _failure(f'{root}/ann.json', _kind(
        f'image files missing under data_prefix.img ({root}/img/)',
        [f'image {i}: {i}.png' for i in range(2, 12)],
        'LoadImageFromFile raises FileNotFoundError on the first batch that draws one; restore '
        "the files, or correct data_prefix.img / the images' file_name, or remove those images "
        'from the json', count=11))


# ----------------------------------------------------------------------------- image size / mode
def test_min_image_side_resize_aware(tmp_path: Path) -> None:
    from mmdet.datasets.transforms import Resize
    images = [dict(id=1, file_name='1.png', width=40, height=20),
              dict(id=2, file_name='2.png', width=100, height=20)]
    root = _coco(tmp_path, [_ann(1, 1, [1, 1, 5, 5]), _ann(2, 2, [1, 1, 5, 5])], images)
    ann_file = f'{root}/ann.json'
    raw = _refused(_cfg(root), min_image_side=32)  # no resize: the json sizes
    assert raw == _failure(ann_file, _kind(
        "images whose short side is below min_image_side=32 (the backbone's largest stride)",
        ['image 1 (1.png): 40x20', 'image 2 (2.png): 100x20'],
        'drop them with filter_cfg=dict(min_size=32) (mmdet filters on the json size) or add a '
        'Resize to the pipeline'))
    resize = dict(type='Resize', scale=(64, 64), keep_ratio=True)
    desc = 'Resize(scale=(64, 64), keep_ratio=True)'
    # 40x20 -> 64x32 (kept), 100x20 -> 64x13 (refused)
    assert _refused(_cfg(root, pipeline=PIPELINE + [resize]), min_image_side=32) == _failure(
        ann_file, _kind(
            f'images whose short side after {KEY}.pipeline.2 {desc} is below min_image_side=32 '
            "(the backbone's largest stride)", ['image 2 (2.png): 100x20 -> 64x13'],
            f'remove them from the json or raise the smallest scale of {desc}'))
    for w, h in ((40, 20), (100, 20)):  # the rule is mmcv's: the real transform agrees
        out = Resize(scale=(64, 64), keep_ratio=True)(dict(img=np.zeros((h, w, 3), np.uint8)))
        assert out['img'].shape[1::-1] == resized_size(w, h, resize)
    random = dict(type='RandomResize', scale=(64, 64), ratio_range=(0.5, 2.0), keep_ratio=True)
    assert resized_size(40, 20, random) == (32, 16)
    rt = data_checks._describe(random)
    assert _refused(_cfg(root, pipeline=PIPELINE + [random]), min_image_side=32) == _failure(
        ann_file, _kind(
            f'images whose short side after {KEY}.pipeline.2 {rt} (its smallest scale) is below '
            "min_image_side=32 (the backbone's largest stride)",
            ['image 1 (1.png): 40x20 -> 32x16', 'image 2 (2.png): 100x20 -> 32x6'],
            f'remove them from the json or raise the smallest scale of {rt}'))
    from mmcv.transforms import RandomChoiceResize, RandomResize
    np.random.seed(0)
    drawn = [RandomResize(scale=(64, 64), ratio_range=(0.5, 2.0), keep_ratio=True)(
        dict(img=np.zeros((20, 40, 3), np.uint8)))['img'].shape[0] for _ in range(50)]
    assert min(drawn) >= 16  # the smallest scale bounds every draw
    choice = dict(type='RandomChoiceResize', scales=[(128, 128), (64, 64)], keep_ratio=True)
    assert resized_size(100, 20, choice) == (64, 13)
    drawn = [RandomChoiceResize(scales=[(128, 128), (64, 64)], keep_ratio=True)(
        dict(img=np.zeros((20, 100, 3), np.uint8)))['img'].shape[0] for _ in range(20)]
    assert min(drawn) == 13
    fixed = dict(type='Resize', scale=(64, 64), keep_ratio=False)  # every image 64x64
    assert check_annotations(_cfg(root, pipeline=PIPELINE + [fixed]), min_image_side=32)


MODES: Dict[str, Optional[str]] = {  # file -> what the check says with color_type='unchanged'
    'rgb.png': None, 'l.png': 'mode L', 'rgba.png': 'mode RGBA', 'la.png': 'mode LA',
    'p.png': None, 'pt.png': 'mode P with transparency', 'g16.png': 'mode I;16, 16-bit PNG',
    'rgb16.png': 'mode RGB, 16-bit PNG', 'l.jpg': 'mode L', 'rgb.jpg': None}


def _mode_files(root: Path) -> None:
    (root / 'img').mkdir(parents=True)
    rgb = Image.fromarray(np.random.default_rng(0).integers(0, 255, (H, W, 3), np.uint8))
    for name, mode in (('rgb.png', 'RGB'), ('l.png', 'L'), ('rgba.png', 'RGBA'),
                       ('la.png', 'LA'), ('p.png', 'P'), ('l.jpg', 'L'), ('rgb.jpg', 'RGB')):
        rgb.convert(mode).save(root / 'img' / name)
    rgb.convert('P').save(root / 'img' / 'pt.png', transparency=0)
    cv2.imwrite(str(root / 'img' / 'g16.png'), np.full((H, W), 40000, np.uint16))
    cv2.imwrite(str(root / 'img' / 'rgb16.png'), np.full((H, W, 3), 40000, np.uint16))


def test_image_modes(tmp_path: Path) -> None:
    from mmcv.transforms import LoadImageFromFile
    _mode_files(tmp_path)
    images = [dict(id=i, file_name=n, width=W, height=H) for i, n in enumerate(MODES, 1)]
    root = _coco(tmp_path, [_ann(i, i, [1, 1, 5, 5]) for i in range(1, len(MODES) + 1)], images,
                 write=[])
    paths = [f'{root}/img/{n}' for n in MODES]
    for p in paths:  # the default color_type: mmcv makes every kind 3-channel uint8
        img = LoadImageFromFile()(dict(img_path=p))['img']
        assert (img.shape, img.dtype) == ((H, W, 3), np.uint8)
    assert _one(_cfg(root)).line() == f'data {KEY} ({root}/ann.json): 10 images, 10 boxes; ' \
        'dropped: nothing'
    unchanged = [dict(type='LoadImageFromFile', color_type='unchanged')] + PIPELINE[1:]
    loader = LoadImageFromFile(color_type='unchanged')
    for p, kind in zip(paths, MODES.values()):  # refused exactly where mmcv is not 3-ch uint8
        img = loader(dict(img_path=p))['img']
        assert ((img.shape, img.dtype) != ((H, W, 3), np.uint8)) == (kind is not None), p
    assert _refused(_cfg(root, pipeline=unchanged)) == _failure(f'{root}/ann.json', _kind(
        f"images that {KEY}.pipeline.0 LoadImageFromFile(color_type='unchanged') does not "
        'decode to 3-channel 8-bit',
        [f'image {i}: {p}: {k}' for i, (p, k) in enumerate(zip(paths, MODES.values()), 1) if k],
        "use LoadImageFromFile(color_type='color') (the default: mmcv decodes grayscale, RGBA, "
        'palette and 16-bit files to 3-channel uint8) or convert the files to 8-bit RGB'))
    gray = [dict(type='LoadImageFromFile', color_type='grayscale')] + PIPELINE[1:]
    assert LoadImageFromFile(color_type='grayscale')(dict(img_path=paths[0]))['img'].ndim == 2
    assert _refused(_cfg(root, pipeline=gray)) == _failure(f'{root}/ann.json', _kind(
        "LoadImageFromFile(color_type='grayscale') decodes every image to 1 channel",
        [f"{KEY}.pipeline.0: color_type='grayscale'"], "the detectors' data_preprocessor and "
        "backbones take 3-channel images; use color_type='color' (the default)"))


def test_image_header_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data_checks, 'IMAGE_HEADER_CAP', 1)
    root = _coco(tmp_path, [_ann(1, 1, [1, 1, 5, 5]), _ann(2, 2, [1, 1, 5, 5])])
    unchanged = [dict(type='LoadImageFromFile', color_type='unchanged')]
    assert _one(_cfg(root, pipeline=unchanged)).line() == (
        f'data {KEY} ({root}/ann.json): 2 images, 2 boxes; dropped: nothing; image modes: checked '
        f"the first 1 of 2 images (IMAGE_HEADER_CAP, {KEY}.pipeline.0 color_type='unchanged')")


# ----------------------------------------------------------------------------- wrappers / layouts
def test_wrapped_datasets(tmp_path: Path) -> None:
    bad = _coco(tmp_path / 'bad', [_ann(1, 1, [10, 10, 40, 30]), _ann(2, 2, [1, 1, 5, 5])])
    good = _coco(tmp_path / 'good', [_ann(1, 1, [1, 1, 5, 5]), _ann(2, 2, [1, 1, 5, 5])])
    leaf = _cfg(bad).train_dataloader.dataset.to_dict()
    cfg = Config(dict(train_dataloader=dict(dataset=dict(type='RepeatDataset', times=2,
                                                         dataset=leaf))))
    assert _refused(cfg) == _failure(f'{bad}/ann.json', _kind(
        'boxes reaching past the right or bottom edge of their image by more than 1 px (mmdet '
        'keeps them unclipped)',
        ['annotation 1 (image 1, 1.png, 48x32): bbox [10, 10, 40, 30] reaches x=50, y=40'],
        XYXY_FIX), key=f'{KEY}.dataset')
    # the resize of a MultiImageMixDataset's own pipeline counts; other dataset types: skipped
    voc = dict(type='XMLDataset', data_root=good, ann_file='ann.json', pipeline=[])
    inner = dict(_cfg(good).train_dataloader.dataset.to_dict(), pipeline=PIPELINE[:1])
    mix = dict(type='MultiImageMixDataset', dataset=inner,
               pipeline=[dict(type='Resize', scale=(8, 8), keep_ratio=True)])
    cfg = Config(dict(train_dataloader=dict(dataset=dict(type='ConcatDataset',
                                                         datasets=[mix, voc]))))
    desc = 'Resize(scale=(8, 8), keep_ratio=True)'
    assert _refused(cfg, min_image_side=8) == _failure(f'{good}/ann.json', _kind(
        f'images whose short side after {KEY}.datasets.0.pipeline.0 {desc} is below '
        "min_image_side=8 (the backbone's largest stride)",
        ['image 1 (1.png): 48x32 -> 8x5', 'image 2 (2.png): 48x32 -> 8x5'],
        f'remove them from the json or raise the smallest scale of {desc}'),
        key=f'{KEY}.datasets.0.dataset')
    (s,) = check_annotations(cfg, min_image_side=4)
    assert s.line() == (f'data {KEY}.datasets.0.dataset ({good}/ann.json): 2 images, 2 boxes; '
                        'dropped: nothing')


def _panoptic_cfg(root: Path) -> Config:
    cfg = Config.fromfile(str(REPO / 'configs/_base_/datasets/shapes_panoptic.py'))
    apply_cfg_options(cfg, {'data_root': f'{root}/'})
    return cfg


def test_panoptic_layout(tmp_path: Path) -> None:
    generate_split(str(tmp_path), 'train', 3, seed=0, spec=SHAPES_SPEC, progress=False)
    cfg = _panoptic_cfg(tmp_path)
    ds_cfg = cfg.train_dataloader.dataset
    ann_file = f'{tmp_path}/annotations/panoptic_train.json'
    assert _one(cfg).line() == f'data {KEY} ({ann_file}): 3 images, 4 boxes; dropped: nothing'
    assert _mmdet(ds_cfg)[:2] == (3, 4)
    data = json.loads(Path(ann_file).read_text())
    segs = data['annotations'][0]['segments_info']
    thing = next(s for s in segs if s['category_id'] <= len(CLASSES))
    thing['iscrowd'] = 1  # mmdet's panoptic parse: a segment, no box
    Path(ann_file).write_text(json.dumps(data))
    assert _one(cfg).line() == (f'data {KEY} ({ann_file}): 3 images, 3 boxes, 1 crowd segment '
                                '(no box); dropped: nothing')
    assert _mmdet(ds_cfg)[:2] == (3, 3)
    thing['iscrowd'], thing['bbox'] = 0, [40, 40, 60, 30]
    segs[-1]['category_id'] = 42
    Path(ann_file).write_text(json.dumps(data))
    (tmp_path / 'annotations/panoptic_train/000001.png').unlink()
    assert _refused(cfg) == _failure(
        ann_file,
        _kind('boxes reaching past the right or bottom edge of their image by more than 1 px '
              '(mmdet keeps them unclipped)',
              [f"segment {thing['id']} (image 1, 000000.png, 64x64): bbox [40, 40, 60, 30] "
               'reaches x=100, y=70'], XYXY_FIX),
        _kind('segments whose category_id mmdet does not map', [
            "category_id 42 (not in the json's categories): 1 segment (first: image 1, segment "
            f"{segs[-1]['id']})"],
            "CocoPanopticDataset raises a bare KeyError on them at dataset build; the json's "
            "categories are: 1 'square', 2 'circle', 3 'triangle', 4 'star', 5 'cross', "
            "6 'lines', 7 'background'; add the class to metainfo.classes (and thing_classes / "
            'stuff_classes) or correct the category_id'),
        _kind(f'panoptic PNGs missing under data_prefix.seg ({tmp_path}/annotations/'
              'panoptic_train/)', ['image 2: 000001.png'],
              'LoadPanopticAnnotations reads one PNG per image at data_prefix.seg + file_name '
              '(.jpg -> .png); restore them or correct data_prefix.seg'))
    with pytest.raises(KeyError, match='42'):  # the refusal is justified
        _mmdet(ds_cfg)


def test_skipped(tmp_path: Path) -> None:
    root = _coco(tmp_path, [_ann(1, 1, [10, 10, 40, 30])])  # refused if it were read
    for ds in (dict(ann_file='s3://bucket/ann.json'), dict(ann_file='missing.json'),
               dict(type='XMLDataset'), dict(type='LVISV1Dataset')):
        assert check_annotations(_cfg(root, **ds)) == []
    assert check_annotations(_cfg(root), stages=('val',)) == []
    (tmp_path / 'ann.json').write_text('{"images": [')
    assert _refused(_cfg(root)) == _failure(f'{root}/ann.json', _kind(
        'the ann_file is not valid JSON', ['Expecting value: line 1 column 13 (char 12)'],
        'rewrite the file (json.dump) or point ann_file at the right one'))


def test_min_image_side_rfdetr_resizes() -> None:
    """RF-DETR's resizes: RFDETRResize sizes as mmdet's Resize (the same rule, checked on the
    real transform); RFDETRTrainResize's square is bounded by the smallest training scale the
    per-batch draw can take (rfdetr's own compute_multi_scale_scales)."""
    from rfdetr.datasets.coco import compute_multi_scale_scales

    from vitdet_plugin.datasets.rfdetr_transforms import RFDETRResize
    test = dict(type='RFDETRResize', scale=(64, 64), keep_ratio=True)
    out = RFDETRResize(scale=(64, 64), keep_ratio=True)(dict(img=np.zeros((20, 100, 3), np.uint8)))
    assert out['img'].shape[1::-1] == resized_size(100, 20, test) == (64, 13)
    train = dict(type='RFDETRTrainResize', resolution=384, block=32)
    side = min(compute_multi_scale_scales(384, expanded_scales=True, patch_size=16, num_windows=2))
    assert resized_size(100, 20, train) == (side, side) == (224, 224)
