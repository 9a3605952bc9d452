"""D-FINE's and DEIMv2's per-image training augmentations as mmdet transforms.

The two recipes (Peterande/D-FINE ``configs/dfine/include/dataloader.yml``,
Intellindust-AI-Lab/DEIMv2 ``configs/base/{dataloader,deimv2}.yml``) run torchvision's
``transforms.v2`` ops on PIL images: photometric distortion, zoom-out, an IoU crop, box
sanitising, a horizontal flip and a resize to the square input, and DEIMv2 adds its own cached
Mosaic. Where mmdet 3.3 has the same op it is used as is (``Expand`` for ``RandomZoomOut``,
``RandomFlip``, ``Resize`` with the pillow backend); the others are here, and run torchvision's
own op on a PIL image of the mmdet image, so that pixels, boxes and random draws (torch's
generator) are the recipes':

* :class:`DEIMClipBoxes`: boxes clipped to the image, as the recipes' COCO loader does;
* :class:`DEIMPhotometricDistort`: ``RandomPhotometricDistort`` (brightness, contrast,
  saturation, hue, channel permutation, each with chance ``p``);
* :class:`DEIMRandomIoUCrop`: ``RandomIoUCrop`` behind a chance ``p`` (the recipes' wrapper);
  boxes whose centre leaves the crop are dropped (torchvision zeroes them for the sanitiser);
* :class:`DEIMSanitizeBoxes`: ``SanitizeBoundingBoxes`` (too small or outside the image);
* :class:`DEIMMosaic`: DEIMv2's Mosaic: four images of a cache, shortest side resized, on a
  2 x 2 grid, then one ``RandomAffine`` of the grid.

Images are mmdet's: ``(H, W, 3)`` uint8 in BGR order (``LoadImageFromFile``); boxes are mmdet
box types (``LoadAnnotations``' default ``box_type='hbox'``). The per-instance keys
(``gt_bboxes_labels``, ``gt_ignore_flags``) follow the boxes. Masks are not handled: these
are the detection recipes.
"""
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import PIL.Image
import torch
import torchvision.transforms.v2 as T
import torchvision.transforms.v2.functional as TF
from mmcv.transforms import BaseTransform
from mmdet.registry import TRANSFORMS
from mmdet.structures.bbox import HorizontalBoxes
from torch import Tensor
from torchvision import tv_tensors

#: The keys that hold one entry per box and follow the boxes when some are dropped.
INSTANCE_KEYS = ('gt_bboxes_labels', 'gt_ignore_flags')
#: The cells of DEIMv2's mosaic grid, in the order the four images fill them: (column, row).
MOSAIC_CELLS = ((0, 0), (1, 0), (0, 1), (1, 1))
#: The images a mosaic joins: the current one and this many drawn from the cache.
MOSAIC_DRAWN = 3


def _boxes(results: dict) -> Tensor:
    """``results['gt_bboxes']`` as an ``(N, 4)`` float32 XYXY tensor; a clear error otherwise."""
    boxes = results.get('gt_bboxes')
    if not isinstance(boxes, HorizontalBoxes):
        raise TypeError(f'D-FINE / DEIMv2 transforms need gt_bboxes as mmdet HorizontalBoxes, '
                        f'got {type(boxes).__name__}: load them with LoadAnnotations('
                        "with_bbox=True) and its default box_type='hbox'")
    if 'gt_masks' in results:
        raise ValueError('D-FINE / DEIMv2 transforms handle boxes only, not gt_masks: load the '
                         'annotations with LoadAnnotations(with_mask=False)')
    return boxes.tensor.float()


def _pil(img: np.ndarray) -> PIL.Image.Image:
    """mmdet's BGR uint8 ``(H, W, 3)`` image as the RGB PIL image the recipes transform."""
    if img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3:
        raise TypeError(f'D-FINE / DEIMv2 transforms need the (H, W, 3) uint8 image of '
                        f'LoadImageFromFile, got {img.dtype} {img.shape}: put them before any '
                        'transform that changes the dtype')
    return PIL.Image.fromarray(np.ascontiguousarray(img[..., ::-1]))


def _bgr(image: PIL.Image.Image) -> np.ndarray:
    """An RGB PIL image back as mmdet's BGR uint8 array."""
    return np.ascontiguousarray(np.asarray(image)[..., ::-1])


def _tv_boxes(boxes: Tensor, height: int, width: int) -> tv_tensors.BoundingBoxes:
    return tv_tensors.BoundingBoxes(boxes, format='XYXY', canvas_size=(height, width))


def _write(results: dict, image: PIL.Image.Image, boxes: Tensor, keep: np.ndarray,
           instances: Dict[str, np.ndarray]) -> dict:
    """Store a transformed image and boxes; ``keep`` picks each box's entry of ``instances``."""
    results['img'] = _bgr(image)
    results['img_shape'] = results['img'].shape[:2]
    results['gt_bboxes'] = HorizontalBoxes(boxes.as_subclass(Tensor).float())
    for key, values in instances.items():
        results[key] = values[keep]
    return results


def _instances(results: dict) -> Dict[str, np.ndarray]:
    return {key: results[key] for key in INSTANCE_KEYS if key in results}


@TRANSFORMS.register_module()
class DEIMClipBoxes(BaseTransform):
    """Boxes clipped to the image, as D-FINE's / DEIMv2's COCO loader clips them on loading:
    put it right after ``LoadAnnotations`` (:class:`DEIMSanitizeBoxes` drops, it does not
    clip, a box that reaches past the image)."""

    def transform(self, results: dict) -> dict:
        _boxes(results)
        results['gt_bboxes'].clip_(results['img'].shape[:2])
        return results


@TRANSFORMS.register_module()
class DEIMPhotometricDistort(BaseTransform):
    """torchvision's ``RandomPhotometricDistort`` on the RGB image: brightness, contrast
    (before or after saturation and hue, even odds), saturation, hue and a channel
    permutation, each with chance ``p``; the factors' ranges are torchvision's defaults.

    Args:
        p: the chance of each distortion (the recipes: 0.5).
        brightness, contrast, saturation, hue: the factors' ``(min, max)``.
    """

    def __init__(self, p: float = 0.5, brightness: Tuple[float, float] = (0.875, 1.125),
                 contrast: Tuple[float, float] = (0.5, 1.5),
                 saturation: Tuple[float, float] = (0.5, 1.5),
                 hue: Tuple[float, float] = (-0.05, 0.05)) -> None:
        self.op = T.RandomPhotometricDistort(brightness=brightness, contrast=contrast,
                                             saturation=saturation, hue=hue, p=p)

    def transform(self, results: dict) -> dict:
        results['img'] = _bgr(self.op(_pil(results['img'])))
        return results

    def __repr__(self) -> str:
        return f'{type(self).__name__}({self.op!r})'


@TRANSFORMS.register_module()
class DEIMRandomIoUCrop(BaseTransform):
    """torchvision's ``RandomIoUCrop`` (SSD's crop: a minimum IoU drawn from
    ``sampler_options``, 1.0 meaning no crop; up to ``trials`` crops of ``min_scale`` -
    ``max_scale`` of each side within the aspect range, the first with a box centre inside and
    some box of at least that IoU with the crop), applied with chance ``p`` as the recipes'
    wrapper does (``torch.rand(1) < p``). Boxes are clipped to the crop; those whose centre is
    outside are dropped here (torchvision zeroes them for the next sanitiser).

    Args:
        p: the chance of a crop (the recipes: 0.8).
        min_scale, max_scale, min_aspect_ratio, max_aspect_ratio, sampler_options, trials:
            torchvision's ``RandomIoUCrop``.
    """

    def __init__(self, p: float = 1.0, min_scale: float = 0.3, max_scale: float = 1.0,
                 min_aspect_ratio: float = 0.5, max_aspect_ratio: float = 2.0,
                 sampler_options: Optional[List[float]] = None, trials: int = 40) -> None:
        self.p = p
        self.op = T.RandomIoUCrop(min_scale=min_scale, max_scale=max_scale,
                                  min_aspect_ratio=min_aspect_ratio,
                                  max_aspect_ratio=max_aspect_ratio,
                                  sampler_options=sampler_options, trials=trials)

    def transform(self, results: dict) -> dict:
        if torch.rand(1) >= self.p:
            return results
        boxes = _boxes(results)
        image = _pil(results['img'])
        target = {'boxes': _tv_boxes(boxes, image.height, image.width),
                  'labels': torch.arange(len(boxes))}
        image, target = self.op(image, target)
        cropped = target['boxes'].as_subclass(Tensor)
        inside = cropped.ne(0).any(dim=1)       # torchvision's mark of a centre outside the crop
        keep = target['labels'][inside].numpy()
        return _write(results, image, cropped[inside], keep, _instances(results))

    def __repr__(self) -> str:
        return f'{type(self).__name__}(p={self.p}, {self.op!r})'


@TRANSFORMS.register_module()
class DEIMSanitizeBoxes(BaseTransform):
    """torchvision's ``SanitizeBoundingBoxes``: boxes narrower or lower than ``min_size``, of
    an area under ``min_area``, or with a coordinate outside the image are dropped, with their
    labels and flags.

    Args:
        min_size: the smallest width and height kept (the recipes: 1; DEIMv2's atto /
            femto / pico: 12).
        min_area: the smallest area kept (torchvision's default).
    """

    def __init__(self, min_size: float = 1.0, min_area: float = 1.0) -> None:
        self.min_size = min_size
        self.min_area = min_area

    def transform(self, results: dict) -> dict:
        boxes = _boxes(results)
        _, valid = TF.sanitize_bounding_boxes(boxes, format='XYXY',
                                              canvas_size=results['img'].shape[:2],
                                              min_size=self.min_size, min_area=self.min_area)
        keep = valid.numpy()
        results['gt_bboxes'] = results['gt_bboxes'][keep]
        for key, values in _instances(results).items():
            results[key] = values[keep]
        return results

    def __repr__(self) -> str:
        return f'{type(self).__name__}(min_size={self.min_size}, min_area={self.min_area})'


@TRANSFORMS.register_module()
class DEIMMosaic(BaseTransform):
    """DEIMv2's Mosaic with its cache. The image's shortest side is resized to
    ``output_size`` (torchvision's ``Resize``, PIL bilinear) and the result cached (at most
    ``max_cached_images``: beyond, one entry other than the newest leaves, a random one if
    ``random_pop``, else the oldest); three more are drawn from the cache (with replacement,
    the new entry included). The four fill the cells of a 2 x 2 grid of the largest width and
    height, each at its cell's top-left corner, on black; torchvision's ``RandomAffine``
    (rotation, translation, scale; nearest pixels, ``fill_value`` outside) then moves the whole
    grid and its boxes (the corners' enclosing box, clipped to the grid).

    The cache lives in the transform, so each dataloader worker has its own, as in DEIMv2. In
    the recipes the mosaic replaces the zoom-out and IoU crop for the image it is drawn for:
    ``RandomChoice`` between the two branches (see the recipes' pipelines).

    Args:
        output_size: the shortest side of each image (DEIMv2: 320; atto / femto / pico: 160).
        max_size: the longest side's cap (torchvision's ``Resize``; None: none).
        rotation_range: the rotation's range in degrees, +-.
        translation_range: the translation's range as fractions of the grid's width, height.
        scaling_range: the scale's ``(min, max)``.
        fill_value: the pixel value the affine fills in.
        max_cached_images: the cache's size.
        random_pop: evict a random entry (else the oldest) when the cache is full.
        prob: the chance of a mosaic (DEIMv2 sets 1.0 and draws it in the policy).
    """

    def __init__(self, output_size: int = 320, max_size: Optional[int] = None,
                 rotation_range: float = 0.0,
                 translation_range: Tuple[float, float] = (0.1, 0.1),
                 scaling_range: Tuple[float, float] = (0.5, 1.5), fill_value: int = 114,
                 max_cached_images: int = 50, random_pop: bool = True, prob: float = 1.0) -> None:
        if max_cached_images < 2:
            raise ValueError(f'max_cached_images={max_cached_images}: the cache must hold the '
                             'new image and one other; use 2 or more (DEIMv2: 50)')
        self.resize = T.Resize(size=output_size, max_size=max_size)
        self.affine = T.RandomAffine(degrees=rotation_range, translate=translation_range,
                                     scale=scaling_range, fill=fill_value)
        self.max_cached_images = max_cached_images
        self.random_pop = random_pop
        self.prob = prob
        self.cache: List[dict] = []

    def _cached(self, results: dict) -> dict:
        """The image resized, with its boxes and per-instance entries."""
        boxes = _boxes(results)
        image = _pil(results['img'])
        image, boxes = self.resize(image, _tv_boxes(boxes, image.height, image.width))
        return dict(img=np.asarray(image), boxes=boxes.as_subclass(Tensor),
                    instances={k: v.copy() for k, v in _instances(results).items()})

    def _draw(self, entry: dict) -> Sequence[dict]:
        """Cache ``entry`` and return the four images of the mosaic, ``entry`` first."""
        self.cache.append(entry)
        if len(self.cache) > self.max_cached_images:
            self.cache.pop(np.random.randint(len(self.cache) - 1) if self.random_pop else 0)
        drawn = np.random.randint(len(self.cache), size=MOSAIC_DRAWN)
        return [entry] + [self.cache[i] for i in drawn]

    def transform(self, results: dict) -> dict:
        if np.random.rand() > self.prob:
            return results
        parts = self._draw(self._cached(results))
        cell_h = max(p['img'].shape[0] for p in parts)
        cell_w = max(p['img'].shape[1] for p in parts)
        grid = np.zeros((2 * cell_h, 2 * cell_w, 3), np.uint8)                # RGB
        boxes = []
        for part, (col, row) in zip(parts, MOSAIC_CELLS):
            h, w = part['img'].shape[:2]
            x, y = col * cell_w, row * cell_h
            grid[y:y + h, x:x + w] = part['img']
            boxes.append(part['boxes'] + torch.tensor([x, y, x, y], dtype=torch.float32))
        joined = torch.cat(boxes)                                              # (N, 4)
        target = {'boxes': _tv_boxes(joined, 2 * cell_h, 2 * cell_w),
                  'labels': torch.arange(len(joined))}
        image, target = self.affine(PIL.Image.fromarray(grid), target)
        instances = {key: np.concatenate([p['instances'][key] for p in parts])
                     for key in parts[0]['instances']}
        keep = target['labels'].numpy()
        return _write(results, image, target['boxes'], keep, instances)

    def __repr__(self) -> str:
        return (f'{type(self).__name__}({self.resize!r}, {self.affine!r}, '
                f'max_cached_images={self.max_cached_images}, random_pop={self.random_pop}, '
                f'prob={self.prob})')
