"""Set prediction loss: Hungarian matching, then focal classification + L1 / GIoU box losses.

Matching and losses are mmdet's (``HungarianAssigner`` with its match costs, ``FocalLoss``,
``L1Loss``, ``GIoULoss``), built from config dicts; this module only arranges targets. Losses
are computed in fp32 whatever the autocast dtype of the predictions.
"""
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from mmdet.models.task_modules.assigners.match_cost import IoUCost
from mmdet.registry import MODELS, TASK_UTILS
from mmdet.structures.bbox import bbox_cxcywh_to_xyxy, bbox_xyxy_to_cxcywh
from mmdet.utils import reduce_mean
from mmengine.structures import InstanceData
from torch import Tensor, nn

DEFAULT_ASSIGNER = dict(
    type='HungarianAssigner',
    match_costs=[
        dict(type='FocalLossCost', weight=2.0),
        dict(type='BBoxL1Cost', weight=5.0, box_format='xywh'),
        dict(type='ClampedIoUCost', iou_mode='giou', weight=2.0)
    ])
DEFAULT_LOSS_CLS = dict(type='FocalLoss', use_sigmoid=True, gamma=2.0, alpha=0.25,
                        loss_weight=2.0)
DEFAULT_LOSS_BBOX = dict(type='L1Loss', loss_weight=5.0)
DEFAULT_LOSS_IOU = dict(type='GIoULoss', loss_weight=2.0)


def cxcywh_to_xyxy(boxes: Tensor) -> Tensor:
    """``(..., 4)`` cxcywh -> xyxy with a negative width or height read as 0, as RF-DETR's
    ``box_ops`` (a query on a raw learned reference box can predict one; sigmoid boxes never
    do, so DETR's are unchanged)."""
    return bbox_cxcywh_to_xyxy(torch.cat((boxes[..., :2], boxes[..., 2:].clamp(min=0)), -1))


@TASK_UTILS.register_module()
class ClampedIoUCost(IoUCost):
    """mmdet's ``IoUCost`` with an inverted predicted box (``x2 < x1`` or ``y2 < y1``: a
    negative predicted size) read as zero-sized at its centre, as RF-DETR's matcher does; the
    L1 cost (``BBoxL1Cost``) still sees the size as predicted, as RF-DETR's."""

    def __call__(self, pred_instances: InstanceData, gt_instances: InstanceData,
                 img_meta: Optional[dict] = None, **kwargs) -> Tensor:
        xyxy = pred_instances.bboxes
        clamped = InstanceData(bboxes=cxcywh_to_xyxy(bbox_xyxy_to_cxcywh(xyxy)))
        return super().__call__(clamped, gt_instances, img_meta, **kwargs)


def _factor(img_meta: dict, like: Tensor) -> Tensor:
    """``(1, 4)`` ``[w, h, w, h]`` of the image (boxes are normalised by ``img_shape``)."""
    img_h, img_w = img_meta['img_shape'][:2]
    return like.new_tensor([img_w, img_h, img_w, img_h])[None]


class SetCriterion(nn.Module):
    """One-to-one matched set loss of DETR-style predictions.

    Args:
        num_classes: foreground classes (sigmoid classification, no background logit).
        assigner: ``TASK_UTILS`` config of the matcher (default: Hungarian with focal 2.0,
            L1 5.0, GIoU 2.0 costs).
        loss_cls, loss_bbox, loss_iou: ``MODELS`` configs of the losses.
    """

    def __init__(self, num_classes: int, assigner: Optional[dict] = None,
                 loss_cls: Optional[dict] = None, loss_bbox: Optional[dict] = None,
                 loss_iou: Optional[dict] = None) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.assigner = TASK_UTILS.build(assigner or DEFAULT_ASSIGNER)
        self.loss_cls = MODELS.build(loss_cls or DEFAULT_LOSS_CLS)
        if not getattr(self.loss_cls, 'use_sigmoid', False):
            raise ValueError(f'loss_cls={loss_cls} must be a sigmoid classification loss '
                             "(e.g. dict(type='FocalLoss', use_sigmoid=True)); the head has no "
                             'background logit')
        self.loss_bbox = MODELS.build(loss_bbox or DEFAULT_LOSS_BBOX)
        self.loss_iou = MODELS.build(loss_iou or DEFAULT_LOSS_IOU)

    @torch.no_grad()
    def match(self, cls_score: Tensor, boxes: Tensor, gt_instances: InstanceData,
              img_meta: dict, masks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """Hungarian matching for one image.

        Args:
            cls_score: logits ``(Q, num_classes)``.
            boxes: normalised cxcywh ``(Q, 4)``.
            gt_instances: ``bboxes`` (xyxy, pixels of the ``img_shape`` frame) and ``labels``;
                with ``masks``, also ``masks`` (the ground truth at the same points).
            masks: mask logits ``(Q, P)`` at sampled points, for the assigner's mask costs.

        Returns:
            ``(query_inds, gt_inds)`` of the matched pairs.
        """
        pred = InstanceData(scores=cls_score.float(),
                            bboxes=bbox_cxcywh_to_xyxy(boxes.float()) * _factor(img_meta, boxes))
        gt = InstanceData(bboxes=gt_instances.bboxes.float(), labels=gt_instances.labels)
        if masks is not None:
            pred.masks, gt.masks = masks.float(), gt_instances.masks
        result = self.assigner.assign(pred_instances=pred, gt_instances=gt, img_meta=img_meta)
        query_inds = torch.nonzero(result.gt_inds > 0, as_tuple=False).squeeze(-1)
        return query_inds, result.gt_inds[query_inds] - 1

    @torch.no_grad()
    def match_one_to_many(self, cls_score: Tensor, boxes: Tensor, gt_instances: InstanceData,
                          img_meta: dict, k: int,
                          invalid: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """One-to-many matching for one image: every ground-truth box takes the ``k``
        predictions of lowest matching cost (the assigner's own costs), a prediction taken by
        several keeps the cheapest; ``invalid`` ``(Q,)`` predictions (padded tokens) are never
        taken. Dense supervision for the encoder's token predictions (hybrid matching).

        Returns:
            ``(query_inds, gt_inds)`` of the matched pairs, at most ``k`` per ground truth.
        """
        empty = boxes.new_zeros(0, dtype=torch.long)
        num_gts, num_preds = len(gt_instances), boxes.shape[0]
        if num_gts == 0 or num_preds == 0:
            return empty, empty
        pred = InstanceData(scores=cls_score.float(),
                            bboxes=bbox_cxcywh_to_xyxy(boxes.float()) * _factor(img_meta, boxes))
        gt = InstanceData(bboxes=gt_instances.bboxes.float(), labels=gt_instances.labels)
        cost = torch.stack([c(pred_instances=pred, gt_instances=gt, img_meta=img_meta)
                            for c in self.match_costs]).sum(0)                   # (Q, G)
        if invalid is not None:
            cost = cost.masked_fill(invalid[:, None], float('inf'))
        top = cost.topk(min(k, num_preds), dim=0, largest=False).indices        # (k, G)
        taken = torch.zeros_like(cost, dtype=torch.bool).scatter_(0, top, True)
        best_cost, best_gt = cost.masked_fill(~taken, float('inf')).min(1)       # (Q,)
        query_inds = torch.nonzero(torch.isfinite(best_cost), as_tuple=False).squeeze(-1)
        return query_inds, best_gt[query_inds]

    @property
    def match_costs(self) -> List[nn.Module]:
        """The assigner's weighted match costs (mmdet's ``HungarianAssigner.match_costs``)."""
        costs = getattr(self.assigner, 'match_costs', None)
        if not costs:
            raise ValueError(f'one-to-many matching needs an assigner with match_costs (mmdet\'s '
                             f'HungarianAssigner), got {type(self.assigner).__name__}')
        return list(costs)

    def forward(self, cls_scores: Tensor, boxes: Tensor,
                batch_gt_instances: Sequence[InstanceData], batch_img_metas: Sequence[dict],
                matches: Optional[List[Tuple[Tensor, Tensor]]] = None) -> Dict[str, Tensor]:
        """Losses of one prediction set.

        Args:
            cls_scores: logits ``(B, Q, num_classes)``.
            boxes: normalised cxcywh ``(B, Q, 4)``.
            batch_gt_instances, batch_img_metas: per image.
            matches: precomputed ``(query_inds, gt_inds)`` per image (e.g. denoising queries,
                whose targets are known); Hungarian matching when None.

        Returns:
            ``loss_cls``, ``loss_bbox``, ``loss_iou``.
        """
        cls_scores, boxes = cls_scores.float(), boxes.float()
        b, q, c = cls_scores.shape
        if c != self.num_classes:
            raise ValueError(f'cls_scores have {c} classes, the criterion {self.num_classes}')
        if matches is None:
            matches = [self.match(cls_scores[i], boxes[i], batch_gt_instances[i],
                                  batch_img_metas[i]) for i in range(b)]
        labels = cls_scores.new_full((b, q), self.num_classes, dtype=torch.long)
        pos_pred, pos_tgt, factors = [], [], []
        for i, (q_inds, g_inds) in enumerate(matches):
            gt = batch_gt_instances[i]
            labels[i, q_inds] = gt.labels[g_inds].to(labels.device)
            pos_pred.append(boxes[i, q_inds])
            factor = _factor(batch_img_metas[i], boxes)
            pos_tgt.append(gt.bboxes[g_inds].float() / factor)
            factors.append(factor.expand(len(q_inds), 4))
        num_pos = sum(len(m[0]) for m in matches)
        avg = torch.clamp(reduce_mean(cls_scores.new_tensor([float(num_pos)])), min=1).item()
        loss_cls = self.loss_cls(cls_scores.reshape(-1, c), labels.reshape(-1), avg_factor=avg)
        pred = torch.cat(pos_pred)
        if num_pos == 0:
            zero = boxes.sum() * 0
            return dict(loss_cls=loss_cls, loss_bbox=zero, loss_iou=zero)
        target_xyxy = torch.cat(pos_tgt)
        factor = torch.cat(factors)
        loss_bbox = self.loss_bbox(pred, bbox_xyxy_to_cxcywh(target_xyxy), avg_factor=avg)
        loss_iou = self.loss_iou(cxcywh_to_xyxy(pred) * factor, target_xyxy * factor,
                                 avg_factor=avg)
        return dict(loss_cls=loss_cls, loss_bbox=loss_bbox, loss_iou=loss_iou)
