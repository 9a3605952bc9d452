"""The DETR core our set-prediction heads stand on (``SdpaDETRHead``, ``LWDETRHead``,
``LWDETRSegHead``, and the next ones): their outputs (:class:`HeadOutputs`), mmdet's head
interface with the per-layer and one-to-many losses and the batched test-time top-k
(:class:`SetPredictionHead`), and the two-stage top-k (:func:`top_proposals`). Sizes are read
from tensors (shapes, an image-size tensor), so that the ONNX export (``vitdet_plugin.deploy``)
calls the same functions on the graph's symbolic sizes.
"""
from typing import (Any, ClassVar, Dict, Iterable, List, NamedTuple, Optional, Sequence,
                    Tuple, cast)

import torch
from mmdet.structures import SampleList
from mmengine.model import BaseModule, bias_init_with_prob
from mmengine.structures import InstanceData
from torch import Tensor, nn

from .detr_memory import image_sizes
from .set_criterion import SetCriterion, cxcywh_to_xyxy

#: Prior probability of the classification logits at init (focal-loss init).
CLS_PRIOR_PROB = 0.01
#: Layers of the box-regression MLPs.
REG_MLP_LAYERS = 3


class HeadOutputs(NamedTuple):
    """Raw predictions: per decoder layer ``(L, B, Q, num_classes)`` logits and ``(L, B, Q, 4)``
    normalised cxcywh boxes; the two-stage proposals' ``(B, P, ...)`` (None without them);
    every memory token's proposal and ``(B, N)`` True where a token is never matched (training
    with a one-to-many loss only); denoising queries' ``(L, B, D, ...)`` outputs and their
    known matches (training only)."""
    all_cls_scores: Tensor
    all_bbox_preds: Tensor
    enc_cls_scores: Optional[Tensor] = None
    enc_bbox_preds: Optional[Tensor] = None
    dense_cls_scores: Optional[Tensor] = None
    dense_bbox_preds: Optional[Tensor] = None
    dense_unusable: Optional[Tensor] = None
    dn_cls_scores: Optional[Tensor] = None
    dn_bbox_preds: Optional[Tensor] = None
    dn_matches: Optional[List[Tuple[Tensor, Tensor]]] = None


class Proposals(NamedTuple):
    """Two-stage proposals (query groups concatenated, ``P`` per group): the decoder's first
    reference boxes ``(B, P, 4)`` (detached), the proposals' logits ``(B, P, K)`` and boxes
    ``(B, P, 4)``, their tokens ``(B, P)`` and features ``(B, P, C)``; with a one-to-many loss
    in training, every token's proposal too: logits ``(B, N, K)``, boxes ``(B, N, 4)`` and
    ``(B, N)`` True where a token is never matched."""
    ref: Tensor
    cls: Tensor
    boxes: Tensor
    token_inds: Tensor
    hidden: Tensor
    dense_cls: Optional[Tensor] = None
    dense_boxes: Optional[Tensor] = None
    dense_unusable: Optional[Tensor] = None

    def outputs(self, all_cls_scores: Tensor, all_bbox_preds: Tensor) -> 'HeadOutputs':
        """:class:`HeadOutputs` of every decoder layer's predictions and these proposals."""
        return HeadOutputs(all_cls_scores, all_bbox_preds, self.cls, self.boxes,
                           self.dense_cls, self.dense_boxes, self.dense_unusable)


class Detections(NamedTuple):
    """A batch's top-k detections by descending score: ``(B, k, 4)`` xyxy boxes in image
    pixels (clipped), ``(B, k)`` sigmoid scores, labels and the query of each."""
    boxes: Tensor
    scores: Tensor
    labels: Tensor
    queries: Tensor


def reg_mlp(dims: int) -> nn.Sequential:
    """The 3-layer ReLU MLP ``C -> C -> C -> 4`` of the box branches."""
    layers: List[nn.Module] = []
    for _ in range(REG_MLP_LAYERS - 1):
        layers += [nn.Linear(dims, dims), nn.ReLU(inplace=True)]
    layers.append(nn.Linear(dims, 4))
    return nn.Sequential(*layers)


def top_proposals(scores: Tensor, num_queries: int) -> Tensor:
    """The two-stage top-k: ``(B, N)`` token scores -> ``(B, P)`` indices of the best
    ``P = min(num_queries, N)`` (a symbolic minimum: fewer tokens than queries stay
    possible in an exported graph)."""
    return scores.topk(torch.sym_min(num_queries, scores.shape[1]), dim=1).indices


def gather_rows(x: Tensor, index: Tensor) -> Tensor:
    """``x (B, N, ...)`` at ``index (B, P)`` along ``N`` -> ``(B, P, ...)``."""
    return x.gather(1, index.view(*index.shape, *[1] * (x.dim() - 2)).expand(
        -1, -1, *x.shape[2:]))


def query_class_top_k(cls: Tensor, boxes: Tensor, img_hw: Tensor, k: int) -> Detections:
    """A set-prediction head's test-time top-k, batched: ``(B, Q, K)`` logits and ``(B, Q, 4)``
    normalised cxcywh boxes -> the ``min(k, Q * K)`` best (query, class) pairs by sigmoid score
    (no NMS), boxes xyxy in the pixels of each image's ``img_hw`` ``(B, 2)`` ``(h, w)``."""
    num_classes = cls.shape[-1]
    k = min(k, cls.shape[1] * num_classes)
    scores, idx = cls.float().sigmoid().flatten(1).topk(k, dim=1)               # (B, k)
    queries = idx // num_classes
    size = img_hw.flip(-1).to(torch.float32).repeat(1, 2)[:, None]             # (B, 1, 4) whwh
    xyxy = cxcywh_to_xyxy(gather_rows(boxes.float(), queries)) * size          # (B, k, 4)
    return Detections(torch.minimum(xyxy.clamp(min=0), size), scores, idx % num_classes,
                      queries)


class SetPredictionHead(BaseModule):
    """mmdet's head interface of our set-prediction heads (module docstring). Subclasses set
    ``num_classes``, ``test_cfg``, ``criterion`` and return :class:`HeadOutputs` (or a tuple
    whose first entry is one) from ``forward``."""

    #: ``max_per_img`` when ``test_cfg`` does not set it.
    default_max_per_img: ClassVar[int] = 100
    criterion: SetCriterion

    def __init__(self, num_classes: int, num_queries: int, embed_dims: int, anchor_size: float,
                 train_cfg: Optional[dict], test_cfg: Optional[dict],
                 init_cfg: Optional[dict]) -> None:
        """Check and keep what every set-prediction head has: classes, queries (per group),
        channels, the side of its level-0 token anchors, and its train / test configs."""
        super().__init__(init_cfg=init_cfg)
        for name, value in (('num_classes', num_classes), ('num_queries', num_queries)):
            if value < 1:
                raise ValueError(f'{name} must be >= 1, got {value}')
        if not 0 < anchor_size < 1:
            raise ValueError(f'anchor_size must be in (0, 1), got {anchor_size}')
        self.num_classes = num_classes
        self.num_queries = num_queries
        self.embed_dims = embed_dims
        self.anchor_size = anchor_size
        self.train_cfg = dict(train_cfg or {})
        self.test_cfg = dict(test_cfg or {})

    @property
    def max_per_img(self) -> int:
        return int(self.test_cfg.get('max_per_img', self.default_max_per_img))

    @staticmethod
    def init_branches(cls_branches: Iterable[nn.Module], reg_branches: Iterable[nn.Module]
                      ) -> None:
        """Classification biases at the focal prior (:data:`CLS_PRIOR_PROB`), the last layer
        of every box MLP (:func:`reg_mlp`) zero: the first boxes are the references."""
        bias = bias_init_with_prob(CLS_PRIOR_PROB)
        for cls in cls_branches:
            nn.init.constant_(cast(nn.Linear, cls).bias, bias)
        for reg in reg_branches:
            last = cast(nn.Linear, cast(nn.Sequential, reg)[-1])
            nn.init.zeros_(last.weight)
            nn.init.zeros_(last.bias)

    # ------------------------------------------------------------------ training
    def layer_losses(self, all_cls_scores: Tensor, all_bbox_preds: Tensor,
                     batch_gt_instances: Sequence[InstanceData],
                     batch_img_metas: Sequence[dict], prefix: str = '',
                     layer_kwargs: Optional[Sequence[Dict[str, Any]]] = None,
                     **criterion_kwargs: Any) -> Dict[str, Tensor]:
        """``criterion`` on every layer of ``(L, B, Q, ...)`` predictions (``layer_kwargs[i]``:
        more arguments for layer ``i`` alone): the last layer's terms named ``prefix + term``,
        the others ``d{i}.`` + that."""
        losses: Dict[str, Tensor] = {}
        num_layers = all_cls_scores.shape[0]
        for i in range(num_layers):
            name = prefix if i == num_layers - 1 else f'd{i}.{prefix}'
            layer = self.criterion(all_cls_scores[i], all_bbox_preds[i], batch_gt_instances,
                                   batch_img_metas, **criterion_kwargs,
                                   **(layer_kwargs[i] if layer_kwargs else {}))
            losses.update({name + k: v for k, v in layer.items()})
        return losses

    def one_to_many_losses(self, outs: HeadOutputs, batch_gt_instances: Sequence[InstanceData],
                           batch_img_metas: Sequence[dict], k: int,
                           num_groups: int = 1) -> Dict[str, Tensor]:
        """Losses of every memory token's proposal (``outs.dense_*``, the ``num_groups``
        groups' tokens concatenated), each group's tokens matched one-to-many: every ground
        truth supervises its ``k`` cheapest tokens, unusable tokens never (hybrid matching: a
        dense training signal for the memory, the backbone under it and the query
        selection)."""
        cls, boxes, unusable = outs.dense_cls_scores, outs.dense_bbox_preds, outs.dense_unusable
        if cls is None or boxes is None or unusable is None:
            raise ValueError('one-to-many losses need the dense proposals of a training forward '
                             'of a head with its one-to-many count set')
        matches = [self.criterion.match_groups(cls[i], boxes[i], gt, meta, num_groups,
                                               one_to_many=k, invalid=unusable[i])
                   for i, (gt, meta) in enumerate(zip(batch_gt_instances, batch_img_metas))]
        return self.criterion(cls, boxes, batch_gt_instances, batch_img_metas, matches,
                              num_groups=num_groups)

    def loss_by_feat(self, outs: HeadOutputs, batch_gt_instances: Sequence[InstanceData],
                     batch_img_metas: Sequence[dict]) -> Dict[str, Tensor]:
        raise NotImplementedError(f'{type(self).__name__} must define loss_by_feat')

    def loss(self, feats: Sequence[Tensor], batch_data_samples: SampleList) -> Dict[str, Tensor]:
        metas = [s.metainfo for s in batch_data_samples]
        gts = [s.gt_instances for s in batch_data_samples]
        return self.loss_by_feat(self(feats, metas, gts), gts, metas)

    # ------------------------------------------------------------------ test
    def predict(self, feats: Sequence[Tensor], batch_data_samples: SampleList,
                rescale: bool = True) -> List[InstanceData]:
        metas = [s.metainfo for s in batch_data_samples]
        return self.predict_by_feat(self(feats, metas), metas, rescale)

    def detections(self, outs: HeadOutputs, img_hw: Tensor) -> Detections:
        """The last layer's top ``max_per_img`` detections of a batch (:func:`query_class_top_k`;
        ``img_hw`` ``(B, 2)``: each image's ``(h, w)``), before ``score_thr``."""
        return query_class_top_k(outs.all_cls_scores[-1], outs.all_bbox_preds[-1], img_hw,
                                 self.max_per_img)

    def predict_by_feat(self, outs: HeadOutputs, batch_img_metas: Sequence[dict],
                        rescale: bool = True) -> List[InstanceData]:
        """:meth:`detections` -> per-image ``InstanceData`` above ``score_thr`` (xyxy boxes in
        the ``img_shape`` frame, or the original image when ``rescale``)."""
        img_hw, _ = image_sizes(batch_img_metas, outs.all_cls_scores.shape[1],
                                device=outs.all_cls_scores.device)
        return instances(self.detections(outs, img_hw), batch_img_metas, rescale,
                         float(self.test_cfg.get('score_thr', 0.0)))


def instances(dets: Detections, batch_img_metas: Sequence[dict], rescale: bool,
              score_thr: float) -> List[InstanceData]:
    """Batched :class:`Detections` -> mmdet's per-image ``InstanceData`` (``bboxes``,
    ``scores``, ``labels``), scores above ``score_thr`` (all when 0; the kept ones are the
    first of each image's descending top-k), boxes divided by ``scale_factor`` when
    ``rescale``."""
    results = []
    for i, meta in enumerate(batch_img_metas):
        bboxes = dets.boxes[i]
        if rescale:
            if meta.get('scale_factor') is None:
                raise KeyError("rescale=True needs 'scale_factor' in the image meta (set by "
                               'the Resize transform); pass rescale=False otherwise')
            bboxes = bboxes / bboxes.new_tensor(meta['scale_factor']).repeat((1, 2))
        keep = dets.scores[i] > score_thr if score_thr > 0 else slice(None)
        results.append(InstanceData(bboxes=bboxes[keep], scores=dets.scores[i][keep],
                                    labels=dets.labels[i][keep]))
    return results
