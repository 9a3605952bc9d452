"""Multi-head attention with separate query / key / value inputs: DETR decoders'
cross-attention to the image memory, and self-attention whose queries and keys (not values)
carry positional embeddings. The core is the shared :func:`attend` (fused
``F.scaled_dot_product_attention``), so padding masks and attention priors pass as one additive
``bias`` and work under fp16 / bf16 autocast.
"""
from typing import Optional

from torch import Tensor, nn

from ...functional.attention import attend


class MultiheadCrossAttention(nn.Module):
    """``softmax(q k^T / sqrt(d) + bias) v`` with separate q / k / v projections.

    Args:
        embed_dims: channels ``C`` of the queries, keys, values and of the output.
        num_heads: attention heads; ``embed_dims`` must be divisible by it.
        attn_drop: dropout on attention weights (training only).
        proj_drop: dropout after the output projection.
    """

    def __init__(self,
                 embed_dims: int,
                 num_heads: int,
                 attn_drop: float = 0.0,
                 proj_drop: float = 0.0) -> None:
        super().__init__()
        if num_heads <= 0 or embed_dims % num_heads:
            raise ValueError(f'embed_dims={embed_dims} must be divisible by '
                             f'num_heads={num_heads}; choose a head count that divides it')
        self.embed_dims = embed_dims
        self.num_heads = num_heads
        self.head_dim = embed_dims // num_heads
        self.q_proj = nn.Linear(embed_dims, embed_dims)
        self.k_proj = nn.Linear(embed_dims, embed_dims)
        self.v_proj = nn.Linear(embed_dims, embed_dims)
        self.out_proj = nn.Linear(embed_dims, embed_dims)
        self.attn_drop = float(attn_drop)
        self.proj_drop = nn.Dropout(proj_drop) if proj_drop > 0 else nn.Identity()
        self.fused = True  # SDPA; eager_attention() switches it
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform projections with zero biases (the ``nn.MultiheadAttention`` init)."""
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            nn.init.xavier_uniform_(proj.weight)
            nn.init.zeros_(proj.bias)

    def _heads(self, x: Tensor) -> Tensor:
        """``(..., N, C)`` -> ``(..., heads, N, head_dim)``."""
        return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(-3, -2)

    def forward(self, query: Tensor, key: Tensor, value: Optional[Tensor] = None,
                bias: Optional[Tensor] = None) -> Tensor:
        """Attend ``query (..., Nq, C)`` to ``key (..., Nk, C)`` and ``value (..., Nk, C)``
        (default ``key``) -> ``(..., Nq, C)``; ``bias``: additive logits broadcastable to
        ``(..., heads, Nq, Nk)`` (e.g. ``-inf`` at padded keys), cast to the attention dtype."""
        if value is None:
            value = key
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(f'key {tuple(key.shape)} and value {tuple(value.shape)} must have '
                             'the same leading dimensions and token count')
        q = self._heads(self.q_proj(query))
        k = self._heads(self.k_proj(key))
        v = self._heads(self.v_proj(value))
        out = attend(q, k, v, bias, self.attn_drop if self.training else 0.0, self.fused)
        out = out.transpose(-3, -2).flatten(-2)
        return self.proj_drop(self.out_proj(out))

    def extra_repr(self) -> str:
        return f'num_heads={self.num_heads}, fused={self.fused}'

