"""Scaled dot-product attention: the fused kernel, or the explicit formula for reference."""
from typing import Optional

import torch.nn.functional as F
from torch import Tensor


def attend(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
           dropout_p: float = 0.0, fused: bool = True, scale: Optional[float] = None) -> Tensor:
    """``softmax(q k^T * scale + attn_mask) v`` for ``(..., N, d)`` inputs.

    ``attn_mask``: additive logits broadcastable to ``(..., N, M)``, cast to ``q``'s dtype (so
    it works under fp16 / bf16 autocast). ``fused``: ``F.scaled_dot_product_attention``;
    False computes the formula step by step (the reference the fused path is tested against).
    ``scale``: ``d ** -0.5`` when None.
    """
    if attn_mask is not None and attn_mask.dtype != q.dtype:
        attn_mask = attn_mask.to(q.dtype)
    if fused:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                              dropout_p=dropout_p, scale=scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = (q * scale) @ k.transpose(-2, -1)                     # (..., N, M)
    if attn_mask is not None:
        logits = logits + attn_mask
    probs = logits.softmax(dim=-1)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    return probs @ v
