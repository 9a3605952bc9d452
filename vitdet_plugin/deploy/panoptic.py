"""Panoptic FPN's last steps in numpy, after its end-to-end graph (no torch, no mmdet).

The graph of a Panoptic FPN (``tools/export_onnx.py --part detector``) outputs the Mask R-CNN
detections and the semantic head's logits at its own stride (``sem_logits``, ``(B, C, Hs, Ws)``,
``C`` = stuff classes + 1 for "a thing"). :func:`panoptic_map` repeats what mmdet does with them:

* ``BaseSemanticHead.predict(rescale=True)``: bilinear (``align_corners=False``) to the padded
  input, crop to the resized image, bilinear to the original image; both resizes are linear and
  separable, so they are one ``(H, Hs)`` and one ``(W, Ws)`` matrix here;
* ``HeuristicFusionHead.predict``: the instances (by descending score) laid on an id map, one
  dropped when more than ``mask_overlap`` of it is already covered, the rest of the image from
  the semantic argmax (stuff labels after the things; the "thing" channel becomes void), stuff
  segments under ``stuff_area_limit`` pixels void.

The result is mmdet's ``pred_panoptic_seg.sem_seg`` encoding: ``label + k * INSTANCE_OFFSET``
for the ``k``-th instance (``k`` from 1), the stuff label for stuff, ``num_classes`` for void.
"""
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

#: mmdet's ``INSTANCE_OFFSET``: a panoptic id is ``label + instance * INSTANCE_OFFSET``.
INSTANCE_OFFSET = 1000
#: Output of the semantic head's logits in the graph.
SEMANTIC_OUTPUT = 'sem_logits'
#: Added to a mask's area in the overlap ratio (mmdet's ``_lay_masks``).
AREA_EPS = 1e-5
#: Offset of a pixel's centre from its corner in ``F.interpolate(align_corners=False)``.
HALF_PIXEL = 0.5


@dataclass(frozen=True)
class FusionConfig:
    """``HeuristicFusionHead``'s settings and which detections enter it (from the graph's
    metadata, ``panoptic``)."""

    num_things: int
    num_stuff: int
    mask_overlap: float
    stuff_area_limit: int
    instance_score_thr: float
    pad_size_divisor: int

    @property
    def num_classes(self) -> int:
        """Things + stuff: also the void label of the panoptic map."""
        return self.num_things + self.num_stuff

    @classmethod
    def from_meta(cls, meta: Dict[str, Any]) -> 'FusionConfig':
        return cls(**{k: meta[k] for k in cls.__dataclass_fields__})


def tent_weights(pos: np.ndarray, cells: int) -> np.ndarray:
    """``(len(pos), cells)``: linear interpolation's weight of each cell (centred at its index)
    at positions ``pos`` in cell units, ``max(0, 1 - |pos - j|)`` (zero outside the cells)."""
    return np.clip(1 - np.abs(pos[:, None] - np.arange(cells)), 0, None)


def resize_matrix(out_len: int, in_len: int, span: Optional[float] = None) -> np.ndarray:
    """``(out_len, in_len)``: 1-D ``F.interpolate(mode='bilinear', align_corners=False)`` as a
    matrix (source ``(i + 0.5) * in / out - 0.5``, clamped to the input: ``grid_sample``'s
    border); ``span``: resize the first ``span`` cells only (default all ``in_len``)."""
    scale = (in_len if span is None else span) / out_len
    pos = (np.arange(out_len) + HALF_PIXEL) * scale - HALF_PIXEL
    return tent_weights(np.clip(pos, 0, in_len - 1), in_len)


def semantic_labels(logits: np.ndarray, resized: Tuple[int, int], original: Tuple[int, int],
                    pad_size_divisor: int) -> np.ndarray:
    """``(H, W)`` argmax of the ``(C, Hs, Ws)`` logits of an image resized to ``resized``
    ``(h, w)`` (the graph's input, padded to ``pad_size_divisor``), at its ``original``
    ``(H, W)`` size, as ``BaseSemanticHead.predict(rescale=True)`` + argmax."""
    (h, w), (height, width) = resized, original
    pad_h = -(-h // pad_size_divisor) * pad_size_divisor
    pad_w = -(-w // pad_size_divisor) * pad_size_divisor
    rows = resize_matrix(height, h) @ resize_matrix(pad_h, logits.shape[1])[:h]   # (H, Hs)
    cols = resize_matrix(width, w) @ resize_matrix(pad_w, logits.shape[2])[:w]    # (W, Ws)
    full = np.einsum('yi,cij,xj->cyx', rows, logits.astype(np.float64), cols)     # (C, H, W)
    return full.argmax(0)


def heuristic_fusion(masks: np.ndarray, labels: np.ndarray, semantic: np.ndarray,
                     cfg: FusionConfig) -> np.ndarray:
    """``HeuristicFusionHead._predict_single``: ``(N, H, W)`` 0 / 1 masks and ``(N,)`` labels
    by descending score, the ``(H, W)`` semantic argmax -> the ``(H, W)`` int32 panoptic map
    (module docstring)."""
    id_map = np.zeros(semantic.shape, np.int64)   # 0: no instance, k: the k-th laid one
    laid: List[int] = []
    for mask, label in zip(masks.astype(bool), labels):
        area = int(mask.sum())
        if area == 0:
            continue
        covered = id_map > 0
        if (mask & covered).sum() / (area + AREA_EPS) > cfg.mask_overlap:
            continue
        id_map[mask & ~covered] = len(laid) + 1
        laid.append(int(label))
    panoptic = semantic.astype(np.int64) + cfg.num_things
    for k, label in enumerate(laid, start=1):
        panoptic[id_map == k] = label + k * INSTANCE_OFFSET
    ids, counts = np.unique(panoptic % INSTANCE_OFFSET, return_counts=True)
    small = ids[(ids >= cfg.num_things) & (counts < cfg.stuff_area_limit)]
    panoptic[np.isin(panoptic, small)] = cfg.num_classes
    return panoptic.astype(np.int32)


def panoptic_map(masks: np.ndarray, scores: np.ndarray, labels: np.ndarray,
                 logits: np.ndarray, resized: Tuple[int, int], cfg: FusionConfig
                 ) -> np.ndarray:
    """One image: its detections at the original size (``(N, H, W)`` masks, by descending
    score) and the graph's ``(C, Hs, Ws)`` semantic logits for the ``resized`` input ->
    mmdet's ``(H, W)`` panoptic map."""
    semantic = semantic_labels(logits, resized, masks.shape[1:], cfg.pad_size_divisor)
    confident = scores >= cfg.instance_score_thr
    return heuristic_fusion(masks[confident], labels[confident], semantic, cfg)
