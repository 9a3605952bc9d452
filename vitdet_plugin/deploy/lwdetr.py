"""RF-DETR / LW-DETR (:class:`~vitdet_plugin.models.heads.LWDETRHead`) inside the end-to-end
graph, batched, dynamic B / H / W.

The graph repeats the head's test path (``SingleStageDetector.predict`` ->
``LWDETRHead.forward`` with one query group -> ``predict_by_feat``) on the projector's maps of
a batch of images that all have the input's size ``h x w``, padded to ``pad_size_divisor``
(mmdet's padding of one image: the same valid area for every image of the batch):

* the memory (``flatten_memory``): the levels flattened, the tokens outside the image masked,
  each level's valid token counts and ratios, from the graph's symbolic sizes instead of the
  image metas (``flatten_memory`` reads the sizes as Python ints, which ``torch.export`` would
  fix to the sample's);
* two-stage proposals of the first query group: the head's own ``proposals`` (top
  ``num_queries`` tokens by their best class logit, boxes on each token's anchor);
* the queries and the decoder: learned content and reference deltas on the proposals; per layer
  grouped self-attention (one group), deformable cross-attention
  (:func:`~.deformable_detr.deformable_attention`: mmcv's PyTorch form, one ``F.grid_sample``
  per level, ONNX ``GridSample``, given the levels' sizes as symbolic ints; mmcv's module reads
  them from a tensor, whose values ``torch.export`` cannot read), FFN, a LayerNorm after each;
  the last layer's output through the shared final norm and the class / box branches, boxes
  relative to the initial references;
* the caller's :func:`~.graph_ops.query_class_top_k` (``predict_by_feat``): sigmoid scores,
  top-k over queries x classes, boxes in input pixels, clipped; no NMS;
* RF-DETR-Seg (``LWDETRSegHead``): the head's own ``mask_branch`` on the first map, the last
  layer's queries and the proposals' features, its last layer's mask logits ``(B, Q, Hm, Wm)``
  at a quarter of the padded batch; :func:`masks_at_input` gives the top-k detections' masks
  at the input's size with the head's own ``masks_to_image`` (one bilinear resize as two
  ``MatMul``, then ``> 0``).

Sizes: any, as the model (DINOv2's position table is resized to the token grid in the graph,
antialiased bicubic, ONNX ``Resize``). At least ``num_queries`` tokens must reach the head: the
graph's proposal ``TopK`` is fixed at ``num_queries`` (in PyTorch the head takes fewer, as
RF-DETR); the graph cannot say so (onnxruntime fails in ``TopK``), so :func:`token_meta` stores
what the runner needs to refuse such an image first.
"""
from typing import Any, Dict, List, Optional, Tuple

import torch
from mmdet.models.layers.transformer.utils import coordinate_to_encoding
from torch import Tensor

from ..models.heads.lwdetr_seg_head import masks_to_image
from ..models.heads.lwdetr_transformer import Memory, reparam_boxes
from ..models.heads.multiscale_memory import _valid_mask
from .deformable_detr import Shapes, deformable_attention

#: What the export repeats (type names).
HEADS = ('LWDETRHead', 'LWDETRSegHead')
#: Of those, the heads with a mask branch (``mask_branch``).
MASK_HEADS = ('LWDETRSegHead',)
#: The stride probe image is this many ``pad_size_divisor`` on a side.
PROBE_MULTIPLE = 4


def is_lwdetr(model: Any) -> bool:
    """True when ``model``'s ``bbox_head`` is an LW-DETR head."""
    return type(getattr(model, 'bbox_head', None)).__name__ in HEADS


def check_lwdetr(model: Any) -> None:
    """A ``ValueError`` naming what the graph does not repeat, unless ``model`` is a
    single-stage detector (``extract_feat`` -> ``bbox_head``) with an :data:`HEADS` head."""
    name, head = type(model).__name__, type(getattr(model, 'bbox_head', None)).__name__
    if head not in HEADS or not hasattr(model, 'extract_feat') or \
            getattr(model, 'roi_head', None) is not None:
        raise ValueError(f'{name} with {head}: no LW-DETR end-to-end export (supported: a '
                         f'single-stage detector, extract_feat -> bbox_head {"/".join(HEADS)})')


def _scalar(value: Any, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A ``()`` tensor of a (symbolic) Python number."""
    return torch.full((), value, dtype=dtype, device=device)


def graph_memory(feats: List[Tensor], padded: Tuple[Any, Any], size: Tuple[Any, Any]) -> Memory:
    """``flatten_memory`` of maps of a batch whose images all have the ``size`` ``(h, w)``,
    padded to ``padded`` ``(Hp, Wp)`` (symbolic ints): tokens, padding mask, valid counts and
    ratios, level shapes."""
    b, device = feats[0].shape[0], feats[0].device
    f32, f64 = torch.float32, torch.float64
    img_hw = torch.stack((_scalar(size[0], f32, device),
                          _scalar(size[1], f32, device)))[None].expand(b, 2)  # (B, 2)
    tokens, masks, sizes, shapes, starts = [], [], [], [], []
    start: Any = 0
    for x in feats:
        h, w = x.shape[-2], x.shape[-1]
        hw = torch.stack((_scalar(h, f32, device), _scalar(w, f32, device)))  # (2,)
        # the model's stride is a Python float64 quotient, stored as float32
        stride = torch.stack((_scalar(padded[0], f64, device) / h,
                              _scalar(padded[1], f64, device) / w)).to(f32)   # (2,)
        counts = torch.minimum(torch.ceil(img_hw / stride), hw)               # (B, 2) rows, cols
        masks.append(~_valid_mask(counts, (h, w)).flatten(1))                 # (B, h*w)
        sizes.append(counts.flip(-1))                                          # (B, 2) = (w, h)
        tokens.append(x.flatten(2).transpose(1, 2))                            # (B, h*w, C)
        shapes.append((h, w))
        starts.append(_scalar(start, torch.long, device))
        start = start + h * w
    spatial_shapes = torch.stack([torch.stack((_scalar(h, torch.long, device),
                                               _scalar(w, torch.long, device)))
                                  for h, w in shapes])                         # (L, 2)
    valid_sizes = torch.stack(sizes, 1)                                        # (B, L, 2)
    ratios = valid_sizes / spatial_shapes.flip(-1).to(f32)
    return Memory(torch.cat(tokens, 1), torch.cat(masks, 1), spatial_shapes,
                  torch.stack(starts), ratios, valid_sizes, shapes)


class LWDetr:
    """``LWDETRHead``'s test path on the projector's maps (module docstring); ``model``
    checked by :func:`check_lwdetr`."""

    def __init__(self, model: Any) -> None:
        check_lwdetr(model)
        self.model = model
        self.with_mask = type(model.bbox_head).__name__ in MASK_HEADS

    def head_outputs(self, feats: List[Tensor], padded: Tuple[Any, Any], size: Tuple[Any, Any]
                     ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """The last decoder layer's ``(B, Q, classes)`` logits and ``(B, Q, 4)`` boxes (cxcywh,
        normalised by the image's valid area): ``LWDETRHead.forward``'s last entries; with a
        mask head its ``(B, Q, Hm, Wm)`` mask logits over the padded batch (else None)."""
        head = self.model.bbox_head
        memory = graph_memory(list(feats), padded, size)
        props = head.proposals(memory, 1)
        q = head.num_queries
        ref = reparam_boxes(head.refpoint_embed.weight[:q], props.ref)        # (B, Q, 4)
        query = head.query_feat.weight[:q].expand(ref.shape[0], -1, -1)      # (B, Q, C)
        hidden = self.decode(query.to(memory.tokens.dtype), ref, memory)
        masks = None
        if self.with_mask:  # the last layer only: its queries as a stack of one (1, B, Q, C)
            masks = head.mask_branch(feats[0], hidden[None], props.hidden, padded).logits(-1)
        return head.cls_branch(hidden), reparam_boxes(head.reg_branch(hidden), ref), masks

    def decode(self, query: Tensor, ref: Tensor, memory: Memory) -> Tensor:
        """``LWDETRDecoder`` with one query group: the last layer's normed ``(B, Q, C)``."""
        decoder = self.model.bbox_head.decoder
        scale = torch.cat((memory.valid_ratios, memory.valid_ratios), -1)     # (B, L, 4)
        ref_points = ref[:, :, None] * scale[:, None]                          # (B, Q, L, 4)
        query_pos = decoder.ref_point_head(
            coordinate_to_encoding(ref_points[:, :, 0], decoder.embed_dims // 2))
        shapes: Shapes = list(memory.shapes)
        for layer in decoder.layers:
            q = (query + query_pos)[:, None]                                   # (B, 1, Q, C)
            query = layer.norm1(query + layer.self_attn(q, q, query[:, None])[:, 0])
            query = layer.norm2(deformable_attention(layer.cross_attn, query, query_pos,
                                                     memory.tokens, ref_points, shapes,
                                                     memory.padding_mask))
            query = layer.norm3(query + layer.ffn(query))
        return decoder.norm(query)


def top_k_queries(cls: Tensor, k: int) -> Tensor:
    """The ``(B, k)`` query of each of :func:`~.graph_ops.query_class_top_k`'s detections on
    the ``(B, Q, C)`` logits (its top-k over queries x classes, the same op on the same input,
    so the same order)."""
    k = min(k, cls.shape[1] * cls.shape[2])
    return cls.float().sigmoid().flatten(1).topk(k, dim=1).indices // cls.shape[2]


def masks_at_input(logits: Tensor, queries: Tensor, keep: Tensor, padded: Tuple[Any, Any],
                   size: Tuple[Any, Any]) -> Tuple[Tensor, Tensor]:
    """``LWDETRSegHead.predict_by_feat``'s masks of the final detections: the ``(B, Q, Hm, Wm)``
    mask logits of their ``(B, K)`` ``queries`` (``keep`` False in padding rows) resized to the
    input's ``size`` (``masks_to_image``: the image's part of the padded batch ``padded``, one
    bilinear resize, ``> 0``). Returns ``(B, K, h, w)`` uint8 0 / 1 masks and the gathered
    ``(B, K, Hm, Wm)`` float32 logits (0 in padding rows; the runner resizes them to another
    image size)."""
    b, k = queries.shape
    hm, wm = logits.shape[-2:]
    picked = torch.gather(logits.float(), 1,
                          queries[..., None, None].expand(-1, -1, hm, wm))   # (B, K, Hm, Wm)
    picked = torch.where(keep[..., None, None], picked, 0.0)
    meta = dict(batch_input_shape=padded, img_shape=size, ori_shape=size)
    masks = masks_to_image(picked.reshape(b * k, hm, wm), meta, False)       # (B*K, h, w)
    masks = masks.reshape(b, k, size[0], size[1]) & keep[..., None, None]
    return masks.to(torch.uint8), picked


def token_meta(model: Any, pad_divisor: int, channels: int) -> Dict[str, Any]:
    """The graph metadata the runner checks an input against (:func:`head_tokens`): the head's
    ``num_queries``, the input's ``pad_size_divisor`` and the strides of the head's maps in
    input pixels (probed in PyTorch: padded side / map side)."""
    size = PROBE_MULTIPLE * pad_divisor
    device = next(model.parameters()).device
    with torch.no_grad():
        maps = model.extract_feat(torch.zeros(1, channels, size, size, device=device))
    return dict(num_queries=int(model.bbox_head.num_queries), pad_size_divisor=pad_divisor,
                strides=[size / m.shape[-1] for m in maps])
