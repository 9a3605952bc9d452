"""D-FINE's and DEIMv2's batch-level augmentations as data-preprocessor batch augments.

Both recipes finish a training batch in their collate function (``BatchImageCollateFunction``),
on the batch of square inputs, by training epoch (0-based, the runner's ``epoch``):

* DEIMv2's mixing (:class:`DEIMBatchMix`): MixUp of the whole batch with chance
  ``mixup_prob`` during ``mixup_epochs``; otherwise, during ``copyblend_epochs``, Copy-Blend
  with chance ``copyblend_prob``: a few objects of the batch blended into every image;
* the multi-scale (:class:`DEIMBatchScale`): the batch resized (nearest pixels) to a side drawn
  from :func:`dfine_scales` while the epoch is before ``stop_epoch``.

Here they run as ``batch_augments`` of mmdet's ``DetDataPreprocessor``, in that order, on the
normalised batch (mixing is linear, so normalising first changes nothing) with boxes in
pixels (the recipes' are normalised, so their resize leaves them alone; here they are
scaled). The draws are Python's ``random``, as the recipes'.
"""
import math
import random
from typing import List, Optional, Sequence, Tuple, Union

import torch
from mmdet.registry import MODELS
from mmdet.structures import DetDataSample
from mmdet.structures.bbox import BaseBoxes, get_box_tensor
from mmengine.logging import MessageHub
from mmengine.structures import InstanceData
from torch import Tensor, nn

from .batch_resize import BatchSquareResize

#: The weight of an image against the one it is mixed with (MixUp) or the objects blended
#: into it (Copy-Blend): uniform in this range, one draw per batch.
MIX_WEIGHT_RANGE = (0.45, 0.55)
#: The multi-scale sides step by this many pixels ...
SCALE_STEP = 32
#: ... from this fraction of the base side to this one (each rounded down to a step).
SCALE_RANGE = (0.75, 1.25)
#: The instance sets a mixed image takes from the image it is mixed with.
MIXED_SETS = ('gt_instances', 'ignored_instances')


def _epoch() -> int:
    """The runner's training epoch (0-based; mmengine's ``RuntimeInfoHook`` records it)."""
    return int(MessageHub.get_current_instance().get_info('epoch', 0))


def _in(epochs: Sequence[int], epoch: int) -> bool:
    return epochs[0] <= epoch < epochs[-1]


def dfine_scales(base_size: int, base_size_repeat: int) -> List[int]:
    """The recipes' multi-scale sides: whole :data:`SCALE_STEP` s from 0.75 x ``base_size`` up
    to below it, ``base_size`` ``base_size_repeat`` times, and as many from 1.25 x
    ``base_size`` down (640, 3: 480 ... 608, 640 x 3, 800 ... 672)."""
    low = int(base_size * SCALE_RANGE[0] / SCALE_STEP) * SCALE_STEP
    if low < SCALE_STEP:
        smallest = math.ceil(SCALE_STEP / SCALE_RANGE[0])
        raise ValueError(f'base_size={base_size} has no multi-scale side: the smallest would be '
                         f'{low} px; use base_size >= {smallest}')
    high = int(base_size * SCALE_RANGE[1] / SCALE_STEP) * SCALE_STEP
    steps = range((base_size - low) // SCALE_STEP)
    return ([low + i * SCALE_STEP for i in steps] + [base_size] * base_size_repeat
            + [high - i * SCALE_STEP for i in steps])


def _with_boxes(instances: InstanceData, like: Union[Tensor, BaseBoxes], boxes: Tensor) -> None:
    """Set ``instances.bboxes`` to ``boxes`` ``(N, 4)``, in the box type of ``like``."""
    instances.bboxes = type(like)(boxes) if isinstance(like, BaseBoxes) else boxes


@MODELS.register_module()
class DEIMBatchMix(nn.Module):
    """DEIMv2's batch mixing: MixUp, else Copy-Blend (module docstring). One weight ``beta``
    per batch (:data:`MIX_WEIGHT_RANGE`).

    * MixUp: every image becomes ``beta`` of itself and ``1 - beta`` of the batch's previous
      image (the first takes the last) and gets that image's boxes as well.
    * Copy-Blend: the batch's objects of a box area of ``area_threshold`` px or more are the
      pool; every image draws ``num_objects`` of them (without replacement, any image's),
      each at a uniform position where it fits whole, and the region there becomes ``beta`` of
      itself and ``1 - beta`` of the object's pixels (from the batch before any blending). The
      region is the box grown by ``expand_ratios`` (one uniform draw per object, of its width
      and height on each side, as far as both images allow); the new box is the object's box.
      The pool is chosen by the box's area at the batch's size (DEIMv2 reads the annotation's
      ``area``, the mask's in the original image, which its transforms do not update).

    Both assume the images fill the batch (the recipes' square resize: no padding).

    Args:
        mixup_prob: the chance of MixUp in a batch of ``mixup_epochs``.
        mixup_epochs: ``(first, stop)``: the epochs with MixUp.
        copyblend_prob: the chance of Copy-Blend in a batch of ``copyblend_epochs`` without
            MixUp.
        copyblend_epochs: ``(first, stop)``: the epochs with Copy-Blend.
        area_threshold: the smallest box area (px) an object of the pool has.
        num_objects: the objects blended into each image (fewer if the pool is smaller).
        expand_ratios: the growth's ``(min, max)`` fraction; None: the box alone.
    """

    def __init__(self, mixup_prob: float = 0.0, mixup_epochs: Sequence[int] = (0, 0),
                 copyblend_prob: float = 0.0, copyblend_epochs: Sequence[int] = (0, 0),
                 area_threshold: float = 100.0, num_objects: int = 3,
                 expand_ratios: Optional[Tuple[float, float]] = None) -> None:
        super().__init__()
        self.mixup_prob, self.mixup_epochs = mixup_prob, tuple(mixup_epochs)
        self.copyblend_prob, self.copyblend_epochs = copyblend_prob, tuple(copyblend_epochs)
        self.area_threshold = area_threshold
        self.num_objects = num_objects
        self.expand_ratios = expand_ratios

    def forward(self, inputs: Tensor, data_samples: List[DetDataSample]
                ) -> Tuple[Tensor, List[DetDataSample]]:
        epoch = _epoch()
        beta = random.uniform(*MIX_WEIGHT_RANGE)
        if _in(self.mixup_epochs, epoch) and random.random() < self.mixup_prob:
            return self.mixup(inputs, data_samples, beta)
        if _in(self.copyblend_epochs, epoch) and random.random() < self.copyblend_prob:
            return self.copy_blend(inputs, data_samples, beta)
        return inputs, data_samples

    @staticmethod
    def mixup(inputs: Tensor, data_samples: List[DetDataSample], beta: float
              ) -> Tuple[Tensor, List[DetDataSample]]:
        """``inputs`` ``(B, C, H, W)``: image ``i`` mixed with image ``i - 1``; boxes joined."""
        mixed = inputs * beta + inputs.roll(1, dims=0) * (1.0 - beta)             # (B, C, H, W)
        for key in MIXED_SETS:
            if all(key in s for s in data_samples):
                sets = [getattr(s, key) for s in data_samples]
                for i, sample in enumerate(data_samples):
                    setattr(sample, key, InstanceData.cat([sets[i], sets[i - 1]]))
        return mixed, data_samples

    def copy_blend(self, inputs: Tensor, data_samples: List[DetDataSample], beta: float
                   ) -> Tuple[Tensor, List[DetDataSample]]:
        """``inputs`` ``(B, C, H, W)``: objects of the batch blended into every image.

        The pool's boxes come to the host once (the draws and slices are Python's)."""
        height, width = inputs.shape[-2:]
        pool = []                                       # (image, x1, y1, x2, y2, label)
        for i, sample in enumerate(data_samples):
            boxes = get_box_tensor(sample.gt_instances.bboxes)
            area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
            big = area >= self.area_threshold
            for box, label in zip(boxes[big].tolist(), sample.gt_instances.labels[big]):
                x1, y1 = max(int(box[0]), 0), max(int(box[1]), 0)
                x2, y2 = min(int(box[2]), width), min(int(box[3]), height)
                if x2 > x1 and y2 > y1:
                    pool.append((i, x1, y1, x2, y2, label))
        if not pool:
            return inputs, data_samples
        out = inputs.clone()
        for i, sample in enumerate(data_samples):
            new_boxes, new_labels = [], []
            for src, sx1, sy1, sx2, sy2, label in random.sample(
                    pool, min(self.num_objects, len(pool))):
                w, h = sx2 - sx1, sy2 - sy1
                dx1, dy1 = random.randint(0, width - w), random.randint(0, height - h)
                new_boxes.append([dx1, dy1, dx1 + w, dy1 + h])
                new_labels.append(label)
                left = top = right = bottom = 0
                if self.expand_ratios is not None:
                    ratio = random.uniform(*self.expand_ratios)
                    grow_w, grow_h = int(w * ratio), int(h * ratio)
                    left, top = min(grow_w, sx1, dx1), min(grow_h, sy1, dy1)
                    right = min(grow_w, width - sx2, width - dx1 - w)
                    bottom = min(grow_h, height - sy2, height - dy1 - h)
                patch = inputs[src, :, sy1 - top:sy2 + bottom, sx1 - left:sx2 + right]
                region = out[i, :, dy1 - top:dy1 + h + bottom, dx1 - left:dx1 + w + right]
                region.mul_(beta).add_(patch, alpha=1.0 - beta)
            if not new_boxes:
                continue
            gt = sample.gt_instances
            added = gt.new(labels=torch.stack(new_labels))
            _with_boxes(added, gt.bboxes, get_box_tensor(gt.bboxes).new_tensor(new_boxes))
            sample.gt_instances = InstanceData.cat([gt, added])
        return out, data_samples

    def extra_repr(self) -> str:
        return (f'mixup_prob={self.mixup_prob}, mixup_epochs={self.mixup_epochs}, '
                f'copyblend_prob={self.copyblend_prob}, '
                f'copyblend_epochs={self.copyblend_epochs}, '
                f'area_threshold={self.area_threshold}, num_objects={self.num_objects}, '
                f'expand_ratios={self.expand_ratios}')


@MODELS.register_module()
class DEIMBatchScale(BatchSquareResize):
    """The recipes' multi-scale: while the epoch is before ``stop_epoch``, each batch is
    resized (nearest pixels, as ``F.interpolate``'s default) to a square side drawn from
    :func:`dfine_scales`; boxes and the shape metas follow.

    Args:
        base_size: the input side (the recipes: 640).
        base_size_repeat: how often ``base_size`` is among the sides (D-FINE / DEIMv2: 3 in
            the base configs, 20 for S, 4 for L).
        stop_epoch: the first epoch at the base size alone (None: never).
    """

    #: the recipes' collate resizes with ``F.interpolate``'s default
    mode = 'nearest'

    def __init__(self, base_size: int = 640, base_size_repeat: int = 3,
                 stop_epoch: Optional[int] = None) -> None:
        super().__init__()
        self.scales = dfine_scales(base_size, base_size_repeat)
        self.stop_epoch = stop_epoch

    def side(self) -> Optional[int]:
        if self.stop_epoch is not None and _epoch() >= self.stop_epoch:
            return None
        return random.choice(self.scales)

    def extra_repr(self) -> str:
        return f'scales={self.scales}, stop_epoch={self.stop_epoch}'
