"""mmdet's DINO inside the end-to-end graph, batched, dynamic B / H / W.

The graph repeats mmdet 3.3's test path of :class:`mmdet.models.DINO` (``predict``:
``extract_feat`` -> ``forward_transformer`` -> ``DINOHead.predict``) on images that fill the
input, which is every image of the graph's batch:

* ``pre_transformer``: each level flattened with its sine position embedding (mmdet's
  ``positional_encoding(None, input=feat)``: the branch taken when every image has the batch's
  size) plus its level embedding; no padding mask, every valid ratio 1;
* encoder: per layer ``MultiScaleDeformableAttention`` (self), norm, FFN, norm, with the
  reference points at each level's pixel centres;
* two-stage query selection (``gen_encoder_output_proposals`` + ``pre_decoder``): a proposal per
  position (its pixel centre, ``0.05 * 2 ** level`` wide and high), the encoder output of
  proposals outside (0.01, 0.99) zeroed, the ``num_queries`` best by their largest class logit
  (``cls_branches[num_layers]``), their boxes (``reg_branches[num_layers]`` + the proposal) as the
  first references, ``query_embedding`` as the content queries (denoising queries are
  training-only);
* ``DinoTransformerDecoder``: per layer the query position from the reference box
  (``coordinate_to_encoding`` + ``ref_point_head``), self-attention, norm, deformable
  cross-attention on the encoder output, norm, FFN, norm, then the references refined by that
  layer's ``reg_branches`` (box refinement);
* ``DeformableDETRHead.predict_by_feat`` on the last layer (the caller's, our heads'
  ``query_class_top_k``: the same sigmoid top-k over queries x classes, boxes cxcywh -> xyxy in
  input pixels, clipped).

Multi-scale deformable attention is our decoder's
(:func:`~vitdet_plugin.models.heads.lwdetr_transformer.deformable_attention`: mmcv's module
given the levels' sizes as the graph's symbolic ints instead of a tensor, whose values
``torch.export`` cannot read; mmcv's PyTorch form, one ``F.grid_sample`` per level, ONNX
``GridSample``), which is what mmdet runs on the CPU.

Refused (:func:`check_dino`): other Deformable DETR detectors (DeformableDETR itself: its query
selection and decoder differ), heads other than ``DINOHead`` with sigmoid scores, and a
``pad_size_divisor`` other than 1 (mmdet would then mask the padding of images whose size is not
a multiple, which this graph does not repeat).
"""
from typing import Any, List, NoReturn, Sequence, Tuple

import torch
from mmdet.models.layers.transformer.utils import coordinate_to_encoding, inverse_sigmoid
from torch import Tensor

from ..models.heads.lwdetr_transformer import deformable_attention
from .graph_ops import BOX_DIM

#: What the export repeats (type names).
DETECTORS = ('DINO',)
HEADS = ('DINOHead',)
#: The class every detector handled here derives from.
FAMILY = 'DeformableDETR'
#: Pixel centres at ``(i + 0.5) / size`` of a level (mmdet's ``linspace(0.5, H - 0.5, H)``).
PIXEL_CENTRE = 0.5
#: ``gen_encoder_output_proposals``: a proposal's side at level 0 (doubling per level) and the
#: open interval its normalised coordinates must lie in to be used.
PROPOSAL_SIDE = 0.05
PROPOSAL_RANGE = (0.01, 0.99)
#: The eps of ``inverse_sigmoid`` between decoder layers (``DinoTransformerDecoder``) and in the
#: head (``DeformableDETRHead.forward``).
REFINE_EPS = 1e-3
HEAD_EPS = 1e-5

#: ``(H_l, W_l)`` of each level: the graph's symbolic sizes.
Shapes = List[Tuple[Any, Any]]


def is_deformable_detr(model: Any) -> bool:
    """True for mmdet's ``DeformableDETR`` and its subclasses (DINO, ...)."""
    return FAMILY in (c.__name__ for c in type(model).__mro__)


def check_dino(model: Any) -> None:
    """A ``ValueError`` naming what is not supported, unless ``model`` is what :class:`Dino`
    repeats."""
    name = type(model).__name__
    head = type(model.bbox_head).__name__

    def refuse(what: str) -> NoReturn:
        raise ValueError(f'{name}: {what}: no end-to-end export (supported: '
                         f'{"/".join(DETECTORS)} with {"/".join(HEADS)}, sigmoid scores and '
                         'pad_size_divisor=1, as in mmdet\'s dino-4scale configs); export '
                         '--part neck and run the transformer in the caller')

    if name not in DETECTORS:
        refuse(f'as_two_stage={model.as_two_stage}, with_box_refine={model.with_box_refine}: '
               'the graph repeats DINO\'s query selection and decoder only, not '
               f'{name}\'s')
    if head not in HEADS or not model.bbox_head.loss_cls.use_sigmoid:
        refuse(f'head {head} (sigmoid scores: {model.bbox_head.loss_cls.use_sigmoid})')
    divisor = int(getattr(model.data_preprocessor, 'pad_size_divisor', 1))
    if divisor != 1:
        refuse(f'pad_size_divisor={divisor}: mmdet masks the padding of images whose size is '
               'not a multiple of it (padding masks, valid ratios), which the graph does not '
               'repeat')


def sine_embedding(encoding: Any, h, w, device: torch.device) -> Tensor:
    """``SinePositionalEncoding.forward(None, input)`` of an ``h x w`` map, flattened to
    ``(h * w, 2 * num_feats)`` (y features, then x). Repeated rather than called: its
    normalisation divides by the last row / column, a ``[-1:]`` slice whose size
    ``torch.export`` cannot prove to be 1 for a symbolic size."""
    def axis(length) -> Tensor:                                          # (length, num_feats)
        embed = torch.arange(1, length + 1, dtype=torch.float32, device=device)
        if encoding.normalize:
            last = embed.narrow(0, length - 1, 1)
            embed = (embed + encoding.offset) / (last + encoding.eps) * encoding.scale
        dim_t = torch.arange(encoding.num_feats, dtype=torch.float32, device=device)
        dim_t = encoding.temperature ** (2 * (dim_t // 2) / encoding.num_feats)
        pos = embed[:, None] / dim_t
        return torch.stack((pos[:, 0::2].sin(), pos[:, 1::2].cos()), -1).flatten(1)

    feats = encoding.num_feats
    pos_y = axis(h)[:, None].expand(h, w, feats)
    pos_x = axis(w)[None].expand(h, w, feats)
    return torch.cat((pos_y, pos_x), -1).reshape(h * w, 2 * feats)


def level_centres(shapes: Shapes, device: torch.device) -> List[Tensor]:
    """Per level ``(H_l * W_l, 2)``: the normalised ``(x, y)`` of each position's pixel centre,
    row by row (the order of a flattened map)."""
    centres = []
    for h, w in shapes:
        y = (torch.arange(h, dtype=torch.float32, device=device) + PIXEL_CENTRE) / h
        x = (torch.arange(w, dtype=torch.float32, device=device) + PIXEL_CENTRE) / w
        grid_y, grid_x = torch.meshgrid(y, x, indexing='ij')             # each (H_l, W_l)
        centres.append(torch.stack((grid_x, grid_y), -1).reshape(-1, 2))
    return centres


class Dino:
    """mmdet's DINO test path on ``(B, C, H_l, W_l)`` neck maps of images that fill the input
    (module docstring); ``model`` checked by :func:`check_dino`."""

    def __init__(self, model: Any) -> None:
        check_dino(model)
        self.model = model

    def head_outputs(self, feats: Sequence[Tensor]) -> Tuple[Tensor, Tensor]:
        """The last decoder layer's ``(B, Q, classes)`` logits and ``(B, Q, 4)`` sigmoid boxes
        (cx, cy, w, h), normalised: ``DINOHead.forward``'s last entries."""
        memory, shapes = self.encode(feats)
        hidden, reference = self.decode(memory, shapes)
        head = self.model.bbox_head
        last = self.model.decoder.num_layers - 1
        box = head.reg_branches[last](hidden) + inverse_sigmoid(reference, HEAD_EPS)
        return head.cls_branches[last](hidden), box.sigmoid()

    def encode(self, feats: Sequence[Tensor]) -> Tuple[Tensor, Shapes]:
        """``pre_transformer`` + ``forward_encoder``: the ``(B, N, C)`` memory of the ``N =
        sum(H_l W_l)`` positions and the levels' sizes."""
        m = self.model
        shapes = [(f.shape[-2], f.shape[-1]) for f in feats]
        flat = torch.cat([f.flatten(2).transpose(1, 2) for f in feats], 1)    # (B, N, C)
        pos = torch.cat([sine_embedding(m.positional_encoding, h, w, flat.device)
                         + m.level_embed[i] for i, (h, w) in enumerate(shapes)])  # (N, C)
        centres = torch.cat(level_centres(shapes, flat.device))                # (N, 2)
        reference = centres[None, :, None].expand(flat.shape[0], -1, len(shapes), -1)
        for layer in m.encoder.layers:                                         # (B, N, L, 2)
            flat = layer.norms[0](deformable_attention(layer.self_attn, flat, pos, flat,
                                                       reference, shapes))
            flat = layer.norms[1](layer.ffn(flat))
        return flat, shapes

    def decode(self, memory: Tensor, shapes: Shapes) -> Tuple[Tensor, Tensor]:
        """``pre_decoder`` + ``DinoTransformerDecoder``: the last layer's normed ``(B, Q, C)``
        output and the ``(B, Q, 4)`` reference boxes it refined (sigmoid, cxcywh)."""
        m = self.model
        b = memory.shape[0]
        reference = self.select_queries(memory, shapes)                        # (B, Q, 4)
        query = m.query_embedding.weight[None].expand(b, -1, -1)              # (B, Q, C)
        layers = m.decoder.layers
        for i, layer in enumerate(layers):
            if i > 0:  # the previous layer's box refinement
                refined = m.bbox_head.reg_branches[i - 1](query)
                reference = (refined + inverse_sigmoid(reference, REFINE_EPS)).sigmoid()
            query_pos = m.decoder.ref_point_head(coordinate_to_encoding(reference))
            query = layer.norms[0](layer.self_attn(query=query, key=query, value=query,
                                                   query_pos=query_pos, key_pos=query_pos))
            boxes = reference[:, :, None].expand(-1, -1, len(shapes), -1)     # (B, Q, L, 4)
            query = layer.norms[1](deformable_attention(layer.cross_attn, query, query_pos,
                                                        memory, boxes, shapes))
            query = layer.norms[2](layer.ffn(query))
        return m.decoder.norm(query), reference

    def select_queries(self, memory: Tensor, shapes: Shapes) -> Tensor:
        """``gen_encoder_output_proposals`` + ``pre_decoder``'s top-k: the ``(B, Q, 4)`` first
        reference boxes (sigmoid, cxcywh) of the ``num_queries`` best positions."""
        m = self.model
        b = memory.shape[0]
        proposals = torch.cat([
            torch.cat((centres, torch.ones_like(centres) * PROPOSAL_SIDE * (2.0 ** level)), -1)
            for level, centres in enumerate(level_centres(shapes, memory.device))])  # (N, 4)
        low, high = PROPOSAL_RANGE
        valid = ((proposals > low) & (proposals < high)).sum(-1, keepdim=True) == BOX_DIM
        proposals = torch.log(proposals / (1 - proposals)).masked_fill(~valid, float('inf'))
        out = m.memory_trans_norm(m.memory_trans_fc(memory.masked_fill(~valid, 0.0)))
        n = m.decoder.num_layers
        scores = m.bbox_head.cls_branches[n](out).max(-1)[0]                   # (B, N)
        coords = m.bbox_head.reg_branches[n](out) + proposals                  # (B, N, 4)
        top = scores.topk(m.num_queries, dim=1)[1]                             # (B, Q)
        return torch.gather(coords, 1, top[..., None].expand(b, -1, BOX_DIM)).sigmoid()
