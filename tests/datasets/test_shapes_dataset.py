"""The embedded shapes dataset: determinism, valid COCO annotations, mmdet loading path."""
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO_ROOT

from vitdet_plugin.datasets import shapes
from vitdet_plugin.datasets.shapes import (
    CLASSES,
    ShapesSpec,
    generate_dataset,
    image_rng,
    render_image,
)

NUM_TRAIN, NUM_VAL = 12, 4


def _digest(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob('*')) if p.is_file()}


@pytest.fixture(scope='module')
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp('shapes')
    generate_dataset(str(root), seed=3, num_train=NUM_TRAIN, num_val=NUM_VAL, progress=False)
    return root


def test_same_seed_same_bytes(dataset, tmp_path):
    generate_dataset(str(tmp_path), seed=3, num_train=NUM_TRAIN, num_val=NUM_VAL,
                     progress=False)
    a, b = _digest(dataset), _digest(tmp_path)
    assert len(a) == 2 * (NUM_TRAIN + NUM_VAL) + 4  # images + panoptic PNGs, 4 JSON files
    assert a == b


def test_other_seed_other_images(dataset, tmp_path):
    generate_dataset(str(tmp_path), seed=4, num_train=NUM_TRAIN, num_val=NUM_VAL,
                     progress=False)
    a, b = _digest(dataset), _digest(tmp_path)
    assert a.keys() == b.keys()
    assert sum(a[k] != b[k] for k in a) == len(a)


def test_image_does_not_depend_on_count():
    spec = ShapesSpec()
    img_a, objs_a = render_image(image_rng(3, 'train', 5), spec)
    img_b, objs_b = render_image(image_rng(3, 'train', 5), spec)
    img_v, _ = render_image(image_rng(3, 'val', 5), spec)
    np.testing.assert_array_equal(img_a, img_b)
    assert [o.label for o in objs_a] == [o.label for o in objs_b]
    assert not np.array_equal(img_a, img_v)  # splits draw from different streams


def test_annotations_are_valid_coco(dataset):
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    spec = ShapesSpec()
    for split, n in (('train', NUM_TRAIN), ('val', NUM_VAL)):
        coco = COCO(str(dataset / f'annotations/instances_{split}.json'))
        assert sorted(coco.getImgIds()) == list(range(1, n + 1))
        assert [c['name'] for c in coco.loadCats(coco.getCatIds())] == list(CLASSES)
        for img in coco.loadImgs(coco.getImgIds()):
            assert (dataset / split / img['file_name']).is_file()
            anns = coco.loadAnns(coco.getAnnIds(imgIds=[img['id']]))
            assert spec.objects[0] <= len(anns) <= spec.objects[1]
            for ann in anns:
                mask = coco.annToMask(ann).astype(bool)  # decodes the polygons
                ys, xs = np.nonzero(mask)
                box = [xs.min(), ys.min(), xs.max() + 1 - xs.min(), ys.max() + 1 - ys.min()]
                assert ann['bbox'] == [float(v) for v in box], ann['id']
                assert ann['area'] == float(mask.sum())
                assert ann['iscrowd'] == 0 and 1 <= ann['category_id'] <= len(CLASSES)
                assert max(ann['bbox'][2:]) <= spec.object_size[1] + 1
        # ground truth scored against itself is perfect through the real COCO evaluation
        dets = [dict(image_id=a['image_id'], category_id=a['category_id'], bbox=a['bbox'],
                     score=1.0) for a in coco.dataset['annotations']]
        ev = COCOeval(coco, coco.loadRes(dets), 'bbox')
        ev.evaluate(), ev.accumulate(), ev.summarize()
        assert ev.stats[0] == pytest.approx(1.0)


def test_dataset_is_hard_enough(dataset):
    """The spec the demo recipe is measured on: sizes, counts, rotations, overlaps."""
    ann = json.loads((dataset / 'annotations/instances_train.json').read_text())
    assert ann['info']['spec']['object_size'] == [20, 100]
    assert ann['info']['spec']['image_size'] == 256
    assert len(ann['categories']) >= 4
    sides = [max(a['bbox'][2:]) for a in ann['annotations']]
    assert min(sides) < 40 and max(sides) > 70
    # objects overlap (later ones occlude earlier ones) and every one stays visible
    spec = ShapesSpec()
    overlapping = 0
    for i in range(30):
        _, objs = render_image(image_rng(0, 'train', i), spec)
        assert all(o.mask.sum() >= shapes.MIN_VISIBLE_PIXELS for o in objs)
        boxes = [shapes.mask_to_bbox(o.mask) for o in objs]
        overlapping += sum(_boxes_intersect(a, b) for k, a in enumerate(boxes)
                           for b in boxes[k + 1:])
    assert overlapping >= 5


def _boxes_intersect(a, b) -> bool:
    return (min(a[0] + a[2], b[0] + b[2]) > max(a[0], b[0])
            and min(a[1] + a[3], b[1] + b[3]) > max(a[1], b[1]))


def test_existing_dataset_kept_or_refused(dataset):
    status = generate_dataset(str(dataset), seed=3, num_train=NUM_TRAIN, num_val=NUM_VAL,
                              progress=False)
    assert status == {'train': 'exists', 'val': 'exists'}
    with pytest.raises(FileExistsError, match='overwrite=True'):
        generate_dataset(str(dataset), seed=5, num_train=NUM_TRAIN, num_val=NUM_VAL,
                         progress=False)


@pytest.mark.parametrize('kwargs, match', [
    (dict(classes=('square', 'blob')), r"unknown classes \['blob'\]"),
    (dict(objects=(0, 3)), r'objects=\(0, 3\)'),
    (dict(object_size=(20, 300)), r'object_size=\(20, 300\).*image_size=256'),
    (dict(max_occlusion=1.0), r'max_occlusion=1.0'),
])
def test_bad_spec_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShapesSpec(**kwargs)


def test_mmdet_coco_dataset_reads_it(dataset):
    """The demo configs' real loading path: mmdet CocoDataset + the config's pipeline."""
    from mmdet.registry import DATASETS
    from mmengine.registry import init_default_scope

    from vitdet_plugin.config import load_config

    cfg = load_config(str(REPO_ROOT / 'configs/_base_/datasets/'
                          'shapes_instance.py'), {'data_root': str(dataset) + '/'})
    init_default_scope('mmdet')
    ds = DATASETS.build(cfg.val_dataloader.dataset)
    assert len(ds) == NUM_VAL
    assert ds.metainfo['classes'] == CLASSES
    item = ds[0]
    coco = json.loads((dataset / 'annotations/instances_val.json').read_text())
    n = sum(a['image_id'] == 1 for a in coco['annotations'])
    sample = item['data_samples']
    assert tuple(item['inputs'].shape) == (3, 256, 256)
    assert len(sample.gt_instances) == n
    assert sample.gt_instances.masks.masks.shape == (n, 256, 256)


def test_make_shapes_reuse_keeps_a_dataset_made_with_other_options(tmp_path, capsys):
    """``make demo`` runs ``make_shapes.py --reuse``: a set made with another seed and generator
    options under DEMO_DATA is used as it is (not refused, not regenerated)."""
    from helpers import load_tool
    tool = load_tool('make_shapes.py')
    root = str(tmp_path / 'other') + '/'
    other = ShapesSpec(image_size=48, classes=('circle', 'star'), objects=(1, 2),
                       object_size=(12, 24))
    generate_dataset(root, seed=5, num_train=3, num_val=2, spec=other, progress=False)
    before = {p.name: p.read_bytes() for p in Path(root, 'annotations').glob('*.json')}
    with pytest.raises(SystemExit, match='holds a different shapes dataset'):
        tool.main(['--out', root, '--quiet'])
    tool.main(['--out', root, '--seed', '0', '--reuse', '--quiet'])
    assert capsys.readouterr().out.count(': exists (') == 2
    assert {p.name: p.read_bytes() for p in Path(root, 'annotations').glob('*.json')} == before
    fresh = str(tmp_path / 'fresh') + '/'
    # absent: generated as asked
    tool.main(['--out', fresh, '--seed', '3', '--num-train', '2', '--num-val', '1',
               '--image-size', '48', '--object-size', '12', '24', '--reuse', '--quiet'])
    assert shapes.dataset_info(fresh, 'train')['seed'] == 3
