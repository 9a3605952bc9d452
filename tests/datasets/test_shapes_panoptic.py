"""Panoptic ground truth of the shapes dataset: PNG/JSON contents, mmdet's reading and scoring,
determinism, unchanged images and instance JSON, upgrade of a dataset from before it existed."""
import hashlib
import importlib.util
import json
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, List, Set

import cv2
import numpy as np
import pytest
import torch

from vitdet_plugin.datasets import shapes
from vitdet_plugin.datasets.shapes import (
    ShapesSpec,
    generate_dataset,
    image_rng,
    render_scene,
    strokes_mask,
)
from vitdet_plugin.datasets.shapes_panoptic import STUFF_CLASSES, decode_ids, panoptic_classes
from helpers import REPO_ROOT

REPO = REPO_ROOT
CONFIG = REPO / 'configs/_base_/datasets/shapes_panoptic.py'
SEED, NUM = 5, dict(train=4, val=2)
SPEC = ShapesSpec(image_size=64, objects=(2, 4), object_size=(12, 32))
#: the last commit of shapes.py before the panoptic ground truth (images + instance JSON only)
PRE_PANOPTIC_COMMIT = 'b872612ad57ba2a1235355f255d81b2816434d14'
#: what that commit writes for SEED / NUM / SPEC (decoded pixels, JSON bytes): the fallback
#: reference where the checkout has no git history
PRE_PANOPTIC_DIGESTS = {
    'annotations/instances_train.json': 'd5b2daa336068d42',
    'annotations/instances_val.json': 'd4a652c2fd0685c1',
    'train/000000.png': '03ccfd02d018b498', 'train/000001.png': '21be1e4ba58abdd0',
    'train/000002.png': '715a0fcdae8826dd', 'train/000003.png': '61f9e343a50863d4',
    'val/000000.png': 'd5a8c6854c785ea6', 'val/000001.png': 'e825f89ae71f5509',
}


def _generate(root: Path, **kwargs) -> Dict[str, str]:
    args: Dict[str, Any] = dict(seed=SEED, num_train=NUM['train'], num_val=NUM['val'],
                                spec=SPEC, progress=False)
    args.update(kwargs)
    return generate_dataset(str(root), **args)


def _imread(path: Path, flags: int = cv2.IMREAD_COLOR) -> np.ndarray:
    img = cv2.imread(str(path), flags)
    assert img is not None, path
    return img


def _bytes_digest(root: Path) -> Dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob('*')) if p.is_file()}


def _content_digest(root: Path) -> Dict[str, str]:
    """Images and instance JSON only; PNGs by their decoded pixels."""
    out = {}
    for p in sorted(root.rglob('*')):
        rel = str(p.relative_to(root))
        if not p.is_file() or 'panoptic' in rel:
            continue
        data = _imread(p, cv2.IMREAD_UNCHANGED).tobytes() if p.suffix == '.png' \
            else p.read_bytes()
        out[rel] = hashlib.sha256(data).hexdigest()[:16]
    return out


def _pan_ids(root: Path, split: str, file_name: str) -> np.ndarray:
    return decode_ids(_imread(root / f'annotations/panoptic_{split}' / file_name)[..., ::-1])


@pytest.fixture(scope='module')
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp('shapes_panoptic')
    assert _generate(root) == {'train': 'generated', 'val': 'generated'}
    return root


def _load(root: Path, split: str, kind: str) -> dict:
    return json.loads((root / f'annotations/{kind}_{split}.json').read_text())


# ----------------------------------------------------------------------------- file contents
def test_things_are_exactly_the_instance_masks(dataset):
    from pycocotools.coco import COCO

    for split in ('train', 'val'):
        pan, inst = _load(dataset, split, 'panoptic'), _load(dataset, split, 'instances')
        coco = COCO(str(dataset / f'annotations/instances_{split}.json'))
        assert [i['file_name'] for i in pan['images']] == [i['file_name']
                                                            for i in inst['images']]
        for i, ann in enumerate(pan['annotations']):
            assert ann['image_id'] == i + 1 and ann['file_name'] == f'{i:06d}.png'
            ids = _pan_ids(dataset, split, ann['file_name'])
            objects = render_scene(image_rng(SEED, split, i), SPEC).objects
            things = [s for s in ann['segments_info'] if s['category_id'] <= len(SPEC.classes)]
            inst_anns = coco.loadAnns(coco.getAnnIds(imgIds=[i + 1]))
            assert len(things) == len(objects) == len(inst_anns)
            for seg, obj, ia in zip(things, objects, inst_anns):
                mask = ids == seg['id']
                np.testing.assert_array_equal(mask, obj.mask)
                assert seg['category_id'] == obj.label + 1 == ia['category_id']
                assert seg['iscrowd'] == 0
                assert seg['area'] == ia['area'] and seg['bbox'] == ia['bbox']
                # the instance polygons decode to the same pixels (up to the tracing tolerance)
                poly = coco.annToMask(ia).astype(bool)
                assert (poly & mask).sum() / (poly | mask).sum() > 0.95


def test_every_pixel_is_a_segment_and_segments_info_matches_png(dataset):
    t = len(SPEC.classes)
    seen_stuff: Set[int] = set()
    for split in ('train', 'val'):
        pan = _load(dataset, split, 'panoptic')
        assert [(c['id'], c['name'], c['isthing']) for c in pan['categories']] == \
            [(k + 1, n, int(k < t)) for k, n in enumerate(panoptic_classes(SPEC.classes))]
        assert pan['info']['version'] == shapes.FORMAT_VERSION
        all_ids: List[int] = []
        for i, ann in enumerate(pan['annotations']):
            ids = _pan_ids(dataset, split, ann['file_name'])
            segs = {s['id']: s for s in ann['segments_info']}
            all_ids += list(segs)
            assert set(np.unique(ids).tolist()) == set(segs)  # no void (0), no stray id
            for sid, s in segs.items():
                mask = ids == sid
                ys, xs = np.nonzero(mask)
                assert s['area'] == int(mask.sum())
                assert s['bbox'] == [int(xs.min()), int(ys.min()), int(xs.max() - xs.min() + 1),
                                     int(ys.max() - ys.min() + 1)]
            cats = [s['category_id'] for s in segs.values()]
            assert cats.count(t + 2) == 1 and cats.count(t + 1) <= 1  # one per stuff class
            seen_stuff.update(c for c in cats if c > t)
            # lines = the pixels the distractor strokes painted, where no object is
            scene = render_scene(image_rng(SEED, split, i), SPEC)
            things = np.zeros(ids.shape, bool)
            for o in scene.objects:
                things |= o.mask
            want = strokes_mask(scene.strokes, SPEC.image_size) & ~things
            got = np.isin(ids, [s for s, v in segs.items() if v['category_id'] == t + 1])
            np.testing.assert_array_equal(got, want)
        assert len(all_ids) == len(set(all_ids))  # unique over the split (fast mmdet index)
    assert seen_stuff == {t + 1, t + 2}  # both stuff classes occur


def test_lines_mask_is_exactly_the_painted_pixels():
    """The documented rule: coverage >= 1/2 of the strokes as drawn on the float32 image."""
    for i in range(10):
        rng = image_rng(1, 'train', i)
        img = shapes._colour_field(rng, 128)
        before = img.copy()
        strokes = shapes._draw_distractors(rng, img, 6)
        painted = (img != before).any(-1)
        np.testing.assert_array_equal(strokes_mask(strokes, 128), painted)


# ----------------------------------------------------------------------------- determinism
def test_same_seed_same_bytes_other_seed_other_bytes(dataset, tmp_path):
    _generate(tmp_path / 'a')
    _generate(tmp_path / 'b', seed=SEED + 1)
    ref, same, other = (_bytes_digest(p) for p in (dataset, tmp_path / 'a', tmp_path / 'b'))
    n = sum(NUM.values())
    assert len(ref) == 2 * n + 4  # images, panoptic PNGs, 2 instance + 2 panoptic JSON
    assert same == ref
    assert other.keys() == ref.keys() and all(other[k] != ref[k] for k in ref)


def _pre_panoptic_module() -> ModuleType:
    src = subprocess.run(['git', '-C', str(REPO), 'show',
                          f'{PRE_PANOPTIC_COMMIT}:vitdet_plugin/datasets/shapes.py'],
                         capture_output=True, text=True, check=True).stdout
    spec = importlib.util.spec_from_loader('shapes_pre_panoptic', loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    exec(compile(src, 'shapes_pre_panoptic.py', 'exec'), module.__dict__)
    return module


def test_images_and_instances_unchanged_and_old_dataset_upgraded(dataset, tmp_path):
    old_root = tmp_path / 'old'
    try:
        old = _pre_panoptic_module()
    except (OSError, subprocess.CalledProcessError):  # no git history: the recorded digests
        old = None
    if old is not None:
        old.generate_dataset(str(old_root), seed=SEED, num_train=NUM['train'],
                             num_val=NUM['val'], spec=old.ShapesSpec(**vars(SPEC)),
                             progress=False)
        old_bytes = _bytes_digest(old_root)
        assert not any('panoptic' in k for k in old_bytes)
        new_bytes = _bytes_digest(dataset)
        assert {k: new_bytes[k] for k in old_bytes} == old_bytes  # byte-identical
    else:
        assert _content_digest(dataset) == PRE_PANOPTIC_DIGESTS
        shutil.copytree(dataset, old_root)
        for p in sorted(old_root.glob('annotations/panoptic_*')):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    # a dataset without panoptic files is upgraded in place, to exactly the new one
    assert _generate(old_root) == {'train': 'upgraded', 'val': 'upgraded'}
    assert _bytes_digest(old_root) == _bytes_digest(dataset)
    assert _generate(old_root) == {'train': 'exists', 'val': 'exists'}
    # an incomplete panoptic split (a PNG gone) is rewritten too
    (old_root / 'annotations/panoptic_val/000001.png').unlink()
    assert _generate(old_root) == {'train': 'exists', 'val': 'upgraded'}
    assert _bytes_digest(old_root) == _bytes_digest(dataset)
    # other seed: refused as before; images not drawn by this generator: no panoptic GT for them
    with pytest.raises(FileExistsError, match='overwrite=True'):
        _generate(old_root, seed=SEED + 1)
    (old_root / 'annotations/panoptic_train.json').unlink()
    cv2.imwrite(str(old_root / 'train/000002.png'), np.zeros((64, 64, 3), np.uint8))
    with pytest.raises(FileExistsError, match=r'000002\.png is not the image'):
        _generate(old_root)
    assert _generate(old_root, overwrite=True) == {'train': 'generated', 'val': 'generated'}
    assert _bytes_digest(old_root) == _bytes_digest(dataset)


# ----------------------------------------------------------------------------- mmdet
def _cfg(root: Path, thing_classes=None):
    from vitdet_plugin.config import load_config

    options: dict = {'data_root': str(root) + '/'}
    if thing_classes is not None:
        meta = dict(classes=panoptic_classes(thing_classes), thing_classes=tuple(thing_classes),
                    stuff_classes=STUFF_CLASSES)
        options.update({'train_dataloader.dataset.metainfo': meta,
                        'val_dataloader.dataset.metainfo': meta})
    return load_config(str(CONFIG), options)


def _expected_labels(root: Path, split: str, index: int) -> np.ndarray:
    """Label map in mmdet's order from the JSON + PNG: category id - 1."""
    ann = _load(root, split, 'panoptic')['annotations'][index]
    ids = _pan_ids(root, split, ann['file_name'])
    labels = np.full(ids.shape, 255)
    for s in ann['segments_info']:
        labels[ids == s['id']] = s['category_id'] - 1
    return labels


def test_config_paths_follow_data_root(dataset):
    cfg = _cfg(dataset)
    root = str(dataset) + '/'
    pan, coco, sem = cfg.val_evaluator
    assert sem.type == 'SemSegMetric'
    assert pan.ann_file == root + 'annotations/panoptic_val.json'
    assert pan.seg_prefix == root + 'annotations/panoptic_val/'
    assert coco.ann_file == root + 'annotations/instances_val.json'
    for loader in (cfg.train_dataloader, cfg.val_dataloader):
        assert loader.dataset.data_root == root
    for path in (pan.ann_file, pan.seg_prefix, coco.ann_file):
        assert Path(path).exists()


def test_mmdet_panoptic_dataset_and_pipeline(dataset):
    from mmdet.registry import DATASETS

    cfg = _cfg(dataset)
    t = len(SPEC.classes)
    assert cfg.metainfo['classes'] == panoptic_classes(SPEC.classes)
    for split, loader in (('val', cfg.val_dataloader), ('train', cfg.train_dataloader)):
        ds = DATASETS.build(loader.dataset)
        assert len(ds) == NUM[split]
        assert ds.metainfo['classes'] == panoptic_classes(SPEC.classes)
        inst = _load(dataset, split, 'instances')
        for k in range(len(ds)):
            sample = ds[k]['data_samples']
            sem = sample.gt_sem_seg.sem_seg[0].numpy()
            labels = sample.gt_instances.labels.tolist()
            want_labels = [a['category_id'] - 1 for a in inst['annotations']
                           if a['image_id'] == sample.img_id]
            assert labels == want_labels
            if split == 'val':  # no augmentation: exact maps at the original size
                expected = _expected_labels(dataset, split, sample.img_id - 1)
                np.testing.assert_array_equal(sem, expected)
                masks = sample.gt_instances.masks.masks.astype(bool)
                objects = render_scene(image_rng(SEED, split, sample.img_id - 1), SPEC).objects
                np.testing.assert_array_equal(masks, np.stack([o.mask for o in objects]))
            else:  # resized to 256 and maybe flipped: the same labels, things and stuff
                assert sem.shape == (256, 256)
            present = set(np.unique(sem).tolist())
            assert t + 1 in present  # background, and no void
            assert 255 not in present and present <= set(range(t + 2))
            assert set(labels) <= present


def _perfect_predictions(sample) -> dict:
    """The ground truth of one packed sample as a panoptic + instance + semantic prediction."""
    from mmdet.evaluation.functional import INSTANCE_OFFSET
    from mmengine.structures import InstanceData, PixelData

    sem = sample.gt_sem_seg.sem_seg.clone()  # (1, H, W) labels
    pan = sem.clone().long()
    masks = torch.from_numpy(sample.gt_instances.masks.masks.astype(bool))
    for k, (mask, label) in enumerate(zip(masks, sample.gt_instances.labels)):
        pan[0][mask] = int(label) + (k + 1) * INSTANCE_OFFSET
    sample.pred_panoptic_seg = PixelData(sem_seg=pan)
    sample.pred_sem_seg = PixelData(sem_seg=sem)
    sample.pred_instances = InstanceData(
        bboxes=sample.gt_instances.bboxes.tensor if hasattr(sample.gt_instances.bboxes, 'tensor')
        else sample.gt_instances.bboxes,
        labels=sample.gt_instances.labels, scores=torch.ones(len(masks)), masks=masks)
    return sample.to_dict()


def test_metrics_score_ground_truth_perfectly(dataset):
    """The config's CocoPanopticMetric (PQ), CocoMetric on the instance JSON and SemSegMetric
    (mIoU) on the ground truth fed back as predictions."""
    from mmdet.registry import DATASETS
    from mmengine.evaluator import Evaluator

    cfg = _cfg(dataset)
    ds = DATASETS.build(cfg.val_dataloader.dataset)
    evaluator = Evaluator(cfg.val_evaluator)
    evaluator.dataset_meta = ds.metainfo
    for k in range(len(ds)):
        evaluator.process(data_samples=[_perfect_predictions(ds[k]['data_samples'])])
    res = evaluator.evaluate(len(ds))
    assert res['coco_panoptic/PQ'] == pytest.approx(100.0)
    assert res['coco_panoptic/PQ_th'] == pytest.approx(100.0)
    assert res['coco_panoptic/PQ_st'] == pytest.approx(100.0)
    assert res['coco/bbox_mAP'] == pytest.approx(1.0)
    assert res['coco/segm_mAP'] == pytest.approx(1.0)
    assert res['mIoU'] == pytest.approx(100.0)


def test_other_classes_and_image_size_via_cli(tmp_path):
    """make_shapes.py options reach the categories, the PNGs and mmdet's label maps."""
    import sys
    sys.path.insert(0, str(REPO / 'tools'))
    try:
        import make_shapes
    finally:
        sys.path.remove(str(REPO / 'tools'))
    from mmdet.registry import DATASETS

    classes = ('star', 'circle')
    make_shapes.main(['--out', str(tmp_path), '--seed', '11', '--image-size', '96',
                      '--classes', *classes, '--objects', '2', '3', '--object-size', '10', '40',
                      '--num-train', '2', '--num-val', '2', '--quiet'])
    pan = _load(tmp_path, 'val', 'panoptic')
    assert [(c['id'], c['name'], c['isthing']) for c in pan['categories']] == \
        [(1, 'star', 1), (2, 'circle', 1), (3, 'lines', 0), (4, 'background', 0)]
    spec = ShapesSpec(image_size=96, classes=classes, objects=(2, 3), object_size=(10, 40))
    for i, ann in enumerate(pan['annotations']):
        ids = _pan_ids(tmp_path, 'val', ann['file_name'])
        assert ids.shape == (96, 96) and 0 not in ids
        objects = render_scene(image_rng(11, 'val', i), spec).objects
        things = [s for s in ann['segments_info'] if s['category_id'] <= 2]
        assert [s['category_id'] for s in things] == [o.label + 1 for o in objects]
        for s, o in zip(things, objects):
            np.testing.assert_array_equal(ids == s['id'], o.mask)
    cfg = _cfg(tmp_path, thing_classes=classes)
    ds = DATASETS.build(cfg.val_dataloader.dataset)
    for k in range(len(ds)):
        sample = ds[k]['data_samples']
        np.testing.assert_array_equal(sample.gt_sem_seg.sem_seg[0].numpy(),
                                      _expected_labels(tmp_path, 'val', k))
        assert set(sample.gt_instances.labels.tolist()) <= {0, 1}


def test_semseg_metric_needs_pred_sem_seg(dataset):
    """What the config says: SemSegMetric reads `pred_sem_seg`, which mmdet 3.3's own panoptic
    models do not write (they give pred_panoptic_seg / pred_instances); without it it raises."""
    from mmdet.registry import DATASETS, METRICS

    cfg = _cfg(dataset)
    ds = DATASETS.build(cfg.val_dataloader.dataset)
    metric = METRICS.build(cfg.val_evaluator[2])
    metric.dataset_meta = ds.metainfo
    sample = _perfect_predictions(ds[0]['data_samples'])
    del sample['pred_sem_seg']
    with pytest.raises(KeyError, match='pred_sem_seg'):
        metric.process({}, [sample])
