"""D-FINE's / DEIMv2's batch augments (their collate function's MixUp, Copy-Blend and
multi-scale) by the recipes' documented behaviour: the multi-scale sides and torch's default
(nearest) ``F.interpolate``; MixUp's ``beta`` mix with the previous image and the joined
boxes; Copy-Blend's pool, blend weights, growth, box and the epoch windows; drawn over many
seeded batches where the behaviour is a chance."""
import random
from typing import List, Tuple

import pytest
import torch
import torch.nn.functional as F
from mmdet.structures import DetDataSample
from mmdet.structures.bbox import HorizontalBoxes
from mmengine.logging import MessageHub
from mmengine.structures import InstanceData

from vitdet_plugin.datasets.deim_batch_augments import (DEIMBatchMix, DEIMBatchScale,
                                                        dfine_scales)

SIDE = 32


@pytest.fixture(autouse=True)
def _epoch_zero():
    yield
    _at_epoch(0)


def _at_epoch(epoch: int) -> None:
    MessageHub.get_current_instance().update_info('epoch', epoch)


def _samples(boxes: List[List[List[float]]], shape: Tuple[int, int] = (SIDE, SIDE)
             ) -> List[DetDataSample]:
    out = []
    for i, image_boxes in enumerate(boxes):
        sample = DetDataSample(metainfo=dict(img_shape=shape, pad_shape=shape,
                                             batch_input_shape=shape))
        sample.gt_instances = InstanceData(
            bboxes=HorizontalBoxes(torch.tensor(image_boxes, dtype=torch.float32).view(-1, 4)),
            labels=torch.arange(len(image_boxes)) + 10 * i)
        sample.ignored_instances = InstanceData(
            bboxes=HorizontalBoxes(torch.tensor([[1., 1., 3., 3.]]) + i), labels=torch.tensor([i]))
        out.append(sample)
    return out


BATCH_BOXES = [[[2., 2., 20., 20.]], [[4., 6., 30., 31.], [1., 1., 5., 5.]], [], [[0., 0., 9., 9.]]]


def test_dfine_scales_are_the_recipes():
    with pytest.raises(ValueError, match=r'base_size=40 has no multi-scale side: the smallest '
                                         r'would be 0 px; use base_size >= 43'):
        dfine_scales(40, 3)
    assert dfine_scales(48, 2) == [48, 48]  # 0.75 x 48 rounds down to 32 = 1.25 x 48's
    assert dfine_scales(640, 3) == [480, 512, 544, 576, 608, 640, 640, 640,
                                    800, 768, 736, 704, 672]
    s20 = dfine_scales(640, 20)
    assert len(s20) == 30 and s20.count(640) == 20 and sorted(set(s20)) == list(range(480, 801, 32))


def test_batch_scale_is_a_nearest_resize_of_the_batch_with_its_boxes():
    _at_epoch(3)
    scale = DEIMBatchScale(base_size=640, base_size_repeat=3, stop_epoch=4)
    inputs = torch.randn(2, 3, 64, 48)
    random.seed(0)
    sides = []
    for _ in range(60):
        out, samples = scale(inputs, _samples(BATCH_BOXES[:2], shape=(64, 48)))
        side = out.shape[-1]
        sides.append(side)
        torch.testing.assert_close(out, F.interpolate(inputs, size=side), rtol=0, atol=0)
        sx, sy = side / 48, side / 64
        torch.testing.assert_close(samples[1].gt_instances.bboxes.tensor,
                                   torch.tensor([[4. * sx, 6 * sy, 30 * sx, 31 * sy],
                                                 [1 * sx, 1 * sy, 5 * sx, 5 * sy]]))
        torch.testing.assert_close(samples[0].ignored_instances.bboxes.tensor,
                                   torch.tensor([[sx, sy, 3 * sx, 3 * sy]]))
        assert samples[0].img_shape == samples[0].batch_input_shape == (side, side)
    assert set(sides) == set(dfine_scales(640, 3))
    assert 0.1 < sides.count(640) / len(sides) < 0.4                   # 3 of 13 sides
    _at_epoch(4)
    still, _ = scale(inputs, _samples(BATCH_BOXES[:2]))
    assert still is inputs


def _beta(out: torch.Tensor, own: torch.Tensor, other: torch.Tensor) -> float:
    """The weight ``b`` with ``out = b * own + (1 - b) * other`` (least squares)."""
    diff = own - other
    return float(((out - other) * diff).sum() / (diff * diff).sum())


def test_mixup_mixes_each_image_with_the_previous_and_joins_their_boxes():
    _at_epoch(5)
    mix = DEIMBatchMix(mixup_prob=1.0, mixup_epochs=(4, 29))
    inputs = torch.randn(4, 3, SIDE, SIDE)
    random.seed(0)
    out, samples = mix(inputs.clone(), _samples(BATCH_BOXES))
    beta = _beta(out[0], inputs[0], inputs[3])
    assert 0.45 <= beta <= 0.55
    torch.testing.assert_close(out, beta * inputs + (1 - beta) * inputs.roll(1, 0))
    for i, sample in enumerate(samples):
        own, prev = BATCH_BOXES[i], BATCH_BOXES[i - 1]
        assert sample.gt_instances.bboxes.tensor.tolist() == own + prev
        assert sample.gt_instances.labels.tolist() == (
            [10 * i + k for k in range(len(own))] + [10 * ((i - 1) % 4) + k
                                                     for k in range(len(prev))])
        assert sample.ignored_instances.labels.tolist() == [i, (i - 1) % 4]


@pytest.mark.parametrize('epoch', [3, 29])
def test_mixup_only_in_its_epochs(epoch):
    _at_epoch(epoch)
    inputs = torch.randn(2, 3, SIDE, SIDE)
    out, samples = DEIMBatchMix(mixup_prob=1.0, mixup_epochs=(4, 29))(
        inputs, _samples(BATCH_BOXES[:2]))
    assert out is inputs and len(samples[0].gt_instances) == 1


def test_mixup_chance_and_copy_blend_only_without_it():
    """mixup 0.5, Copy-Blend 1.0: half the batches mixed up, the others blended; after the
    MixUp epochs every batch is blended."""
    mix = DEIMBatchMix(mixup_prob=0.5, mixup_epochs=(4, 29), copyblend_prob=1.0,
                       copyblend_epochs=(4, 50), num_objects=1)
    random.seed(0)
    counts = []
    for epoch in [10] * 200 + [30] * 20:
        _at_epoch(epoch)
        _, samples = mix(torch.zeros(2, 3, SIDE, SIDE), _samples(BATCH_BOXES[:2]))
        counts.append(len(samples[0].gt_instances))     # 1 own + 1 (MixUp: 2 of image 1)
    assert set(counts[200:]) == {2}                     # Copy-Blend: 1 object added
    mixed = counts[:200].count(3)
    assert 80 < mixed < 120 and counts[:200].count(2) == 200 - mixed


def _blend_batch() -> Tuple[torch.Tensor, List[DetDataSample]]:
    """Image 0: background 1, one object (12 x 10, value 5); image 1: background -2 and an
    object of 25 px (under the threshold): the pool is image 0's object."""
    inputs = torch.empty(2, 3, SIDE, SIDE)
    inputs[0] = 1.0
    inputs[0, :, 4:14, 4:16] = 5.0
    inputs[1] = -2.0
    return inputs, _samples([[[4., 4., 16., 14.]], [[20., 20., 25., 25.]]])


def _changed(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """(H, W) mask of the pixels that changed in any channel."""
    return (before != after).any(dim=0)


def test_copy_blend_blends_the_pools_object_at_a_random_place():
    _at_epoch(10)
    blend = DEIMBatchMix(copyblend_prob=1.0, copyblend_epochs=(4, 50), area_threshold=100,
                         num_objects=3)
    random.seed(0)
    places = set()
    for _ in range(20):
        inputs, samples = _blend_batch()
        out, samples = blend(inputs.clone(), samples)
        gt = samples[1].gt_instances
        assert gt.labels.tolist() == [10, 0]            # own, then image 0's object
        x1, y1, x2, y2 = (int(v) for v in gt.bboxes.tensor[-1].tolist())
        assert (x2 - x1, y2 - y1) == (12, 10) and 0 <= x1 <= SIDE - 12 and 0 <= y1 <= SIDE - 10
        places.add((x1, y1))
        region = torch.zeros(SIDE, SIDE, dtype=torch.bool)
        region[y1:y2, x1:x2] = True
        assert torch.equal(_changed(inputs[1], out[1]), region)
        beta = _beta(out[1, :, y1:y2, x1:x2], inputs[1, :, y1:y2, x1:x2],
                     torch.full((3, 10, 12), 5.0))
        assert 0.45 <= beta <= 0.55
        torch.testing.assert_close(out[1, :, y1:y2, x1:x2],
                                   torch.full((3, 10, 12), beta * -2 + (1 - beta) * 5))
        assert samples[0].gt_instances.labels.tolist() == [0, 0]
    assert len(places) > 10


def test_copy_blend_grows_the_blended_region_not_the_box():
    """expand_ratios (0.1, 0.25): up to int(0.25 x 12) = 3 px left and right, 2 above and below
    of the source's surroundings (background 1) come along; the new box is the object's."""
    _at_epoch(10)
    blend = DEIMBatchMix(copyblend_prob=1.0, copyblend_epochs=(4, 50), num_objects=1,
                         expand_ratios=(0.1, 0.25))
    random.seed(1)
    grown = 0
    for _ in range(20):
        inputs, samples = _blend_batch()
        out, samples = blend(inputs.clone(), samples)
        x1, y1, x2, y2 = (int(v) for v in samples[1].gt_instances.bboxes.tensor[-1].tolist())
        assert (x2 - x1, y2 - y1) == (12, 10)
        changed = _changed(inputs[1], out[1])
        ys, xs = torch.nonzero(changed, as_tuple=True)
        assert changed[y1:y2, x1:x2].all()
        assert x1 - 3 <= xs.min() and xs.max() < x2 + 3 and y1 - 2 <= ys.min() and ys.max() < y2 + 2
        beta = _beta(out[1, :, y1:y2, x1:x2], inputs[1, :, y1:y2, x1:x2],
                     torch.full((3, 10, 12), 5.0))
        ring = changed.clone()
        ring[y1:y2, x1:x2] = False
        torch.testing.assert_close(out[1][:, ring], torch.full_like(out[1][:, ring],
                                                                    beta * -2 + (1 - beta) * 1))
        grown += int(ring.sum()) > 0
    assert grown > 15


def test_copy_blend_without_a_pool_leaves_the_batch():
    _at_epoch(10)
    inputs = torch.randn(2, 3, SIDE, SIDE)
    out, samples = DEIMBatchMix(copyblend_prob=1.0, copyblend_epochs=(4, 50))(
        inputs, _samples([[[0., 0., 9., 9.]], []]))            # 81 px < 100
    assert out is inputs and len(samples[0].gt_instances) == 1


def test_batch_augments_run_in_mmdets_data_preprocessor_on_packed_samples():
    """PackDetInputs' samples through DetDataPreprocessor with the recipe's batch augments:
    MixUp joins the boxes, the multi-scale resizes the batch and them (training only)."""
    import numpy as np
    from mmdet.datasets.transforms import PackDetInputs
    from mmdet.registry import MODELS
    from mmengine.registry import init_default_scope
    init_default_scope('mmdet')
    _at_epoch(5)
    preprocessor = MODELS.build(dict(
        type='DetDataPreprocessor', mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375],
        bgr_to_rgb=True, batch_augments=[
            dict(type='DEIMBatchMix', mixup_prob=1.0, mixup_epochs=(4, 64)),
            dict(type='DEIMBatchScale', base_size=2 * SIDE, base_size_repeat=0, stop_epoch=120)]))
    pack = PackDetInputs()
    rng = np.random.default_rng(0)
    data = [pack(dict(img=rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8),
                      img_shape=(SIDE, SIDE), ori_shape=(SIDE, SIDE), scale_factor=(1., 1.),
                      img_id=i, img_path='', gt_bboxes=HorizontalBoxes(torch.tensor(b).view(-1, 4)),
                      gt_bboxes_labels=np.arange(len(b)), gt_ignore_flags=np.zeros(len(b), bool)))
            for i, b in enumerate(([[2., 2., 20., 20.]], [[4., 6., 30., 31.]]))]
    batch = preprocessor(dict(inputs=[d['inputs'] for d in data],
                              data_samples=[d['data_samples'] for d in data]), training=True)
    side = batch['inputs'].shape[-1]
    assert side in dfine_scales(2 * SIDE, 0) == [SIDE, 2 * SIDE]
    assert batch['inputs'].shape[-2] == side
    boxes = batch['data_samples'][1].gt_instances.bboxes    # a tensor (boxtype2tensor)
    torch.testing.assert_close(boxes, torch.tensor([[4., 6., 30., 31.], [2., 2., 20., 20.]])
                               * side / SIDE)
    assert batch['data_samples'][1].img_shape == (side, side)
    plain = preprocessor(dict(inputs=[d['inputs'] for d in data],
                              data_samples=[d['data_samples'] for d in data]), training=False)
    assert plain['inputs'].shape[-1] == SIDE
