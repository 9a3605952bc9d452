"""RF-DETR-Seg's set loss: :class:`GroupSetCriterion` with mask costs and point-sampled mask
losses.

Masks are the dot products of per-pixel embeddings ``(C, Hm, Wm)`` (a quarter of the padded
batch) with per-query embeddings, plus one learned bias; they are never formed for every query:

* matching: one set of random points per prediction set (all images and groups share it); the
  point logits of every query and the ground truth at those points (nearest) feed mmdet's
  ``CrossEntropyLossCost`` and ``DiceCost`` beside the box costs (RF-DETR's weights 5 / 5);
* losses: the full masks of the matched queries only, sampled at PointRend's points (3x
  oversampled, 75 % most uncertain, the rest random) -> mmdet's sigmoid ``CrossEntropyLoss``
  and ``DiceLoss`` (5 / 5), normalised like the box losses (ground truths x groups).

Points sample with border padding, as RF-DETR (mmcv's ``point_sample`` defaults to zeros);
ground-truth masks are taken in the padded batch frame (zero outside the image).
"""
from types import MappingProxyType
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from mmcv.ops import point_sample
from mmdet.registry import MODELS
from mmengine.structures import InstanceData
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from .detr_core import gather_rows
from .lwdetr_loss import GroupSetCriterion
from .set_criterion import DEFAULT_ASSIGNER

#: RF-DETR's mask cost and loss weights (``mask_ce_loss_coef``, ``mask_dice_loss_coef``).
MASK_CE_WEIGHT = 5.0
MASK_DICE_WEIGHT = 5.0
#: RF-DETR-Seg's matcher: the detection costs plus sigmoid BCE and (naive, +1 smoothed) Dice.
MASK_ASSIGNER: Mapping[str, Any] = MappingProxyType(dict(
    type='HungarianAssigner',
    match_costs=[
        *DEFAULT_ASSIGNER['match_costs'],
        dict(type='CrossEntropyLossCost', use_sigmoid=True, weight=MASK_CE_WEIGHT),
        dict(type='DiceCost', pred_act=True, eps=1.0, naive_dice=True, weight=MASK_DICE_WEIGHT),
    ]))
MASK_LOSS: Mapping[str, Any] = MappingProxyType(dict(
    type='CrossEntropyLoss', use_sigmoid=True, loss_weight=MASK_CE_WEIGHT))
DICE_LOSS: Mapping[str, Any] = MappingProxyType(dict(
    type='DiceLoss', use_sigmoid=True, activate=True, naive_dice=True, eps=1.0,
    loss_weight=MASK_DICE_WEIGHT))
#: Pixels per sampled point (RF-DETR's ``mask_point_sample_ratio``).
POINT_SAMPLE_RATIO = 16
#: PointRend's training points: candidates per point, share taken by uncertainty.
OVERSAMPLE_RATIO = 3
IMPORTANCE_SAMPLE_RATIO = 0.75


class LayerMasks(NamedTuple):
    """One prediction set's mask embeddings: pixels ``(B, C, Hm, Wm)``, queries
    ``(B, G*Q, C)`` and the bias ``(1,)``; mask logits are ``pixels . query + bias``."""
    pixels: Tensor
    queries: Tensor
    bias: Tensor

    def logits(self, queries: Optional[Tensor] = None) -> Tensor:
        """Mask logits of every query ``(B, G*Q, Hm, Wm)``, or of the ``(B, k)`` ``queries``
        only, ``(B, k, Hm, Wm)``."""
        embed = self.queries if queries is None else gather_rows(self.queries, queries)
        return torch.einsum('bchw,bqc->bqhw', self.pixels, embed) + self.bias


def sample_points(x: Tensor, points: Tensor, mode: str = 'bilinear') -> Tensor:
    """``x (N, C, H, W)`` at ``points (N, P, 2)`` (``(x, y)`` in ``[0, 1]`` of the map) ->
    ``(N, C, P)``; border padding (RF-DETR's)."""
    return point_sample(x, points, align_corners=False, mode=mode, padding_mode='border')


def uncertain_points(logits: Tensor, num_points: int) -> Tensor:
    """PointRend's training points of ``logits (N, 1, H, W)`` -> ``(N, num_points, 2)``: of
    :data:`OVERSAMPLE_RATIO` x ``num_points`` random points the
    :data:`IMPORTANCE_SAMPLE_RATIO` share with the smallest ``|logit|``, then fresh random
    ones (mmdet's ``get_uncertain_point_coords_with_randomness`` with border padding)."""
    n = logits.shape[0]
    candidates = torch.rand(n, num_points * OVERSAMPLE_RATIO, 2, device=logits.device)
    uncertainty = -sample_points(logits, candidates)[:, 0].abs()               # (N, 3P)
    num_uncertain = int(IMPORTANCE_SAMPLE_RATIO * num_points)
    top = uncertainty.topk(num_uncertain, dim=1).indices                       # (N, k)
    chosen = candidates.gather(1, top[..., None].expand(-1, -1, 2))           # (N, k, 2)
    fresh = torch.rand(n, num_points - num_uncertain, 2, device=logits.device)
    return torch.cat((chosen, fresh), 1)


def gt_mask_tensor(gt_instances: InstanceData, img_meta: dict, like: Tensor) -> Tensor:
    """One image's ground-truth masks (mmdet ``BitmapMasks`` or a tensor, in the image or the
    padded frame) -> ``(n, H, W)`` float in the padded batch frame: ``batch_input_shape``, or
    ``mask_batch_shape`` where a batch resize left the masks at their resolution (the losses
    sample them at normalised points, which the uniform resize does not move)."""
    masks = gt_instances.masks
    if hasattr(masks, 'to_tensor'):
        masks = masks.to_tensor(dtype=like.dtype, device=like.device)
    masks = masks.to(like)
    batch_h, batch_w = img_meta.get('mask_batch_shape', img_meta['batch_input_shape'])
    h, w = masks.shape[-2:]
    if h > batch_h or w > batch_w:
        raise ValueError(f'ground-truth masks of {h}x{w} exceed the batch input '
                         f'{batch_h}x{batch_w}; give masks in the image or the padded frame')
    return F.pad(masks, (0, batch_w - w, 0, batch_h - h))


class MaskGroupSetCriterion(GroupSetCriterion):
    """Group DETR set loss with IA-BCE classification, boxes and masks (module docstring).

    Args:
        num_classes, loss_cls, loss_bbox, loss_iou: see :class:`GroupSetCriterion`.
        assigner: matcher with mask costs (default :data:`MASK_ASSIGNER`).
        loss_mask, loss_dice: point losses (default :data:`MASK_LOSS`, :data:`DICE_LOSS`).
        point_sample_ratio: mask pixels per sampled point (:data:`POINT_SAMPLE_RATIO`).
    """

    def __init__(self, num_classes: int, assigner: Optional[dict] = None,
                 loss_cls: Optional[dict] = None, loss_bbox: Optional[dict] = None,
                 loss_iou: Optional[dict] = None, loss_mask: Optional[dict] = None,
                 loss_dice: Optional[dict] = None,
                 point_sample_ratio: int = POINT_SAMPLE_RATIO) -> None:
        super().__init__(num_classes, assigner or dict(MASK_ASSIGNER), loss_cls, loss_bbox,
                         loss_iou)
        self.loss_mask = MODELS.build(loss_mask or dict(MASK_LOSS))
        self.loss_dice = MODELS.build(loss_dice or dict(DICE_LOSS))
        self.point_sample_ratio = point_sample_ratio

    def forward(self, cls_scores: Tensor, boxes: Tensor,
                batch_gt_instances: Sequence[InstanceData], batch_img_metas: Sequence[dict],
                matches: Optional[List[Tuple[Tensor, Tensor]]] = None, num_groups: int = 1,
                masks: Optional[LayerMasks] = None) -> Dict[str, Tensor]:
        """Losses of one prediction set with its mask embeddings ``masks``:
        :class:`GroupSetCriterion`'s on matches that also weigh the masks at one set of random
        points for every image and group (or the given ``matches``), plus ``loss_mask`` and
        ``loss_dice``."""
        if masks is None:
            raise ValueError(f'{type(self).__name__} needs the mask embeddings (masks=...)')
        masks = LayerMasks(*(t.float() for t in masks))  # losses in fp32 under autocast
        gt_masks = [gt_mask_tensor(gt, meta, masks.pixels)
                    for gt, meta in zip(batch_gt_instances, batch_img_metas)]
        if matches is None:
            with torch.no_grad():
                h, w = masks.pixels.shape[-2:]
                points = torch.rand(1, h * w // self.point_sample_ratio, 2,
                                    device=masks.pixels.device)
                # every query's logits at the points: their pixel embeddings as a (P, 1) map
                pixels = sample_points(masks.pixels, points.expand(len(gt_masks), -1, -1))
                logits = masks._replace(pixels=pixels[..., None]).logits()[..., 0]  # (B,GQ,P)
                gts = [InstanceData(bboxes=gt.bboxes, labels=gt.labels, masks=sample_points(
                    m[:, None], points.expand(len(m), -1, -1), mode='nearest')[:, 0])  # (n, P)
                    for gt, m in zip(batch_gt_instances, gt_masks)]
            matches = [self.match_groups(cls_scores[i], boxes[i], gt, meta, num_groups,
                                         masks=logits[i])
                       for i, (gt, meta) in enumerate(zip(gts, batch_img_metas))]
        losses = super().forward(cls_scores, boxes, batch_gt_instances, batch_img_metas,
                                 matches, num_groups)
        avg = self.avg_factor(batch_gt_instances, num_groups, 0, cls_scores)
        losses.update(self.mask_losses(masks, gt_masks, matches, avg))
        return losses

    def mask_losses(self, masks: LayerMasks, gt_masks: List[Tensor],
                    matches: List[Tuple[Tensor, Tensor]], avg: Tensor) -> Dict[str, Tensor]:
        """Point BCE and Dice of the matched queries' full masks against their ground truth
        (the masks of each image's matched queries at once, padded to the most matches)."""
        queries = pad_sequence([q for q, _ in matches], batch_first=True, padding_value=-1)
        pred = masks.logits(queries.clamp(min=0))[queries >= 0][:, None]      # (N, 1, Hm, Wm)
        if pred.shape[0] == 0:  # zero losses that still reach every mask parameter (DDP)
            zero = (masks.pixels.sum() + masks.queries.sum() + masks.bias.sum()) * 0.0
            return dict(loss_mask=zero, loss_dice=zero)
        h, w = pred.shape[-2:]
        num_points = max(h, h * w // self.point_sample_ratio)
        with torch.no_grad():
            points = uncertain_points(pred, num_points)                         # (N, P, 2)
            target = torch.cat([gt_masks[i][g] for i, (_, g) in enumerate(matches)])
            labels = sample_points(target[:, None], points, mode='nearest')[:, 0]  # (N, P)
        logits = sample_points(pred, points)[:, 0]                              # (N, P)
        return dict(loss_mask=self.loss_mask(logits, labels, avg_factor=avg * num_points),
                    loss_dice=self.loss_dice(logits, labels, avg_factor=avg))
