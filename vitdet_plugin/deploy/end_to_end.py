"""The whole detector as one ONNX graph: uint8 image -> detections.

:class:`EndToEndDetector` wraps a built mmdet detector. Its graph (see ``docs/deploy.md``):

* input ``image`` ``(B, 3, H, W)`` uint8 in the channel order the test pipeline loads
  (``LoadImageFromFile``: BGR), already resized as the test pipeline resizes; B, H, W dynamic.
  A test pipeline that resizes with ``RFDETRResize`` to a fixed size (``keep_ratio=False``,
  RF-DETR's ``predict``) resizes inside the graph instead (:func:`graph_resize`): the graph
  takes the image as it is and its boxes and masks are in the input's pixels;
* inside: the data preprocessor (channel flip, mean / std, zero padding of the normalised image
  to ``pad_size_divisor``), the network, box decoding and the config's ``test_cfg``
  (``score_thr``, ``max_per_img``, NMS IoU through ONNX ``NonMaxSuppression``);
* outputs, ``K = max_per_img``: ``boxes`` ``(B, K, 4)`` float32 xyxy in input pixels,
  ``scores`` ``(B, K)`` float32, ``labels`` ``(B, K)`` int64 and ``num_dets`` ``(B,)`` int64:
  the first ``num_dets[b]`` rows of image ``b`` are its detections, by descending score; the
  rest are padding (boxes 0, scores 0, labels -1); with a mask head also ``masks``
  ``(B, K, H, W)`` uint8 0 / 1 at the input's size and ``mask_probs`` ``(B, K, S, S)`` float32,
  the mask head's probabilities they are pasted from (padding rows all 0); RF-DETR-Seg
  replaces ``mask_probs`` by ``mask_logits`` ``(B, K, Hp / 4, Wp / 4)`` float32, its mask
  logits over the padded input they are resized from; a Panoptic FPN
  adds ``sem_logits`` ``(B, C, Hs, Ws)`` float32, its semantic head's logits at the head's
  stride of the padded input, which the runner resizes and fuses with the instances
  (:mod:`.panoptic`).

Exported: our set-prediction heads (:data:`SET_HEADS`: ``SdpaDETRHead``, RF-DETR's
``LWDETRHead`` / ``LWDETRSegHead``, D-FINE / DEIMv2's ``DFineHead``) through their own test
path, traced: the head's ``forward_images`` on the maps, the padded input's size and each
image's size as tensors, then its batched ``detections`` (top-k over queries x classes, no NMS)
and, for RF-DETR-Seg, its ``masks_to_image``; nothing of them is repeated here. Graph forms of
mmdet's heads, which read sizes as Python numbers: single-stage anchor heads decoded per level
(RetinaNet: sigmoid scores, ``nms_pre`` per level, class-aware NMS), Faster / Mask R-CNN (RPN +
``StandardRoIHead``, :mod:`.two_stage`), Panoptic FPN (Mask R-CNN + ``PanopticFPNHead``; the
heuristic fusion runs in the runner) and mmdet's DINO (:mod:`.deformable_detr`). Anything else
is refused with the reason (:func:`check_exportable`).
"""
import json
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .deformable_detr import Dino, check_dino, is_deformable_detr
from ..models.heads.detr_core import query_class_top_k
from ..models.heads.detr_memory import size_tensor
from ..models.heads.lwdetr_seg_head import masks_to_image
from .graph_ops import (DROPPED_SCORE, NmsConfig, anchor_candidates, large_enough,
                        nms_survivors, top_k_padded)
from .graph_ops import PAD_LABEL  # (also the I/O contract's padding label, re-exported)
from .onnx_export import EXPORT_SAMPLE_SIZE, dynamic_shapes, export_graph
from .panoptic import SEMANTIC_OUTPUT
from .runner import (INPUT_NAME, MASK_OUTPUTS, META_KEY, META_VERSION, OUTPUT_NAMES,
                     SEG_MASK_OUTPUTS)
from .two_stage import TwoStage, check_two_stage

#: Name of the graph's score threshold (``test_cfg``'s ``score_thr``): exported as an input, so
#: that no other constant is folded into it, then stored as an initializer of that name, which
#: the export check overrides to compare the raw top-k below it (:mod:`.end_to_end_check`).
SCORE_THRESHOLD = 'score_threshold'


#: Heads whose outputs (semantic / panoptic maps) the graph has no output for, unless the
#: detector is a Panoptic FPN (:data:`PANOPTIC_DETECTORS`).
SEGMENTATION_HEADS = ('semantic_head', 'panoptic_head', 'panoptic_fusion_head')
#: Panoptic FPN, as exported: the detector, its semantic head and its fusion (type names).
PANOPTIC_DETECTORS = ('PanopticFPN', 'AllOutputsPanopticFPN')
PANOPTIC_PARTS = dict(semantic_head=('PanopticFPNHead',),
                      panoptic_fusion_head=('HeuristicFusionHead',))


def is_panoptic_fpn(model: Any) -> bool:
    """True for a Panoptic FPN the graph repeats (its semantic logits as an output, the fusion
    in the runner); False without segmentation heads; else a ``ValueError`` saying why not."""
    name = type(model).__name__
    seg_heads = [h for h in SEGMENTATION_HEADS if getattr(model, h, None) is not None]
    if not seg_heads:
        return False
    parts = {h: type(getattr(model, h, None)).__name__ for h in SEGMENTATION_HEADS}
    with_mask = bool(getattr(getattr(model, 'roi_head', None), 'with_mask', False))
    if name in PANOPTIC_DETECTORS and with_mask and \
            all(parts[h] in types for h, types in PANOPTIC_PARTS.items()):
        return True
    raise ValueError(f'{name} has {" and ".join(f"{h} {parts[h]}" for h in seg_heads)}: no '
                     f'end-to-end export (panoptic: {"/".join(PANOPTIC_DETECTORS)} with '
                     f'{" + ".join("/".join(t) for t in PANOPTIC_PARTS.values())} only, its '
                     'semantic logits an output and the fusion of its Mask R-CNN instances in the '
                     'runner); export --part neck and run the heads in the caller')


def check_exportable(model: Any) -> str:
    """The kind of end-to-end graph ``model`` exports to (``'detr'``, ``'dense'``,
    ``'two_stage'``, which includes Panoptic FPN, ``'dino'``, ``'lwdetr'`` or ``'dfine'``), or a
    ``ValueError`` saying why it cannot."""
    name = type(model).__name__
    is_panoptic_fpn(model)  # refuses the segmentation heads it does not repeat
    if hasattr(model, 'roi_head') or hasattr(model, 'rpn_head'):
        check_two_stage(model)  # refuses what it does not repeat
        return 'two_stage'
    if is_deformable_detr(model):
        check_dino(model)  # refuses what it does not repeat (DeformableDETR, ...)
        return 'dino'
    head = getattr(model, 'bbox_head', None)
    if head is None:
        raise ValueError(f'{name} has no bbox_head: nothing decodes detections; export --part '
                         'neck or --part backbone')
    if type(head).__name__ in SET_HEADS:
        if not hasattr(model, 'extract_feat'):
            raise ValueError(f'{name} with {type(head).__name__}: no end-to-end export '
                             '(supported: a single-stage detector, extract_feat -> bbox_head)')
        return SET_HEADS[type(head).__name__]
    if all(hasattr(head, a) for a in ('prior_generator', 'bbox_coder', 'cls_out_channels')) \
            and getattr(head, 'use_sigmoid_cls', False) and type(head).__name__ in DENSE_HEADS:
        return 'dense'
    raise ValueError(f'{name} with {type(head).__name__}: no end-to-end export (supported: '
                     'SdpaDETR with SdpaDETRHead, LWDETRHead (RF-DETR), DFineHead (D-FINE / '
                     'DEIMv2), mmdet\'s DINO and the '
                     f'sigmoid anchor heads {DENSE_HEADS}); export --part neck')


#: Our set-prediction heads, traced as they are (their ``forward_images`` and ``detections``),
#: and the kind of graph each makes.
SET_HEADS = dict(SdpaDETRHead='detr', LWDETRHead='lwdetr', LWDETRSegHead='lwdetr',
                 DFineHead='dfine')
#: Of those, the heads with RF-DETR-Seg's mask branch (outputs :data:`SEG_MASK_OUTPUTS`).
SEG_HEADS = ('LWDETRSegHead',)
#: IoU threshold of an anchor head's NMS when its ``test_cfg`` gives none.
DENSE_IOU = 0.5
#: Anchor heads whose test-time path is ``AnchorHead.predict_by_feat`` unchanged.
DENSE_HEADS = ('RetinaHead', 'RetinaSepBNHead', 'AnchorHead')


class EndToEndDetector(nn.Module):
    """uint8 image batch -> padded detections (module docstring); ``model`` in eval mode."""

    model: Any  # an mmdet detector (its parts are untyped)
    default_score_thr: Tensor  # () float32: test_cfg's score_thr, forward's default

    def __init__(self, model: Any, resize_to: Optional[Tuple[int, int]] = None) -> None:
        super().__init__()
        self.kind = check_exportable(model)
        if resize_to is not None and self.kind not in ('detr', 'lwdetr'):
            raise ValueError(f'a resize inside the graph (RFDETRResize with keep_ratio=False) '
                             f'is for the set-prediction heads {list(SET_HEADS)}, not a '
                             f'{self.kind} detector: use mmdet\'s Resize in its test pipeline')
        #: ``(h, w)`` the graph resizes its input to (:func:`graph_resize`), or None
        self.resize_to = None if resize_to is None else (int(resize_to[0]), int(resize_to[1]))
        self.model = model
        pre = model.data_preprocessor
        self.flip_channels = bool(getattr(pre, '_channel_conversion', False))
        self.normalize = bool(getattr(pre, '_enable_normalize', False))
        self.pad_divisor = int(getattr(pre, 'pad_size_divisor', 1))
        self.pad_value = float(getattr(pre, 'pad_value', 0))
        self.two_stage = TwoStage(model) if self.kind == 'two_stage' else None
        self.panoptic = is_panoptic_fpn(model)
        self.dino = Dino(model) if self.kind == 'dino' else None
        self.with_seg_masks = type(getattr(model, 'bbox_head', None)).__name__ in SEG_HEADS
        test_cfg = model.roi_head.test_cfg if self.two_stage else model.bbox_head.test_cfg
        self.max_per_img = int(test_cfg.get('max_per_img', 100))
        self.score_thr = float(test_cfg.get('score_thr', 0.0))
        device = next(model.parameters()).device
        self.register_buffer('default_score_thr', torch.tensor(self.score_thr, device=device),
                             persistent=False)
        self.nms = self.two_stage.nms if self.two_stage else \
            NmsConfig.of(type(model.bbox_head).__name__, test_cfg.get('nms'), DENSE_IOU)
        self.nms_pre = int(test_cfg.get('nms_pre', -1))
        self.min_bbox_size = float(test_cfg.get('min_bbox_size', -1))

    @property
    def in_channels(self) -> int:
        return int(getattr(self.model.backbone, 'in_channels', 3))

    def preprocess(self, image: Tensor) -> Tensor:
        """``(B, 3, H, W)`` uint8 -> normalised, padded ``(B, 3, Hp, Wp)`` float32; resized
        first to :attr:`resize_to` as ``RFDETRResize`` does (torch's bilinear on the float
        pixels, ``align_corners=False``, no antialiasing: ONNX ``Resize`` linear, half pixel)."""
        x = image.float()
        if self.resize_to is not None:
            x = F.interpolate(x, size=self.resize_to, mode='bilinear', align_corners=False,
                              antialias=False)                               # (B, 3, h, w)
        if self.flip_channels:
            x = x.flip(1)
        if self.normalize:
            pre = self.model.data_preprocessor
            x = (x - pre.mean) / pre.std
        h, w = x.shape[-2:]
        pad_h = (self.pad_divisor - h % self.pad_divisor) % self.pad_divisor
        pad_w = (self.pad_divisor - w % self.pad_divisor) % self.pad_divisor
        return F.pad(x, (0, pad_w, 0, pad_h), value=self.pad_value)

    @property
    def output_names(self) -> List[str]:
        """:data:`OUTPUT_NAMES`, then ``masks`` and ``mask_probs`` when the detector has a
        mask head (RF-DETR-Seg: ``masks`` and ``mask_logits``), then ``sem_logits`` for a
        Panoptic FPN."""
        with_mask = self.two_stage is not None and self.two_stage.with_mask
        seg = self.with_seg_masks
        return list(OUTPUT_NAMES) + (list(MASK_OUTPUTS) if with_mask else []) + \
            (list(SEG_MASK_OUTPUTS) if seg else []) + ([SEMANTIC_OUTPUT] if self.panoptic else [])

    def forward(self, image: Tensor, score_thr: Optional[Tensor] = None) -> Tuple[Tensor, ...]:
        """Detections of a ``(B, 3, H, W)`` uint8 batch; ``score_thr``: a ``()`` float32
        threshold (default: ``test_cfg``'s; :data:`SCORE_THRESHOLD`)."""
        thr = self.default_score_thr if score_thr is None else score_thr
        out_h, out_w = image.shape[-2:]                  # the frame of the boxes and masks
        h, w = self.resize_to or (out_h, out_w)          # the network's image
        x = self.preprocess(image)
        padded = (x.shape[-2], x.shape[-1])
        feats = self.model.extract_feat(x)
        seg_outs: Any = None  # RF-DETR-Seg: its outputs, for the masks of the detections
        if self.two_stage is not None:
            proposals, real = self.two_stage.proposals(feats, h, w)
            boxes, scores, labels = self.two_stage.detections(feats, proposals, real, h, w,
                                                              thr)
        elif self.kind in ('detr', 'lwdetr', 'dfine'):
            boxes, scores, labels, seg_outs = self._set_prediction(feats, padded, h, w, thr)
        elif self.dino is not None:  # DeformableDETRHead.predict_by_feat: no score_thr
            cls, box = self.dino.head_outputs(feats)
            found = query_class_top_k(cls, box, self._image_sizes(x, h, w), self.max_per_img)
            boxes, scores, labels = found.boxes, found.scores, found.labels
        else:
            boxes, scores, labels = self._dense(feats, h, w, thr)
        if self.resize_to is not None:  # to the input's pixels, as mmdet's rescale
            boxes = boxes / self._scale_factor(boxes, self.resize_to, out_h, out_w)
        out: Tuple[Tensor, ...] = top_k_padded(boxes, scores, labels, self.max_per_img)
        if self.two_stage is not None and self.two_stage.with_mask:
            out = out + self.two_stage.masks(feats, out[0], out[2], h, w)
        if seg_outs is not None:  # label + classes * query -> label, masks
            classes = seg_outs.det.all_cls_scores.shape[-1]
            codes, keep = out[2], out[2] != PAD_LABEL
            logits = seg_outs.masks.logits(-1, codes.clamp(min=0) // classes)  # (B, K, Hm, Wm)
            out = out[:2] + (torch.where(keep, codes % classes, PAD_LABEL), out[3]) + \
                masks_at_input(logits, keep, padded, (h, w), (out_h, out_w))
        if self.panoptic:  # the semantic head's logits at its stride: (B, C, Hs, Ws)
            out = out + (self.model.semantic_head(feats)['seg_preds'].float(),)
        return out

    @staticmethod
    def _scale_factor(like: Tensor, size: Tuple[int, int], out_h: Any, out_w: Any) -> Tensor:
        """``(4,)`` float32 ``(w / W, h / H, w / W, h / H)``: ``RFDETRResize``'s
        ``scale_factor`` from the input ``(H, W)`` to ``size`` ``(h, w)``, per box coordinate."""
        factor = torch.tensor(size[::-1], dtype=torch.float32, device=like.device)
        return (factor / size_tensor((out_w, out_h), like.device)).repeat(2)   # (4,)

    # ------------------------------------------------------------------ per kind
    @staticmethod
    def _image_sizes(x: Tensor, h: Any, w: Any) -> Tensor:
        """``(B, 2)`` int64 ``(h, w)`` of every image of the batch ``x`` (the input's size)."""
        return size_tensor((h, w), x.device).expand(x.shape[0], 2)

    def _set_prediction(self, feats: Tuple[Tensor, ...], padded: Tuple[Any, Any], h: Any,
                        w: Any, thr: Tensor) -> Tuple[Tensor, Tensor, Tensor, Any]:
        """Our set-prediction head's own test path: ``forward_images`` on the maps of the
        padded batch, its batched ``detections`` (``predict_by_feat`` before ``score_thr``),
        then ``score_thr``. RF-DETR-Seg: each detection's query rides in its label (label +
        classes * query) through the padded top-k; also returns the head's outputs."""
        head = self.model.bbox_head
        img_hw = self._image_sizes(feats[0], h, w)
        outs = head.forward_images(feats, img_hw, padded)
        det = outs.det if self.with_seg_masks else outs
        found = head.detections(det, img_hw)
        labels = found.labels
        if self.with_seg_masks:
            labels = labels + det.all_cls_scores.shape[-1] * found.queries
        # (at score_thr 0 the head keeps every score; a sigmoid is 0 only below logit -100)
        scores = torch.where(found.scores > thr, found.scores, DROPPED_SCORE)
        return found.boxes, scores, labels, outs if self.with_seg_masks else None

    def _dense(self, feats: Tuple[Tensor, ...], h, w, thr: Tensor
               ) -> Tuple[Tensor, Tensor, Tensor]:
        """AnchorHead.predict_by_feat: per level the ``nms_pre`` best (anchor, class) scores
        above ``score_thr``, decoded; then class-aware NMS (ONNX NonMaxSuppression)."""
        head = self.model.bbox_head
        cls_scores, bbox_preds = head(feats)[:2]
        boxes, scores, labels, _ = anchor_candidates(head, cls_scores, bbox_preds, self.nms_pre,
                                                     h, w)
        # mmdet drops boxes clipped to no width / height
        valid = (scores > thr) & large_enough(boxes, self.min_bbox_size)
        scores = torch.where(valid, scores, DROPPED_SCORE)
        survived = nms_survivors(boxes, scores, labels, head.cls_out_channels, self.max_per_img,
                                 self.nms)
        scores = torch.where(survived & valid, scores, DROPPED_SCORE)
        return boxes, scores, labels


# ---------------------------------------------------------------------- export
#: Test-pipeline transforms that do not touch the image (the graph needs nothing of them).
IMAGE_FREE_TRANSFORMS = ('LoadAnnotations', 'LoadPanopticAnnotations', 'PackDetInputs')


def graph_resize(cfg: Any) -> Optional[Tuple[int, int]]:
    """The ``(h, w)`` the graph resizes its input to: the fixed size of the test pipeline's
    ``RFDETRResize`` with ``keep_ratio=False`` (RF-DETR's ``predict``: torch's bilinear on the
    float pixels, which the graph repeats exactly), else None (the runner resizes the uint8
    image with OpenCV as mmdet's ``Resize`` does)."""
    for t in cfg.test_dataloader.dataset.pipeline:
        if t['type'] == 'RFDETRResize' and not t.get('keep_ratio', False) and \
                not t.get('antialias', False) and t.get('scale') is not None:
            scale = t['scale']
            width, height = (scale, scale) if isinstance(scale, int) else scale  # mmdet: (w, h)
            return int(height), int(width)
    return None


def pipeline_meta(cfg: Any, module: EndToEndDetector) -> Dict[str, Any]:
    """What the runner repeats outside the graph (JSON, stored in the ONNX file): how the
    config's test pipeline loads and resizes an image (``resize.in_graph``: the graph resizes,
    :func:`graph_resize`), the classes and ``test_cfg``; a pipeline step the runner does not
    repeat is refused with its name."""
    dataset = cfg.test_dataloader.dataset
    resize = None
    for t in dataset.pipeline:
        kind = t['type']
        if kind == 'LoadImageFromFile':
            if t.get('color_type', 'color') != 'color' or \
                    t.get('imdecode_backend', 'cv2') != 'cv2' or t.get('to_float32', False):
                raise ValueError(f'test pipeline {t}: the runner loads colour images with '
                                 'OpenCV as uint8 (color_type="color", imdecode_backend="cv2", '
                                 'to_float32=False) only')
        elif kind in ('Resize', 'RFDETRResize'):  # RFDETRResize keeping the ratio: OpenCV
            if t.get('scale') is None or t.get('interpolation', 'bilinear') != 'bilinear':
                raise ValueError(f'test pipeline {t}: the runner repeats Resize with a fixed '
                                 'scale and bilinear interpolation only')
            if module.with_seg_masks and module.resize_to is None:
                raise ValueError(f'test pipeline {t}: RF-DETR-Seg resizes inside the graph (its '
                                 'masks come out at the image\'s size): resize with '
                                 'RFDETRResize(scale=..., keep_ratio=False), as rfdetr\'s '
                                 'predict and configs/rfdetr/rfdetr_seg_*.py do')
            resize = dict(scale=[int(v) for v in t['scale']],
                          keep_ratio=bool(t.get('keep_ratio', False)),
                          in_graph=module.resize_to is not None)
        elif kind not in IMAGE_FREE_TRANSFORMS:
            raise ValueError(f'test pipeline step {kind!r}: the runner does not repeat it (it '
                             'repeats LoadImageFromFile and Resize); drop it from the config\'s '
                             'test pipeline to export')
    classes = (dataset.get('metainfo') or {}).get('classes')
    if classes is None:
        from mmdet.registry import DATASETS
        classes = DATASETS.get(dataset.type).METAINFO['classes']
    return dict(version=META_VERSION, kind=module.kind, channel_order='bgr', resize=resize,
                classes=list(classes), max_per_img=module.max_per_img,
                score_thr=module.score_thr, iou_threshold=module.nms.iou_threshold,
                outputs=module.output_names,
                mask_thr_binary=module.two_stage.mask_thr if module.two_stage else None,
                panoptic=fusion_meta(module) if module.panoptic else None,
                pad_size_divisor=module.pad_divisor)


def masks_at_input(logits: Tensor, keep: Tensor, padded: Tuple[Any, Any], size: Tuple[Any, Any],
                   out: Tuple[Any, Any]) -> Tuple[Tensor, Tensor]:
    """RF-DETR-Seg's masks of the final detections: their ``(B, K, Hm, Wm)`` mask logits
    (``keep`` False in padding rows) through the head's ``masks_to_image`` from the network's
    image ``size`` (its part of the ``padded`` batch) to the input's size ``out`` (the same
    unless the graph resizes): ``(B, K, H, W)`` uint8 0 / 1 and the logits, 0 in padding
    rows."""
    b, k, hm, wm = logits.shape
    logits = torch.where(keep[..., None, None], logits.float(), 0.0)
    meta = dict(batch_input_shape=padded, img_shape=size, ori_shape=out)
    masks = masks_to_image(logits.reshape(b * k, hm, wm), meta, True)           # (B*K, H, W)
    masks = masks.reshape(b, k, out[0], out[1]) & keep[..., None, None]
    return masks.to(torch.uint8), logits


def fusion_meta(module: EndToEndDetector) -> Dict[str, Any]:
    """A Panoptic FPN's fusion settings for the runner (:class:`~.panoptic.FusionConfig`): the
    fusion head's ``test_cfg``; the instances entering it are those of score >=
    ``instance_score_thr`` for :class:`AllOutputsPanopticFPN`, all for mmdet's PanopticFPN."""
    from ..models.detectors.panoptic_fpn import PANOPTIC_INSTANCE_SCORE_THR
    model = module.model
    fusion = model.panoptic_fusion_head
    thr = model.test_cfg.get('panoptic', {}).get('instance_score_thr',
                                                PANOPTIC_INSTANCE_SCORE_THR) \
        if type(model).__name__ == 'AllOutputsPanopticFPN' else 0.0
    return dict(num_things=int(fusion.num_things_classes), num_stuff=int(fusion.num_stuff_classes),
                mask_overlap=float(fusion.test_cfg.mask_overlap),
                stuff_area_limit=int(fusion.test_cfg.stuff_area_limit),
                instance_score_thr=float(thr), pad_size_divisor=module.pad_divisor)


def export_end_to_end(module: EndToEndDetector, path: str,
                      sample_size: Tuple[int, int] = EXPORT_SAMPLE_SIZE,
                      sample_batch: int = 2) -> None:
    """Export ``module`` to ``path`` with dynamic batch, height and width. ``sample_batch``
    >= 2 (a batch of 1 would be specialised)."""
    module.eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (sample_batch, module.in_channels, *sample_size),
                      dtype=torch.uint8, generator=g)
    export_graph(module, (x, module.default_score_thr.clone()), path, (*dynamic_shapes(), {}),
                 [INPUT_NAME, SCORE_THRESHOLD], module.output_names)
    store_score_threshold(path, module.score_thr)


def store_score_threshold(path: str, score_thr: float) -> None:
    """The graph's :data:`SCORE_THRESHOLD` input becomes an initializer holding ``score_thr``
    (the graph's only input is the image; an input never used, as DINO's, is dropped)."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(path)
    inputs = graph.graph.input
    for entry in [i for i in inputs if i.name == SCORE_THRESHOLD]:
        inputs.remove(entry)
    if any(SCORE_THRESHOLD in node.input for node in graph.graph.node):
        graph.graph.initializer.append(numpy_helper.from_array(
            np.array(score_thr, dtype=np.float32), SCORE_THRESHOLD))
    onnx.save(graph, path)


def add_metadata(path: str, meta: Dict[str, Any]) -> None:
    """Store ``meta`` (:func:`pipeline_meta`) as JSON under :data:`~.runner.META_KEY` in the
    ONNX file's metadata, where :class:`~.runner.OnnxDetector` reads it."""
    import onnx

    graph = onnx.load(path)
    entry = graph.metadata_props.add()
    entry.key, entry.value = META_KEY, json.dumps(meta)
    onnx.save(graph, path)
