"""The LW-DETR / RF-DETR decoder: post-norm layers with multi-scale deformable cross-attention.

Each layer: self-attention of the queries (within each query group: Group DETR trains
``num_groups`` independent query sets in one batch), mmcv's ``MultiScaleDeformableAttention``
to the memory (its parameter names; on CUDA it runs ``mmcv._ext``, i.e. compiled mmcv or our
compile-free op; elsewhere mmcv's PyTorch form), a ReLU FFN, a LayerNorm after each. The query
position is an MLP of the sine encoding of the reference box. With RF-DETR's
``lite_refpoint_refine`` every layer attends around the same initial reference boxes (no
layer-by-layer refinement) and the box of every layer is predicted relative to them.

Self-attention is our :class:`MultiheadCrossAttention` (fused SDPA) and the FFN our
:class:`Mlp`; the sine encoding is mmdet's ``coordinate_to_encoding`` (DINO's).
"""
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
from mmcv.ops import MultiScaleDeformableAttention
from mmdet.models.layers.transformer.utils import coordinate_to_encoding
from torch import Tensor, nn

from ..layers.cross_attention import MultiheadCrossAttention
from ..layers.mlp import Mlp
from .multiscale_memory import _valid_mask, image_shapes

#: Proposals whose normalised centre or size leaves ``(VALID_MIN, 1 - VALID_MIN)`` are dropped
#: (zero memory, zero box), as RF-DETR's ``gen_encoder_output_proposals``.
VALID_MIN = 0.01


class Memory(NamedTuple):
    """The decoder's view of the multi-scale maps.

    Attributes:
        tokens: ``(B, N, C)`` all levels flattened.
        padding_mask: ``(B, N)`` bool, True outside each image (``img_shape``).
        spatial_shapes: ``(L, 2)`` int64 ``(H, W)`` per level.
        level_start_index: ``(L,)`` first token of each level.
        valid_ratios: ``(B, L, 2)`` valid fraction ``(w, h)`` of each level.
        valid_sizes: ``(B, L, 2)`` valid ``(w, h)`` in tokens of each level (float).
        shapes: ``(H, W)`` per level as Python ints.
    """
    tokens: Tensor
    padding_mask: Tensor
    spatial_shapes: Tensor
    level_start_index: Tensor
    valid_ratios: Tensor
    valid_sizes: Tensor
    shapes: List[Tuple[int, int]]


def flatten_memory(feats: Sequence[Tensor],
                   batch_img_metas: Optional[Sequence[dict]] = None) -> Memory:
    """NCHW maps (all at ``embed_dims``) -> :class:`Memory`. A token is valid when its cell
    starts inside the image (nearest-resizing the pixel mask, as RF-DETR and mmdet's DETRs);
    without metas the batch is unpadded."""
    b, device = feats[0].shape[0], feats[0].device
    frame = (int(feats[0].shape[-2]), int(feats[0].shape[-1]))
    batch_shape, img_shapes = image_shapes(batch_img_metas, b, frame)
    img_hw = torch.tensor(img_shapes, dtype=torch.float32, device=device)      # (B, 2)
    tokens, masks, sizes, shapes = [], [], [], []
    for x in feats:
        h, w = int(x.shape[-2]), int(x.shape[-1])
        size = torch.tensor((h, w), dtype=torch.float32, device=device)
        stride = size.new_tensor((batch_shape[0] / h, batch_shape[1] / w))
        counts = torch.minimum(torch.ceil(img_hw / stride), size)               # (B, 2) rows, cols
        masks.append(~_valid_mask(counts, (h, w)).flatten(1))                  # (B, h*w)
        sizes.append(counts.flip(-1))                                           # (B, 2) = (w, h)
        tokens.append(x.flatten(2).transpose(1, 2))                             # (B, h*w, C)
        shapes.append((h, w))
    spatial_shapes = torch.tensor(shapes, dtype=torch.long, device=device)
    level_start_index = torch.cat((spatial_shapes.new_zeros(1),
                                   spatial_shapes.prod(1).cumsum(0)[:-1]))
    valid_sizes = torch.stack(sizes, 1)                                         # (B, L, 2)
    ratios = valid_sizes / spatial_shapes.flip(-1).to(valid_sizes.dtype)
    return Memory(torch.cat(tokens, 1), torch.cat(masks, 1), spatial_shapes, level_start_index,
                  ratios, valid_sizes, shapes)


def token_proposals(memory: Memory, anchor_size: float) -> Tuple[Tensor, Tensor]:
    """The anchor box of every token and whether it is usable.

    Returns:
        ``(B, N, 4)`` cxcywh boxes normalised by each image's valid area: the token's cell
        centre and ``anchor_size * 2**level`` sides (0 where unusable), and ``(B, N)`` bool,
        False at padded tokens and where the box leaves ``(VALID_MIN, 1 - VALID_MIN)``.
    """
    boxes = []
    for level, (h, w) in enumerate(memory.shapes):
        ys = torch.arange(h, dtype=torch.float32, device=memory.tokens.device)
        xs = torch.arange(w, dtype=torch.float32, device=memory.tokens.device)
        gy, gx = torch.meshgrid(ys, xs, indexing='ij')
        grid = torch.stack((gx, gy), -1).view(1, h * w, 2) + 0.5              # (1, hw, 2) x, y
        centres = grid / memory.valid_sizes[:, level, None]                     # (B, hw, 2)
        sides = torch.full_like(centres, anchor_size * 2.0 ** level)
        boxes.append(torch.cat((centres, sides), -1))
    anchors = torch.cat(boxes, 1)                                               # (B, N, 4)
    usable = ((anchors > VALID_MIN) & (anchors < 1 - VALID_MIN)).all(-1) & ~memory.padding_mask
    return anchors * usable[..., None], usable


def reparam_boxes(delta: Tensor, ref: Tensor) -> Tensor:
    """RF-DETR's box reparameterisation: ``(dx, dy, dw, dh)`` relative to ``ref`` (cxcywh) ->
    ``(cx + dx w, cy + dy h, w e^dw, h e^dh)``."""
    return torch.cat((delta[..., :2] * ref[..., 2:] + ref[..., :2],
                      delta[..., 2:].exp() * ref[..., 2:]), -1)


class LWDETRDecoderLayer(nn.Module):
    """Post-norm decoder layer: grouped self-attention, deformable cross-attention, FFN.

    Args:
        embed_dims: query channels.
        self_heads: self-attention heads.
        cross_heads: deformable attention heads.
        num_levels: memory levels.
        num_points: sampling points per head and level.
        ffn_dims: FFN hidden channels.
        dropout: dropout after each sub-layer.
    """

    def __init__(self, embed_dims: int, self_heads: int, cross_heads: int, num_levels: int,
                 num_points: int, ffn_dims: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.self_attn = MultiheadCrossAttention(embed_dims, self_heads, proj_drop=dropout)
        self.norm1 = nn.LayerNorm(embed_dims)
        self.cross_attn = MultiScaleDeformableAttention(
            embed_dims, cross_heads, num_levels, num_points, dropout=dropout, batch_first=True)
        self.norm2 = nn.LayerNorm(embed_dims)
        self.ffn = Mlp(embed_dims, ffn_dims, act_layer=nn.ReLU, drop=dropout)
        self.norm3 = nn.LayerNorm(embed_dims)

    def forward(self, query: Tensor, query_pos: Tensor, memory: Memory, ref_points: Tensor,
                num_groups: int) -> Tensor:
        """``query (B, G*Q, C)`` with ``query_pos``, reference boxes ``(B, G*Q, L, 4)``;
        the ``num_groups`` query groups do not attend to each other."""
        q = (query + query_pos).unflatten(1, (num_groups, -1))                  # (B, G, Q, C)
        out = self.self_attn(q, q, query.unflatten(1, (num_groups, -1))).flatten(1, 2)
        query = self.norm1(query + out)
        # mmcv adds the residual (query before query_pos) and its dropout
        query = self.norm2(self.cross_attn(
            query, value=memory.tokens, query_pos=query_pos,
            key_padding_mask=memory.padding_mask, reference_points=ref_points,
            spatial_shapes=memory.spatial_shapes, level_start_index=memory.level_start_index))
        return self.norm3(query + self.ffn(query))


class LWDETRDecoder(nn.Module):
    """The decoder stack; every layer's output goes through the shared final LayerNorm.

    Args:
        num_layers: decoder layers.
        embed_dims, self_heads, cross_heads, num_levels, num_points, ffn_dims, dropout: see
            :class:`LWDETRDecoderLayer`.
    """

    def __init__(self, num_layers: int, embed_dims: int, self_heads: int, cross_heads: int,
                 num_levels: int, num_points: int, ffn_dims: int, dropout: float = 0.0) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f'num_decoder_layers must be >= 1, got {num_layers}')
        self.embed_dims = embed_dims
        self.layers = nn.ModuleList(
            LWDETRDecoderLayer(embed_dims, self_heads, cross_heads, num_levels, num_points,
                               ffn_dims, dropout) for _ in range(num_layers))
        # query position = MLP(sine(cx, cy, w, h)) (DAB-DETR / DINO / LW-DETR)
        self.ref_point_head = Mlp(2 * embed_dims, embed_dims, embed_dims, act_layer=nn.ReLU)
        self.norm = nn.LayerNorm(embed_dims)

    def forward(self, query: Tensor, ref: Tensor, memory: Memory, num_groups: int) -> Tensor:
        """``query (B, G*Q, C)`` around reference boxes ``ref (B, G*Q, 4)`` (cxcywh of each
        image's valid area) -> every layer's normed output ``(layers, B, G*Q, C)``."""
        scale = torch.cat((memory.valid_ratios, memory.valid_ratios), -1)        # (B, L, 4)
        ref_points = ref[:, :, None] * scale[:, None]                           # (B, G*Q, L, 4)
        query_pos = self.ref_point_head(
            coordinate_to_encoding(ref_points[:, :, 0], self.embed_dims // 2))
        hidden = []
        for layer in self.layers:
            query = layer(query, query_pos, memory, ref_points, num_groups)
            hidden.append(self.norm(query))
        return torch.stack(hidden)
