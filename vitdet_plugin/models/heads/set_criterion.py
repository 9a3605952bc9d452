"""Set prediction loss: Hungarian matching, then focal classification + L1 / GIoU box losses.

One criterion for every set-prediction head: query groups (Group DETR, one by default) are
matched each on its own; one-to-many matching (:meth:`SetCriterion.match_one_to_many`) serves
the dense losses of memory tokens; a subclass changes the classification target
(:meth:`SetCriterion.classification_loss`) or the normaliser
(:meth:`SetCriterion.avg_factor`), never the target loop or the box losses.

Matching and losses are mmdet's (``HungarianAssigner`` with its match costs, ``FocalLoss``,
``L1Loss``, ``GIoULoss``), built from config dicts; this module only arranges targets. Losses
are computed in fp32 whatever the autocast dtype of the predictions.
"""
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

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


def _cost_inputs(cls_score: Tensor, boxes: Tensor, gt_instances: InstanceData,
                 img_meta: dict) -> Tuple[InstanceData, InstanceData]:
    """One image's predictions (``(Q, K)`` logits, ``(Q, 4)`` normalised cxcywh) and ground truth
    as mmdet's match costs take them: fp32, boxes xyxy in pixels."""
    pred = InstanceData(scores=cls_score.float(),
                        bboxes=bbox_cxcywh_to_xyxy(boxes.float()) * _factor(img_meta, boxes))
    return pred, InstanceData(bboxes=gt_instances.bboxes.float(), labels=gt_instances.labels)


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
        """Hungarian matching for one image: ``(Q, num_classes)`` logits and ``(Q, 4)``
        normalised cxcywh boxes against ``gt_instances`` (``bboxes`` xyxy in ``img_shape``
        pixels, ``labels``; with ``masks``, the ``(Q, P)`` mask logits at sampled points, also
        their ``masks`` at those points) -> ``(query_inds, gt_inds)`` of the matched pairs."""
        pred, gt = _cost_inputs(cls_score, boxes, gt_instances, img_meta)
        if masks is not None:
            pred.masks, gt.masks = masks.float(), gt_instances.masks
        result = self.assigner.assign(pred_instances=pred, gt_instances=gt, img_meta=img_meta)
        query_inds = torch.nonzero(result.gt_inds > 0, as_tuple=False).squeeze(-1)
        return query_inds, result.gt_inds[query_inds] - 1

    @torch.no_grad()
    def match_one_to_many(self, cls_score: Tensor, boxes: Tensor, gt_instances: InstanceData,
                          img_meta: dict, k: int,
                          invalid: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """One-to-many matching for one image -> ``(query_inds, gt_inds)``: every ground-truth
        box takes the ``k`` predictions of lowest matching cost (the assigner's own costs), a
        prediction taken by several keeps the cheapest; ``invalid`` ``(Q,)`` predictions (padded
        tokens) are never taken. Dense supervision for the encoder's token predictions."""
        empty = boxes.new_zeros(0, dtype=torch.long)
        num_gts, num_preds = len(gt_instances), boxes.shape[0]
        if num_gts == 0 or num_preds == 0:
            return empty, empty
        costs = getattr(self.assigner, 'match_costs', None)
        if not costs:
            raise ValueError(f'one-to-many matching needs an assigner with match_costs (mmdet\'s '
                             f'HungarianAssigner), got {type(self.assigner).__name__}')
        pred, gt = _cost_inputs(cls_score, boxes, gt_instances, img_meta)
        cost = torch.stack([c(pred_instances=pred, gt_instances=gt, img_meta=img_meta)
                            for c in costs]).sum(0)                              # (Q, G)
        if invalid is not None:
            cost = cost.masked_fill(invalid[:, None], float('inf'))
        top = cost.topk(min(k, num_preds), dim=0, largest=False).indices        # (k, G)
        taken = torch.zeros_like(cost, dtype=torch.bool).scatter_(0, top, True)
        best_cost, best_gt = cost.masked_fill(~taken, float('inf')).min(1)       # (Q,)
        query_inds = torch.nonzero(torch.isfinite(best_cost), as_tuple=False).squeeze(-1)
        return query_inds, best_gt[query_inds]

    @torch.no_grad()
    def match_groups(self, cls_score: Tensor, boxes: Tensor, gt_instances: InstanceData,
                     img_meta: dict, num_groups: int = 1, masks: Optional[Tensor] = None,
                     one_to_many: Optional[int] = None,
                     invalid: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """:meth:`match` of each of ``num_groups`` consecutive query groups of one image
        (``cls_score (G*Q, K)``, ``boxes (G*Q, 4)``, optional mask logits at points
        ``(G*Q, P)``) -> ``(query_inds, gt_inds)``; with ``one_to_many=k``,
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

    def avg_factor(self, batch_gt_instances: Sequence[InstanceData], num_groups: int,
                   num_matched: int, like: Tensor) -> Tensor:
        """The losses' normaliser: the matched predictions, averaged over ranks, >= 1."""
        return reduce_mean(like.new_tensor(float(num_matched))).clamp(min=1)

    def classification_loss(self, cls_scores: Tensor, boxes: Tensor, targets: 'Targets',
                            avg: Tensor) -> Tensor:
        """``loss_cls`` of ``cls_scores (B, Q, K)`` on hard labels: the matched class at matched
        queries, background (``num_classes``) elsewhere (``boxes``: the predictions, for
        targets that weigh them)."""
        b, q, c = cls_scores.shape
        labels = cls_scores.new_full((b, q), self.num_classes, dtype=torch.long)
        labels[targets.image, targets.query] = targets.label
        return self.loss_cls(cls_scores.reshape(-1, c), labels.reshape(-1), avg_factor=avg)

    def forward(self, cls_scores: Tensor, boxes: Tensor,
                batch_gt_instances: Sequence[InstanceData], batch_img_metas: Sequence[dict],
                matches: Optional[List[Tuple[Tensor, Tensor]]] = None,
                num_groups: int = 1) -> Dict[str, Tensor]:
        """``loss_cls``, ``loss_bbox`` and ``loss_iou`` of one prediction set: logits
        ``cls_scores (B, G*Q, num_classes)`` and normalised cxcywh ``boxes (B, G*Q, 4)``, each
        of the ``num_groups`` query groups (Group DETR) matched to the ground truth alone, or
        the given ``matches``: per image ``(query_inds, gt_inds)`` (e.g. denoising queries,
        whose targets are known)."""
        cls_scores, boxes = cls_scores.float(), boxes.float()
        b, num_queries, c = cls_scores.shape
        if c != self.num_classes or num_queries % num_groups:
            raise ValueError(f'cls_scores {tuple(cls_scores.shape)} must have {self.num_classes}'
                             f' classes and a query count divisible by num_groups={num_groups}')
        if matches is None:
            matches = [self.match_groups(cls_scores[i], boxes[i], batch_gt_instances[i],
                                         batch_img_metas[i], num_groups) for i in range(b)]
        targets = Targets.of(matches, batch_gt_instances, batch_img_metas, boxes)
        avg = self.avg_factor(batch_gt_instances, num_groups, len(targets.query), cls_scores)
        loss_cls = self.classification_loss(cls_scores, boxes, targets, avg)
        pred = boxes[targets.image, targets.query]                              # (P, 4)
        if len(targets.query) == 0:
            zero = boxes.sum() * 0
            return dict(loss_cls=loss_cls, loss_bbox=zero, loss_iou=zero)
        loss_bbox = self.loss_bbox(pred, bbox_xyxy_to_cxcywh(targets.boxes), avg_factor=avg)
        loss_iou = self.loss_iou(cxcywh_to_xyxy(pred) * targets.factor,
                                 targets.boxes * targets.factor, avg_factor=avg)
        return dict(loss_cls=loss_cls, loss_bbox=loss_bbox, loss_iou=loss_iou)


class Targets(NamedTuple):
    """The matched pairs of a batch, flattened: each pair's image, query and label ``(P,)``,
    its ground-truth box ``(P, 4)`` xyxy normalised by its image and the image's
    ``[w, h, w, h]`` ``(P, 4)``."""
    image: Tensor
    query: Tensor
    label: Tensor
    boxes: Tensor
    factor: Tensor

    @classmethod
    def of(cls, matches: Sequence[Tuple[Tensor, Tensor]],
           batch_gt_instances: Sequence[InstanceData], batch_img_metas: Sequence[dict],
           like: Tensor) -> 'Targets':
        """Per image ``(query_inds, gt_inds)`` -> :class:`Targets`."""
        images, queries, labels, boxes, factors = [], [], [], [], []
        for i, (q_inds, g_inds) in enumerate(matches):
            gt = batch_gt_instances[i]
            factor = _factor(batch_img_metas[i], like).expand(len(q_inds), 4)
            images.append(torch.full_like(q_inds, i))
            queries.append(q_inds)
            labels.append(gt.labels[g_inds].to(q_inds.device))
            boxes.append(gt.bboxes[g_inds].float().to(like.device) / factor)
            factors.append(factor)
        return cls(torch.cat(images), torch.cat(queries), torch.cat(labels), torch.cat(boxes),
                   torch.cat(factors))
