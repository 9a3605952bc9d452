"""An end-to-end graph in onnxruntime vs mmdet's own ``predict`` on the same uint8 images."""
from dataclasses import dataclass
from typing import Any, List, Sequence, Tuple

import numpy as np
import torch

from .runner import INPUT_NAME

#: Largest box difference, relative to the image's longer side.
BOX_TOLERANCE = 1e-3
#: Largest score difference.
SCORE_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Parity:
    """One image: onnxruntime vs mmdet (detections matched by rank)."""

    size: Tuple[int, int]
    num_onnx: int
    num_torch: int
    box_error: float      # max |onnx - torch| / max(H, W)
    score_error: float    # max |onnx - torch|
    labels_equal: bool    # at every rank whose score is not tied with a neighbour's

    @property
    def ok(self) -> bool:
        return (self.num_onnx == self.num_torch and self.box_error <= BOX_TOLERANCE
                and self.score_error <= SCORE_TOLERANCE and self.labels_equal)


def mmdet_predict(model: Any, image: torch.Tensor
                  ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """mmdet's ``predict`` of ``model`` on one ``(3, H, W)`` uint8 image already at the
    graph's input size (its data preprocessor: channel flip, mean / std, padding):
    ``(boxes, scores, labels)`` by descending score."""
    from mmdet.structures import DetDataSample

    h, w = image.shape[-2:]
    sample = DetDataSample(metainfo=dict(img_shape=(h, w), ori_shape=(h, w),
                                         scale_factor=(1.0, 1.0)))
    with torch.no_grad():
        data = model.data_preprocessor(dict(inputs=[image], data_samples=[sample]), False)
        pred = model.predict(data['inputs'], data['data_samples'])[0].pred_instances
    order = torch.argsort(pred.scores, descending=True, stable=True)
    return (pred.bboxes[order].numpy(), pred.scores[order].numpy(),
            pred.labels[order].numpy())


def untied(scores: np.ndarray) -> np.ndarray:
    """True at the ranks whose score differs from both neighbours' by more than the tolerance
    (a tie may be broken either way)."""
    gaps = np.abs(np.diff(scores)) > SCORE_TOLERANCE
    return np.concatenate(([True], gaps)) & np.concatenate((gaps, [True]))


def compare(session: Any, model: Any, images: Sequence[torch.Tensor]) -> List[Parity]:
    """Each ``(3, H, W)`` uint8 image through ``session`` (as a batch of 1) and mmdet."""
    results = []
    for image in images:
        boxes, scores, labels, num = session.run(None, {INPUT_NAME: image[None].numpy()})
        n = int(num[0])
        ref_boxes, ref_scores, ref_labels = mmdet_predict(model, image)
        m = min(n, len(ref_scores))
        side = float(max(image.shape[-2:]))
        untied_ranks = untied(ref_scores[:m])
        results.append(Parity(
            size=(int(image.shape[-2]), int(image.shape[-1])), num_onnx=n,
            num_torch=len(ref_scores),
            box_error=float(np.abs(boxes[0, :m] - ref_boxes[:m])[untied_ranks].max(initial=0))
            / side,
            score_error=float(np.abs(scores[0, :m] - ref_scores[:m]).max(initial=0)),
            labels_equal=bool((labels[0, :m] == ref_labels[:m])[untied_ranks].all())))
    return results
