"""The LW-DETR / RF-DETR decoder: post-norm layers with multi-scale deformable cross-attention.

Each layer: self-attention of the queries (within each query group: Group DETR trains
``num_groups`` independent query sets in one batch), deformable attention to the memory
(:func:`deformable_attention` with the parameters of mmcv's ``MultiScaleDeformableAttention``),
a ReLU FFN, a LayerNorm after each. The query position is an MLP of the sine encoding of the
reference box. With RF-DETR's ``lite_refpoint_refine`` every layer attends around the same
initial reference boxes (no layer-by-layer refinement) and the box of every layer is predicted
relative to them.

Self-attention is our :class:`MultiheadCrossAttention` (fused SDPA) and the FFN our
:class:`Mlp`; the sine encoding is mmdet's ``coordinate_to_encoding`` (DINO's).
"""
from typing import Optional, Sequence, Tuple

import torch
from mmcv.ops import MultiScaleDeformableAttention
from mmcv.ops.multi_scale_deform_attn import (MultiScaleDeformableAttnFunction,
                                              multi_scale_deformable_attn_pytorch)
from mmdet.models.layers.transformer.utils import coordinate_to_encoding
from torch import Tensor, nn

from ..layers.cross_attention import MultiheadCrossAttention
from ..layers.mlp import Mlp
from .detr_memory import Memory, Shape

#: Proposals whose normalised centre or size leaves ``(VALID_MIN, 1 - VALID_MIN)`` are dropped
#: (zero memory, zero box), as RF-DETR's ``gen_encoder_output_proposals``.
VALID_MIN = 0.01


def token_proposals(memory: Memory, anchor_size: float) -> Tuple[Tensor, Tensor]:
    """The anchor box of every token and whether it is usable.

    Returns:
        ``(B, N, 4)`` cxcywh boxes normalised by each image's valid area: the token's cell
        centre and ``anchor_size * 2**level`` sides (0 where unusable), and ``(B, N)`` bool,
        False at padded tokens and where the box leaves ``(VALID_MIN, 1 - VALID_MIN)``.
    """
    centres = memory.cell_centres()                                             # (B, N, 2)
    sides = memory.level_sides(anchor_size)[None, :, None].expand_as(centres)   # (B, N, 2)
    anchors = torch.cat((centres, sides), -1)                                   # (B, N, 4)
    usable = ((anchors > VALID_MIN) & (anchors < 1 - VALID_MIN)).all(-1) & ~memory.padding_mask
    return anchors * usable[..., None], usable


def deformable_attention(attn: MultiScaleDeformableAttention, query: Tensor, query_pos: Tensor,
                         value: Tensor, reference: Tensor, shapes: Sequence[Shape],
                         padding_mask: Optional[Tensor] = None,
                         spatial_shapes: Optional[Tensor] = None,
                         level_start_index: Optional[Tensor] = None) -> Tensor:
    """``MultiScaleDeformableAttention.forward`` (batch first) of ``attn``, the levels' sizes
    given as ``shapes`` (ints, or a traced graph's symbolic ints, which mmcv's module would read
    from a tensor's values): ``query`` ``(B, Q, C)`` attends to ``value`` ``(B, N, C)`` (zeroed
    where ``padding_mask`` is True) around ``reference`` ``(B, Q, L, 2)`` points or
    ``(B, Q, L, 4)`` boxes, normalised. Sampling runs mmcv's op on CUDA (``mmcv._ext``:
    compiled mmcv or our compile-free op; given ``spatial_shapes`` / ``level_start_index``),
    else mmcv's PyTorch form (``F.grid_sample`` per level: ONNX ``GridSample`` in an exported
    graph), in the reference's precision."""
    b, q, _ = query.shape
    heads, levels, points = attn.num_heads, attn.num_levels, attn.num_points
    identity = query
    query = query + query_pos
    value = attn.value_proj(value)                                      # (B, N, C)
    if padding_mask is not None:
        value = value.masked_fill(padding_mask[..., None], 0.0)
    value = value.view(b, value.shape[1], heads, -1)                    # (B, N, heads, d)
    offsets = attn.sampling_offsets(query).view(b, q, heads, levels, points, 2)
    weights = attn.attention_weights(query).view(b, q, heads, levels * points).softmax(-1)
    weights = weights.view(b, q, heads, levels, points)
    if reference.shape[-1] == 2:
        normalizer = torch.stack([torch.stack((torch.full((), w), torch.full((), h)))
                                  for h, w in shapes]).to(offsets)       # (L, 2)
        locations = reference[:, :, None, :, None, :] \
            + offsets / normalizer[None, None, None, :, None, :]        # (B, Q, heads, L, P, 2)
    else:  # offsets in units of half the box's width / height per point
        locations = reference[:, :, None, :, None, :2] \
            + offsets / points * reference[:, :, None, :, None, 2:] * 0.5
    dtype = locations.dtype  # the reference's: sampling positions keep their precision
    if value.is_cuda and spatial_shapes is not None and not torch.compiler.is_exporting():
        out = MultiScaleDeformableAttnFunction.apply(
            value.to(dtype), spatial_shapes, level_start_index, locations, weights.to(dtype),
            attn.im2col_step)
    else:
        out = multi_scale_deformable_attn_pytorch(value.to(dtype), shapes, locations,
                                                  weights.to(dtype))
    return attn.dropout(attn.output_proj(out.to(identity.dtype))) + identity


def reparam_boxes(delta: Tensor, ref: Tensor) -> Tensor:
    """RF-DETR's box reparameterisation: ``(dx, dy, dw, dh)`` relative to ``ref`` (cxcywh) ->
    ``(cx + dx w, cy + dy h, w e^dw, h e^dh)``."""
    return torch.cat((delta[..., :2] * ref[..., 2:] + ref[..., :2],
                      delta[..., 2:].exp() * ref[..., 2:]), -1)


class LWDETRDecoderLayer(nn.Module):
    """Post-norm decoder layer on ``embed_dims`` queries: grouped self-attention
    (``self_heads``), deformable cross-attention (``cross_heads``, ``num_points`` per head and
    level of ``num_levels`` memory levels), FFN (``ffn_dims`` hidden), a LayerNorm after each."""

    def __init__(self, embed_dims: int, self_heads: int, cross_heads: int, num_levels: int,
                 num_points: int, ffn_dims: int) -> None:
        super().__init__()
        self.self_attn = MultiheadCrossAttention(embed_dims, self_heads)
        self.norm1 = nn.LayerNorm(embed_dims)
        # no dropout (RF-DETR's 0; mmcv's module defaults to 0.1)
        self.cross_attn = MultiScaleDeformableAttention(
            embed_dims, cross_heads, num_levels, num_points, dropout=0.0, batch_first=True)
        self.norm2 = nn.LayerNorm(embed_dims)
        self.ffn = Mlp(embed_dims, ffn_dims, act_layer=nn.ReLU)
        self.norm3 = nn.LayerNorm(embed_dims)

    def forward(self, query: Tensor, query_pos: Tensor, memory: Memory, ref_points: Tensor,
                num_groups: int) -> Tensor:
        """``query (B, G*Q, C)`` with ``query_pos``, reference boxes ``(B, G*Q, L, 4)``;
        the ``num_groups`` query groups do not attend to each other."""
        # the groups fold into the batch: 4-D attention inputs keep SDPA on its fused kernels
        # (a 5-D (B, G, heads, Q, d) input runs the unfused formula on CPU)
        b, gq, c = query.shape
        q = (query + query_pos).reshape(b * num_groups, -1, c)                # (B*G, Q, C)
        v = query.reshape(b * num_groups, -1, c)                              # (B*G, Q, C)
        out = self.self_attn(q, q, v).reshape(b, gq, c)                       # (B, G*Q, C)
        query = self.norm1(query + out)
        # mmcv's forward adds the residual (query before query_pos)
        query = self.norm2(deformable_attention(
            self.cross_attn, query, query_pos, memory.tokens, ref_points, memory.shapes,
            memory.padding_mask, memory.spatial_shapes, memory.level_start_index))
        return self.norm3(query + self.ffn(query))


class LWDETRDecoder(nn.Module):
    """``num_layers`` :class:`LWDETRDecoderLayer` (the other arguments are theirs); every
    layer's output goes through the shared final LayerNorm."""

    def __init__(self, num_layers: int, embed_dims: int, self_heads: int, cross_heads: int,
                 num_levels: int, num_points: int, ffn_dims: int) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f'num_decoder_layers must be >= 1, got {num_layers}')
        self.embed_dims = embed_dims
        self.layers = nn.ModuleList(
            LWDETRDecoderLayer(embed_dims, self_heads, cross_heads, num_levels, num_points,
                               ffn_dims) for _ in range(num_layers))
        # query position = MLP(sine(cx, cy, w, h)) (DAB-DETR / DINO / LW-DETR)
        self.ref_point_head = Mlp(2 * embed_dims, embed_dims, embed_dims, act_layer=nn.ReLU)
        self.norm = nn.LayerNorm(embed_dims)

    def forward(self, query: Tensor, ref: Tensor, memory: Memory, num_groups: int) -> Tensor:
        """``query (B, G*Q, C)`` around reference boxes ``ref (B, G*Q, 4)`` (cxcywh of each
        image's valid area) -> every layer's normed output ``(layers, B, G*Q, C)``."""
        scale = torch.cat((memory.valid_ratios, memory.valid_ratios), -1)        # (B, L, 4)
        ref_points = ref[:, :, None] * scale[:, None]                           # (B, G*Q, L, 4)
        # the encoding in the queries' dtype: FSDP's bf16 parameters see no fp32 input
        query_pos = self.ref_point_head(
            coordinate_to_encoding(ref_points[:, :, 0], self.embed_dims // 2).to(query.dtype))
        hidden = []
        for layer in self.layers:
            query = layer(query, query_pos, memory, ref_points, num_groups)
            hidden.append(self.norm(query))
        return torch.stack(hidden)
