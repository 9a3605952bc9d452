"""Run an end-to-end detector graph (``tools/export_onnx.py --part detector``) with numpy and
onnxruntime only: no torch, no mmdet (the deployment side imports nothing else of ours).

The graph's own metadata (ONNX ``metadata_props`` key :data:`META_KEY`, JSON written at export)
says how the config's test pipeline loads and resizes an image; :class:`OnnxDetector` repeats
that (OpenCV, as mmcv does: ``cv2.imread`` BGR, ``cv2.resize`` bilinear), runs the graph and maps
the boxes (and a Mask R-CNN graph's masks) back to the original image. OpenCV is needed for
:func:`load_image` and resizing only (``opencv-python``, which mmcv requires too); arrays already
at the graph's input size need none.
"""
import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

#: Metadata key of the pipeline parameters inside the ONNX file.
META_KEY = 'vitdet_plugin.deploy'
#: Version of that metadata's layout.
META_VERSION = 1
#: Input name of the end-to-end graph.
INPUT_NAME = 'image'
#: Image channels the graph takes.
CHANNELS = 3
#: Rounding offset of mmcv's ``rescale_size`` (``int(x * scale + 0.5)``).
ROUND_HALF = 0.5
#: Name of the masks output (graphs of detectors with a mask head).
MASK_OUTPUT = 'masks'
#: A mask resized bilinearly to the original image is 1 where it is at least this.
MASK_THRESHOLD = 0.5


@dataclass(frozen=True)
class Detections:
    """One image's detections, by descending score: ``boxes`` ``(N, 4)`` xyxy in the original
    image's pixels, ``scores`` ``(N,)``, ``labels`` ``(N,)`` (indices into ``classes``) and,
    from a detector with a mask head, ``masks`` ``(N, H, W)`` uint8 0 / 1 of the original
    image's size."""

    boxes: np.ndarray
    scores: np.ndarray
    labels: np.ndarray
    masks: Optional[np.ndarray] = None


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
        from the original to the resized image."""
        image = check_image(image)
        height, width = image.shape[:2]
        resize: Optional[Dict[str, Any]] = self.meta.get('resize')
        if resize is not None:
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
        outputs = self.session.run(None, {INPUT_NAME: batch})
        boxes, scores, labels, num = outputs[:4]
        n = int(num[0])
        scale = np.array([sx, sy, sx, sy], dtype=np.float32)
        masks = None
        if self.with_masks:
            masks = resize_masks(outputs[4][0, :n], image.shape[:2])
        return Detections(boxes=boxes[0, :n] / scale, scores=scores[0, :n],
                          labels=labels[0, :n], masks=masks)

    def predict_file(self, path: str) -> Detections:
        return self(load_image(path))


def resize_masks(masks: np.ndarray, size: Tuple[int, int]) -> np.ndarray:
    """``(N, h, w)`` 0 / 1 masks of the graph's input -> ``(N, H, W)`` uint8 of the original
    ``size`` ``(H, W)``: bilinear (as the image was resized), then at least
    :data:`MASK_THRESHOLD`."""
    height, width = size
    if masks.shape[1:] == (height, width):
        return masks.astype(np.uint8)
    import cv2
    out = np.zeros((len(masks), height, width), np.uint8)
    for i, mask in enumerate(masks):
        resized = cv2.resize(mask.astype(np.float32), (width, height),
                             interpolation=cv2.INTER_LINEAR)
        out[i] = resized >= MASK_THRESHOLD
    return out
