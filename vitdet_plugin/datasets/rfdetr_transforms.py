"""RF-DETR's resizes (the ``rfdetr`` package, 1.11.2) as mmdet transforms and a batch augment.

RF-DETR trains and predicts square, at sizes derived from one number, the model's
``resolution`` (a multiple of the *block*, patch size x windows per side):

* test (:class:`RFDETRResize`): ``RFDETR.predict`` resizes the float image to
  ``resolution`` x ``resolution`` with torch's bilinear interpolation (``align_corners=False``,
  no antialiasing) and normalises it; mmdet's ``Resize`` uses OpenCV on the uint8 image and
  rounds, which moves detections on images of another size. :class:`RFDETRResize` is mmdet's
  ``Resize`` (same keys, boxes, masks, ``scale_factor``) with rfdetr's pixels: float32 out;
* training (:class:`RFDETRTrainResize`): the training scales (:func:`rfdetr_scales`,
  rfdetr's ``compute_multi_scale_scales`` with ``expanded_scales``) and, with even odds, a
  square resize or RF-DETR's crop branch (shortest side 400 / 500 / 600, a random square crop
  of 384-600 px, :class:`RandomSquareCrop`, resized square). Per batch (rfdetr's default
  ``MultiScale.PER_BATCH``) every image goes to the largest scale and :class:`RFDETRBatchScale`
  (a data-preprocessor batch augment) resizes the whole batch to one scale drawn per optimizer
  step, as rfdetr's ``on_train_batch_start`` does; per image, each draws its own scale.

The resizes are torch's (antialiased in training, as rfdetr's torchvision training transforms,
which resize PIL images), so all of this runs on numpy images in the dataloader workers.
"""
import random
from typing import List, Optional, Tuple, Union

import mmcv
import numpy as np
import torch
import torch.nn.functional as F
from mmcv.transforms import BaseTransform
from mmcv.transforms.utils import cache_randomness
from mmdet.datasets.transforms import RandomCrop, Resize
from mmdet.registry import MODELS, TRANSFORMS
from mmengine.logging import MessageHub

from .batch_resize import BatchSquareResize

#: rfdetr's ``compute_multi_scale_scales``: training sizes are ``resolution // block`` plus
#: these many blocks (``expanded_scales=True``, its default) ...
EXPANDED_OFFSETS = tuple(range(-5, 6))
#: ... or these (``expanded_scales=False``)
NARROW_OFFSETS = tuple(range(-3, 5))
#: the smallest training size, in blocks
MIN_BLOCKS = 2
#: RF-DETR's crop branch: the shortest side first (one of these), then a square crop of a side
#: in this range (clamped to the image)
CROP_SHORT_SIDES = (400, 500, 600)
CROP_SIDE_RANGE = (384, 600)
#: the chance of the crop branch (rfdetr's ``RandomSelect`` p)
CROP_PROB = 0.5
#: a long side no resize reaches: the shortest-side resize of the crop branch has no cap
UNCAPPED = 1 << 20


def rfdetr_scales(resolution: int, block: int, expanded: bool = True) -> List[int]:
    """RF-DETR's square training sizes for ``resolution``: whole ``block`` s (patch x windows)
    around ``resolution // block``, none below :data:`MIN_BLOCKS` blocks, ascending."""
    if resolution % block:
        raise ValueError(f'resolution {resolution} is not a multiple of the block {block} '
                         '(patch size x windows per side): use a multiple of it')
    offsets = EXPANDED_OFFSETS if expanded else NARROW_OFFSETS
    base = resolution // block
    return [(base + o) * block for o in offsets if base + o >= MIN_BLOCKS]


def resize_pixels(img: np.ndarray, size: Tuple[int, int], antialias: bool) -> np.ndarray:
    """``img`` ``(H, W[, C])`` -> float32 ``(h, w[, C])`` for ``size`` ``(h, w)``: torch's
    bilinear resize with ``align_corners=False`` (torchvision's ``resize`` of a tensor, which
    returns an image already of that size unchanged)."""
    h, w = img.shape[:2]
    pixels = np.ascontiguousarray(img, dtype=np.float32)
    if (h, w) == tuple(size):
        return pixels
    chw = torch.from_numpy(pixels.reshape(h, w, -1)).permute(2, 0, 1)[None]   # (1, C, H, W)
    out = F.interpolate(chw, size=tuple(size), mode='bilinear', align_corners=False,
                        antialias=antialias)                                  # (1, C, h, w)
    return out[0].permute(1, 2, 0).reshape(*size, *img.shape[2:]).numpy()


@TRANSFORMS.register_module()
class RFDETRResize(Resize):
    """mmdet's ``Resize`` whose image is resized as rfdetr resizes tensors (module docstring):
    torch bilinear, ``align_corners=False``, antialiased if ``antialias``; the image comes out
    float32 (0-255, the data preprocessor normalises it). Everything else (``scale`` /
    ``scale_factor``, ``keep_ratio``, boxes, masks, ``img_shape``, ``scale_factor`` key) is
    mmdet's ``Resize``.

    Args:
        antialias: antialias a downscale (rfdetr's training resizes; its ``predict`` does not).
        scale, scale_factor, keep_ratio, clip_object_border: mmdet's ``Resize``.
    """

    def __init__(self, scale: Optional[Union[int, Tuple[int, int]]] = None,
                 scale_factor: Optional[Union[float, Tuple[float, float]]] = None,
                 keep_ratio: bool = False, clip_object_border: bool = True,
                 antialias: bool = False) -> None:
        super().__init__(scale=scale, scale_factor=scale_factor, keep_ratio=keep_ratio,
                         clip_object_border=clip_object_border)
        self.antialias = antialias

    def _resize_img(self, results: dict) -> None:
        img = results.get('img')
        if img is None:
            return
        h, w = img.shape[:2]
        new_w, new_h = (mmcv.rescale_size((w, h), results['scale']) if self.keep_ratio
                        else results['scale'])
        results['img'] = resize_pixels(img, (new_h, new_w), self.antialias)
        results['img_shape'] = (new_h, new_w)
        results['scale_factor'] = (new_w / w, new_h / h)
        results['keep_ratio'] = self.keep_ratio

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f', antialias={self.antialias})'


@TRANSFORMS.register_module()
class RandomSquareCrop(RandomCrop):
    """mmdet's ``RandomCrop`` of a square: the side drawn uniformly from ``crop_size`` ``(min,
    max)`` clamped to the image's short side, at a uniform position (rfdetr's
    ``RandomSizedCrop``); boxes clipped, empty ones dropped, masks cropped, as ``RandomCrop``.

    Args:
        crop_size: the side's range ``(min, max)`` in pixels.
        allow_negative_crop: keep a crop without a box (rfdetr does).
    """

    def __init__(self, crop_size: Tuple[int, int] = CROP_SIDE_RANGE,
                 allow_negative_crop: bool = True) -> None:
        super().__init__(crop_size=crop_size, crop_type='absolute_range',
                         allow_negative_crop=allow_negative_crop)

    @cache_randomness
    def _get_crop_size(self, image_size: Tuple[int, int]) -> Tuple[int, int]:
        high = min(self.crop_size[1], *image_size)
        side = np.random.randint(min(self.crop_size[0], high), high + 1)
        return side, side


@TRANSFORMS.register_module()
class RFDETRTrainResize(BaseTransform):
    """RF-DETR's training resize of one image (module docstring): square at a training scale,
    or first RF-DETR's crop branch (:data:`CROP_PROB`).

    Args:
        resolution: the model's input side (rfdetr's ``resolution``).
        block: patch size x windows per side: the step of the training scales.
        per_batch: every image at the largest scale, for :class:`RFDETRBatchScale` to draw the
            batch's (rfdetr's ``MultiScale.PER_BATCH``); else one scale per image
            (``PER_SAMPLE``).
        expanded_scales: rfdetr's ``expanded_scales`` (:func:`rfdetr_scales`).
    """

    def __init__(self, resolution: int, block: int, per_batch: bool = True,
                 expanded_scales: bool = True) -> None:
        self.scales = rfdetr_scales(resolution, block, expanded_scales)
        sizes = self.scales[-1:] if per_batch else self.scales
        self.squares = [RFDETRResize(scale=(s, s), antialias=True) for s in sizes]
        self.short_sides = [RFDETRResize(scale=(s, UNCAPPED), keep_ratio=True, antialias=True)
                            for s in CROP_SHORT_SIDES]
        self.crop = RandomSquareCrop()

    @cache_randomness
    def _draw(self) -> Tuple[Optional[RFDETRResize], RFDETRResize]:
        """The crop branch's short-side resize (None: the square resize alone), the square."""
        short = (self.short_sides[np.random.randint(len(self.short_sides))]
                 if np.random.rand() < CROP_PROB else None)
        return short, self.squares[np.random.randint(len(self.squares))]

    def transform(self, results: dict) -> dict:
        short, square = self._draw()
        if short is not None:
            results = self.crop(short(results))
        return square(results)

    def __repr__(self) -> str:
        return (f'{type(self).__name__}(scales={self.scales}, '
                f'sizes={[t.scale[0] for t in self.squares]})')


@MODELS.register_module()
class RFDETRBatchScale(BatchSquareResize):
    """RF-DETR's per-batch multi-scale (``MultiScale.PER_BATCH``) as a data-preprocessor batch
    augment: the padded batch resized (bilinear, ``align_corners=False``) to one square training
    scale, drawn as rfdetr draws it: ``random.Random(step).choice(scales)`` for optimizer step
    ``step`` (the runner's iteration // ``interval``), the same on every rank without a
    broadcast. Boxes and the shape metas follow; the ground-truth masks keep their resolution,
    as rfdetr samples them at normalised points (RF-DETR-Seg's losses read them through
    ``mask_batch_shape``).

    Args:
        resolution, block, expanded_scales: the scales (:func:`rfdetr_scales`).
        interval: iterations per optimizer step (the optimizer wrapper's
            ``accumulative_counts``): rfdetr draws per optimizer step.
    """

    resize_masks = False

    def __init__(self, resolution: int, block: int, expanded_scales: bool = True,
                 interval: int = 1) -> None:
        super().__init__()
        self.scales = rfdetr_scales(resolution, block, expanded_scales)
        self.interval = interval

    def scale_at(self, iteration: int) -> int:
        """The batch side of training iteration ``iteration`` (0-based)."""
        return random.Random(iteration // self.interval).choice(self.scales)

    def side(self) -> int:
        return self.scale_at(MessageHub.get_current_instance().get_info('iter', 0))
