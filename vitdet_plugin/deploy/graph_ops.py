"""Pieces the end-to-end graphs share (:mod:`.end_to_end`, :mod:`.two_stage`): the NMS custom op
and its ONNX translation, an anchor head's per-level candidates (RetinaNet's head, the RPN), box
clipping and the padded top-k of the graph's outputs; Linear and GELU in the forms onnxruntime
fuses.

``vitdet_deploy::nms`` has ONNX ``NonMaxSuppression``'s semantics; in PyTorch it runs
torchvision's kernel, in the graph it becomes the ONNX op (:func:`translation_table`).
"""
import math
from dataclasses import dataclass
from typing import Any, Sequence, Tuple

import torch
from torch import Tensor

#: Label of a padding row.
PAD_LABEL = -1
#: Score given to candidates that must not survive (below any threshold; scores are > 0).
DROPPED_SCORE = -1.0
#: Namespace of our export-only custom op (``NonMaxSuppression`` in the graph).
OP_NAMESPACE = 'vitdet_deploy'
#: Box columns.
BOX_DIM = 4
#: GELU's tanh approximation, ``sqrt(2 / pi) * (x + 0.044715 x^3)``: its two constants.
GELU_TANH_CUBIC = 0.044715
GELU_TANH_SCALE = math.sqrt(2.0 / math.pi)

_lib = torch.library.Library(OP_NAMESPACE, 'DEF')
_lib.define('nms(Tensor boxes, Tensor scores, int max_per_class, float iou_threshold, '
            'float score_threshold) -> Tensor')


@torch.library.impl(_lib, 'nms', 'CompositeExplicitAutograd')
def _nms(boxes: Tensor, scores: Tensor, max_per_class: int, iou_threshold: float,
         score_threshold: float) -> Tensor:
    """ONNX ``NonMaxSuppression`` semantics in PyTorch: ``boxes`` ``(B, N, 4)`` xyxy,
    ``scores`` ``(B, C, N)``; ``(M, 3)`` int64 rows ``(batch, class, box)`` kept, per batch
    and class by descending score."""
    import torchvision

    rows = []
    for b in range(boxes.shape[0]):
        for c in range(scores.shape[1]):
            s = scores[b, c]
            idx = torch.nonzero(s > score_threshold).flatten()
            keep = idx[torchvision.ops.nms(boxes[b, idx], s[idx], iou_threshold)][:max_per_class]
            rows.append(torch.stack((torch.full_like(keep, b), torch.full_like(keep, c), keep),
                                    1))
    return torch.cat(rows) if rows else boxes.new_zeros((0, 3), dtype=torch.long)


@torch.library.register_fake(f'{OP_NAMESPACE}::nms')
def _nms_fake(boxes: Tensor, scores: Tensor, max_per_class: int, iou_threshold: float,
              score_threshold: float) -> Tensor:
    kept = torch.library.get_ctx().new_dynamic_size()
    return boxes.new_empty((kept, 3), dtype=torch.long)


def nms_onnx(boxes, scores, max_per_class: int, iou_threshold: float, score_threshold: float):
    """Translation of ``vitdet_deploy::nms`` to ONNX ``NonMaxSuppression`` (corner boxes)."""
    from onnxscript import opset18
    op: Any = opset18  # its typed signatures reject the constants' generic type
    return op.NonMaxSuppression(boxes, scores, op.Constant(value_ints=[max_per_class]),
                                op.Constant(value_floats=[iou_threshold]),
                                op.Constant(value_floats=[score_threshold]),
                                center_point_box=0)


def gelu_onnx(x, approximate: str = 'none'):
    """Translation of ``aten.gelu``: ``x * (1 + erf(x / sqrt(2))) * 0.5``, in the node order
    onnxruntime fuses into one ``Gelu`` (``BiasGelu`` after a Linear); torch's own translation
    multiplies by 0.5 before ``x``, which it leaves as five nodes. The values are the same (a
    product by 0.5 is exact). ``approximate='tanh'`` (no model of ours uses it) is written out
    as its formula."""
    from onnxscript import opset18
    op: Any = opset18

    def const(value: float):
        return op.CastLike(op.Constant(value_float=value), x)

    if approximate == 'tanh':  # sqrt(2 / pi) * (x + 0.044715 x^3)
        inner = op.Mul(op.Add(x, op.Mul(op.Mul(op.Mul(x, x), x), const(GELU_TANH_CUBIC))),
                       const(GELU_TANH_SCALE))
        gate = op.Add(op.Tanh(inner), const(1.0))
    else:
        gate = op.Add(op.Erf(op.Div(x, const(math.sqrt(2.0)))), const(1.0))
    return op.Mul(op.Mul(x, gate), const(0.5))


def linear_onnx(x, weight, bias=None):
    """Translation of ``aten.linear`` as one ``Gemm`` (``transB``) on the tokens flattened to
    ``(-1, in)``, reshaped back: onnxruntime adds the bias inside the product (torch's own
    translation writes MatMul + Add, which onnxruntime fuses into Gemm only at fixed shapes)."""
    from onnxscript import opset18
    op: Any = opset18
    rows = op.Concat(op.Constant(value_ints=[-1]), op.Shape(weight, start=1, end=2), axis=0)
    out = op.Gemm(op.Reshape(x, rows), weight, bias, transB=1)      # (tokens, out); C optional
    lead = op.Shape(x, start=0, end=-1)
    return op.Reshape(out, op.Concat(lead, op.Shape(weight, start=0, end=1), axis=0))


def translation_table() -> dict:
    """``custom_translation_table`` of ``torch.onnx.export`` for our graphs (the end-to-end
    detector and the ``--part`` exports)."""
    return {torch.ops.vitdet_deploy.nms.default: nms_onnx, torch.ops.aten.gelu.default: gelu_onnx,
            torch.ops.aten.linear.default: linear_onnx}


#: mmcv NMS types the graph repeats: ONNX ``NonMaxSuppression`` is hard NMS.
NMS_TYPES = ('nms',)


@dataclass(frozen=True)
class NmsConfig:
    """An mmcv ``nms`` config as the graph repeats it: the IoU threshold and whether the
    suppression crosses classes (``class_agnostic``: mmdet's Panoptic FPN box head)."""

    iou_threshold: float
    class_agnostic: bool = False

    @classmethod
    def of(cls, owner: str, cfg: Any, default_iou: float) -> 'NmsConfig':
        """``cfg`` (a ``test_cfg.nms`` dict or None) of ``owner`` (named in the refusal),
        else a ``ValueError`` naming the NMS type the graph cannot repeat."""
        cfg = cfg or {}
        kind = cfg.get('type', 'nms')
        if kind not in NMS_TYPES:
            raise ValueError(f'{owner}: test_cfg nms type {kind!r}: no end-to-end export (ONNX '
                             f'NonMaxSuppression is hard NMS: type in {NMS_TYPES}); set '
                             'type="nms" or export --part neck')
        return cls(float(cfg.get('iou_threshold', default_iou)),
                   bool(cfg.get('class_agnostic', False)))


def nms_survivors(boxes: Tensor, scores: Tensor, groups: Tensor, num_groups: int,
                  max_per_group: int, nms: NmsConfig) -> Tensor:
    """NMS within each group (class or level), as mmcv's ``batched_nms``: ``boxes``
    ``(B, N, 4)``, ``scores`` ``(B, N)`` (:data:`DROPPED_SCORE` where a candidate does not take
    part), ``groups`` ``(B, N)`` int64 in ``[0, num_groups)`` (one group for all when
    ``nms.class_agnostic``); ``(B, N)`` bool, True where kept (ONNX ``NonMaxSuppression`` with
    one score row per group)."""
    if nms.class_agnostic:
        groups, num_groups = torch.zeros_like(groups), 1
    group_ids = torch.arange(num_groups, device=groups.device)           # (G,)
    per_group = torch.where(                                             # (B, G, N)
        groups[:, None] == group_ids[None, :, None], scores[:, None], DROPPED_SCORE)
    kept = torch.ops.vitdet_deploy.nms(boxes, per_group, max_per_group, nms.iou_threshold,
                                       DROPPED_SCORE / 2)
    return torch.zeros_like(scores, dtype=torch.bool).index_put_(
        (kept[:, 0], kept[:, 2]), torch.ones_like(kept[:, 0], dtype=torch.bool))


def anchor_candidates(head: Any, cls_scores: Sequence[Tensor], bbox_preds: Sequence[Tensor],
                      nms_pre: int, h, w) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """An anchor head's ``predict_by_feat`` up to its NMS (``AnchorHead`` / ``RPNHead``, sigmoid
    scores): per level the ``nms_pre`` best (anchor, class) scores (all when ``nms_pre <= 0``),
    their anchors' deltas decoded by the head's ``bbox_coder`` and clipped to the ``h x w``
    image; the levels concatenated: boxes ``(B, N, 4)``, scores, classes and levels ``(B, N)``."""
    sizes = [c.shape[-2:] for c in cls_scores]
    priors = head.prior_generator.grid_priors(sizes, dtype=cls_scores[0].dtype,
                                              device=cls_scores[0].device)
    b = cls_scores[0].shape[0]
    num_classes = head.cls_out_channels
    boxes, scores, classes, levels = [], [], [], []
    for level, (cls, reg, anchors) in enumerate(zip(cls_scores, bbox_preds, priors)):
        score = cls.permute(0, 2, 3, 1).reshape(b, -1).sigmoid()        # (B, HWA * C)
        deltas = reg.permute(0, 2, 3, 1).reshape(b, -1, BOX_DIM)        # (B, HWA, 4)
        k = score.shape[1] if nms_pre <= 0 else min(nms_pre, score.shape[1])
        top, idx = score.topk(k, dim=1)                                  # (B, k)
        anchor = idx // num_classes
        picked = torch.gather(deltas, 1, anchor[..., None].expand(-1, -1, BOX_DIM))
        # decoded as one (B * k, 4) batch, mmdet's per-image path; clipped below
        decoded = head.bbox_coder.decode(anchors[anchor].reshape(-1, BOX_DIM),
                                         picked.reshape(-1, BOX_DIM))   # (B * k, 4)
        boxes.append(clip_boxes(decoded.reshape(b, -1, BOX_DIM), h, w))
        scores.append(top)
        classes.append(idx % num_classes)
        levels.append(torch.full_like(idx, level))
    return (torch.cat(boxes, 1), torch.cat(scores, 1),                   # (B, N, 4), (B, N)
            torch.cat(classes, 1), torch.cat(levels, 1))                 # (B, N), (B, N)


def large_enough(boxes: Tensor, min_size: float) -> Tensor:
    """``(B, N)`` True where a ``(B, N, 4)`` box is wider and higher than ``min_size`` (mmdet's
    ``min_bbox_size``; every box when it is negative)."""
    if min_size < 0:
        return torch.ones_like(boxes[..., 0], dtype=torch.bool)
    wh = boxes[..., 2:] - boxes[..., :2]
    return (wh > min_size).all(-1)


def clip_boxes(boxes: Tensor, h, w) -> Tensor:
    """xyxy ``boxes`` clipped to the ``h x w`` image."""
    x = boxes[..., 0::2].clamp(min=0).clamp(max=w)
    y = boxes[..., 1::2].clamp(min=0).clamp(max=h)
    return torch.stack((x[..., 0], y[..., 0], x[..., 1], y[..., 1]), -1)


def top_k_padded(boxes: Tensor, scores: Tensor, labels: Tensor, k: int
                 ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The ``k`` best candidates by score (``(B, N, 4)``, ``(B, N)``, ``(B, N)``; dropped ones
    at :data:`DROPPED_SCORE`), dropped ones and the rest padded (boxes 0, scores 0, labels
    :data:`PAD_LABEL`): ``(B, k, 4)``, ``(B, k)``, ``(B, k)`` and the valid count ``(B,)``."""
    b = boxes.shape[0]
    # k padding candidates: enough for a top-k of k whatever N is
    boxes = torch.cat((boxes, boxes.new_zeros((b, k, BOX_DIM))), 1)     # (B, N + k, 4)
    scores = torch.cat((scores, scores.new_full((b, k), DROPPED_SCORE)), 1)
    labels = torch.cat((labels, labels.new_full((b, k), PAD_LABEL)), 1)
    scores, idx = scores.topk(k, dim=1)                                  # (B, k)
    boxes = torch.gather(boxes, 1, idx[..., None].expand(-1, -1, BOX_DIM))
    labels = torch.gather(labels, 1, idx)
    valid = scores > DROPPED_SCORE / 2
    boxes = torch.where(valid[..., None], boxes, 0.0)
    scores = torch.where(valid, scores, 0.0)
    labels = torch.where(valid, labels, PAD_LABEL)
    return boxes, scores, labels, valid.sum(1)
