"""LW-DETR / RF-DETR's set loss: per-group Hungarian matching, IoU-aware BCE, L1 + GIoU.

Group DETR trains ``num_groups`` query sets at once, each matched to the ground truth on its
own (:class:`SetCriterion`'s matching); the losses of all groups are summed and divided by the
number of ground-truth boxes times the number of groups.

IA-BCE (LW-DETR's IoU-aware classification loss) is a binary cross-entropy whose target is
``t = max(p^alpha IoU^(1-alpha), 0.01)`` at the matched class of a matched query (``p`` its
predicted probability, ``IoU`` of its box with the ground truth, both detached) and 0
elsewhere, weighted 1 at those positives and ``p^2`` elsewhere. That is mmdet's
``VarifocalLoss`` with ``alpha=1``, ``gamma=2`` and ``iou_weighted=False`` given ``t`` as its
soft target, so the loss itself is mmdet's; this module builds the target.
"""
from types import MappingProxyType
from typing import Any, Mapping, Optional, Sequence

import torch
from mmdet.structures.bbox import bbox_overlaps
from mmdet.utils import reduce_mean
from mmengine.structures import InstanceData
from torch import Tensor

from .set_criterion import SetCriterion, Targets, cxcywh_to_xyxy

#: IA-BCE as mmdet's VarifocalLoss (see the module docstring); RF-DETR's class weight 1.
IA_BCE_LOSS: Mapping[str, Any] = MappingProxyType(dict(
    type='VarifocalLoss', use_sigmoid=True, alpha=1.0, gamma=2.0, iou_weighted=False,
    loss_weight=1.0))
#: ``alpha`` of the IA-BCE target ``p^alpha IoU^(1-alpha)`` (RF-DETR's ``focal_alpha``).
SCORE_ALPHA = 0.25
#: Floor of the IA-BCE target at positives.
MIN_SCORE_TARGET = 0.01


class GroupSetCriterion(SetCriterion):
    """Group DETR set loss with IA-BCE classification: :class:`SetCriterion`'s arguments (its
    defaults, Hungarian with focal 2 / L1 5 / GIoU 2 costs and L1 5 / GIoU 2 losses, are
    RF-DETR's), ``loss_cls`` a soft-target loss (default :data:`IA_BCE_LOSS`)."""

    def __init__(self, num_classes: int, assigner: Optional[dict] = None,
                 loss_cls: Optional[dict] = None, loss_bbox: Optional[dict] = None,
                 loss_iou: Optional[dict] = None) -> None:
        super().__init__(num_classes, assigner, loss_cls or dict(IA_BCE_LOSS), loss_bbox,
                         loss_iou)

    def avg_factor(self, batch_gt_instances: Sequence[InstanceData], num_groups: int,
                   num_matched: int, like: Tensor) -> Tensor:
        """The losses' normaliser: ground-truth boxes times groups, averaged over ranks, >= 1."""
        num_gts = sum(len(gt) for gt in batch_gt_instances) * num_groups
        return reduce_mean(like.new_tensor(float(num_gts))).clamp(min=1)

    def classification_loss(self, cls_scores: Tensor, boxes: Tensor, targets: Targets,
                            avg: Tensor) -> Tensor:
        """IA-BCE on its soft target (module docstring; ``boxes (B, Q, 4)``: the predictions,
        whose IoU with the matched ground truth enters the target)."""
        c = cls_scores.shape[-1]
        with torch.no_grad():
            pred = boxes[targets.image, targets.query]                          # (P, 4)
            iou = bbox_overlaps(cxcywh_to_xyxy(pred), targets.boxes, is_aligned=True)
            prob = cls_scores[targets.image, targets.query, targets.label].sigmoid()
            score = (prob.pow(SCORE_ALPHA) * iou.pow(1 - SCORE_ALPHA)).clamp(min=MIN_SCORE_TARGET)
            soft = torch.zeros_like(cls_scores)
            soft[targets.image, targets.query, targets.label] = score
        return self.loss_cls(cls_scores.reshape(-1, c), soft.reshape(-1, c), avg_factor=avg)
