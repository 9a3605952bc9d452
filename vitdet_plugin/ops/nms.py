"""``mmcv._ext.nms`` / ``softnms`` / ``nms_match`` with mmcv 2.1's semantics.

* ``nms``: torchvision's kernel (CPU and CUDA). mmcv's ``offset=1`` (legacy pixel-inclusive
  boxes: widths ``x2 - x1 + 1``) is torchvision's formula on boxes whose ``x2, y2`` are moved by
  1, which is exactly mmcv's intersection and area arithmetic. Only indices come back, so dtypes
  torchvision has no kernel for on the device (float16 on the CPU, bfloat16 everywhere) are
  compared in float32, which is also how mmcv rounds (its kernels take float32 only).
* ``softnms`` and ``nms_match``: sequential by definition and CPU-only in mmcv (its wrappers move
  the boxes to the CPU), here one vectorised NumPy step per kept box, in float32 as mmcv computes.
  Where two remaining boxes have exactly the same score, mmcv's in-place swaps may pick them in
  another order than the stable order used here; the kept set and the scores are the same.
"""
from typing import List

import numpy as np
import torch
import torchvision

from .checks import FLOATING, OpInputError, check_same_device, check_tensor

#: mmcv's softnms methods (``mmcv.ops.soft_nms``: naive, linear, gaussian).
SOFTNMS_NAIVE, SOFTNMS_LINEAR, SOFTNMS_GAUSSIAN = 0, 1, 2
#: Dtypes torchvision's nms kernel has per device type.
TORCHVISION_NMS_DTYPES = {'cpu': (torch.float32, torch.float64),
                          'cuda': (torch.float16, torch.float32, torch.float64)}
#: Columns of the (N, 5) ``dets`` of softnms / nms_match: x1, y1, x2, y2, score.
DET_COLUMNS = 5


def _check_offset(op: str, offset: int) -> int:
    if offset not in (0, 1):
        raise OpInputError(f'{op}: offset must be 0 or 1 (1: legacy x2 - x1 + 1 widths), got '
                           f'{offset!r}')
    return int(offset)


def _check_boxes_scores(op: str, boxes: torch.Tensor, scores: torch.Tensor) -> None:
    check_tensor(op, 'boxes', boxes, shape=(None, 4), what='(N, 4) = (x1, y1, x2, y2)')
    check_tensor(op, 'scores', scores, ndim=1, what='(N,)')
    check_same_device(op, boxes=boxes, scores=scores)
    if boxes.size(0) != scores.size(0):
        raise OpInputError(f'{op}: boxes and scores must hold the same number of boxes, got '
                           f'{boxes.size(0)} boxes and {scores.size(0)} scores')


def nms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float,
        offset: int = 0) -> torch.Tensor:
    """Indices of the kept boxes, by decreasing score (``mmcv._ext.nms``)."""
    op = 'nms'
    _check_boxes_scores(op, boxes, scores)
    offset = _check_offset(op, offset)
    if boxes.numel() == 0:
        return torch.empty(0, dtype=torch.long, device=boxes.device)
    native = TORCHVISION_NMS_DTYPES.get(boxes.device.type, (torch.float32, torch.float64))
    dtype = boxes.dtype if boxes.dtype in native else torch.float32
    boxes = boxes.to(dtype)
    if offset:
        boxes = torch.cat([boxes[:, :2], boxes[:, 2:] + offset], dim=1)
    return torchvision.ops.nms(boxes, scores.to(dtype), float(iou_threshold))


def _iou_one_to_many(box: np.ndarray, area: np.floating, boxes: np.ndarray, areas: np.ndarray,
                     offset: int) -> np.ndarray:
    """IoU of one (4,) box with (M, 4) boxes, mmcv's arithmetic (widths ``+ offset``)."""
    lt = np.maximum(box[:2], boxes[:, :2])                          # (M, 2)
    rb = np.minimum(box[2:], boxes[:, 2:])                          # (M, 2)
    wh = np.maximum(rb - lt + offset, 0)                            # (M, 2)
    inter = wh[:, 0] * wh[:, 1]
    return inter / (area + areas - inter)


def softnms(boxes: torch.Tensor, scores: torch.Tensor, dets: torch.Tensor, iou_threshold: float,
            sigma: float, min_score: float, method: int, offset: int) -> torch.Tensor:
    """Soft-NMS (``mmcv._ext.softnms``): fills ``dets[:n]`` with the kept boxes and their
    decayed scores in selection order and returns their indices (n,).

    One box is kept per step, so this is a loop; on NumPy arrays, in float32 as mmcv computes
    (mmcv's wrapper hands the boxes over on the CPU; a step of small torch ops costs ~30x more).
    """
    op = 'softnms'
    _check_boxes_scores(op, boxes, scores)
    check_tensor(op, 'dets', dets, shape=(boxes.size(0), DET_COLUMNS),
                 what='(N, 5) = (x1, y1, x2, y2, score)')
    offset = _check_offset(op, offset)
    if method not in (SOFTNMS_NAIVE, SOFTNMS_LINEAR, SOFTNMS_GAUSSIAN):
        raise OpInputError(f'{op}: method must be 0 (naive), 1 (linear) or 2 (gaussian), got '
                           f'{method!r}')
    if boxes.numel() == 0:
        return torch.empty(0, dtype=torch.long, device=boxes.device)
    box = boxes.detach().float().cpu().numpy()
    score = scores.detach().float().cpu().numpy().copy()
    area = (box[:, 2] - box[:, 0] + offset) * (box[:, 3] - box[:, 1] + offset)
    index = np.arange(box.shape[0])
    rows = np.empty((box.shape[0], DET_COLUMNS), dtype=np.float32)
    kept = np.empty(box.shape[0], dtype=np.int64)
    count = 0
    while index.size:
        best = int(np.argmax(score))  # first of equal maxima, as mmcv's scan
        kept[count] = index[best]
        rows[count, :4], rows[count, 4] = box[best], score[best]
        count += 1
        rest = np.arange(index.size) != best
        ovr = _iou_one_to_many(box[best], area[best], box[rest], area[rest], offset)
        if method == SOFTNMS_NAIVE:
            weight = np.where(ovr >= iou_threshold, 0.0, 1.0)
        elif method == SOFTNMS_LINEAR:
            weight = np.where(ovr >= iou_threshold, 1 - ovr, 1.0)
        else:
            weight = np.exp(-(ovr * ovr) / sigma)
        box, area, index = box[rest], area[rest], index[rest]
        score = (score[rest] * weight).astype(np.float32)
        alive = score >= min_score
        box, area, index, score = box[alive], area[alive], index[alive], score[alive]
    dets[:count] = torch.from_numpy(rows[:count]).to(dets)
    return torch.from_numpy(kept[:count]).to(boxes.device)


def nms_match(dets: torch.Tensor, iou_threshold: float) -> List[List[int]]:
    """Groups of box indices (``mmcv._ext.nms_match``): each kept box, by decreasing score,
    followed by the boxes it suppresses (IoU >= threshold), in score order. A loop over the kept
    boxes, on NumPy arrays as :func:`softnms` (mmcv's wrapper passes CPU boxes)."""
    op = 'nms_match'
    check_tensor(op, 'dets', dets, shape=(None, DET_COLUMNS),
                 what='(N, 5) = (x1, y1, x2, y2, score)')
    if dets.size(0) == 0:
        return []
    values = dets.detach().float().cpu().numpy()
    box = values[:, :4]
    area = (box[:, 2] - box[:, 0]) * (box[:, 3] - box[:, 1])
    order = np.argsort(-values[:, 4], kind='stable')
    suppressed = np.zeros(values.shape[0], dtype=bool)
    groups: List[List[int]] = []
    for position, i in enumerate(order.tolist()):
        if suppressed[i]:
            continue
        later = order[position + 1:]
        later = later[~suppressed[later]]
        ovr = _iou_one_to_many(box[i], area[i], box[later], area[later], offset=0)
        matched = later[ovr >= iou_threshold]
        suppressed[matched] = True
        groups.append([i] + matched.tolist())
    return groups


__all__ = ['FLOATING', 'nms', 'nms_match', 'softnms']
