"""The D-FINE / DEIMv2 decoder with Fine-grained Distribution Refinement, its two-stage query
selection and its contrastive denoising groups.

- :class:`DFineDecoder`: ``num_layers`` :class:`~.dfine_layers.DFineDecoderLayer`. Layer 0's
  output also feeds ``pre_bbox_head``, which refines the selected anchors once into the
  *initial* boxes; every layer ``i`` then predicts four edge distributions as a residual on
  layer ``i - 1``'s (its input is its output plus layer ``i - 1``'s detached output) and decodes
  them against the fixed initial boxes. Each layer's boxes, detached, are the next layer's
  reference (sampling and query position). Class logits get the LQE quality score.
- :class:`DFineQuerySelector`: scores every memory token (``enc_output`` -> class / box
  heads, boxes relative to a grid anchor per token), keeps the ``num_queries`` best by their top
  class score; their features (or learnt embeddings) and boxes start the decoder.
- :func:`contrastive_denoising_group`: noised copies of the ground truth (positives: within half
  the box size, negatives: further away) in groups that only see themselves.
"""
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from mmdet.models.layers.transformer.utils import inverse_sigmoid
from mmdet.registry import MODELS
from torch import Tensor, nn

from .dfine_layers import (MLP, STYLES, DFineDecoderLayer, QualityEstimator, distance_to_box,
                           integral, weighting_function)

#: query position embeddings are clamped to this range (D-FINE).
POS_CLAMP = 10.0
#: anchor side at the finest level, as a fraction of the image; doubled per level.
ANCHOR_GRID_SIZE = 0.05
#: anchors whose coordinates are not all inside (eps, 1 - eps) are invalid.
ANCHOR_EPS = 1e-2

Shapes = Sequence[Tuple[int, int]]


class DFineDecoderOutput(NamedTuple):
    """Per-layer predictions, ``L`` layers in training, the ``eval_idx`` layer only in eval.

    ``logits (L, B, Q, K)`` (after LQE), ``boxes (L, B, Q, 4)`` cxcywh, ``corners (L, B, Q,
    4 (reg_max + 1))`` edge-distribution logits, ``hidden (L, B, Q, C)``; ``initial_boxes (B, Q,
    4)``: the boxes the corners are decoded against; ``pre_boxes (B, Q, 4)``: the same before
    detaching; ``pre_logits (B, Q, K)``: layer 0's class logits without LQE (training only).
    """
    logits: Tensor
    boxes: Tensor
    corners: Tensor
    hidden: Tensor
    initial_boxes: Tensor
    pre_boxes: Tensor
    pre_logits: Optional[Tensor]


@MODELS.register_module()
class DFineDecoder(nn.Module):
    """D-FINE (``style='dfine'``) or DEIMv2 (``style='deimv2'``) decoder with its class and
    distribution heads.

    Args:
        num_classes: class logits per query.
        embed_dims, num_heads, ffn_dims, num_layers: transformer sizes.
        num_points: sampling points per head, one int per memory level.
        offset_scale: deformable offsets are ``offset / points * box size * offset_scale``.
        reg_max, reg_scale, up: the edge distributions' bins (:func:`weighting_function`).
        eval_idx: the layer whose predictions inference returns (negative: from the end); in
            eval the layers after it are skipped.
        layer_scale: width factor of the layers after ``eval_idx``; only 1.0 is implemented.
        use_gateway: DEIMv2's gate after cross-attention (D-FINE always has it).
        ffn_act: D-FINE FFN activation; ``query_pos_act``: activation of DEIMv2's 3-layer query
            position MLP (D-FINE's has 2 layers, ``2 C`` hidden, ReLU).
        mlp_act: activation of the box MLPs (pre-head, distribution heads) and the quality
            estimators: ReLU in D-FINE and transformers' DEIMv2; SiLU in the official DEIMv2
            configs (``mlp_act`` / ``activation``).
        lqe_top_k, lqe_hidden_dims, lqe_layers: the quality estimator.
        share_reg_branch: one distribution head for all layers (DEIMv2's ``share_bbox_head``).
        query_pos_per_layer: each layer's query positions from its input references (D-FINE,
            transformers' DEIMv2); False: every layer's from the selected references, computed
            once (the official DEIMv2 decoder).
        sampling: ``'bilinear'`` or ``'discrete'`` deformable sampling (D-FINE's
            ``decoder_method`` ``'default'`` / ``'discrete'``).
    """

    project: Tensor

    def __init__(self, num_classes: int, embed_dims: int = 256, num_heads: int = 8,
                 ffn_dims: int = 1024, num_layers: int = 6,
                 num_points: Union[int, Sequence[int]] = (4, 4, 4), offset_scale: float = 0.5,
                 reg_max: int = 32, reg_scale: float = 4.0, up: float = 0.5, eval_idx: int = -1,
                 layer_scale: float = 1.0, style: str = 'dfine', use_gateway: bool = True,
                 ffn_act: str = 'relu', query_pos_act: str = 'relu', mlp_act: str = 'relu',
                 layer_norm_eps: float = 1e-5, lqe_top_k: int = 4, lqe_hidden_dims: int = 64,
                 lqe_layers: int = 2, share_reg_branch: bool = False, dropout: float = 0.0,
                 attn_drop: float = 0.0, sampling: str = 'bilinear',
                 query_pos_per_layer: bool = True) -> None:
        super().__init__()
        if style not in STYLES:
            raise ValueError(f'style={style!r} is not one of {STYLES}; use dfine for D-FINE and '
                             'deimv2 for DEIMv2')
        if not -num_layers <= eval_idx < num_layers:
            raise ValueError(f'eval_idx={eval_idx} is outside the {num_layers} decoder layers; '
                             f'use -1 (the last) or 0..{num_layers - 1}')
        if layer_scale != 1.0:
            raise ValueError(f'layer_scale={layer_scale}: wider layers after eval_idx are not '
                             'implemented; use layer_scale=1.0 (every released D-FINE / DEIMv2 '
                             'config does)')
        if reg_max < 4 or reg_max % 2:
            raise ValueError(f'reg_max={reg_max} must be an even number >= 4 (D-FINE uses 32)')
        points = [num_points] if isinstance(num_points, int) else list(num_points)
        self.num_layers = num_layers
        self.eval_idx = eval_idx % num_layers
        self.reg_max = reg_max
        self.reg_scale = reg_scale
        self.query_pos_per_layer = query_pos_per_layer
        self.register_buffer('project', weighting_function(reg_max, up, reg_scale),
                             persistent=False)
        self.layers = nn.ModuleList(
            DFineDecoderLayer(embed_dims, num_heads, ffn_dims, points, offset_scale, style,
                              use_gateway, ffn_act, layer_norm_eps, dropout, attn_drop,
                              sampling)
            for _ in range(num_layers))
        self.query_pos_head = (MLP(4, 2 * embed_dims, embed_dims, 2) if style == 'dfine' else
                               MLP(4, embed_dims, embed_dims, 3, query_pos_act))
        self.pre_bbox_head = MLP(embed_dims, embed_dims, 4, 3, mlp_act)
        self.cls_branches = nn.ModuleList(nn.Linear(embed_dims, num_classes)
                                          for _ in range(num_layers))
        num_reg = 1 if share_reg_branch else num_layers
        reg = [MLP(embed_dims, embed_dims, 4 * (reg_max + 1), 3, mlp_act)
               for _ in range(num_reg)]
        self.reg_branches = nn.ModuleList(reg * num_layers if share_reg_branch else reg)
        self.lqe_layers = nn.ModuleList(
            QualityEstimator(reg_max, lqe_top_k, lqe_hidden_dims, lqe_layers, mlp_act)
            for _ in range(num_layers))

    def forward(self, query: Tensor, ref_logits: Tensor, memory: Tensor, spatial_shapes: Shapes,
                attn_mask: Optional[Tensor] = None) -> DFineDecoderOutput:
        """``query (B, Q, C)``; ``ref_logits (B, Q, 4)``: inverse-sigmoid cxcywh reference
        boxes; ``memory (B, S, C)`` with ``spatial_shapes`` ``[(h, w)]`` per level; ``attn_mask``
        additive ``(Q, Q)`` self-attention mask (denoising groups)."""
        ref = ref_logits.sigmoid()                                      # (B, Q, 4)
        x = query
        prev_hidden: Union[Tensor, float] = 0.0
        prev_corners: Union[Tensor, float] = 0.0
        initial = pre_boxes = ref
        pre_logits: Optional[Tensor] = None
        keep: Dict[str, List[Tensor]] = {'logits': [], 'boxes': [], 'corners': [], 'hidden': []}
        pos = self.query_pos_head(ref).clamp(-POS_CLAMP, POS_CLAMP)          # (B, Q, C)
        for i, layer in enumerate(self.layers):
            if i > 0 and self.query_pos_per_layer:
                pos = self.query_pos_head(ref).clamp(-POS_CLAMP, POS_CLAMP)
            x = layer(x, pos, ref, memory, spatial_shapes, attn_mask)
            if i == 0:
                pre_boxes = (self.pre_bbox_head(x) + inverse_sigmoid(ref)).sigmoid()
                initial = pre_boxes.detach()
            corners = self.reg_branches[i](x + prev_hidden) + prev_corners  # (B, Q, 4 (R + 1))
            boxes = distance_to_box(initial, integral(corners, self.project), self.reg_scale)
            prev_corners, prev_hidden, ref = corners, x.detach(), boxes.detach()
            if self.training or i == self.eval_idx:
                logits = self.cls_branches[i](x)
                if i == 0 and self.training:
                    pre_logits = logits
                keep['logits'].append(self.lqe_layers[i](logits, corners))
                keep['boxes'].append(boxes)
                keep['corners'].append(corners)
                keep['hidden'].append(x)
            if not self.training and i == self.eval_idx:
                break
        stacked = {k: torch.stack(v) for k, v in keep.items()}
        return DFineDecoderOutput(initial_boxes=initial, pre_boxes=pre_boxes,
                                  pre_logits=pre_logits, **stacked)


class SelectedQueries(NamedTuple):
    """Two-stage selection: ``query (B, Q, C)`` and ``ref_logits (B, Q, 4)`` (both detached) start
    the decoder; ``topk_logits (B, Q, K)`` / ``topk_boxes (B, Q, 4)`` are supervised (encoder
    loss); ``enc_logits (B, S, K)`` / ``enc_coord_logits (B, S, 4)`` score every token."""
    query: Tensor
    ref_logits: Tensor
    topk_logits: Tensor
    topk_boxes: Tensor
    enc_logits: Tensor
    enc_coord_logits: Tensor


@MODELS.register_module()
class DFineQuerySelector(nn.Module):
    """Top-``num_queries`` memory tokens by class score, with boxes relative to grid anchors.

    Every token of level ``l`` has an anchor at its cell centre of side ``grid_size 2^l``; tokens
    whose anchor is not inside ``(eps, 1 - eps)`` are zeroed and their box logits are the dtype's
    maximum. ``learn_initial_query``: the decoder starts from learnt embeddings instead of the
    selected tokens' features. ``enc_output``: the tokens pass a Linear + LayerNorm before the
    score and box heads (D-FINE, and transformers' DEIMv2); False: they are scored as they are
    (an Identity, no parameters: the official DEIMv2 decoder). ``mlp_act``: the box MLP's
    activation (the decoder's ``mlp_act``).
    """

    def __init__(self, num_classes: int, num_queries: int = 300, embed_dims: int = 256,
                 learn_initial_query: bool = False, grid_size: float = ANCHOR_GRID_SIZE,
                 layer_norm_eps: float = 1e-5, enc_output: bool = True,
                 mlp_act: str = 'relu') -> None:
        super().__init__()
        self.num_queries = num_queries
        self.grid_size = grid_size
        self.enc_output: nn.Module = (
            nn.Sequential(nn.Linear(embed_dims, embed_dims),
                          nn.LayerNorm(embed_dims, eps=layer_norm_eps))
            if enc_output else nn.Identity())
        self.enc_score_head = nn.Linear(embed_dims, num_classes)
        self.enc_bbox_head = MLP(embed_dims, embed_dims, 4, 3, mlp_act)
        self.weight_embedding = (nn.Embedding(num_queries, embed_dims) if learn_initial_query
                                 else None)
        self._anchors: Dict[Tuple[object, ...], Tuple[Tensor, Tensor]] = {}

    def anchors(self, spatial_shapes: Shapes, device: torch.device, dtype: torch.dtype
                ) -> Tuple[Tensor, Tensor]:
        """``(1, S, 4)`` inverse-sigmoid anchors and the ``(1, S, 1)`` valid mask (cached)."""
        key = (tuple(map(tuple, spatial_shapes)), device, dtype)
        if key not in self._anchors:
            self._anchors[key] = grid_anchors(spatial_shapes, self.grid_size, device, dtype)
        return self._anchors[key]

    def forward(self, memory: Tensor, spatial_shapes: Shapes) -> SelectedQueries:
        """``memory (B, S, C)`` with ``spatial_shapes`` ``[(h, w)]`` per level."""
        anchors, valid = self.anchors(spatial_shapes, memory.device, memory.dtype)
        features = self.enc_output(valid.to(memory.dtype) * memory)     # (B, S, C)
        enc_logits = self.enc_score_head(features)                      # (B, S, K)
        enc_coord = self.enc_bbox_head(features) + anchors              # (B, S, 4)
        index = enc_logits.max(-1).values.topk(self.num_queries, dim=1).indices  # (B, Q)

        def pick(x: Tensor) -> Tensor:
            return x.gather(1, index[..., None].expand(-1, -1, x.shape[-1]))

        ref_logits = pick(enc_coord)
        if self.weight_embedding is not None:
            query = self.weight_embedding.weight[None].expand(memory.shape[0], -1, -1)
        else:
            query = pick(features).detach()
        return SelectedQueries(query, ref_logits.detach(), pick(enc_logits),
                               ref_logits.sigmoid(), enc_logits, enc_coord)


def grid_anchors(spatial_shapes: Shapes, grid_size: float, device: torch.device,
                 dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """Cell-centre anchors ``(1, S, 4)`` (inverse sigmoid, invalid ones at the dtype's max) and
    their ``(1, S, 1)`` valid mask."""
    levels = []
    for level, (h, w) in enumerate(spatial_shapes):
        y, x = torch.meshgrid(torch.arange(h, device=device, dtype=dtype),
                              torch.arange(w, device=device, dtype=dtype), indexing='ij')
        centre = torch.stack([(x + 0.5) / w, (y + 0.5) / h], dim=-1)   # (h, w, 2)
        size = torch.full_like(centre, grid_size * 2.0 ** level)
        levels.append(torch.cat([centre, size], dim=-1).reshape(-1, 4))
    anchors = torch.cat(levels)[None]                                   # (1, S, 4)
    valid = ((anchors > ANCHOR_EPS) & (anchors < 1 - ANCHOR_EPS)).all(-1, keepdim=True)
    logits = torch.log(anchors / (1 - anchors))
    return torch.where(valid, logits, torch.finfo(dtype).max), valid


class DenoisingGroup(NamedTuple):
    """Denoising queries to put before the matching queries.

    ``query (B, D, C)``: embedded (noised) labels; ``ref_logits (B, D, 4)``: noised boxes,
    inverse sigmoid; ``attn_mask (D + Q, D + Q)``: additive self-attention mask;
    ``positive_idx``: per image, the positive queries' indices, group by group, each group in
    ground-truth order; ``num_groups``; ``num_denoising`` = ``D``.
    """
    query: Tensor
    ref_logits: Tensor
    attn_mask: Tensor
    positive_idx: List[Tensor]
    num_groups: int
    num_denoising: int


def contrastive_denoising_group(labels: Sequence[Tensor], boxes: Sequence[Tensor],
                                num_classes: int, num_queries: int, label_embed: nn.Embedding,
                                num_denoising: int = 100, label_noise_ratio: float = 0.5,
                                box_noise_scale: float = 1.0) -> Optional[DenoisingGroup]:
    """RT-DETR's contrastive denoising groups from per-image ``labels (n,)`` and normalised
    cxcywh ``boxes (n, 4)``; None when there is no ground truth or ``num_denoising <= 0``.

    Each group holds every image's ground truth twice (padded to the batch's largest count
    ``m``): ``m`` positives, whose box corners move by up to half the box size, then ``m``
    negatives, moved by 0.5-1 box size. ``num_denoising // m`` groups (at least 1). A label is
    replaced by a random class with probability ``label_noise_ratio / 2``. The random draws
    are, in order: label-noise mask, new labels, box-noise signs, box-noise magnitudes.
    """
    counts = [len(t) for t in labels]
    max_gt = max(counts, default=0)
    if num_denoising <= 0 or max_gt == 0:
        return None
    groups = max(num_denoising // max_gt, 1)
    bs, device = len(counts), labels[0].device
    gt_labels = torch.full((bs, max_gt), num_classes, dtype=torch.int32, device=device)
    gt_boxes = torch.zeros((bs, max_gt, 4), device=device)
    pad = torch.zeros((bs, max_gt), dtype=torch.bool, device=device)
    for i, (lab, box) in enumerate(zip(labels, boxes)):
        gt_labels[i, :len(lab)] = lab
        gt_boxes[i, :len(lab)] = box
        pad[i, :len(lab)] = True
    dn_labels = gt_labels.tile(1, 2 * groups)                          # (B, D)
    dn_boxes = gt_boxes.tile(1, 2 * groups, 1)                         # (B, D, 4)
    dn_pad = pad.tile(1, 2 * groups)
    negative = torch.zeros((bs, 2 * max_gt, 1), device=device)
    negative[:, max_gt:] = 1
    negative = negative.tile(1, groups, 1)                             # (B, D, 1)
    if label_noise_ratio > 0:
        flip = torch.rand_like(dn_labels, dtype=torch.float) < label_noise_ratio * 0.5
        random_labels = torch.randint_like(flip, 0, num_classes, dtype=dn_labels.dtype)
        dn_labels = torch.where(flip & dn_pad, random_labels, dn_labels)
    if box_noise_scale > 0:
        corners = torch.cat([dn_boxes[..., :2] - dn_boxes[..., 2:] / 2,
                             dn_boxes[..., :2] + dn_boxes[..., 2:] / 2], dim=-1)
        half_size = dn_boxes[..., 2:].tile(1, 1, 2) * 0.5 * box_noise_scale
        sign = torch.randint_like(dn_boxes, 0, 2) * 2.0 - 1.0
        magnitude = torch.rand_like(dn_boxes)
        magnitude = (magnitude + 1.0) * negative + magnitude * (1 - negative)
        corners = (corners + magnitude * sign * half_size).clip(0.0, 1.0)
        dn_boxes = torch.cat([(corners[..., :2] + corners[..., 2:]) / 2,
                              corners[..., 2:] - corners[..., :2]], dim=-1)
    total = 2 * max_gt * groups
    size = total + num_queries
    mask = torch.zeros((size, size), device=device)
    mask[total:, :total] = float('-inf')
    for g in range(groups):
        start, end = 2 * max_gt * g, 2 * max_gt * (g + 1)
        mask[start:end, :start] = float('-inf')
        mask[start:end, end:total] = float('-inf')
    offsets = torch.arange(groups, device=device) * 2 * max_gt
    positive = [(offsets[:, None] + torch.arange(n, device=device)).flatten() for n in counts]
    return DenoisingGroup(label_embed(dn_labels), inverse_sigmoid(dn_boxes), mask, positive,
                          groups, total)
