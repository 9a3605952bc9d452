"""The loss terms of D-FINE and DEIMv2 for one set of predictions and its matching.

Every term takes the predictions ``logits (B, Q, K)``, ``boxes (B, Q, 4)`` (cxcywh in [0, 1]),
the matched pairs (``Matched``: batch and query indices of the matched predictions, their
targets' labels and cxcywh boxes) and ``num_boxes``, the normaliser (ground-truth count):

- :func:`vfl_loss`: varifocal loss, positives' targets are their IoU with the matched box;
- :func:`mal_loss`: DEIM's matching-aware loss, targets ``IoU^gamma``, positives weighted 1;
- :func:`box_losses`: L1 and GIoU of the matched boxes;
- :func:`fgl_loss`: fine-grained localisation, the edge distributions against the target edges
  as a two-bin interpolation of :func:`~vitdet_plugin.models.heads.dfine_layers.
  weighting_function` (:func:`box_to_distance`), IoU-weighted;
- :func:`ddf_loss`: decoupled distillation focal loss (GO-LSD), KL divergence of the edge
  distributions to a teacher layer's, weighted by IoU (matched) or teacher confidence (others),
  matched and unmatched means mixed by the square roots of their counts per image.
"""
from typing import NamedTuple, Tuple, Union

import torch
import torch.nn.functional as F
from mmdet.structures.bbox import bbox_overlaps
from torch import Tensor

#: a ground-truth count: a number, or a tensor averaged over the processes.
Count = Union[float, Tensor]


class Matched(NamedTuple):
    """Matched pairs: ``batch``, ``query`` (M,) indices of the predictions; their targets'
    ``labels (M,)`` and cxcywh ``boxes (M, 4)``."""
    batch: Tensor
    query: Tensor
    labels: Tensor
    boxes: Tensor


def cxcywh_to_xyxy(boxes: Tensor) -> Tensor:
    """``(..., 4)`` centre / size -> corners."""
    return torch.cat([boxes[..., :2] - 0.5 * boxes[..., 2:],
                      boxes[..., :2] + 0.5 * boxes[..., 2:]], dim=-1)


def matched_iou(boxes: Tensor, matched: Matched) -> Tensor:
    """IoU ``(M,)`` of the matched predictions with their targets (no gradient)."""
    pred = boxes[matched.batch, matched.query].detach()
    return bbox_overlaps(cxcywh_to_xyxy(pred), cxcywh_to_xyxy(matched.boxes), is_aligned=True)


def _class_targets(logits: Tensor, matched: Matched, iou: Tensor) -> Tuple[Tensor, Tensor]:
    """One-hot ``(B, Q, K)`` of the matched classes and the same times the IoU."""
    onehot = torch.zeros_like(logits)
    onehot[matched.batch, matched.query, matched.labels] = 1.0
    score = torch.zeros(logits.shape[:2], dtype=logits.dtype, device=logits.device)
    score[matched.batch, matched.query] = iou.to(logits.dtype)
    return onehot, onehot * score[..., None]


def _per_query_sum(loss: Tensor, num_boxes: Count) -> Tensor:
    """``(B, Q, K)`` -> sum over queries of the class-mean, per ground-truth box."""
    return loss.mean(1).sum() * loss.shape[1] / num_boxes


def vfl_loss(logits: Tensor, boxes: Tensor, matched: Matched, num_boxes: Count,
             alpha: float = 0.75, gamma: float = 2.0) -> Tensor:
    """Varifocal loss: BCE to ``IoU`` on the matched class, to 0 elsewhere, negatives
    weighted ``alpha p^gamma``, positives by their IoU."""
    onehot, target = _class_targets(logits, matched, matched_iou(boxes, matched))
    weight = alpha * logits.detach().sigmoid().pow(gamma) * (1 - onehot) + target
    loss = F.binary_cross_entropy_with_logits(logits, target, weight=weight, reduction='none')
    return _per_query_sum(loss, num_boxes)


def mal_loss(logits: Tensor, boxes: Tensor, matched: Matched, num_boxes: Count,
             gamma: float = 2.0, alpha: float | None = None) -> Tensor:
    """Matching-aware loss: BCE to ``IoU^gamma`` on the matched class, positives weighted 1,
    negatives ``p^gamma`` (times ``alpha`` when given)."""
    onehot, target = _class_targets(logits, matched, matched_iou(boxes, matched))
    negative = logits.detach().sigmoid().pow(gamma) * (1 - onehot)
    weight = (negative if alpha is None else alpha * negative) + onehot
    loss = F.binary_cross_entropy_with_logits(logits, target.pow(gamma), weight=weight,
                                              reduction='none')
    return _per_query_sum(loss, num_boxes)


def box_losses(boxes: Tensor, matched: Matched, num_boxes: Count) -> Tuple[Tensor, Tensor]:
    """L1 (cxcywh) and ``1 - GIoU`` of the matched boxes, each summed per ground-truth box."""
    pred = boxes[matched.batch, matched.query]
    l1 = F.l1_loss(pred, matched.boxes, reduction='none').sum() / num_boxes
    giou = bbox_overlaps(cxcywh_to_xyxy(pred), cxcywh_to_xyxy(matched.boxes), mode='giou',
                         is_aligned=True)
    return l1, (1 - giou).sum() / num_boxes


def box_to_distance(ref: Tensor, target_xyxy: Tensor, project: Tensor, reg_scale: float,
                    eps: float = 0.1) -> Tuple[Tensor, Tensor, Tensor]:
    """Target edges as bins: ``(N, 4)`` reference cxcywh and target xyxy boxes -> flat
    ``(4 N,)`` fractional left-bin index (clamped to ``[0, reg_max - eps]``), right and left
    interpolation weights over the bin values ``project``."""
    reg_max = project.numel() - 1
    reg_scale = abs(reg_scale)
    unit = torch.cat([ref[:, 2:], ref[:, 2:]], dim=-1) / reg_scale + 1e-16   # (N, 4)
    edges = torch.cat([ref[:, :2] - target_xyxy[:, :2], target_xyxy[:, 2:] - ref[:, :2]], -1)
    dist = (edges / unit - 0.5 * reg_scale).reshape(-1)                     # (4 N,)
    left = (project[None] <= dist[:, None]).sum(1) - 1                      # (4 N,)
    inside = (left >= 0) & (left < reg_max)
    low = project[left.clamp(0, reg_max - 1)]
    high = project[left.clamp(0, reg_max - 1) + 1]
    low_diff, high_diff = (dist - low).abs(), (high - dist).abs()
    right_w = torch.where(inside, low_diff / (low_diff + high_diff),
                          (left >= reg_max).to(dist.dtype))
    index = torch.where(left < 0, 0.0, torch.where(left >= reg_max, reg_max - 0.1,
                                                    left.to(dist.dtype)))
    return index.clamp(0, reg_max - eps), right_w, 1 - right_w


def fgl_loss(corners: Tensor, ref: Tensor, boxes: Tensor, matched: Matched, num_boxes: Count,
             project: Tensor, reg_scale: float) -> Tensor:
    """Fine-grained localisation: cross-entropy of the matched edge distributions ``corners
    (B, Q, 4 (R + 1))`` to the two bins around the target edge (relative to the reference
    ``ref (B, Q, 4)``), interpolation-weighted and IoU-weighted, per ground-truth box."""
    bins = project.numel()
    pred = corners[matched.batch, matched.query].reshape(-1, bins)          # (4 M, R + 1)
    with torch.no_grad():
        index, right_w, left_w = box_to_distance(
            ref[matched.batch, matched.query].detach(), cxcywh_to_xyxy(matched.boxes),
            project, reg_scale)
    weight = matched_iou(boxes, matched)[:, None].expand(-1, 4).reshape(-1)
    left = index.long()
    loss = (F.cross_entropy(pred, left, reduction='none') * left_w
            + F.cross_entropy(pred, left + 1, reduction='none') * right_w)
    return (loss * weight).sum() / num_boxes


def ddf_loss(corners: Tensor, teacher_corners: Tensor, teacher_logits: Tensor, boxes: Tensor,
             matched: Matched, temperature: float = 5.0) -> Tensor:
    """Decoupled distillation focal loss of ``corners (B, Q, 4 (R + 1))`` to the teacher's.

    Per edge: ``T^2 KL(softmax(teacher / T) || softmax(corners / T))`` weighted by the IoU
    (matched queries) or the teacher's top class probability (others); the matched and
    unmatched means are mixed with weights ``sqrt(count / B)``."""
    bins = corners.shape[-1] // 4
    bs = corners.shape[0]
    weight = teacher_logits.detach().sigmoid().max(-1).values                 # (B, Q)
    weight = weight.index_put((matched.batch, matched.query),
                              matched_iou(boxes, matched).to(weight.dtype))
    positive = torch.zeros_like(weight, dtype=torch.bool)
    positive[matched.batch, matched.query] = True
    weight = weight[..., None].expand(-1, -1, 4).reshape(-1)                   # (B Q 4,)
    positive = positive[..., None].expand(-1, -1, 4).reshape(-1)
    kl = F.kl_div(F.log_softmax(corners.reshape(-1, bins) / temperature, dim=1),
                  F.softmax(teacher_corners.detach().reshape(-1, bins) / temperature, dim=1),
                  reduction='none').sum(-1)
    loss = weight * temperature ** 2 * kl
    num_pos = positive.sum().to(loss.dtype)
    num_neg = (~positive).sum().to(loss.dtype)
    mean_pos = (loss * positive).sum() / num_pos.clamp(min=1)
    mean_neg = (loss * ~positive).sum() / num_neg.clamp(min=1)
    scale_pos, scale_neg = (num_pos / bs).sqrt(), (num_neg / bs).sqrt()
    return (mean_pos * scale_pos + mean_neg * scale_neg) / (scale_pos + scale_neg)
