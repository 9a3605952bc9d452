"""Encoder / decoder layers of the SDPA DETR head.

All attention runs through :class:`~vitdet_plugin.models.layers.MultiheadCrossAttention`
(fused ``F.scaled_dot_product_attention``); padding and the box prior are one additive bias,
so there is no custom CUDA op and fp16 / bf16 autocast work.

The decoder uses content queries plus reference boxes ``(cx, cy, w, h)`` in ``[0, 1]``: the
query positional embedding is an MLP of the boxes' sine encoding (DAB-DETR / DINO), every layer
refines the boxes (Deformable-DETR iterative refinement), and cross-attention can add a
Gaussian prior centred on the reference box and scaled by its size (SMCA), which focuses the
dense attention on the object from the first iterations and speeds convergence.
"""
import math
from typing import List, Optional, Sequence, Tuple

import torch
from mmdet.models.layers.transformer.utils import coordinate_to_encoding, inverse_sigmoid
from torch import Tensor, nn

from ..layers.cross_attention import MultiheadCrossAttention
from ..layers.mlp import Mlp

#: Floor of the box-prior logits: far tokens get at most this penalty, so the prior never
#: overwhelms content attention nor reaches the ``-inf`` of padded tokens.
PRIOR_MIN_LOGIT = -30.0
#: Smallest box side (normalised) the prior divides by.
PRIOR_MIN_SIZE = 1e-3


def padding_bias(padding_mask: Optional[Tensor]) -> Optional[Tensor]:
    """``(B, N)`` bool (True = padded) -> additive key bias ``(B, 1, 1, N)``; None -> None
    (the caller knows from the sizes that nothing is padded: attention without a mask).

    Padded keys get ``-inf`` (exactly zero attention in every dtype); every image keeps at
    least one valid token, so no attention row is fully masked.
    """
    if padding_mask is None:
        return None
    bias = torch.zeros(padding_mask.shape, dtype=torch.float32, device=padding_mask.device)
    return bias.masked_fill_(padding_mask, float('-inf'))[:, None, None, :]


class TransformerLayer(nn.Module):
    """Post-norm transformer layer: self-attention, optional cross-attention, FFN.

    Args:
        embed_dims: token channels ``C``.
        num_heads: attention heads.
        ffn_dims: hidden channels of the FFN.
        dropout: dropout after attention / FFN.
        cross_attention: add a cross-attention sub-layer (decoder) or not (encoder).
    """

    def __init__(self, embed_dims: int, num_heads: int, ffn_dims: int, dropout: float = 0.0,
                 cross_attention: bool = True) -> None:
        super().__init__()
        self.self_attn = MultiheadCrossAttention(embed_dims, num_heads, proj_drop=dropout)
        self.norm1 = nn.LayerNorm(embed_dims)
        self.cross_attn: Optional[MultiheadCrossAttention]
        if cross_attention:
            self.cross_attn = MultiheadCrossAttention(embed_dims, num_heads, proj_drop=dropout)
            self.norm2 = nn.LayerNorm(embed_dims)
        else:
            self.cross_attn = None
        self.ffn = Mlp(embed_dims, ffn_dims, act_layer=nn.ReLU, drop=dropout)
        self.norm3 = nn.LayerNorm(embed_dims)

    def forward(self, query: Tensor, query_pos: Tensor, self_bias: Optional[Tensor] = None,
                memory: Optional[Tensor] = None, memory_key: Optional[Tensor] = None,
                cross_bias: Optional[Tensor] = None) -> Tensor:
        """Update ``query (B, Q, C)``.

        Args:
            query_pos: positional embedding added to queries and keys ``(B, Q, C)``.
            self_bias: self-attention bias broadcastable to ``(B, heads, Q, Q)``.
            memory: cross-attention values ``(B, N, C)``.
            memory_key: cross-attention keys ``(B, N, C)`` (memory + its position).
            cross_bias: cross-attention bias broadcastable to ``(B, heads, Q, N)``.
        """
        q = query + query_pos
        query = self.norm1(query + self.self_attn(q, q, query, self_bias))
        if self.cross_attn is not None:
            out = self.cross_attn(query + query_pos, memory_key, memory, cross_bias)
            query = self.norm2(query + out)
        return self.norm3(query + self.ffn(query))


class BoxAttentionPrior(nn.Module):
    """Gaussian cross-attention prior around each query's reference box (SMCA-style).

    ``bias[b, h, q, n] = -((x_n - cx)^2 / w^2 + (y_n - cy)^2 / h^2) / (2 sigma_{b,q,h}^2)``,
    floored at :data:`PRIOR_MIN_LOGIT`. ``log sigma`` is a learned per-head base (initialised
    log-spaced in ``init_sigmas``, so some heads look locally and some almost globally) plus a
    query-dependent offset (a linear layer initialised to zero).

    Args:
        embed_dims: query channels.
        num_heads: attention heads.
        init_sigmas: ``(smallest, largest)`` initial head widths, in box sizes.
    """

    def __init__(self, embed_dims: int, num_heads: int,
                 init_sigmas: Tuple[float, float] = (0.5, 4.0)) -> None:
        super().__init__()
        lo, hi = (float(s) for s in init_sigmas)
        if not 0 < lo <= hi:
            raise ValueError(f'init_sigmas must be (smallest, largest) with 0 < smallest <= '
                             f'largest, got {init_sigmas}')
        self.num_heads = num_heads
        self.init_sigmas = (lo, hi)
        self.log_sigma = nn.Parameter(torch.linspace(math.log(lo), math.log(hi), num_heads))
        self.sigma_offset = nn.Linear(embed_dims, num_heads)
        nn.init.zeros_(self.sigma_offset.weight)
        nn.init.zeros_(self.sigma_offset.bias)

    def forward(self, query: Tensor, ref_boxes: Tensor, token_xy: Tensor) -> Tensor:
        """``query (B, Q, C)``, ``ref_boxes (B, Q, 4)`` cxcywh, ``token_xy (B, N, 2)`` ->
        bias ``(B, heads, Q, N)`` (fp32)."""
        boxes = ref_boxes.float()
        size = boxes[..., 2:].clamp(min=PRIOR_MIN_SIZE)
        dx = (token_xy[:, None, :, 0] - boxes[..., None, 0]) / size[..., None, 0]
        dy = (token_xy[:, None, :, 1] - boxes[..., None, 1]) / size[..., None, 1]
        dist2 = dx.square() + dy.square()                                        # (B, Q, N)
        log_sigma = self.log_sigma + self.sigma_offset(query).float()            # (B, Q, H)
        inv_two_var = 0.5 * torch.exp(-2.0 * log_sigma).permute(0, 2, 1)       # (B, H, Q)
        bias = -dist2[:, None] * inv_two_var[..., None]
        return bias.clamp_(min=PRIOR_MIN_LOGIT)

    def extra_repr(self) -> str:
        return f'num_heads={self.num_heads}, init_sigmas={self.init_sigmas}'


class RefineDecoder(nn.Module):
    """DETR decoder with reference boxes refined layer by layer.

    Args:
        num_layers: decoder layers.
        embed_dims, num_heads, ffn_dims, dropout: layer sizes (see :class:`TransformerLayer`).
        box_prior: add the :class:`BoxAttentionPrior` to cross-attention.
        prior_init_sigmas: initial prior widths.
    """

    def __init__(self, num_layers: int, embed_dims: int, num_heads: int, ffn_dims: int,
                 dropout: float = 0.0, box_prior: bool = True,
                 prior_init_sigmas: Tuple[float, float] = (0.5, 4.0)) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f'num_decoder_layers must be >= 1, got {num_layers}')
        self.embed_dims = embed_dims
        self.layers = nn.ModuleList(
            TransformerLayer(embed_dims, num_heads, ffn_dims, dropout) for _ in range(num_layers))
        # query position = MLP(sine(cx, cy, w, h)) (DAB-DETR / DINO)
        self.ref_point_head = Mlp(2 * embed_dims, embed_dims, embed_dims, act_layer=nn.ReLU)
        self.priors = nn.ModuleList(
            BoxAttentionPrior(embed_dims, num_heads, prior_init_sigmas)
            for _ in range(num_layers)) if box_prior else None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def forward(self, query: Tensor, ref_boxes: Tensor, memory: Tensor, memory_key: Tensor,
                token_xy: Tensor, key_bias: Optional[Tensor],
                reg_branches: Sequence[nn.Module],
                self_bias: Optional[Tensor] = None) -> Tuple[List[Tensor], List[Tensor]]:
        """Run all layers.

        Args:
            query: content queries ``(B, Q, C)``.
            ref_boxes: initial reference boxes ``(B, Q, 4)``, cxcywh in ``[0, 1]`` (detached).
            memory, memory_key: cross-attention values / keys ``(B, N, C)``.
            token_xy: memory token centres ``(B, N, 2)`` (for the box prior).
            key_bias: padding bias ``(B, 1, 1, N)`` or None.
            reg_branches: one box-delta head per layer (``C -> 4``).
            self_bias: query self-attention bias (e.g. denoising group mask).

        Returns:
            per-layer hidden states ``(B, Q, C)`` and refined boxes ``(B, Q, 4)`` (fp32,
            differentiable through the last refinement only, as Deformable DETR).
        """
        hidden, boxes = [], []
        ref = ref_boxes.float()
        for i, layer in enumerate(self.layers):
            query_pos = self.ref_point_head(
                coordinate_to_encoding(ref, self.embed_dims // 2).to(query.dtype))
            cross_bias = key_bias
            if self.priors is not None:
                prior = self.priors[i](query, ref, token_xy)
                cross_bias = prior if key_bias is None else prior + key_bias
            query = layer(query, query_pos, self_bias, memory, memory_key, cross_bias)
            delta = reg_branches[i](query).float()
            new_ref = (delta + inverse_sigmoid(ref)).sigmoid()
            hidden.append(query)
            boxes.append(new_ref)
            ref = new_ref.detach()
        return hidden, boxes


class MemoryEncoder(nn.Module):
    """Light self-attention encoder over chosen memory levels (RT-DETR's AIFI idea: attention
    on the coarsest level is cheap and carries most of the benefit).

    Args:
        num_layers: encoder layers (0 disables the encoder).
        embed_dims, num_heads, ffn_dims, dropout: layer sizes.
    """

    def __init__(self, num_layers: int, embed_dims: int, num_heads: int, ffn_dims: int,
                 dropout: float = 0.0) -> None:
        super().__init__()
        if num_layers < 0:
            raise ValueError(f'num_encoder_layers must be >= 0, got {num_layers}')
        self.layers = nn.ModuleList(
            TransformerLayer(embed_dims, num_heads, ffn_dims, dropout, cross_attention=False)
            for _ in range(num_layers))

    def forward(self, tokens: Tensor, pos: Tensor, padding_mask: Optional[Tensor]) -> Tensor:
        """Encode ``tokens (B, N, C)`` with positions ``pos`` and padding ``(B, N)`` (None:
        no padded token)."""
        bias = padding_bias(padding_mask)
        for layer in self.layers:
            tokens = layer(tokens, pos, bias)
        return tokens
