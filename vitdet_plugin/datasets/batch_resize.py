"""Square multi-scale training as a data-preprocessor batch augment: the whole padded batch
resized to one side per batch, its boxes, masks and shape metas following.

RF-DETR (:class:`~.rfdetr_transforms.RFDETRBatchScale`) and D-FINE / DEIMv2
(:class:`~.deim_batch_augments.DEIMBatchScale`) draw the side and interpolate differently;
:class:`BatchSquareResize` holds what they share: the resize of the batch and of what describes
it, for any ``side`` a subclass draws.
"""
from typing import Any, Optional, Sequence, Tuple

import torch.nn.functional as F
from mmdet.structures import DetDataSample
from mmdet.structures.bbox import BaseBoxes
from torch import Tensor, nn

#: The instance sets of a data sample whose boxes (and masks) follow the batch's resize.
INSTANCE_SETS = ('gt_instances', 'ignored_instances')
#: Meta key of the padded frame the ground-truth masks are in when the batch resize leaves them
#: at their size (``resize_masks`` False): the batch input before the resize.
MASK_BATCH_SHAPE = 'mask_batch_shape'



def _scaled(shape: Tuple[int, int], sx: float, sy: float) -> Tuple[int, int]:
    return round(shape[0] * sy), round(shape[1] * sx)


def _rescale_instances(instances: Any, sx: float, sy: float, masks: bool) -> None:
    """Boxes (tensor or mmdet box type) and, with ``masks``, masks (mmdet mask type) of one
    image scaled by ``(sx, sy)``."""
    boxes = instances.bboxes
    if isinstance(boxes, BaseBoxes):
        boxes.rescale_((sx, sy))
    else:
        instances.bboxes = boxes * boxes.new_tensor([sx, sy, sx, sy])
    if masks and 'masks' in instances:
        mh, mw = instances.masks.height, instances.masks.width
        instances.masks = instances.masks.resize(_scaled((mh, mw), sx, sy))


class BatchSquareResize(nn.Module):
    """Resize the batch to the square :meth:`side` of this batch (None: leave it), with
    ``F.interpolate``'s ``mode`` (``align_corners=False`` where the mode has corners).

    The whole padded batch scales uniformly, so a position in normalised coordinates stays
    where it was: with ``resize_masks`` False the ground-truth masks keep their resolution and
    the samples record the padded frame they are in (:data:`MASK_BATCH_SHAPE`), for losses that
    sample them at normalised points."""

    #: ``F.interpolate``'s mode.
    mode = 'bilinear'
    #: Resize the ground-truth masks with the batch (nearest); False: keep them (see above).
    resize_masks = True

    def side(self) -> Optional[int]:
        raise NotImplementedError(f'{type(self).__name__} must define side()')

    def forward(self, inputs: Tensor, data_samples: Sequence[DetDataSample]
                ) -> Tuple[Tensor, Sequence[DetDataSample]]:
        side = self.side()
        h, w = inputs.shape[-2:]
        if side is None or (h, w) == (side, side):
            return inputs, data_samples
        corners = dict(align_corners=False) if self.mode in ('bilinear', 'bicubic') else {}
        inputs = F.interpolate(inputs, size=(side, side), mode=self.mode,
                               **corners)                                    # (B, C, s, s)
        sx, sy = side / w, side / h
        for sample in data_samples:
            if not self.resize_masks and MASK_BATCH_SHAPE not in sample:
                sample.set_metainfo({MASK_BATCH_SHAPE: sample.batch_input_shape})
            sample.set_metainfo(dict(
                img_shape=_scaled(sample.img_shape, sx, sy),
                pad_shape=_scaled(sample.pad_shape, sx, sy), batch_input_shape=(side, side)))
            for key in INSTANCE_SETS:
                if key in sample:
                    _rescale_instances(getattr(sample, key), sx, sy, self.resize_masks)
        return inputs, data_samples
