"""Two-stage detectors inside the end-to-end graph: mmdet's ``RPNHead`` + ``StandardRoIHead``
(Mask R-CNN; Faster R-CNN when the RoI head has no mask head), batched, dynamic B / H / W.

The graph repeats mmdet's test path step by step (``docs/deploy.md``):

* RPN (``RPNHead.predict_by_feat``): per level the ``nms_pre`` best sigmoid scores, their
  anchors decoded by the head's ``bbox_coder`` and clipped to the image, boxes no wider / higher
  than ``min_bbox_size`` dropped, NMS within each level (mmcv's ``batched_nms`` with the level as
  the class: ONNX ``NonMaxSuppression`` with one score row per level), the ``max_per_img`` best
  proposals, padded to exactly ``max_per_img`` (a padding proposal never gives a detection);
* RoI features (``SingleRoIExtractor``): each RoI's level by mmdet's own ``map_roi_levels``
  (scale ``sqrt(w h)`` against ``finest_scale``), RoIAlign (``torchvision.ops.roi_align``, which
  is mmcv's average-mode kernel and exports to ONNX ``RoiAlign``) on every level, the RoI's level
  selected;
* box head (``BBoxHead.predict_by_feat`` + ``multiclass_nms``): softmax, class-specific deltas
  decoded from the proposals and clipped, ``score_thr``, class-aware NMS, the ``max_per_img``
  best;
* mask head (``FCNMaskHead.predict_by_feat``): the RoI features of the final boxes, the mask of
  each box's label, sigmoid, pasted into the input image as ``_do_paste_mask`` does
  (``grid_sample``, bilinear, zeros outside, at pixel centres, on the whole image: mmdet's GPU
  path; its CPU path pastes inside the boxes' bounds + 1 px, where outside values stay below
  0.5 x the mask's border probability, so the two agree for ``mask_thr_binary`` >= 0.5) and
  thresholded at ``mask_thr_binary``. That sampling grid is separable, so the paste is two
  small matrix products per box, ``rows (H, S) @ probs (S, S) @ cols (W, S)^T``, not a
  ``grid_sample`` over ``H x W`` points (onnxruntime's GridSample is far slower).
"""
from typing import Any, NoReturn, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision.ops import roi_align

from .graph_ops import (BOX_DIM, DROPPED_SCORE, PAD_LABEL, NmsConfig, anchor_candidates,
                        clip_boxes, large_enough, nms_survivors, top_k_padded)
from .runner import PIXEL_CENTRE  # the runner's paste samples at the same pixel centres

#: What the two-stage export supports (type names), by part.
RPN_HEADS = ('RPNHead',)
ROI_HEADS = ('StandardRoIHead',)
BBOX_HEADS = ('BBoxHead', 'ConvFCBBoxHead', 'Shared2FCBBoxHead', 'Shared4Conv1FCBBoxHead')
MASK_HEADS = ('FCNMaskHead',)
ROI_EXTRACTORS = ('SingleRoIExtractor',)
ROI_LAYERS = ('RoIAlign',)
BOX_CODERS = ('DeltaXYWHBBoxCoder',)
#: IoU thresholds of mmdet's RPN / RoI head NMS when a config gives none.
RPN_IOU, RCNN_IOU = 0.7, 0.5
#: mmcv RoIAlign's pool mode that torchvision's (and ONNX's average) RoIAlign computes.
AVG_POOL = 'avg'


def _name(obj: Any) -> str:
    return type(obj).__name__


def check_two_stage(model: Any) -> None:
    """A ``ValueError`` naming the part and what is supported, unless ``model``'s RPN and RoI
    heads are what :class:`TwoStage` repeats."""
    name = _name(model)
    roi_head = getattr(model, 'roi_head', None)
    rpn_head = getattr(model, 'rpn_head', None)
    supported = (f'supported: {"/".join(RPN_HEADS)} + {"/".join(ROI_HEADS)} with '
                 f'{"/".join(ROI_EXTRACTORS)} ({"/".join(ROI_LAYERS)}, avg), the box heads '
                 f'{BBOX_HEADS} (softmax, {"/".join(BOX_CODERS)}) and optionally '
                 f'{"/".join(MASK_HEADS)}, as in Faster / Mask R-CNN')

    def refuse(what: str) -> NoReturn:
        raise ValueError(f'{name}: {what}: no end-to-end export ({supported}); export --part '
                         'neck and run the rest in the caller')

    if rpn_head is None or _name(rpn_head) not in RPN_HEADS:
        refuse(f'RPN head {_name(rpn_head)}')
    if not getattr(rpn_head, 'use_sigmoid_cls', False) or \
            _name(rpn_head.bbox_coder) not in BOX_CODERS:
        refuse(f'RPNHead with a softmax classifier or {_name(rpn_head.bbox_coder)}')
    if roi_head is None or _name(roi_head) not in ROI_HEADS:
        refuse(f'RoI head {_name(roi_head)}')
    bbox_head = roi_head.bbox_head
    if _name(bbox_head) not in BBOX_HEADS or bbox_head.custom_cls_channels or \
            _name(bbox_head.bbox_coder) not in BOX_CODERS:
        refuse(f'box head {_name(bbox_head)} (custom classifier: '
               f'{bbox_head.custom_cls_channels}, coder {_name(bbox_head.bbox_coder)})')
    extractors = [roi_head.bbox_roi_extractor]
    if roi_head.with_mask:
        if _name(roi_head.mask_head) not in MASK_HEADS or roi_head.share_roi_extractor:
            refuse(f'mask head {_name(roi_head.mask_head)} (shared RoI extractor: '
                   f'{roi_head.share_roi_extractor})')
        if roi_head.test_cfg.get('mask_thr_binary', -1) < 0:
            refuse('mask_thr_binary < 0 (soft masks)')
        extractors.append(roi_head.mask_roi_extractor)
    for extractor in extractors:
        layer = extractor.roi_layers[0]
        if _name(extractor) not in ROI_EXTRACTORS or _name(layer) not in ROI_LAYERS or \
                layer.pool_mode != AVG_POOL:
            refuse(f'RoI extractor {_name(extractor)} with {_name(layer)} '
                   f'({getattr(layer, "pool_mode", None)})')


def roi_features(extractor: Any, feats: Sequence[Tensor], boxes: Tensor) -> Tensor:
    """``SingleRoIExtractor`` on ``boxes`` ``(B, R, 4)`` xyxy in input pixels: ``(B * R, C, S,
    S)``, RoI ``i`` of image ``b`` at row ``b * R + i``."""
    b, r = boxes.shape[:2]
    image = torch.arange(b, dtype=boxes.dtype, device=boxes.device)
    image = image[:, None].expand(b, r)                                  # (B, R)
    rois = torch.cat((image.reshape(-1, 1), boxes.reshape(-1, BOX_DIM)), 1)  # (B * R, 5)
    feats = feats[:extractor.num_inputs]
    levels = extractor.map_roi_levels(rois, len(feats))                  # (B * R,)
    out: Optional[Tensor] = None
    for i, (feat, layer) in enumerate(zip(feats, extractor.roi_layers)):
        pooled = roi_align(feat, rois, layer.output_size, layer.spatial_scale,
                           layer.sampling_ratio, layer.aligned)         # (B * R, C, S, S)
        out = pooled if out is None else \
            torch.where((levels == i)[:, None, None, None], pooled, out)
    assert out is not None
    return out


class TwoStage:
    """The RPN, box and mask stages of ``model`` (checked by :func:`check_two_stage`); the
    ``test_cfg`` values are read once here."""

    def __init__(self, model: Any) -> None:
        check_two_stage(model)
        self.model = model
        rpn_cfg = model.rpn_head.test_cfg
        self.rpn_nms_pre = int(rpn_cfg.get('nms_pre', -1))
        self.num_proposals = int(rpn_cfg.get('max_per_img', 1000))
        self.rpn_nms = NmsConfig.of('RPN', rpn_cfg.get('nms'), RPN_IOU)
        self.rpn_min_size = float(rpn_cfg.get('min_bbox_size', -1))
        rcnn_cfg = model.roi_head.test_cfg
        self.nms = NmsConfig.of('RoI head', rcnn_cfg.get('nms'), RCNN_IOU)
        self.max_per_img = int(rcnn_cfg.get('max_per_img', 100))
        self.with_mask = bool(model.roi_head.with_mask)
        self.mask_thr = float(rcnn_cfg.get('mask_thr_binary', 0.5))

    def proposals(self, feats: Tuple[Tensor, ...], h, w) -> Tuple[Tensor, Tensor]:
        """``RPNHead.predict_by_feat``: ``(B, P, 4)`` proposals by descending score, ``P`` =
        the RPN's ``max_per_img``, and ``(B, P)`` True where a proposal is real."""
        head = self.model.rpn_head
        cls_scores, bbox_preds = head(feats)
        boxes, scores, _, levels = anchor_candidates(head, cls_scores, bbox_preds,
                                                     self.rpn_nms_pre, h, w)
        valid = large_enough(boxes, self.rpn_min_size)
        scores = torch.where(valid, scores, DROPPED_SCORE)
        kept = nms_survivors(boxes, scores, levels, len(cls_scores), self.num_proposals,
                             self.rpn_nms)
        scores = torch.where(kept & valid, scores, DROPPED_SCORE)
        boxes, _, levels, _ = top_k_padded(boxes, scores, levels, self.num_proposals)
        return boxes, levels != PAD_LABEL

    def detections(self, feats: Tuple[Tensor, ...], proposals: Tensor, real: Tensor, h, w,
                   score_thr: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """``BBoxHead.predict_by_feat`` + ``multiclass_nms`` on ``(B, P, 4)`` proposals:
        ``(B, P * C, 4)`` boxes, scores (:data:`DROPPED_SCORE` where not kept) and labels, one
        candidate per (proposal, class); ``score_thr``: the RoI head's (a tensor, so that the
        graph holds it as an initializer)."""
        head = self.model.roi_head.bbox_head
        b, p = proposals.shape[:2]
        num_classes = head.num_classes
        cls_score, bbox_pred = head(roi_features(self.model.roi_head.bbox_roi_extractor,
                                                 feats, proposals))
        scores = F.softmax(cls_score, dim=-1)[:, :num_classes]              # (B * P, C)
        reg_classes = 1 if head.reg_class_agnostic else num_classes
        rois = proposals[:, :, None].expand(b, p, reg_classes, BOX_DIM)      # (B, P, Cr, 4)
        boxes = head.bbox_coder.decode(rois.reshape(-1, BOX_DIM),
                                       bbox_pred.reshape(-1, BOX_DIM))      # (B * P * Cr, 4)
        boxes = clip_boxes(boxes.reshape(b, p, reg_classes, BOX_DIM), h, w)
        boxes = boxes.expand(b, p, num_classes, BOX_DIM).reshape(b, -1, BOX_DIM)  # (B, PC, 4)
        scores = scores.reshape(b, -1)                                       # (B, P * C)
        labels = torch.arange(num_classes, device=scores.device)
        labels = labels.repeat(p)[None].expand(b, -1)                        # (B, P * C)
        real = real[:, :, None].expand(b, p, num_classes).reshape(b, -1)    # (B, P * C)
        valid = real & (scores > score_thr)
        scores = torch.where(valid, scores, DROPPED_SCORE)
        kept = nms_survivors(boxes, scores, labels, num_classes, self.max_per_img, self.nms)
        return boxes, torch.where(kept & valid, scores, DROPPED_SCORE), labels

    def masks(self, feats: Tuple[Tensor, ...], boxes: Tensor, labels: Tensor, h, w
              ) -> Tuple[Tensor, Tensor]:
        """``FCNMaskHead.predict_by_feat`` on the final ``(B, K, 4)`` boxes and ``(B, K)``
        labels (:data:`PAD_LABEL` rows give empty masks): ``(B, K, h, w)`` uint8 0 / 1 masks
        and the ``(B, K, S, S)`` float32 probabilities of each box's label they are pasted
        from (0 in padding rows; the runner pastes them at another image size)."""
        roi_head = self.model.roi_head
        b, k = boxes.shape[:2]
        logits = roi_head.mask_head(roi_features(roi_head.mask_roi_extractor, feats, boxes))
        size = logits.shape[-1]                                              # (B * K, C, S, S)
        label = labels.clamp(min=0).reshape(-1)                              # (B * K,)
        if roi_head.mask_head.class_agnostic:
            label = torch.zeros_like(label)
        probs = torch.gather(logits, 1, label[:, None, None, None].expand(-1, 1, size, size)
                             ).sigmoid()                                     # (B * K, 1, S, S)
        keep = (labels != PAD_LABEL).reshape(-1, 1, 1, 1)                    # (B * K, 1, 1, 1)
        probs = torch.where(keep, probs, 0.0)
        x0, y0, x1, y1 = boxes.reshape(-1, BOX_DIM).unbind(-1)              # each (B * K,)
        rows = _bilinear_weights(h, y0, y1, size)                            # (B * K, h, S)
        cols = _bilinear_weights(w, x0, x1, size)                            # (B * K, w, S)
        pasted = rows @ probs[:, 0] @ cols.transpose(1, 2)                   # (B * K, h, w)
        masks = (pasted >= self.mask_thr) & keep[:, 0]
        return (masks.reshape(b, k, h, w).to(torch.uint8),                   # (B, K, h, w)
                probs.reshape(b, k, size, size))                             # (B, K, S, S)


def _bilinear_weights(length, start: Tensor, end: Tensor, cells: int) -> Tensor:
    """``(N, length, cells)``: along one axis, the weight of mask cell ``j`` at pixel ``i`` in
    each of the ``(N,)`` boxes ``[start, end)``: ``grid_sample``'s bilinear taps with zeros
    outside, ``max(0, 1 - |pos - j|)``, at the pixel centre's position in cell units
    ``pos = (i + 0.5 - start) / (end - start) * cells - 0.5``; a box without extent samples the
    mask's centre (mmdet's replacement of infinities in the grid)."""
    centres = torch.arange(length, dtype=start.dtype, device=start.device)  # (length,)
    centres = centres + PIXEL_CENTRE
    pos = (centres[None] - start[:, None]) / (end - start)[:, None] * cells - PIXEL_CENTRE
    pos = torch.where(torch.isinf(pos), cells / 2 - PIXEL_CENTRE, pos)     # (N, length)
    cell = torch.arange(cells, dtype=start.dtype, device=start.device)      # (cells,)
    return (1 - (pos[..., None] - cell).abs()).clamp(min=0)                 # (N, length, cells)

