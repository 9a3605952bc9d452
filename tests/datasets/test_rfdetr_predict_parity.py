"""mmdet's ``inference_detector`` on an RF-DETR config (its test pipeline: ``RFDETRResize``)
equals ``RFDETR.predict`` of the ``rfdetr`` package (1.11.2) on images of another size than the
model's square input: rfdetr's ``RFDETRNano`` (and, ``slow``, ``RFDETRSegMedium``: the whole
seg model at its 432 px) with every parameter random
(``pretrain_weights=None``, :func:`helpers.random_rfdetr`), its state dict saved in rfdetr's
checkpoint format and converted through our loader (``vitdet_plugin.weights``, as
tests/models/test_rfdetr_model_parity.py), the config's model at the checkpoint's 91 logits.
Labels equal, scores <= 1e-4, boxes <= 1e-3 of the image side; detections whose scores tie
(:data:`TIE_TOL`) may swap ranks, as in the whole-model parity test. The same comparison with
mmdet's ``Resize`` (OpenCV on uint8) in the pipeline misses the score tolerance."""
import copy
from typing import Callable, Dict, Tuple

import numpy as np
import pytest
import torch
from helpers import REPO_ROOT
from test_rfdetr_model_parity import rfdetr_pair
from torch import nn

import vitdet_plugin.datasets  # noqa: F401  (RF-DETR's transforms)

SCORE_TOL, BOX_SIDE_TOL = 1e-4, 1e-3
#: scores closer than this tie (300 x 91 sigmoid scores of random weights crowd together)
TIE_TOL = 1e-5
#: original image sizes (height, width): COCO's most common, and one of another aspect
SHAPES = ((480, 640), (427, 500))


#: rfdetr's class and our config of each size compared
SIZES = {'N': ('RFDETRNano', 'rfdetr_nano.py'),
         'Seg-M': ('RFDETRSegMedium', 'rfdetr_seg_medium.py')}


@pytest.fixture(scope='module')
def built(tmp_path_factory) -> Callable[[str], Tuple[object, nn.Module]]:
    """``built(size)``: rfdetr's model of that size and our detector loaded from its file."""
    cache: Dict[str, Tuple[object, nn.Module]] = {}

    def build(size: str) -> Tuple[object, nn.Module]:
        if size not in cache:
            name, config = SIZES[size]
            cache[size] = rfdetr_pair(name, str(REPO_ROOT / 'configs' / 'rfdetr' / config),
                                      str(tmp_path_factory.mktemp('rfdetr')))
        return cache[size]

    return build


def _image(shape: Tuple[int, int]) -> np.ndarray:
    """A smooth RGB uint8 image with some noise (detections spread over it)."""
    gen = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    coarse = torch.rand(1, 3, shape[0] // 32, shape[1] // 32, generator=gen)
    smooth = nn.functional.interpolate(coarse, size=shape, mode='bicubic', align_corners=False)
    noise = torch.rand(1, 3, *shape, generator=gen)
    rgb = (255 * (0.8 * smooth + 0.2 * noise)).clamp(0, 255).to(torch.uint8)[0]
    return rgb.permute(1, 2, 0).numpy()


def _errors(ours, theirs, shape: Tuple[int, int]) -> Tuple[float, float]:
    """The largest score error and box error (fraction of the side) of our detections against
    rfdetr's, rank by rank or, among tied scores, against the tied detection of our label and
    box; a detection that is neither fails."""
    side = torch.tensor([shape[1], shape[0]] * 2, dtype=torch.float32)
    boxes, scores = ours.bboxes, ours.scores
    want_boxes = torch.as_tensor(theirs.xyxy, dtype=torch.float32)
    want_scores = torch.as_tensor(theirs.confidence, dtype=torch.float32)
    want_labels = torch.as_tensor(theirs.class_id)
    assert len(scores) == len(want_scores)
    err = ((boxes[:, None] - want_boxes[None]).abs() / side).amax(-1)          # (D, D)
    same_rank = (ours.labels == want_labels) & (err.diagonal() <= BOX_SIDE_TOL)
    tied = ((ours.labels[:, None] == want_labels[None])
            & ((scores[:, None] - want_scores[None]).abs() <= TIE_TOL))
    best = torch.where(tied, err, torch.inf).min(1).values
    at_cut = (scores - want_scores[-1]).abs() <= TIE_TOL
    ok = same_rank | (best <= BOX_SIDE_TOL) | at_cut
    box_err = torch.where(same_rank, err.diagonal(), best)[same_rank | (best <= BOX_SIDE_TOL)]
    if not bool(ok.all()):
        return float((scores - want_scores).abs().max()), float('inf')
    return float((scores - want_scores).abs().max()), float(box_err.max())


CASES = ([pytest.param('N', s, id=f'N-{s[0]}x{s[1]}') for s in SHAPES]
         + [pytest.param('Seg-M', SHAPES[0], id='Seg-M-480x640', marks=pytest.mark.slow)])


@pytest.mark.parametrize('size,shape', CASES)
def test_inference_detector_is_rfdetrs_predict(built, size, shape):
    from mmdet.apis import inference_detector
    theirs, ours = built(size)
    rgb = _image(shape)
    with torch.no_grad():
        want = theirs.predict(rgb, threshold=0.0)
        got = inference_detector(ours, np.ascontiguousarray(rgb[..., ::-1])).pred_instances
    score_err, box_err = _errors(got, want, shape)
    print(f'RF-DETR {size} {shape[0]}x{shape[1]}: scores {score_err:.2g}, boxes {box_err:.2g} '
          f'(top score {float(got.scores[0]):.4g}, {len(got.scores)} detections)')
    assert score_err <= SCORE_TOL and box_err <= BOX_SIDE_TOL, (score_err, box_err)


def test_mmdets_resize_is_not_rfdetrs_predict(built):
    """The check can fail: OpenCV's uint8 resize moves the scores past the tolerance."""
    from mmdet.apis import inference_detector
    theirs, ours = built('N')
    shape = SHAPES[0]
    rgb = _image(shape)
    original = ours.cfg
    ours.cfg = copy.deepcopy(original)
    ours.cfg.test_dataloader.dataset.pipeline = [
        dict(t, type='Resize', keep_ratio=False) if t['type'] == 'RFDETRResize' else t
        for t in original.test_dataloader.dataset.pipeline]
    try:
        with torch.no_grad():
            want = theirs.predict(rgb, threshold=0.0)
            got = inference_detector(ours, np.ascontiguousarray(rgb[..., ::-1])).pred_instances
    finally:
        ours.cfg = original
    score_err, box_err = _errors(got, want, shape)
    print(f'RF-DETR N {shape[0]}x{shape[1]} with mmdet\'s Resize: scores {score_err:.2g}, '
          f'boxes {box_err:.2g}')
    assert score_err > SCORE_TOL, score_err
