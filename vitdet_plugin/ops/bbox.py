"""``mmcv._ext.bbox_overlaps``: IoU / IoF of box sets with mmcv's kernel arithmetic."""
import torch

from .checks import check_same_device, check_same_dtype, check_tensor

#: mmcv's modes (``mmcv.ops.bbox_overlaps``).
MODE_IOU, MODE_IOF = 0, 1


def bbox_overlaps(bboxes1: torch.Tensor, bboxes2: torch.Tensor, ious: torch.Tensor,
                  mode: int = MODE_IOU, aligned: bool = False, offset: int = 0) -> None:
    """Write into ``ious`` ((N, M), or (N,) when ``aligned``) the overlaps of (N, 4) and (M, 4)
    boxes: intersection over union (``mode`` 0) or over the area of ``bboxes1`` (1); widths
    ``x2 - x1 + offset``; the denominator is clamped at ``offset`` as mmcv's kernel does."""
    op = 'bbox_overlaps'
    check_tensor(op, 'bboxes1', bboxes1, shape=(None, 4), what='(N, 4) = (x1, y1, x2, y2)')
    check_tensor(op, 'bboxes2', bboxes2, shape=(None, 4), what='(M, 4) = (x1, y1, x2, y2)')
    check_same_device(op, bboxes1=bboxes1, bboxes2=bboxes2, ious=ious)
    check_same_dtype(op, bboxes1=bboxes1, bboxes2=bboxes2)
    b1 = bboxes1 if aligned else bboxes1[:, None]                   # (N, 4) | (N, 1, 4)
    area1 = (b1[..., 2] - b1[..., 0] + offset) * (b1[..., 3] - b1[..., 1] + offset)
    area2 = (bboxes2[:, 2] - bboxes2[:, 0] + offset) * (bboxes2[:, 3] - bboxes2[:, 1] + offset)
    lt = torch.maximum(b1[..., :2], bboxes2[..., :2])               # (N, 2) | (N, M, 2)
    rb = torch.minimum(b1[..., 2:], bboxes2[..., 2:])
    wh = (rb - lt + offset).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    base = area1 + area2 - inter if mode == MODE_IOU else area1.expand_as(inter)
    ious.copy_(inter / base.clamp(min=offset))
