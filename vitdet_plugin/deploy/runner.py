"""Run an end-to-end detector graph (``tools/export_onnx.py --part detector``) with numpy and
onnxruntime only: no torch, no mmdet (the deployment side imports nothing else of ours).

The graph's own metadata (ONNX ``metadata_props`` key :data:`META_KEY`, JSON written at export)
says how the config's test pipeline loads and resizes an image; :class:`OnnxDetector` repeats
that (OpenCV, as mmcv does: ``cv2.imread`` BGR, ``cv2.resize`` bilinear; a graph that resizes
inside, ``resize.in_graph``: RF-DETR's ``RFDETRResize``, takes the image as it is), runs the
graph and maps the boxes (and a Mask R-CNN graph's masks) back to the original image; a
Panoptic FPN graph's semantic logits are fused with the instances into mmdet's panoptic map
(:mod:`.panoptic`).
OpenCV is needed for :func:`load_image` and resizing only (``opencv-python``, which mmcv
requires too); arrays already at the graph's input size need none.
"""
import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .panoptic import SEMANTIC_OUTPUT, FusionConfig, panoptic_map, tent_weights

#: Metadata key of the pipeline parameters inside the ONNX file.
META_KEY = 'vitdet_plugin.deploy'
#: Version of that metadata's layout.
META_VERSION = 2
#: Input name of the end-to-end graph.
INPUT_NAME = 'image'
#: Image channels the graph takes.
CHANNELS = 3
#: Rounding offset of mmcv's ``rescale_size`` (``int(x * scale + 0.5)``).
ROUND_HALF = 0.5
#: Outputs of every end-to-end graph: ``(B, K, 4)`` boxes, ``(B, K)`` scores and labels, and
#: ``(B,)`` the number of real detections in each image's ``K`` rows.
OUTPUT_NAMES = ('boxes', 'scores', 'labels', 'num_dets')
#: Outputs of a detector with a mask head, after boxes, scores, labels, num_dets: the binary
#: masks at the input's size and the mask head's probabilities they are pasted from.
MASK_OUTPUT, MASK_PROBS_OUTPUT = 'masks', 'mask_probs'
MASK_OUTPUTS = (MASK_OUTPUT, MASK_PROBS_OUTPUT)
#: RF-DETR-Seg's instead: the masks and the mask logits over the padded input (at a quarter of
#: its size) they are resized from.
MASK_LOGITS_OUTPUT = 'mask_logits'
SEG_MASK_OUTPUTS = (MASK_OUTPUT, MASK_LOGITS_OUTPUT)
#: Offset of a pixel's centre from its corner (mmdet's ``_do_paste_mask`` samples there), and
#: of a mask cell's centre from its corner.
PIXEL_CENTRE = 0.5


@dataclass(frozen=True)
class Detections:
    """One image's detections, by descending score: ``boxes`` ``(N, 4)`` xyxy in the original
    image's pixels, ``scores`` ``(N,)``, ``labels`` ``(N,)`` (indices into ``classes``) and,
    from a detector with a mask head, ``masks`` ``(N, H, W)`` uint8 0 / 1 of the original
    image's size; from a Panoptic FPN also ``panoptic`` ``(H, W)`` int32, mmdet's
    ``pred_panoptic_seg`` (:mod:`.panoptic`: ``label + k * INSTANCE_OFFSET`` for the ``k``-th
    instance, the stuff label for stuff, ``len(classes)`` for void)."""

    boxes: np.ndarray
    scores: np.ndarray
    labels: np.ndarray
    masks: Optional[np.ndarray] = None
    panoptic: Optional[np.ndarray] = None


def load_image(path: str) -> np.ndarray:
    """``(H, W, 3)`` uint8 in BGR order, as mmcv's ``LoadImageFromFile`` reads it."""
    import cv2
    image = cv2.imread(path, cv2.IMREAD_COLOR)
    if image is None:
        raise FileNotFoundError(f'cannot read an image from {path!r} (missing, or not an image '
                                'OpenCV decodes)')
    return image


def rescale_size(width: int, height: int, scale: Sequence[int], keep_ratio: bool
                 ) -> Tuple[int, int]:
    """The ``(new_w, new_h)`` mmdet's ``Resize(scale, keep_ratio)`` gives (mmcv's
    ``rescale_size``: the largest size fitting ``scale``'s long and short edges)."""
    if not keep_ratio:
        return int(scale[0]), int(scale[1])
    factor = min(max(scale) / max(height, width), min(scale) / min(height, width))
    return int(width * factor + ROUND_HALF), int(height * factor + ROUND_HALF)


def check_image(image: Any) -> np.ndarray:
    """``image`` as the runner takes it: an ``(H, W, 3)`` uint8 array, else a clear error."""
    if not isinstance(image, np.ndarray):
        raise TypeError(f'image must be a numpy array (H, W, 3) uint8, got {type(image).__name__}')
    if image.dtype != np.uint8:
        raise TypeError(f'image dtype is {image.dtype}; the graph takes uint8 pixels 0-255 '
                        '(convert with image.astype(np.uint8) if the values are 0-255)')
    if image.ndim != 3 or image.shape[2] != CHANNELS:
        raise ValueError(f'image shape is {image.shape}; expected (H, W, {CHANNELS}) '
                         '(a grey image: np.repeat(image[..., None], 3, axis=2); RGBA: drop '
                         'the alpha channel)')
    return image


class OnnxDetector:
    """An end-to-end graph in onnxruntime.

    Args:
        path: the ``.onnx`` file written by ``tools/export_onnx.py --part detector``.
        providers: onnxruntime execution providers.
    """

    def __init__(self, path: str, providers: Sequence[str] = ('CPUExecutionProvider',)) -> None:
        import onnxruntime as ort
        self.session = ort.InferenceSession(path, providers=list(providers))
        meta = self.session.get_modelmeta().custom_metadata_map
        if META_KEY not in meta:
            raise ValueError(f'{path} has no {META_KEY!r} metadata: it is not an end-to-end '
                             'detector graph; export one with tools/export_onnx.py CONFIG '
                             '[CKPT] --part detector')
        self.meta: Dict[str, Any] = json.loads(meta[META_KEY])
        if self.meta.get('version') != META_VERSION:
            raise ValueError(f'{path}: metadata version {self.meta.get("version")} is not '
                             f'{META_VERSION}; re-export it with this version of the plugin')
        self.classes: List[str] = list(self.meta['classes'])

    def preprocess(self, image: np.ndarray) -> Tuple[np.ndarray, Tuple[float, float]]:
        """``(H, W, 3)`` uint8 -> the graph input ``(1, 3, h, w)`` and the ``(sx, sy)`` factors
        from the original image to it (1 when the graph resizes inside)."""
        image = check_image(image)
        height, width = image.shape[:2]
        resize: Optional[Dict[str, Any]] = self.meta.get('resize')
        if resize is not None and not resize.get('in_graph', False):
            new_w, new_h = rescale_size(width, height, resize['scale'], resize['keep_ratio'])
            if (new_w, new_h) != (width, height):
                import cv2
                image = cv2.resize(image, (new_w, new_h), interpolation=cv2.INTER_LINEAR)
        new_h, new_w = image.shape[:2]
        batch = np.ascontiguousarray(image.transpose(2, 0, 1)[None])    # (1, 3, h, w)
        return batch, (new_w / width, new_h / height)

    @property
    def with_masks(self) -> bool:
        return MASK_OUTPUT in self.meta.get('outputs', ())

    def __call__(self, image: np.ndarray) -> Detections:
        batch, (sx, sy) = self.preprocess(image)
        outputs = dict(zip(self.meta['outputs'], self.session.run(None, {INPUT_NAME: batch})))
        boxes, scores, labels, num = (outputs[name] for name in OUTPUT_NAMES)
        n = int(num[0])
        scale = np.array([sx, sy, sx, sy], dtype=np.float32)
        boxes, scores, labels = boxes[0, :n] / scale, scores[0, :n], labels[0, :n]
        masks = None
        if self.with_masks and (sx, sy) == (1.0, 1.0):  # the graph's masks are the image's
            masks = outputs[MASK_OUTPUT][0, :n]
        elif self.with_masks:  # pasted at the original size, as mmdet's rescaled predict does
            masks = np.stack([paste_mask(p, box, image.shape[:2], self.meta['mask_thr_binary'])
                              for p, box in zip(outputs[MASK_PROBS_OUTPUT][0, :n], boxes)]) \
                if n else np.zeros((0, *image.shape[:2]), np.uint8)
        panoptic = None
        if SEMANTIC_OUTPUT in outputs and masks is not None:
            panoptic = panoptic_map(masks, scores, labels, outputs[SEMANTIC_OUTPUT][0],
                                    batch.shape[-2:], FusionConfig.from_meta(self.meta['panoptic']))
        return Detections(boxes=boxes, scores=scores, labels=labels, masks=masks,
                          panoptic=panoptic)

    def predict_file(self, path: str) -> Detections:
        return self(load_image(path))


def paste_mask(probs: np.ndarray, box: np.ndarray, size: Tuple[int, int], threshold: float
               ) -> np.ndarray:
    """mmdet's ``_do_paste_mask`` + threshold in numpy: the ``(S, S)`` mask probabilities
    sampled bilinearly (``grid_sample``, ``align_corners=False``, zeros outside) at the pixel
    centres of ``box`` (xyxy) in an image of ``size`` ``(H, W)``; ``(H, W)`` uint8 0 / 1.
    The sampling grid is separable: ``rows (H, S) @ probs @ cols (W, S)^T``."""
    height, width = size
    x0, y0, x1, y1 = (float(v) for v in box)
    rows = _bilinear_weights(height, y0, y1, probs.shape[0])
    cols = _bilinear_weights(width, x0, x1, probs.shape[1])
    return (rows @ probs.astype(np.float64) @ cols.T >= threshold).astype(np.uint8)


def _bilinear_weights(length: int, start: float, end: float, cells: int) -> np.ndarray:
    """``(length, cells)``: the weight of mask cell ``j`` at pixel ``i`` along one axis,
    ``grid_sample``'s bilinear taps with zeros outside, ``max(0, 1 - |pos - j|)``, at the pixel
    centre ``i + 0.5`` in cell units ``pos = (i + 0.5 - start) / (end - start) * cells - 0.5``;
    a box without extent samples the mask's centre, as mmdet's replacement of infinities (the
    graph's paste, ``two_stage._bilinear_weights``, in numpy)."""
    centres = np.arange(length) + PIXEL_CENTRE                         # (length,)
    extent = end - start
    pos = (centres - start) / extent * cells - PIXEL_CENTRE if extent != 0 else \
        np.full(length, cells / 2 - PIXEL_CENTRE)
    return tent_weights(pos, cells)                                    # (length, cells)

