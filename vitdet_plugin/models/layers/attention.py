"""Multi-head self-attention through ``F.scaled_dot_product_attention`` (``fused``; else the
explicit formula): the core the plain ViT's attention extends; and the one kernel switch,
:func:`eager_attention`, that runs every attention module of ours with the explicit formula.
"""
from contextlib import contextmanager
from typing import Any, Iterator, List, Optional, Tuple

from torch import Tensor, nn

from ...functional.attention import attend
from .arguments import head_dim

__all__ = ['Attention', 'eager_attention']


class Attention(nn.Module):
    """Multi-head self-attention over tokens ``(B, N, C)`` with an optional additive bias;
    ``qkv`` / ``proj`` as timm / SAM name them. ``attn_drop``: dropout on the attention weights
    (training only), ``proj_drop`` after ``proj``; ``scale``: default ``head_dim ** -0.5``."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True,
                 attn_drop: float = 0.0, proj_drop: float = 0.0,
                 scale: Optional[float] = None) -> None:
        super().__init__()
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = head_dim(dim, num_heads)
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = float(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop) if proj_drop > 0 else nn.Identity()
        self.fused = True  # SDPA; eager_attention() switches it
        self.scale = self.head_dim ** -0.5 if scale is None else scale

    def project_qkv(self, x: Tensor) -> Tensor:
        """``(..., C)`` tokens -> ``(..., 3C)``: queries, keys and values, concatenated."""
        return self.qkv(x)

    def qkv_heads(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """``(B, N, C)`` -> q, k, v, each ``(B, heads, N, head_dim)`` (views of one buffer)."""
        b, n, _ = x.shape
        qkv = self.project_qkv(x).view(b, n, 3 * self.num_heads, self.head_dim)
        # one transpose, then three contiguous blocks of heads (an exported graph copies the
        # blocks whole instead of gathering every token's q / k / v)
        q, k, v = qkv.transpose(1, 2).chunk(3, dim=1)                # (B, heads, N, d) each
        return q, k, v

    def project_out(self, x: Tensor) -> Tensor:
        """``(..., C)`` attention output -> ``(..., C)``: ``proj``, then its dropout."""
        return self.proj_drop(self.proj(x))

    @property
    def dropout_p(self) -> float:
        """Attention dropout of the current mode (none in eval)."""
        return self.attn_drop if self.training else 0.0

    def forward(self, x: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        """``(B, N, C)`` -> ``(B, N, C)``; ``bias`` broadcastable to ``(B, heads, N, N)``."""
        b, n, c = x.shape
        q, k, v = self.qkv_heads(x)                                  # (B, heads, N, d)
        out = attend(q, k, v, bias, self.dropout_p, self.fused, self.scale)
        return self.project_out(out.transpose(1, 2).reshape(b, n, c))

    def extra_repr(self) -> str:
        return f'num_heads={self.num_heads}, fused={self.fused}'


@contextmanager
def eager_attention(model: nn.Module) -> Iterator[nn.Module]:
    """Run ``model`` with the explicit attention formula instead of SDPA, then restore it: the
    one kernel switch, for every attention module of ours (each calls :func:`attend` with its
    ``fused`` flag). ONNX export and FLOP counting use it."""
    modules: List[Any] = list(model.modules())
    saved = [(m, m.fused) for m in modules if isinstance(getattr(m, 'fused', None), bool)]
    for m, _ in saved:
        m.fused = False
    try:
        yield model
    finally:
        for m, fused in saved:
            m.fused = fused
