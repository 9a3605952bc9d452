"""D-FINE / DEIMv2 set criterion: Hungarian matching and the weighted loss terms over the final
predictions, the auxiliary sets (earlier layers, pre-head, encoder top-k) and the denoising sets.

The head decides which prediction sets exist and what they are paired with (a
:class:`PredictionSet` carries its logits, boxes and, for the distribution losses, its edge
distributions, the boxes they are decoded against and the distillation teacher); the criterion
matches each set (denoising sets use their known positives), computes the class term (VFL for
D-FINE, MAL for DEIMv2), L1 + GIoU and, where a set has edge distributions, FGL and DDF, and
names them ``loss_<term>``, ``loss_<term>_aux_<i>``, ``loss_<term>_dn_<i>``. With
``dense_one_to_one`` (DEIMv2) the box and distribution terms of the final and auxiliary sets
use the union of all their matchings (GO-LSD), each query kept with its most frequent target.
The normalisers (ground-truth count, union size) are averaged over the processes.

DEIMv2's recipes change the matching cost late in training (``matcher_change_epoch``): from
then on the cost is ``-(p * IoU^iou_order_alpha)`` (:class:`HungarianMatcher`'s
``iou_order``); :class:`DEIMMatcherSwitchHook` sets it by epoch.
"""
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from mmdet.registry import HOOKS, MODELS
from mmdet.structures.bbox import bbox_overlaps
from mmdet.utils import reduce_mean
from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper
from scipy.optimize import linear_sum_assignment
from torch import Tensor, nn

from ..heads.dfine_decoder import DFineDecoderOutput
from ..heads.dfine_layers import weighting_function
from .dfine_terms import (Matched, box_losses, cxcywh_to_xyxy, ddf_loss, fgl_loss, mal_loss,
                          vfl_loss)

#: class terms by name: D-FINE's varifocal loss and DEIM's matching-aware loss.
CLASS_LOSSES = ('vfl', 'mal')
#: the published loss weights (D-FINE / DEIMv2 configs); ``loss_<class term>`` is added.
DEFAULT_WEIGHTS = {'bbox': 5.0, 'giou': 2.0, 'fgl': 0.15, 'ddf': 1.5}
#: matching costs: class (focal), L1, GIoU.
DEFAULT_COSTS = {'class': 2.0, 'bbox': 5.0, 'giou': 2.0}
#: inside the logs of the focal matching cost.
COST_EPS = 1e-8

#: per image: normalised cxcywh ``boxes (n, 4)`` and ``labels (n,)``.
Targets = Sequence[Tuple[Tensor, Tensor]]
#: per image: (query indices, target indices).
Indices = List[Tuple[Tensor, Tensor]]


class PredictionSet(NamedTuple):
    """One set of predictions: ``logits (B, Q, K)``, cxcywh ``boxes (B, Q, 4)``; for FGL / DDF
    also ``corners (B, Q, 4 (reg_max + 1))`` and ``ref (B, Q, 4)`` (the boxes they are decoded
    against); DDF needs ``teacher_corners`` / ``teacher_logits`` (None: no DDF term, e.g. for
    the teacher layer itself)."""
    logits: Tensor
    boxes: Tensor
    corners: Optional[Tensor] = None
    ref: Optional[Tensor] = None
    teacher_corners: Optional[Tensor] = None
    teacher_logits: Optional[Tensor] = None


class HungarianMatcher(nn.Module):
    """One-to-one matching minimising ``class * focal cost + bbox * L1 + giou * (-GIoU)``.

    The focal cost is ``alpha (1 - p)^gamma (-log p) - (1 - alpha) p^gamma (-log(1 - p))`` of the
    target class; non-finite costs become the dtype's maximum. The assignment runs on the CPU
    (scipy), one image at a time. With ``iou_order`` set (DEIMv2 after its
    ``matcher_change_epoch``; needs ``iou_order_alpha``) the cost is
    ``-(p * IoU^iou_order_alpha)`` instead: the class probability times a power of the IoU.
    """

    def __init__(self, costs: Optional[Dict[str, float]] = None, alpha: float = 0.25,
                 gamma: float = 2.0, iou_order_alpha: Optional[float] = None) -> None:
        super().__init__()
        self.costs = dict(DEFAULT_COSTS if costs is None else costs)
        if sorted(self.costs) != sorted(DEFAULT_COSTS):
            raise ValueError(f'costs has keys {sorted(self.costs)}; give exactly '
                             f'{sorted(DEFAULT_COSTS)}')
        self.alpha, self.gamma = alpha, gamma
        self.iou_order_alpha = iou_order_alpha
        #: use the IoU-order cost (set by :class:`DEIMMatcherSwitchHook`)
        self.iou_order = False

    @torch.no_grad()
    def forward(self, logits: Tensor, boxes: Tensor, targets: Targets) -> Indices:
        bs, nq = logits.shape[:2]
        gt_boxes = torch.cat([b for b, _ in targets])                     # (N, 4)
        gt_labels = torch.cat([lab for _, lab in targets])
        prob = logits.flatten(0, 1).sigmoid()[:, gt_labels]               # (B Q, N)
        flat = boxes.flatten(0, 1)
        if self.iou_order:
            iou = bbox_overlaps(cxcywh_to_xyxy(flat), cxcywh_to_xyxy(gt_boxes))  # (B Q, N)
            cost = -(prob * iou ** self.iou_order_alpha)
        else:
            pos = self.alpha * (1 - prob) ** self.gamma * -(prob + COST_EPS).log()
            neg = (1 - self.alpha) * prob ** self.gamma * -(1 - prob + COST_EPS).log()
            giou = bbox_overlaps(cxcywh_to_xyxy(flat), cxcywh_to_xyxy(gt_boxes), mode='giou')
            cost = (self.costs['bbox'] * torch.cdist(flat, gt_boxes, p=1)
                    + self.costs['class'] * (pos - neg) - self.costs['giou'] * giou)
        big = torch.finfo(cost.dtype).max
        cost = torch.nan_to_num(cost, nan=big, posinf=big, neginf=big).view(bs, nq, -1).cpu()
        indices = []
        for i, part in enumerate(cost.split([len(b) for b, _ in targets], -1)):
            rows, cols = linear_sum_assignment(part[i])
            indices.append((torch.as_tensor(rows, dtype=torch.int64),
                            torch.as_tensor(cols, dtype=torch.int64)))
        return indices


def dense_one_to_one(indices: Sequence[Indices]) -> Indices:
    """Union of several matchings per image; a query matched to several targets keeps the
    pair that occurs most often (ties: the order ``torch.unique`` / ``argsort`` give)."""
    out = []
    for per_image in zip(*indices):
        pairs = torch.cat([torch.stack([q, t], dim=1) for q, t in per_image])  # (n, 2)
        unique, counts = torch.unique(pairs, return_counts=True, dim=0)
        ranked = unique[torch.argsort(counts, descending=True)].tolist()
        chosen: Dict[int, int] = {}
        for query, target in ranked:
            chosen.setdefault(query, target)
        out.append((torch.tensor(list(chosen), dtype=torch.int64),
                    torch.tensor(list(chosen.values()), dtype=torch.int64)))
    return out


@MODELS.register_module()
class DFineCriterion(nn.Module):
    """Weighted D-FINE (``class_loss='vfl'``) or DEIMv2 (``'mal'``, ``dense_one_to_one=True``)
    losses over final, auxiliary and denoising prediction sets.

    Args:
        num_classes: K.
        class_loss: ``'vfl'`` or ``'mal'``.
        loss_weights: ``{'<class_loss>', 'bbox', 'giou', 'fgl', 'ddf'}`` weights (default 1 for
            the class term and :data:`DEFAULT_WEIGHTS`).
        focal_alpha, focal_gamma: VFL's ``alpha`` / ``gamma``; MAL uses ``focal_gamma``.
        mal_alpha: MAL's negative weight (None: 1).
        match_costs, match_alpha, match_gamma: :class:`HungarianMatcher`.
        match_iou_order_alpha: the IoU power of DEIMv2's later matching cost (None: none).
        reg_max, reg_scale, up: the decoder's distribution bins.
        ddf_temperature: DDF's softmax temperature.
        dense_one_to_one: box / distribution terms use the union of the matchings.
    """

    project: Tensor

    def __init__(self, num_classes: int, class_loss: str = 'vfl',
                 loss_weights: Optional[Dict[str, float]] = None, focal_alpha: float = 0.75,
                 focal_gamma: float = 2.0, mal_alpha: Optional[float] = None,
                 match_costs: Optional[Dict[str, float]] = None, match_alpha: float = 0.25,
                 match_gamma: float = 2.0, reg_max: int = 32, reg_scale: float = 4.0,
                 up: float = 0.5, ddf_temperature: float = 5.0,
                 dense_one_to_one: bool = False,
                 match_iou_order_alpha: Optional[float] = None) -> None:
        super().__init__()
        if class_loss not in CLASS_LOSSES:
            raise ValueError(f'class_loss={class_loss!r} is not one of {CLASS_LOSSES}; use vfl '
                             'for D-FINE and mal for DEIMv2')
        weights = {class_loss: 1.0, **DEFAULT_WEIGHTS, **(loss_weights or {})}
        expected = {class_loss, *DEFAULT_WEIGHTS}
        if set(weights) != expected:
            raise ValueError(f'loss_weights has keys {sorted(weights)}; the terms are '
                             f'{sorted(expected)}')
        self.num_classes = num_classes
        self.class_loss = class_loss
        self.weights = weights
        self.focal_alpha, self.focal_gamma, self.mal_alpha = focal_alpha, focal_gamma, mal_alpha
        self.matcher = HungarianMatcher(match_costs, match_alpha, match_gamma,
                                        match_iou_order_alpha)
        self.reg_scale = reg_scale
        self.ddf_temperature = ddf_temperature
        self.dense_one_to_one = dense_one_to_one
        self.register_buffer('project', weighting_function(reg_max, up, reg_scale),
                             persistent=False)

    def forward(self, final: PredictionSet, aux: Sequence[PredictionSet], targets: Targets,
                dn: Sequence[PredictionSet] = (),
                dn_positive_idx: Optional[Sequence[Tensor]] = None,
                dn_num_groups: int = 1) -> Dict[str, Tensor]:
        """Weighted losses of ``final`` (``loss_<term>``), ``aux[i]`` (``_aux_<i>``) and
        ``dn[i]`` (``_dn_<i>``, matched to ``dn_positive_idx``: per image, ``dn_num_groups``
        copies of its targets in order)."""
        num_boxes = self._normaliser(sum(len(b) for b, _ in targets), final.logits)
        final_idx = self.matcher(final.logits, final.boxes, targets)
        aux_idx = [self.matcher(s.logits, s.boxes, targets) for s in aux]
        union: Optional[Indices] = None
        union_boxes = num_boxes
        if self.dense_one_to_one:
            union = dense_one_to_one([final_idx, *aux_idx])
            union_boxes = self._normaliser(sum(len(q) for q, _ in union), final.logits)
        losses: Dict[str, Tensor] = {}
        sets = [('', final, final_idx)] + [
            (f'_aux_{i}', pred, idx) for i, (pred, idx) in enumerate(zip(aux, aux_idx))]
        for suffix, pred, indices in sets:
            box_idx = indices if union is None else union
            losses.update(self._set_losses(pred, targets, indices, num_boxes, box_idx,
                                           union_boxes, suffix))
        if dn:
            if dn_positive_idx is None:
                raise ValueError('dn prediction sets need dn_positive_idx (the positive '
                                 'denoising queries per image); pass the DenoisingGroup\'s')
            dn_idx = [(pos, torch.arange(len(b), device=pos.device).repeat(dn_num_groups))
                      for pos, (b, _) in zip(dn_positive_idx, targets)]
            dn_boxes = num_boxes * dn_num_groups
            for i, pred in enumerate(dn):
                losses.update(self._set_losses(pred, targets, dn_idx, dn_boxes, dn_idx,
                                               dn_boxes, f'_dn_{i}'))
        return losses

    def _set_losses(self, pred: PredictionSet, targets: Targets, indices: Indices,
                    num_boxes: Tensor, box_indices: Indices, box_num: Tensor,
                    suffix: str) -> Dict[str, Tensor]:
        """The weighted terms of one set: class term on ``indices``, box / distribution terms
        on ``box_indices`` (normalised by ``box_num``)."""
        matched = self._matched(indices, targets, pred.logits.device)
        if self.class_loss == 'vfl':
            cls = vfl_loss(pred.logits, pred.boxes, matched, num_boxes, self.focal_alpha,
                           self.focal_gamma)
        else:
            cls = mal_loss(pred.logits, pred.boxes, matched, num_boxes, self.focal_gamma,
                           self.mal_alpha)
        box_matched = self._matched(box_indices, targets, pred.logits.device)
        l1, giou = box_losses(pred.boxes, box_matched, box_num)
        terms = {self.class_loss: cls, 'bbox': l1, 'giou': giou}
        if pred.corners is not None and pred.ref is not None:
            terms['fgl'] = fgl_loss(pred.corners, pred.ref, pred.boxes, box_matched, box_num,
                                    self.project, self.reg_scale)
            if pred.teacher_corners is not None and pred.teacher_logits is not None:
                terms['ddf'] = ddf_loss(pred.corners, pred.teacher_corners, pred.teacher_logits,
                                        pred.boxes, box_matched, self.ddf_temperature)
            else:
                terms['ddf'] = pred.corners.sum() * 0
        return {f'loss_{k}{suffix}': v * self.weights[k] for k, v in terms.items()}

    @staticmethod
    def _normaliser(count: int, like: Tensor) -> Tensor:
        """``count`` averaged over the processes (one per GPU), at least 1."""
        return reduce_mean(like.new_tensor(float(count))).clamp(min=1)

    @staticmethod
    def _matched(indices: Indices, targets: Targets, device: torch.device) -> Matched:
        batch = torch.cat([torch.full_like(q, i) for i, (q, _) in enumerate(indices)])
        query = torch.cat([q for q, _ in indices])
        labels = torch.cat([lab[t.to(lab.device)] for (_, t), (_, lab) in zip(indices, targets)])
        boxes = torch.cat([b[t.to(b.device)] for (_, t), (b, _) in zip(indices, targets)])
        return Matched(batch.to(device), query.to(device), labels, boxes)


@HOOKS.register_module()
class DEIMMatcherSwitchHook(Hook):
    """DEIMv2's matcher change: from training epoch ``switch_epoch`` (0-based, the recipes'
    ``matcher_change_epoch``) every :class:`HungarianMatcher` of the model matches with its
    IoU-order cost; before it, with the focal / L1 / GIoU cost (set at each epoch's start, so
    a resumed run is in the right state)."""

    priority = 'NORMAL'

    def __init__(self, switch_epoch: int) -> None:
        self.switch_epoch = switch_epoch

    def before_train_epoch(self, runner: Any) -> None:
        model = runner.model.module if is_model_wrapper(runner.model) else runner.model
        matchers = [m for m in model.modules() if isinstance(m, HungarianMatcher)]
        if not matchers or any(m.iou_order_alpha is None for m in matchers):
            raise ValueError(f'{type(self).__name__} needs a model whose DFineCriterion has '
                             'match_iou_order_alpha (DEIMv2: 4.0); set it in '
                             "bbox_head.criterion or remove the hook")
        for matcher in matchers:
            matcher.iou_order = runner.epoch >= self.switch_epoch


def dfine_prediction_sets(decoder: DFineDecoderOutput, enc_topk_logits: Tensor,
                          enc_topk_boxes: Tensor, num_denoising: int = 0
                          ) -> Tuple[PredictionSet, List[PredictionSet], List[PredictionSet]]:
    """The prediction sets of one training step, paired as the D-FINE authors' code pairs them.

    ``final``: the last layer with its distributions (it is the distillation teacher, so its
    DDF term is 0); ``aux``: layers ``0 .. L-2`` (teacher: the last layer), the pre-head
    outputs, the encoder's top-k; ``dn``: every layer's denoising part (the last without a
    teacher), then the pre-head's. The first ``num_denoising`` queries are the denoising ones.
    Boxes are clamped to [0, 1].
    """
    if decoder.pre_logits is None:
        raise ValueError('the decoder output has no pre-head logits; run the decoder in '
                         'training mode to get the loss inputs')
    split = num_denoising
    logits, boxes = decoder.logits, decoder.boxes.clamp(0, 1)
    corners, ref = decoder.corners, decoder.initial_boxes
    pre_logits, pre_boxes = decoder.pre_logits, decoder.pre_boxes.clamp(0, 1)
    layers = logits.shape[0]

    def layer_set(k: int, dn: bool) -> PredictionSet:
        part = slice(None, split) if dn else slice(split, None)
        teacher = k != layers - 1
        return PredictionSet(logits[k][:, part], boxes[k][:, part], corners[k][:, part],
                             ref[:, part], corners[-1][:, part] if teacher else None,
                             logits[-1][:, part] if teacher else None)

    final = layer_set(layers - 1, False)
    aux = [layer_set(k, False) for k in range(layers - 1)] + [
        PredictionSet(pre_logits[:, split:], pre_boxes[:, split:]),
        PredictionSet(enc_topk_logits, enc_topk_boxes.clamp(0, 1))]
    dn: List[PredictionSet] = []
    if num_denoising:
        dn = [layer_set(k, True) for k in range(layers)] + [
            PredictionSet(pre_logits[:, :split], pre_boxes[:, :split])]
    return final, aux, dn
