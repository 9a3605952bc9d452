"""LW-DETR / RF-DETR's set loss: per-group Hungarian matching, IoU-aware BCE, L1 + GIoU.

Group DETR trains ``num_groups`` query sets at once: each group is matched to the ground truth
on its own (mmdet's ``HungarianAssigner`` with focal / L1 / GIoU costs, as
:class:`SetCriterion`), and the losses of all groups are summed and divided by the number of
ground-truth boxes times the number of groups.

IA-BCE (LW-DETR's IoU-aware classification loss) is a binary cross-entropy whose target is
``t = max(p^alpha IoU^(1-alpha), 0.01)`` at the matched class of a matched query (``p`` its
predicted probability, ``IoU`` of its box with the ground truth, both detached) and 0
elsewhere, weighted 1 at those positives and ``p^2`` elsewhere. That is mmdet's
``VarifocalLoss`` with ``alpha=1``, ``gamma=2`` and ``iou_weighted=False`` given ``t`` as its
soft target, so the loss itself is mmdet's; this module builds the target.
"""
from types import MappingProxyType
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from mmdet.structures.bbox import bbox_overlaps, bbox_xyxy_to_cxcywh
from mmdet.utils import reduce_mean
from mmengine.structures import InstanceData
from torch import Tensor

from .set_criterion import SetCriterion, _factor, cxcywh_to_xyxy

#: IA-BCE as mmdet's VarifocalLoss (see the module docstring); RF-DETR's class weight 1.
IA_BCE_LOSS: Mapping[str, Any] = MappingProxyType(dict(
    type='VarifocalLoss', use_sigmoid=True, alpha=1.0, gamma=2.0, iou_weighted=False,
    loss_weight=1.0))
#: ``alpha`` of the IA-BCE target ``p^alpha IoU^(1-alpha)`` (RF-DETR's ``focal_alpha``).
SCORE_ALPHA = 0.25
#: Floor of the IA-BCE target at positives.
MIN_SCORE_TARGET = 0.01


class GroupSetCriterion(SetCriterion):
    """Group DETR set loss with IA-BCE classification.

    Args:
        num_classes: foreground classes.
        assigner: ``TASK_UTILS`` config of the matcher (default: :class:`SetCriterion`'s,
            Hungarian with focal 2 / L1 5 / GIoU 2 costs, RF-DETR's).
        loss_cls: soft-target classification loss (default: :data:`IA_BCE_LOSS`).
        loss_bbox, loss_iou: box losses (default: L1 5, GIoU 2, RF-DETR's).
        score_alpha: ``alpha`` of the IA-BCE target.
    """

    def __init__(self, num_classes: int, assigner: Optional[dict] = None,
                 loss_cls: Optional[dict] = None, loss_bbox: Optional[dict] = None,
                 loss_iou: Optional[dict] = None, score_alpha: float = SCORE_ALPHA) -> None:
        super().__init__(num_classes, assigner, loss_cls or dict(IA_BCE_LOSS), loss_bbox,
                         loss_iou)
        self.score_alpha = score_alpha

    @torch.no_grad()
    def match_groups(self, cls_score: Tensor, boxes: Tensor, gt_instances: InstanceData,
                     img_meta: dict, num_groups: int, masks: Optional[Tensor] = None,
                     one_to_many: Optional[int] = None,
                     invalid: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """Hungarian matching of each of ``num_groups`` consecutive query groups of one image
        (``cls_score (G*Q, K)``, ``boxes (G*Q, 4)``, optional mask logits at points
        ``(G*Q, P)``, see :meth:`match`) -> ``(query_inds, gt_inds)``; with ``one_to_many=k``,
        :meth:`match_one_to_many` of each group instead (``invalid (G*Q,)`` never taken)."""
        per_group = cls_score.shape[0] // num_groups
        query_inds, gt_inds = [], []
        for g in range(num_groups):
            part = slice(g * per_group, (g + 1) * per_group)
            if one_to_many is None:
                q, gt = self.match(cls_score[part], boxes[part], gt_instances, img_meta,
                                   None if masks is None else masks[part])
            else:
                q, gt = self.match_one_to_many(cls_score[part], boxes[part], gt_instances,
                                               img_meta, one_to_many,
                                               None if invalid is None else invalid[part])
            query_inds.append(q + g * per_group)
            gt_inds.append(gt)
        return torch.cat(query_inds), torch.cat(gt_inds)

    @staticmethod
    def avg_factor(batch_gt_instances: Sequence[InstanceData], num_groups: int,
                   like: Tensor) -> Tensor:
        """The losses' normaliser: ground-truth boxes times groups, averaged over ranks, >= 1."""
        num_gts = sum(len(gt) for gt in batch_gt_instances) * num_groups
        return reduce_mean(like.new_tensor(float(num_gts))).clamp(min=1)

    def forward(self, cls_scores: Tensor, boxes: Tensor,
                batch_gt_instances: Sequence[InstanceData], batch_img_metas: Sequence[dict],
                matches: Optional[List[Tuple[Tensor, Tensor]]] = None,
                num_groups: int = 1) -> Dict[str, Tensor]:
        """Losses of one prediction set ``cls_scores (B, G*Q, K)`` / ``boxes (B, G*Q, 4)``
        (normalised cxcywh), its ``num_groups`` query groups matched separately (or the given
        ``matches``); normalised by ground-truth boxes times groups, averaged over ranks."""
        cls_scores, boxes = cls_scores.float(), boxes.float()
        b, num_queries, c = cls_scores.shape
        if c != self.num_classes or num_queries % num_groups:
            raise ValueError(f'cls_scores {tuple(cls_scores.shape)} must have {self.num_classes}'
                             f' classes and a query count divisible by num_groups={num_groups}')
        if matches is None:
            matches = [self.match_groups(cls_scores[i], boxes[i], batch_gt_instances[i],
                                         batch_img_metas[i], num_groups) for i in range(b)]
        avg = self.avg_factor(batch_gt_instances, num_groups, cls_scores)
        images, queries, labels, targets, factors = [], [], [], [], []
        for i, (q_inds, g_inds) in enumerate(matches):
            gt = batch_gt_instances[i]
            factor = _factor(batch_img_metas[i], boxes).expand(len(q_inds), 4)
            images.append(torch.full_like(q_inds, i))
            queries.append(q_inds)
            labels.append(gt.labels[g_inds].to(q_inds.device))
            targets.append(gt.bboxes[g_inds].float() / factor)                   # xyxy in [0, 1]
            factors.append(factor)
        image, query, label = torch.cat(images), torch.cat(queries), torch.cat(labels)
        pred, target = boxes[image, query], torch.cat(targets)                   # (P, 4)
        with torch.no_grad():
            iou = bbox_overlaps(cxcywh_to_xyxy(pred), target, is_aligned=True)
            prob = cls_scores[image, query, label].sigmoid()
            score = (prob.pow(self.score_alpha) * iou.pow(1 - self.score_alpha)).clamp(
                min=MIN_SCORE_TARGET)
            soft = torch.zeros_like(cls_scores)
            soft[image, query, label] = score
        loss_cls = self.loss_cls(cls_scores.reshape(-1, c), soft.reshape(-1, c), avg_factor=avg)
        factor = torch.cat(factors)
        loss_bbox = self.loss_bbox(pred, bbox_xyxy_to_cxcywh(target), avg_factor=avg)
        loss_iou = self.loss_iou(cxcywh_to_xyxy(pred) * factor, target * factor,
                                 avg_factor=avg)
        return dict(loss_cls=loss_cls, loss_bbox=loss_bbox, loss_iou=loss_iou)
