"""Multi-head attention with separate query / key / value projections.

Used where queries and keys come from different token sets (DETR decoder cross-attention to
the image memory) or where the query/key inputs differ from the values (DETR self-attention
adds positional embeddings to queries and keys only). The core is the shared :func:`attend`
(fused ``F.scaled_dot_product_attention`` with an optional additive bias), so padding masks
and attention priors pass as one additive ``bias`` and work under fp16 / bf16 autocast.
"""
from typing import Optional

from torch import Tensor, nn

from ...functional.attention import attend


class MultiheadCrossAttention(nn.Module):
    """``softmax(q k^T / sqrt(d) + bias) v`` with separate q / k / v projections.

    Args:
        embed_dims: channels ``C`` of the queries and of the output.
        num_heads: attention heads; ``embed_dims`` must be divisible by it.
        key_dims: channels of ``key`` (default ``embed_dims``).
        value_dims: channels of ``value`` (default ``key_dims``).
        qkv_bias: biases on the q / k / v projections.
        attn_drop: dropout on attention weights (training only).
        proj_drop: dropout after the output projection.
    """

    def __init__(self,
                 embed_dims: int,
                 num_heads: int,
                 key_dims: Optional[int] = None,
                 value_dims: Optional[int] = None,
                 qkv_bias: bool = True,
                 attn_drop: float = 0.0,
                 proj_drop: float = 0.0) -> None:
        super().__init__()
        if num_heads <= 0 or embed_dims % num_heads:
            raise ValueError(f'embed_dims={embed_dims} must be divisible by '
                             f'num_heads={num_heads}; choose a head count that divides it')
        key_dims = embed_dims if key_dims is None else key_dims
        value_dims = key_dims if value_dims is None else value_dims
        self.embed_dims = embed_dims
        self.num_heads = num_heads
        self.head_dim = embed_dims // num_heads
        self.q_proj = nn.Linear(embed_dims, embed_dims, bias=qkv_bias)
        self.k_proj = nn.Linear(key_dims, embed_dims, bias=qkv_bias)
        self.v_proj = nn.Linear(value_dims, embed_dims, bias=qkv_bias)
        self.out_proj = nn.Linear(embed_dims, embed_dims)
        self.attn_drop = float(attn_drop)
        self.proj_drop = nn.Dropout(proj_drop) if proj_drop > 0 else nn.Identity()
        self.fused = True  # SDPA; eager_attention() switches it
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform projections with zero biases (the ``nn.MultiheadAttention`` init)."""
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            nn.init.xavier_uniform_(proj.weight)
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)

    def _heads(self, x: Tensor) -> Tensor:
        """``(..., N, C)`` -> ``(..., heads, N, head_dim)``."""
        return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(-3, -2)

    def forward(self, query: Tensor, key: Tensor, value: Optional[Tensor] = None,
                bias: Optional[Tensor] = None) -> Tensor:
        """Attend ``query (..., Nq, C)`` to ``key (..., Nk, Ck)`` / ``value (..., Nk, Cv)``.

        Args:
            query: ``(..., Nq, C)``.
            key: ``(..., Nk, Ck)``.
            value: ``(..., Nk, Cv)``; defaults to ``key``.
            bias: additive logits broadcastable to ``(..., heads, Nq, Nk)`` (e.g. ``-inf`` at
                padded keys); cast to the attention dtype.

        Returns:
            ``(..., Nq, C)``.
        """
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

