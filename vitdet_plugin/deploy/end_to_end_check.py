"""An end-to-end graph in onnxruntime vs mmdet's own ``predict`` on the same uint8 images.

:func:`report` compares at the config's ``score_thr`` and, when it is positive, at 0 as well
(the graph's threshold overridden, mmdet's ``test_cfg`` set alike): the raw top-k below the
threshold, so that a model with no detection above it (an under-trained one) is still checked;
a size with nothing to compare fails.

A two-stage graph (LW-DETR's) picks its proposals by a top-k over per-token scores; where two
tokens' scores are nearly tied (an under-trained model's often are), onnxruntime's rounding may
order them the other way and every output after it differs. The check therefore also reads the
graph's proposal tokens and, where they differ from PyTorch's, says whether only near-tied tokens
swapped (the outputs are then not comparable at that size, and the check says so) or not (a
failure).
"""
import dataclasses
import json
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..models.heads.lwdetr_head import LWDETRHead
from .end_to_end import SCORE_THRESHOLD
from .ort_check import ort_session
from .panoptic import SEMANTIC_OUTPUT, FusionConfig, panoptic_map
from .runner import INPUT_NAME, MASK_OUTPUT, META_KEY

#: Largest box difference, relative to the image's longer side.
BOX_TOLERANCE = 1e-3
#: Largest score difference.
SCORE_TOLERANCE = 1e-4
#: Smallest IoU of a detection's mask with mmdet's.
MASK_IOU_TOLERANCE = 0.99
#: Smallest fraction of pixels whose panoptic id equals mmdet's.
PANOPTIC_TOLERANCE = 0.99
#: Largest difference of two tokens' PyTorch proposal scores (best-class logits) that
#: onnxruntime may rank the other way (fp32 rounding of a different kernel order).
PROPOSAL_TIE_TOLERANCE = 1e-5
#: The graph output :func:`threshold_session` adds for an LW-DETR graph: the token indices of
#: its two-stage proposals (the outputs of the graph's first TopK, the proposal selection).
PROPOSAL_OUTPUT = 'check_proposal_tokens'


@dataclass(frozen=True)
class Parity:
    """One image: onnxruntime vs mmdet (detections matched by rank)."""

    size: Tuple[int, int]
    num_onnx: int
    num_torch: int
    box_error: float      # max |onnx - torch| / max(H, W)
    score_error: float    # max |onnx - torch|
    labels_equal: bool    # at every rank whose score is not tied with a neighbour's
    mask_iou: float = 1.0  # smallest mask IoU at those ranks (1 without masks)
    panoptic_agreement: float = 1.0  # pixels of equal panoptic id (1 without a panoptic map)
    #: where the graph's proposal tokens differ from PyTorch's (by rank), the largest PyTorch
    #: score difference of the two tokens at one rank; None: the same proposals (or no check)
    proposal_gap: Optional[float] = None

    @property
    def empty(self) -> bool:
        """Nothing to compare: no detection on either side."""
        return self.num_onnx == self.num_torch == 0

    @property
    def tied(self) -> bool:
        """The proposals differ only between near-tied tokens: the outputs are not
        comparable (nor wrong)."""
        return self.proposal_gap is not None and self.proposal_gap <= PROPOSAL_TIE_TOLERANCE

    @property
    def ok(self) -> bool:
        if self.proposal_gap is not None:
            return self.tied
        return (self.num_onnx == self.num_torch and self.box_error <= BOX_TOLERANCE
                and self.score_error <= SCORE_TOLERANCE and self.labels_equal
                and self.mask_iou >= MASK_IOU_TOLERANCE
                and self.panoptic_agreement >= PANOPTIC_TOLERANCE)


#: A detector's outputs on one image, by descending score: ``(N, 4)`` boxes, ``(N,)`` scores
#: and labels, ``(N, H, W)`` masks or None, and a panoptic detector's ``(H, W)`` panoptic map
#: (mmdet's ``pred_panoptic_seg``) or None.
Instances = Tuple[np.ndarray, np.ndarray, np.ndarray, Optional[np.ndarray], Optional[np.ndarray]]


def mmdet_predict(model: Any, image: torch.Tensor,
                  resize_to: Optional[Tuple[int, int]] = None
                  ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """mmdet's ``predict`` of ``model`` on one ``(3, H, W)`` uint8 image already at the
    graph's input size (its data preprocessor: channel flip, mean / std, padding):
    ``(boxes, scores, labels)`` by descending score. ``resize_to``: the ``(h, w)`` of a graph
    that resizes inside (``resize.in_graph``): the image goes through ``RFDETRResize`` first
    and the detections are rescaled to it, as the test pipeline and ``predict`` do."""
    return mmdet_instances(model, image, resize_to)[:3]


def mmdet_instances(model: Any, image: torch.Tensor,
                    resize_to: Optional[Tuple[int, int]] = None) -> Instances:
    """:func:`mmdet_predict`, the ``(N, H, W)`` bool masks (None without a mask head) and the
    panoptic map (None without one)."""
    from mmdet.structures import DetDataSample

    from ..datasets.rfdetr_transforms import resize_pixels

    ori_h, ori_w = image.shape[-2:]
    h, w = resize_to or (ori_h, ori_w)
    pixels: torch.Tensor = image
    if resize_to is not None:  # RFDETRResize: float32 pixels (H, W, 3) -> (3, h, w)
        hwc = image.permute(1, 2, 0).numpy()
        pixels = torch.from_numpy(resize_pixels(hwc, (h, w), antialias=False)).permute(2, 0, 1)
    sample = DetDataSample(metainfo=dict(img_shape=(h, w), ori_shape=(ori_h, ori_w),
                                         scale_factor=(w / ori_w, h / ori_h)))
    with torch.no_grad():
        data = model.data_preprocessor(dict(inputs=[pixels], data_samples=[sample]), False)
        sample = model.predict(data['inputs'], data['data_samples'])[0]
    pred = sample.pred_instances
    order = torch.argsort(pred.scores, descending=True, stable=True)
    masks = pred.masks[order].numpy() if 'masks' in pred else None
    panoptic = sample.pred_panoptic_seg.sem_seg[0].numpy() if 'pred_panoptic_seg' in sample \
        else None
    return (pred.bboxes[order].numpy(), pred.scores[order].numpy(),
            pred.labels[order].numpy(), masks, panoptic)


def mask_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of each pair of ``(N, H, W)`` binary masks (1 where both are empty)."""
    a, b = a.astype(bool), b.astype(bool)
    union = (a | b).sum((1, 2))
    return np.where(union > 0, (a & b).sum((1, 2)) / np.maximum(union, 1), 1.0)


def untied(scores: np.ndarray) -> np.ndarray:
    """True at the ranks whose score differs from both neighbours' by more than the tolerance
    (a tie may be broken either way)."""
    if len(scores) == 0:  # (np.diff of nothing would still leave one True)
        return np.zeros(0, dtype=bool)
    gaps = np.abs(np.diff(scores)) > SCORE_TOLERANCE
    return np.concatenate(([True], gaps)) & np.concatenate((gaps, [True]))


def parity(outputs: Sequence[np.ndarray], reference: Instances, size: Tuple[int, int],
           fusion: Optional[FusionConfig] = None) -> Parity:
    """One image's graph outputs (a batch of 1: boxes, scores, labels, num_dets, then masks,
    mask_probs and sem_logits when the graph has them) vs the ``reference`` detections,
    matched by rank; with ``fusion``, the runner's panoptic map vs the reference's."""
    boxes, scores, labels, num = outputs[:4]
    n = int(num[0])
    ref_boxes, ref_scores, ref_labels, ref_masks, ref_panoptic = reference
    m = min(n, len(ref_scores))
    untied_ranks = untied(ref_scores[:m])
    ious = mask_iou(outputs[4][0, :m], ref_masks[:m])[untied_ranks] \
        if ref_masks is not None else np.ones(0)
    return Parity(
        size=size, num_onnx=n, num_torch=len(ref_scores),
        box_error=float(np.abs(boxes[0, :m] - ref_boxes[:m])[untied_ranks].max(initial=0))
        / max(size),
        score_error=float(np.abs(scores[0, :m] - ref_scores[:m]).max(initial=0)),
        labels_equal=bool((labels[0, :m] == ref_labels[:m])[untied_ranks].all()),
        mask_iou=float(ious.min(initial=1.0)),
        panoptic_agreement=1.0 if fusion is None or ref_panoptic is None else float(
            (panoptic_map(outputs[4][0, :n], scores[0, :n], labels[0, :n], outputs[6][0], size,
                          fusion) == ref_panoptic).mean()))


def threshold_session(path: str, proposals: bool = False) -> Tuple[Any, bool]:
    """An onnxruntime session of the graph at ``path`` whose score threshold
    (:data:`~.end_to_end.SCORE_THRESHOLD`, an initializer) is made an input defaulting to its
    value, so that :func:`compare` can set it; and whether the graph holds one (DINO's keeps its
    top-k without a threshold, and a threshold of 0 may be folded away). With ``proposals`` (an
    LW-DETR graph) the session also outputs :data:`PROPOSAL_OUTPUT`: the indices of the graph's
    first TopK (every later one descends from the proposals, so the first in the graph's
    topological order is theirs)."""
    import onnx

    graph = onnx.load(path)
    found = any(t.name == SCORE_THRESHOLD for t in graph.graph.initializer)
    if found:
        graph.graph.input.append(onnx.helper.make_tensor_value_info(
            SCORE_THRESHOLD, onnx.TensorProto.FLOAT, []))
    if proposals:
        topk = next((n for n in graph.graph.node if n.op_type == 'TopK'), None)
        if topk is None:
            raise RuntimeError(f'{path} holds no TopK node: not the graph of a two-stage '
                               'LW-DETR head (export it with --part detector)')
        graph.graph.node.append(onnx.helper.make_node('Identity', [topk.output[1]],
                                                      [PROPOSAL_OUTPUT]))
        graph.graph.output.append(onnx.helper.make_tensor_value_info(
            PROPOSAL_OUTPUT, onnx.TensorProto.INT64, None))
    return ort_session(graph.SerializeToString(), quiet=True), found


def has_proposals(model: Any) -> bool:
    """Whether ``model``'s graph selects two-stage proposals that :func:`compare` checks (an
    LW-DETR head's)."""
    return isinstance(getattr(model, 'bbox_head', None), LWDETRHead)


@contextmanager
def proposal_scores(model: Any) -> Iterator[List[torch.Tensor]]:
    """Collects the ``(B, N)`` proposal scores of every token (best-class logit of the
    first group's proposal classifier: what ``LWDETRHead.proposals`` ranks) of each forward of
    ``model`` inside the block."""
    found: List[torch.Tensor] = []
    handle = model.bbox_head.enc_cls_branches[0].register_forward_hook(
        lambda module, args, out: found.append(out.detach().float().max(-1).values))
    try:
        yield found
    finally:
        handle.remove()


def proposal_gap(onnx_tokens: np.ndarray, scores: torch.Tensor) -> Optional[float]:
    """The graph's proposal tokens ``(P,)`` by rank against PyTorch's ranking of the ``(N,)``
    ``scores`` (``LWDETRHead.proposals``' top-k): None where they are the same tokens in the
    same order, else the largest score difference of the two tokens at one rank."""
    mine = scores.topk(len(onnx_tokens)).indices.numpy()
    differ = mine != onnx_tokens
    if not differ.any():
        return None
    values = scores.numpy()
    return float(np.abs(values[onnx_tokens[differ]] - values[mine[differ]]).max())


@contextmanager
def mmdet_score_thr(model: Any, score_thr: Optional[float]) -> Iterator[None]:
    """mmdet's ``predict`` with the ``test_cfg`` ``score_thr`` that the end-to-end graph reads
    (the RoI head's, else the bbox head's) set to ``score_thr`` (None: as configured)."""
    cfg = model.roi_head.test_cfg if getattr(model, 'roi_head', None) is not None \
        else model.bbox_head.test_cfg
    before = cfg.get('score_thr')
    if score_thr is not None:
        cfg['score_thr'] = score_thr
    try:
        yield
    finally:
        if before is None:
            cfg.pop('score_thr', None)
        else:
            cfg['score_thr'] = before


def compare(session: Any, model: Any, images: Sequence[torch.Tensor],
            score_thr: Optional[float] = None) -> List[Parity]:
    """Each ``(3, H, W)`` uint8 image through ``session`` (as a batch of 1) and mmdet (masks
    and the panoptic map too when the graph has them); ``score_thr``: the threshold of both
    (a :func:`threshold_session`; None: the graph's and the config's)."""
    fusion = None
    meta = json.loads(session.get_modelmeta().custom_metadata_map.get(META_KEY, '{}'))
    if SEMANTIC_OUTPUT in [o.name for o in session.get_outputs()]:
        fusion = FusionConfig.from_meta(meta['panoptic'])
    resize_to = graph_resize_of(meta)
    feed: Dict[str, np.ndarray] = {} if score_thr is None else \
        {SCORE_THRESHOLD: np.array(score_thr, dtype=np.float32)}
    names = [o.name for o in session.get_outputs()]
    found = []
    with mmdet_score_thr(model, score_thr):
        for image in images:
            outputs = session.run(None, {INPUT_NAME: image[None].numpy(), **feed})
            checks: ContextManager[List[torch.Tensor]] = (
                proposal_scores(model) if PROPOSAL_OUTPUT in names else nullcontext([]))
            with checks as scores:
                reference = mmdet_instances(model, image, resize_to)
            p = parity(outputs, reference, (int(image.shape[-2]), int(image.shape[-1])), fusion)
            if scores:
                p = dataclasses.replace(p, proposal_gap=proposal_gap(
                    outputs[names.index(PROPOSAL_OUTPUT)][0], scores[0][0]))
            found.append(p)
    return found


def graph_resize_of(meta: Dict[str, Any]) -> Optional[Tuple[int, int]]:
    """The ``(h, w)`` a graph with metadata ``meta`` resizes its input to inside
    (``resize.in_graph``), else None."""
    resize = meta.get('resize') or {}
    if not resize.get('in_graph', False):
        return None
    width, height = resize['scale']
    return int(height), int(width)


def describe(p: Parity, masks: bool, panoptic: bool) -> str:
    """One image's comparison in words, ending in ``ok`` or ``FAILED``."""
    if p.proposal_gap is not None:
        return (f'the two-stage proposals differ from PyTorch\'s between tokens whose PyTorch '
                f'scores are {p.proposal_gap:.1e} apart: ' + (
                    f'near-tied (<= {PROPOSAL_TIE_TOLERANCE:.0e}), onnxruntime\'s rounding may '
                    'rank them the other way; outputs not comparable at this size, ok'
                    if p.tied else 'not a tie FAILED'))
    if p.empty:
        return 'no detection to compare (onnxruntime 0, PyTorch 0) FAILED'
    extra = f', min mask IoU {p.mask_iou:.4f}' if masks else ''
    if panoptic:
        extra += f', panoptic map equal at {100 * p.panoptic_agreement:.2f} % of the pixels'
    return (f'{p.num_onnx} detections (PyTorch {p.num_torch}), box error {p.box_error:.1e} of '
            f'the image side, score error {p.score_error:.1e}, labels '
            f'{"equal" if p.labels_equal else "DIFFER"}{extra} {"ok" if p.ok else "FAILED"}')


def report(path: str, model: Any, images: Sequence[torch.Tensor], score_thr: float
           ) -> Iterator[Tuple[str, str, bool]]:
    """The export check of the graph at ``path`` (exported at ``score_thr``, the config's):
    ``(size, line, passed)`` per line. Per image: at ``score_thr``; when it is positive also
    at 0 (the raw top-k below it), and a loud warning instead of the first line when nothing
    lies above it; a comparison of no detection at all fails."""
    session, has_threshold = threshold_session(path, has_proposals(model))
    if score_thr > 0 and not has_threshold:
        raise RuntimeError(f'{path} holds no {SCORE_THRESHOLD!r} initializer though score_thr '
                           f'is {score_thr:g}: the check cannot compare below the threshold')
    outputs = [o.name for o in session.get_outputs()]
    masks, panoptic = MASK_OUTPUT in outputs, SEMANTIC_OUTPUT in outputs
    at_thr = compare(session, model, images, score_thr if has_threshold else None)
    raw = compare(session, model, images, 0.0) if score_thr > 0 else [None] * len(images)
    for p, r in zip(at_thr, raw):
        size = f'{p.size[0]}x{p.size[1]}'
        if r is not None and p.empty:
            yield size, (f'  WARNING {size}: no detection above score_thr {score_thr:g} '
                         '(onnxruntime 0, PyTorch 0): compared below it only'), True
        else:
            yield size, f'  {size}: {describe(p, masks, panoptic)}', p.ok and not p.empty
        if r is not None:
            yield size, (f'  {size} at score_thr 0 (the raw top-k): '
                         f'{describe(r, masks, panoptic)}'), r.ok and not r.empty
