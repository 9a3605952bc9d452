"""D-FINE's / DEIMv2's per-image augmentations against the recipes' ops: torchvision v2's
transforms on PIL RGB images (what the recipes run), on the same image, boxes and torch draws;
mmdet's own transforms where the recipes' table maps an op to one; DEIMv2's Mosaic by its
documented behaviour (grid, cache, one RandomAffine of the grid)."""
from types import SimpleNamespace
from typing import Dict, Tuple

import numpy as np
import PIL.Image
import pytest
import torch
import torchvision.transforms.v2 as T
import torchvision.transforms.v2.functional as TF
from mmcv.transforms import Compose
from mmdet.datasets.transforms import Expand, RandomFlip, Resize
from mmdet.engine.hooks import PipelineSwitchHook
from mmdet.structures.bbox import HorizontalBoxes
from mmengine.registry import init_default_scope
from torchvision import tv_tensors

from vitdet_plugin.datasets.deim_transforms import (DEIMClipBoxes, DEIMMosaic,
                                                    DEIMPhotometricDistort, DEIMRandomIoUCrop,
                                                    DEIMSanitizeBoxes)

H, W = 48, 64
BOXES = [[4., 6., 30., 40.], [34., 2., 62., 20.], [20., 24., 50., 46.], [40., 30., 43., 33.]]
SEEDS = range(12)


def _sample(seed: int = 0, boxes=BOXES) -> dict:
    """mmdet's results after LoadImageFromFile + LoadAnnotations: BGR uint8, hbox boxes."""
    rng = np.random.default_rng(seed)
    n = len(boxes)
    return dict(img=rng.integers(0, 256, (H, W, 3), dtype=np.uint8), img_shape=(H, W),
                gt_bboxes=HorizontalBoxes(torch.tensor(boxes, dtype=torch.float32).view(-1, 4)),
                gt_bboxes_labels=np.arange(10, 10 + n), gt_ignore_flags=np.arange(n) % 2 == 1)


def _official(results: dict) -> Tuple[PIL.Image.Image, Dict[str, torch.Tensor]]:
    """The same sample as the recipes hold it: RGB PIL image, XYXY BoundingBoxes, labels."""
    image = PIL.Image.fromarray(np.ascontiguousarray(results['img'][..., ::-1]))
    boxes = tv_tensors.BoundingBoxes(results['gt_bboxes'].tensor, format='XYXY',
                                     canvas_size=results['img'].shape[:2])
    return image, {'boxes': boxes, 'labels': torch.as_tensor(results['gt_bboxes_labels'])}


def _assert_same(ours: dict, image: PIL.Image.Image, target: Dict[str, torch.Tensor]) -> None:
    np.testing.assert_array_equal(ours['img'][..., ::-1], np.asarray(image))
    assert ours['img_shape'] == (image.height, image.width)
    torch.testing.assert_close(ours['gt_bboxes'].tensor, target['boxes'].as_subclass(torch.Tensor))
    np.testing.assert_array_equal(ours['gt_bboxes_labels'], target['labels'].numpy())
    # the ignore flags followed the labels (label 10 + k had flag k % 2)
    np.testing.assert_array_equal(ours['gt_ignore_flags'], (ours['gt_bboxes_labels'] - 10) % 2)


def test_photometric_distort_is_torchvisions_on_the_rgb_image():
    changed = 0
    for seed in SEEDS:
        torch.manual_seed(seed)
        ours = DEIMPhotometricDistort(p=0.5)(_sample(seed))
        image, target = _official(_sample(seed))
        torch.manual_seed(seed)
        ref = T.RandomPhotometricDistort(p=0.5)(image)
        _assert_same(ours, ref, target)
        changed += not np.array_equal(ours['img'], _sample(seed)['img'])
    assert changed >= len(SEEDS) - 2  # five distortions of chance 0.5: 1 / 32 keep every pixel
    unchanged = DEIMPhotometricDistort(p=0.0)(_sample())
    np.testing.assert_array_equal(unchanged['img'], _sample()['img'])


@pytest.mark.parametrize('p', [0.8, 1.0])
def test_iou_crop_is_torchvisions_behind_the_recipes_gate(p):
    """Ours (boxes with a centre outside the crop dropped) then the sanitiser == the recipes'
    ``if torch.rand(1) >= p: skip`` + RandomIoUCrop + SanitizeBoundingBoxes(min_size=1)."""
    cropped = 0
    for seed in SEEDS:
        torch.manual_seed(seed)
        ours = DEIMSanitizeBoxes(min_size=1)(DEIMRandomIoUCrop(p=p)(_sample(seed)))
        image, target = _official(_sample(seed))
        torch.manual_seed(seed)
        if torch.rand(1) < p:
            image, target = T.RandomIoUCrop()(image, target)
        image, target = T.SanitizeBoundingBoxes(min_size=1)(image, target)
        _assert_same(ours, image, target)
        cropped += ours['img_shape'] != (H, W)
    assert 0 < cropped < len(SEEDS)  # the sampler's 1.0 option (and 1 - p) leave it whole


def test_iou_crop_drops_the_boxes_whose_centre_leaves_the_crop():
    for seed in SEEDS:
        torch.manual_seed(seed)
        out = DEIMRandomIoUCrop()(_sample(seed))
        h, w = out['img_shape']
        boxes = out['gt_bboxes'].tensor
        assert len(boxes) == len(out['gt_bboxes_labels']) == len(out['gt_ignore_flags']) >= 1
        assert (boxes >= 0).all() and (boxes[:, 0::2] <= w).all() and (boxes[:, 1::2] <= h).all()
        assert (boxes[:, 2:] > boxes[:, :2]).all()


def test_images_without_boxes_pass_every_transform():
    """The recipes train on COCO images without annotations too (filter_empty_gt=False): the
    IoU crop finds no crop with a box centre inside and keeps the image."""
    for transform in (DEIMClipBoxes(), DEIMPhotometricDistort(), DEIMRandomIoUCrop(),
                      DEIMSanitizeBoxes(), DEIMMosaic(output_size=24)):
        out = transform(_sample(0, boxes=[]))
        assert len(out['gt_bboxes']) == len(out['gt_bboxes_labels']) == 0
    assert DEIMRandomIoUCrop()(_sample(0, boxes=[]))['img_shape'] == (H, W)


@pytest.mark.parametrize('min_size', [1, 12])
def test_sanitize_is_torchvisions(min_size):
    boxes = BOXES + [[-1., 5., 10., 10.], [60., 5., 65., 9.], [5., 5., 5.5, 30.], [8., 8., 8., 9.]]
    ours = DEIMSanitizeBoxes(min_size=min_size)(_sample(0, boxes))
    image, target = T.SanitizeBoundingBoxes(min_size=min_size)(*_official(_sample(0, boxes)))
    _assert_same(ours, image, target)
    assert len(ours['gt_bboxes']) == (4 if min_size == 1 else 3)


def test_clip_boxes_clamps_to_the_image_as_the_recipes_loader():
    boxes = [[-3., 5., 70., 20.], [10., -2., 20., 50.]]
    out = DEIMClipBoxes()(_sample(0, boxes))
    expected = TF.clamp_bounding_boxes(_official(_sample(0, boxes))[1]['boxes'])
    torch.testing.assert_close(out['gt_bboxes'].tensor, expected.as_subclass(torch.Tensor))


def test_transforms_refuse_masks_and_non_box_types():
    with pytest.raises(ValueError, match=r'handle boxes only, not gt_masks: load the '
                                         r'annotations with LoadAnnotations\(with_mask=False\)'):
        DEIMSanitizeBoxes()(dict(_sample(), gt_masks=None))
    with pytest.raises(TypeError, match=r'need gt_bboxes as mmdet HorizontalBoxes, got ndarray'):
        DEIMSanitizeBoxes()(dict(_sample(), gt_bboxes=np.zeros((0, 4), np.float32)))
    with pytest.raises(TypeError, match=r'need the \(H, W, 3\) uint8 image of LoadImageFromFile, '
                                        r'got float32'):
        DEIMPhotometricDistort()(dict(_sample(), img=np.zeros((H, W, 3), np.float32)))


def test_expand_is_torchvisions_zoom_out():
    """mmdet's Expand(mean 0, ratio 1-4, prob 0.5) == RandomZoomOut(fill=0): one chance 0.5,
    canvas int(side x r) for r uniform in [1, 4], offset uniform; given the placement Expand
    drew, torchvision's zoom-out kernel (pad) gives the same pixels and boxes."""
    expand = Expand(mean=(0, 0, 0), to_rgb=False, ratio_range=(1, 4), prob=0.5)
    np.random.seed(0)
    ratios = []
    for seed in range(200):
        ours = expand(_sample(seed % 3))
        if ours['img_shape'] == (H, W):
            continue
        canvas_h, canvas_w = ours['img_shape']
        left, top = (ours['gt_bboxes'].tensor[0, :2] - torch.tensor(BOXES[0][:2])).int().tolist()
        image, target = _official(_sample(seed % 3))
        padding = [left, top, canvas_w - W - left, canvas_h - H - top]
        ref_image = TF.pad(image, padding, fill=0)
        ref_boxes = TF.pad(target['boxes'], padding)
        _assert_same(ours, ref_image, {'boxes': ref_boxes, 'labels': target['labels']})
        ratios.append(canvas_w / W)
    assert 70 < len(ratios) < 130                               # chance 0.5 in 200 draws
    assert 1 <= min(ratios) < 1.3 and 3.7 < max(ratios) <= 4


def test_flip_and_pillow_resize_are_torchvisions():
    """The recipes' RandomHorizontalFlip and Resize([s, s]) on a PIL image == mmdet's RandomFlip
    and Resize(keep_ratio=False, backend='pillow'); OpenCV's resize (mmdet's default) is not."""
    flipped = RandomFlip(prob=1.0)(_sample())
    image, target = _official(_sample())
    _assert_same(flipped, *T.RandomHorizontalFlip(p=1.0)(image, target))
    for side in (32, 80):
        resized = Resize(scale=(side, side), keep_ratio=False, backend='pillow')(_sample())
        _assert_same(resized, *T.Resize((side, side))(*_official(_sample())))
    pillow = Resize(scale=(32, 32), keep_ratio=False, backend='pillow')(_sample())
    cv2 = Resize(scale=(32, 32), keep_ratio=False)(_sample())
    assert not np.array_equal(cv2['img'], pillow['img'])


def _identity_mosaic(**kwargs) -> DEIMMosaic:
    return DEIMMosaic(output_size=24, translation_range=(0, 0), scaling_range=(1, 1), **kwargs)


def test_mosaic_grid_of_resized_cached_images():
    """The first mosaic has a cache of one: the image (shortest side 24, torchvision's PIL
    resize) in all four cells of a 2 x 2 grid, each at its top-left corner."""
    out = _identity_mosaic(fill_value=0)(_sample(1))
    image, target = T.Resize(24)(*_official(_sample(1)))
    cell = np.asarray(image)                                     # (24, 32, 3) RGB
    np.testing.assert_array_equal(out['img'][..., ::-1], np.tile(cell, (2, 2, 1)))
    shifts = torch.tensor([[0, 0, 0, 0], [32, 0, 32, 0], [0, 24, 0, 24], [32, 24, 32, 24]])
    expected = (target['boxes'].as_subclass(torch.Tensor)[None] + shifts[:, None]).view(-1, 4)
    torch.testing.assert_close(out['gt_bboxes'].tensor, expected.float())
    np.testing.assert_array_equal(out['gt_bboxes_labels'], np.tile(_sample()['gt_bboxes_labels'],
                                                                   4))
    assert out['img_shape'] == (48, 64)


def test_mosaic_cells_take_the_largest_width_and_height():
    """A tall image (resized to 32 x 24) after a wide one (24 x 32): the grid's cells are as
    wide as the widest drawn and as high as the highest; the new image fills the top-left
    cell from its corner, black to its right when a wide one was drawn."""
    def tall():
        return dict(_sample(1), img=_sample(1)['img'].transpose(1, 0, 2).copy(), img_shape=(W, H))

    resized_tall = np.asarray(T.Resize(24)(_official(tall())[0]))[..., ::-1]  # (32, 24, 3)
    shapes = set()
    for seed in range(6):
        mosaic = _identity_mosaic(fill_value=0)
        mosaic(_sample(0))
        np.random.seed(seed)
        out = mosaic(tall())
        shapes.add(out['img_shape'])
        np.testing.assert_array_equal(out['img'][:32, :24], resized_tall)
        if out['img_shape'] == (64, 64):
            assert (out['img'][:32, 24:32] == 0).all()
    assert shapes == {(64, 64), (64, 48)}


def test_mosaic_affine_is_torchvisions_random_affine_of_the_grid():
    recipe = DEIMMosaic(output_size=24, rotation_range=10, fill_value=0)
    identity = _identity_mosaic(fill_value=0)
    for seed in range(4):
        np.random.seed(seed)
        torch.manual_seed(seed)
        ours = recipe(_sample(seed))
        np.random.seed(seed)
        grid = identity(_sample(seed))
        torch.manual_seed(seed)
        ref = T.RandomAffine(degrees=10, translate=(0.1, 0.1), scale=(0.5, 1.5), fill=0)(
            *_official(grid))
        _assert_same(ours, *ref)


def test_mosaic_cache_evicts_as_deimv2():
    oldest_first = _identity_mosaic(max_cached_images=2, random_pop=False)
    for seed in range(3):
        oldest_first(_sample(seed))
    assert [entry['img'].tolist() for entry in oldest_first.cache] == [
        np.asarray(T.Resize(24)(_official(_sample(seed))[0])).tolist() for seed in (1, 2)]
    random_pop = _identity_mosaic(max_cached_images=3)
    np.random.seed(0)
    for seed in range(20):
        random_pop(_sample(seed))
        assert len(random_pop.cache) == min(seed + 1, 3)
        assert np.array_equal(random_pop.cache[-1]['img'],
                              np.asarray(T.Resize(24)(_official(_sample(seed))[0])))
    with pytest.raises(ValueError, match=r'max_cached_images=1: the cache must hold the new '
                                         r'image and one other; use 2 or more \(DEIMv2: 50\)'):
        DEIMMosaic(max_cached_images=1)


def test_mosaic_prob_zero_leaves_the_sample():
    out = DEIMMosaic(prob=0.0)(_sample())
    np.testing.assert_array_equal(out['img'], _sample()['img'])
    assert len(out['gt_bboxes']) == len(BOXES)


#: DEIMv2's pipeline in its mosaic stage (the report's recipe, at a small size): a mosaic with
#: chance 0.5 instead of the zoom-out and IoU crop.
_PHOTO = dict(type='DEIMPhotometricDistort', p=0.5)
MOSAIC_STAGE = [
    dict(type='DEIMClipBoxes'),
    dict(type='RandomChoice', prob=[0.5, 0.5], transforms=[
        [dict(type='DEIMMosaic', output_size=24, rotation_range=10, fill_value=0), _PHOTO],
        [_PHOTO, dict(type='Expand', mean=(0, 0, 0), to_rgb=False, ratio_range=(1, 4), prob=0.5),
         dict(type='DEIMRandomIoUCrop', p=0.8)]]),
    dict(type='DEIMSanitizeBoxes', min_size=1),
    dict(type='RandomFlip', prob=0.5),
    dict(type='Resize', scale=(40, 40), keep_ratio=False, backend='pillow'),
    dict(type='DEIMSanitizeBoxes', min_size=1),
]


def test_recipe_pipeline_builds_and_keeps_instances_consistent():
    init_default_scope('mmdet')
    pipeline = Compose(MOSAIC_STAGE)
    np.random.seed(0)
    for seed in range(8):
        out = pipeline(_sample(seed))
        n = len(out['gt_bboxes'])
        assert out['img'].shape == (40, 40, 3) and out['img_shape'] == (40, 40)
        assert len(out['gt_bboxes_labels']) == len(out['gt_ignore_flags']) == n
        boxes = out['gt_bboxes'].tensor
        assert (boxes >= 0).all() and (boxes <= 40).all()
        assert ((boxes[:, 2:] - boxes[:, :2]) >= 1).all()


def test_pipeline_switch_hooks_give_deimv2s_stages_also_on_resume():
    """One mmdet PipelineSwitchHook per stage change (the recipe's policy epochs 4, 64, 120):
    the stage of any epoch, also when training resumes there."""
    init_default_scope('mmdet')
    stages = {4: 'mosaic', 64: 'aug', 120: 'plain'}

    def run(first_epoch, last_epoch):
        hooks = [PipelineSwitchHook(epoch, [dict(type='DEIMSanitizeBoxes', min_size=epoch)])
                 for epoch in stages]
        loader = SimpleNamespace(dataset=SimpleNamespace(pipeline='plain-start'))
        logger = SimpleNamespace(info=lambda msg: None)
        seen = {}
        for epoch in range(first_epoch, last_epoch):
            runner = SimpleNamespace(epoch=epoch, train_dataloader=loader, logger=logger)
            for hook in hooks:
                hook.before_train_epoch(runner)
            pipeline = loader.dataset.pipeline
            seen[epoch] = pipeline if isinstance(pipeline, str) else stages[
                pipeline.transforms[0].min_size]
        return seen

    full = run(0, 132)
    assert [full[e] for e in (0, 3, 4, 63, 64, 119, 120, 131)] == [
        'plain-start', 'plain-start', 'mosaic', 'mosaic', 'aug', 'aug', 'plain', 'plain']
    assert run(70, 72) == {70: 'aug', 71: 'aug'}
    assert run(125, 126) == {125: 'plain'}
