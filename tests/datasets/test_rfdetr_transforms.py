"""RF-DETR's resizes (vitdet_plugin/datasets/rfdetr_transforms.py) against the ``rfdetr`` package
(1.11.2) as the oracle: the training scales against ``compute_multi_scale_scales``, the pixels
against torchvision's ``resize`` of a tensor (what ``RFDETR.predict`` and rfdetr's training
transforms call), the square crop against ``RandomSizedCrop``'s side rule, and the per-batch scale
against rfdetr's own ``on_train_batch_start`` (its source, run without PyTorch Lightning) on the
same batch and optimizer steps. Tiny arrays: the file runs in seconds."""
import ast
import importlib.util
import os.path as osp
import random
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF
from mmdet.datasets.transforms import Resize
from mmdet.structures import DetDataSample
from mmdet.structures.bbox import HorizontalBoxes
from mmdet.structures.mask import BitmapMasks
from mmengine.logging import MessageHub
from mmengine.structures import InstanceData

from vitdet_plugin.datasets.rfdetr_transforms import (RandomSquareCrop, RFDETRBatchScale,
                                                      RFDETRResize, RFDETRTrainResize,
                                                      rfdetr_scales)

#: (resolution, patch, windows) of rfdetr 1.11.2's sizes: N, S, M, L, Seg N, Seg S ... Seg 2XL
SIZES = [(384, 16, 2), (512, 16, 2), (576, 16, 2), (704, 16, 2), (312, 12, 1), (384, 12, 2),
         (432, 12, 2), (504, 12, 2), (624, 12, 2), (768, 12, 2)]
#: float32 rounding of a bilinear resize done on 0-255 against on 0-1 values
PIXEL_TOL = 1e-4


def _image(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, 256, (h, w, 3), dtype=np.uint8)


def _torchvision_resize(img: np.ndarray, size, antialias: bool) -> np.ndarray:
    """rfdetr's resize: the image as a float tensor in [0, 1], torchvision's ``resize``."""
    chw = torch.from_numpy(img).permute(2, 0, 1).float() / 255
    return (TF.resize(chw, list(size), antialias=antialias) * 255).permute(1, 2, 0).numpy()


@pytest.mark.parametrize('resolution,patch,windows', SIZES)
@pytest.mark.parametrize('expanded', [True, False])
def test_scales_are_rfdetrs(resolution, patch, windows, expanded):
    from rfdetr.datasets.coco import compute_multi_scale_scales
    assert rfdetr_scales(resolution, patch * windows, expanded) == compute_multi_scale_scales(
        resolution, expanded, patch, windows)


def test_a_resolution_off_the_block_is_refused():
    with pytest.raises(ValueError, match=r'resolution 390 is not a multiple of the block 32 '
                                         r'\(patch size x windows per side\): use a multiple'):
        rfdetr_scales(390, 32)


@pytest.mark.parametrize('shape,antialias', [((256, 320), False), ((480, 640), False),
                                             ((480, 640), True), ((384, 384), False)])
def test_resize_pixels_are_torchvisions(shape, antialias):
    img = _image(*shape)
    out = RFDETRResize(scale=(384, 384), antialias=antialias)(dict(img=img))
    assert out['img'].dtype == np.float32 and out['img_shape'] == (384, 384)
    assert out['scale_factor'] == (384 / shape[1], 384 / shape[0])
    want = _torchvision_resize(img, (384, 384), antialias)
    assert np.abs(out['img'] - want).max() <= PIXEL_TOL * 255


def test_resize_keys_are_mmdets():
    """Everything but the pixels is mmdet's ``Resize``: boxes, masks, sizes, keep_ratio."""
    img = _image(300, 500)
    boxes = np.array([[10.0, 20.0, 200.0, 290.0], [300.0, 5.0, 499.0, 100.0]], np.float32)
    masks = np.zeros((2, 300, 500), np.uint8)
    masks[0, 20:290, 10:200] = 1
    for keep_ratio in (False, True):
        def results():
            return dict(img=img, gt_bboxes=HorizontalBoxes(boxes.copy()),
                        gt_masks=BitmapMasks(masks.copy(), 300, 500))
        ours = RFDETRResize(scale=(400, 1000), keep_ratio=keep_ratio)(results())
        theirs = Resize(scale=(400, 1000), keep_ratio=keep_ratio)(results())
        for key in ('img_shape', 'scale_factor', 'keep_ratio'):
            assert ours[key] == theirs[key], key
        assert ours['img'].shape == theirs['img'].shape
        assert torch.equal(ours['gt_bboxes'].tensor, theirs['gt_bboxes'].tensor)
        assert np.array_equal(ours['gt_masks'].masks, theirs['gt_masks'].masks)


@pytest.mark.parametrize('shape,low,high', [((500, 700), 384, 500), ((300, 900), 300, 300),
                                            ((800, 900), 384, 600)])
def test_square_crop_is_rfdetrs_random_sized_crop(shape, low, high):
    """rfdetr's RandomSizedCrop((384, 600)): a square side uniform in [min(384, m), m] with m =
    min(600, h, w), at a uniform position."""
    np.random.seed(0)
    sides = set()
    for _ in range(40):
        out = RandomSquareCrop()(dict(img=_image(*shape), img_shape=shape,
                                      gt_bboxes=HorizontalBoxes(np.zeros((0, 4), np.float32)),
                                      gt_bboxes_labels=np.zeros(0, np.int64),
                                      gt_ignore_flags=np.zeros(0, bool)))
        h, w = out['img'].shape[:2]
        assert h == w and low <= h <= high
        sides.add(h)
    assert min(sides) < max(sides) or low == high


@pytest.mark.parametrize('per_batch', [True, False])
def test_train_resize_sizes(per_batch):
    """Per batch every image ends at the largest scale (rfdetr's skip_random_resize), per image
    at one of the scales; both branches (square resize, crop first) are drawn."""
    from rfdetr.datasets.coco import compute_multi_scale_scales
    scales = compute_multi_scale_scales(384, True, 16, 2)
    t = RFDETRTrainResize(384, 32, per_batch=per_batch)
    np.random.seed(0)
    seen, cropped = set(), 0
    for _ in range(30):
        boxes = HorizontalBoxes(np.array([[0.0, 0.0, 639.0, 479.0]], np.float32))
        out = t(dict(img=_image(480, 640), img_shape=(480, 640), gt_bboxes=boxes,
                     gt_bboxes_labels=np.zeros(1, np.int64), gt_ignore_flags=np.zeros(1, bool)))
        side = out['img'].shape[0]
        assert out['img'].shape[:2] == (side, side) and side in scales
        seen.add(side)
        # the whole-image box stays whole after a square resize, not after a crop
        cropped += not bool(torch.allclose(out['gt_bboxes'].tensor,
                                           torch.tensor([[0.0, 0.0, 639.0 * side / 640,
                                                          479.0 * side / 480]])))
    assert seen == ({scales[-1]} if per_batch else seen) and (per_batch or len(seen) > 3)
    assert 5 < cropped < 25


def _rfdetr_on_train_batch_start() -> Callable[..., None]:
    """rfdetr's ``RFDETRLightningModule.on_train_batch_start`` compiled from its source alone
    (its module imports PyTorch Lightning, not installed here)."""
    from rfdetr.config import MultiScale
    from rfdetr.datasets.coco import compute_multi_scale_scales
    spec = importlib.util.find_spec('rfdetr')
    path = osp.join(spec.submodule_search_locations[0], 'training', 'module_model.py')
    with open(path) as f:
        tree = ast.parse(f.read())
    (fn,) = [n for n in ast.walk(tree)
             if isinstance(n, ast.FunctionDef) and n.name == 'on_train_batch_start']
    namespace: dict = dict(Any=Any, random=random, torch=torch, F=torch.nn.functional,
                           MultiScale=MultiScale,
                           compute_multi_scale_scales=compute_multi_scale_scales)
    exec(compile(ast.Module(body=[fn], type_ignores=[]), path, 'exec'), namespace)
    return namespace['on_train_batch_start']


def _batch(side: int):
    torch.manual_seed(0)
    inputs = torch.randn(2, 3, side, side)
    samples = []
    for i in range(2):
        masks = np.zeros((1, side, side), np.uint8)
        masks[0, 10:200, 30:100] = 1
        gt = InstanceData(bboxes=torch.tensor([[30.0, 10.0, 100.0, 200.0 + i]]),
                          masks=BitmapMasks(masks, side, side))
        samples.append(DetDataSample(gt_instances=gt, metainfo=dict(
            img_shape=(side, side), pad_shape=(side, side), batch_input_shape=(side, side))))
    return inputs, samples


def test_batch_scale_is_rfdetrs_per_batch_multi_scale():
    """Accumulating 4 iterations per optimizer step, on steps 0-7: the batch side and pixels of
    rfdetr's on_train_batch_start (global_step = optimizer steps) on the same batch; boxes and
    shape metas scaled with it; the masks kept at their resolution, as rfdetr keeps its targets'
    (their padded frame recorded as mask_batch_shape)."""
    from rfdetr.config import MultiScale
    hook = _rfdetr_on_train_batch_start()
    resolution, patch, windows, accumulate = 384, 16, 2, 4
    ours = RFDETRBatchScale(resolution, patch * windows, interval=accumulate)
    hub = MessageHub.get_instance('test_rfdetr_batch_scale')
    largest = rfdetr_scales(resolution, patch * windows)[-1]
    sides = set()
    for step in range(8):
        inputs, samples = _batch(largest)
        theirs = SimpleNamespace(tensors=inputs.clone(), mask=torch.zeros(2, largest, largest,
                                                                           dtype=torch.bool))
        module = SimpleNamespace(
            train_config=SimpleNamespace(multi_scale=MultiScale.PER_BATCH, expanded_scales=True),
            model_config=SimpleNamespace(resolution=resolution, patch_size=patch,
                                         num_windows=windows),
            trainer=SimpleNamespace(global_step=step))
        hook(module, (theirs, None), 0)
        for micro in range(accumulate):
            hub.update_info('iter', step * accumulate + micro)
            out, scaled = ours(inputs.clone(), _batch(largest)[1])
            assert out.shape == theirs.tensors.shape
            assert torch.allclose(out, theirs.tensors, atol=1e-6)
        side = out.shape[-1]
        sides.add(side)
        f = side / largest
        for sample, orig in zip(scaled, samples):
            assert sample.img_shape == sample.pad_shape == sample.batch_input_shape == (side, side)
            assert torch.allclose(sample.gt_instances.bboxes, orig.gt_instances.bboxes * f)
            assert np.array_equal(sample.gt_instances.masks.masks, orig.gt_instances.masks.masks)
            assert sample.mask_batch_shape == (largest, largest)
    assert len(sides) > 2


def test_batch_scale_leaves_a_batch_at_its_scale():
    ours = RFDETRBatchScale(384, 32)
    MessageHub.get_instance('test_rfdetr_batch_scale_same').update_info('iter', 0)
    side = ours.scale_at(0)
    inputs, samples = _batch(side)
    out, same = ours(inputs, samples)
    assert out is inputs and same is samples
