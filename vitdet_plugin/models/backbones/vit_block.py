"""The plain ViT's block and attention (ViTDet's extras are in ``vit.py``)."""
from functools import partial
from typing import Callable, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from mmcv.cnn import build_activation_layer, build_norm_layer
from torch import Tensor, nn

from ...functional.attention import attend
from ...functional.rope import apply_rope
from ...functional.window import from_windows, to_windows
from ..layers.attention import Attention
from ..layers.drop_path import DropPath
from ..layers.mlp import Mlp
from ..layers.swiglu import SwiGLU, SwiGLUPacked
from .vit_archs import PlainViTArch

#: ``(sin, cos)`` rotary tables, each ``(G, N, head_dim)``: one table for every window / image
#: (``G = 1``) or one per window of an image (``G = nW``).
RopeTables = Tuple[Tensor, Tensor]


class LayerScale(nn.Module):
    """``x * gamma`` with ``gamma`` ``(C,)`` initialised to ``init_value`` (DINOv2 / DINOv3:
    ``1e-5``, so every block starts close to the identity)."""

    def __init__(self, dim: int, init_value: float) -> None:
        super().__init__()
        self.init_value = float(init_value)
        self.gamma = nn.Parameter(torch.full((dim,), self.init_value))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma

    def extra_repr(self) -> str:
        return f'{self.gamma.shape[0]}, init_value={self.init_value:g}'


class TokenLayout(NamedTuple):
    """What the blocks of one forward share (built once per forward by the backbone)."""
    grid: Tuple[int, int]                  # (h, w) patch grid
    num_prefix: int                        # cls / register tokens leading the sequence
    rope_global: Optional[RopeTables]      # G = 1, N = h * w
    rope_window: Optional[RopeTables]      # N = wh * ww


class ViTAttention(Attention):
    """Multi-head attention over ``(B, P + N, C)``: ``P`` prefix tokens, then the ``N`` patch
    tokens of a ``(gh, gw)`` grid, which alone are rotated by the rotary tables. ``qkv_bias``:
    ``'qkv'``, ``'qv'`` (no k bias) or ``'none'``; ``sub_ln_eps``: EVA-02's norm before
    ``proj``; ``rotate_half``: DINOv3's rotary layout (else EVA-02's pairs)."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: str = 'qkv', attn_drop: float = 0.0,
                 proj_drop: float = 0.0, sub_ln_eps: Optional[float] = None,
                 rotate_half: bool = False) -> None:
        super().__init__(dim, num_heads, qkv_bias == 'qkv', attn_drop, proj_drop)
        self.qkv_bias_mode = qkv_bias
        self.q_bias: Optional[nn.Parameter] = None
        self.v_bias: Optional[nn.Parameter] = None
        if qkv_bias == 'qv':
            self.q_bias = nn.Parameter(torch.zeros(dim))
            self.v_bias = nn.Parameter(torch.zeros(dim))
        self.norm = nn.LayerNorm(dim, eps=sub_ln_eps) if sub_ln_eps is not None else nn.Identity()
        self.rotate_half = rotate_half

    def project_qkv(self, x: Tensor) -> Tensor:
        """``(..., C)`` -> ``(..., 3C)``; with ``'qv'`` biases the k part gets none."""
        if self.q_bias is None or self.v_bias is None:
            return self.qkv(x)
        bias = torch.cat([self.q_bias, torch.zeros_like(self.q_bias), self.v_bias])  # (3C,)
        return F.linear(x, self.qkv.weight, bias)

    def rotate(self, t: Tensor, num_prefix: int, rope: RopeTables) -> Tensor:
        """Rotate the patch tokens of ``t`` ``(B * G, heads, P + N, d)`` by the ``(G, N, d)``
        tables (window ``g`` of every image by table ``g``)."""
        sin, cos = rope
        groups = sin.shape[0]
        patches = t[:, :, num_prefix:].unflatten(0, (-1, groups))   # (B, G, heads, N, d)
        patches = apply_rope(patches, sin[:, None], cos[:, None], self.rotate_half)
        patches = patches.flatten(0, 1)                              # (B * G, heads, N, d)
        if num_prefix == 0:
            return patches
        return torch.cat([t[:, :, :num_prefix], patches], dim=2)    # (B * G, heads, P + N, d)

    def attend_heads(self, q: Tensor, k: Tensor, v: Tensor, grid: Tuple[int, int]) -> Tensor:
        """Attention of the heads ``(B', heads, P + N, d)`` -> the same."""
        return attend(q, k, v, None, self.dropout_p, self.fused, self.scale)

    def forward(self, x: Tensor, grid: Tuple[int, int],  # type: ignore[override]
                num_prefix: int = 0, rope: Optional[RopeTables] = None) -> Tensor:
        b, n, c = x.shape                                            # (B', P + N, C)
        q, k, v = self.qkv_heads(x)                                  # (B', heads, P + N, d)
        if rope is not None:
            q, k = self.rotate(q, num_prefix, rope), self.rotate(k, num_prefix, rope)
            # q and k are new tensors now: a v of its own, so backward keeps (B', P + N, C)
            # instead of the whole (B', P + N, 3C) projection alive (docs/speed.md)
            v = v.contiguous()
        out = self.attend_heads(q, k, v, grid)                       # (B', heads, P + N, d)
        out = out.transpose(1, 2).reshape(b, n, c)                   # (B', P + N, C)
        return self.project_out(self.norm(out))

    def extra_repr(self) -> str:
        return f'{super().extra_repr()}, qkv_bias={self.qkv_bias_mode!r}'


def build_mlp(spec: PlainViTArch, drop: float, act_cfg: Optional[dict] = None) -> nn.Module:
    """The block MLP of ``spec``: ``Mlp`` (``act_cfg``, default GELU) or a SwiGLU."""
    dim, hidden = spec.embed_dims, spec.mlp_hidden
    if spec.mlp == 'swiglu':
        return SwiGLU(dim, hidden, spec.norm_eps if spec.mlp_sub_ln else None, drop)
    if spec.mlp == 'swiglu_packed':
        return SwiGLUPacked(dim, hidden, drop)
    return Mlp(dim, hidden, act_layer=partial(build_activation_layer, act_cfg or
                                              dict(type='GELU')), drop=drop)


class ViTBlock(nn.Module):
    """Pre-norm block on ``(B, P + h * w, C)``: ``x + ls1(attn(norm1(x)))``, then
    ``x + ls2(mlp(norm2(x)))``. Window blocks (``window_size`` given) cut the patch grid into
    zero-padded windows (ViTDet); the ``P`` prefix tokens join every window and their outputs
    are averaged over the windows. ``attention`` builds ``attn`` (:class:`ViTAttention`'s
    arguments); ``norm_cfg`` default: LayerNorm with the arch's eps."""

    def __init__(self, spec: PlainViTArch, window_size: Optional[Tuple[int, int]],
                 rotate_half: bool = False, drop: float = 0.0, attn_drop: float = 0.0,
                 drop_path: float = 0.0, norm_cfg: Optional[dict] = None,
                 act_cfg: Optional[dict] = None,
                 attention: Callable[..., ViTAttention] = ViTAttention) -> None:
        super().__init__()
        dim, eps = spec.embed_dims, spec.norm_eps
        norm_cfg = norm_cfg or dict(type='LN', eps=eps)
        self.window_size = window_size
        self.norm1 = build_norm_layer(norm_cfg, dim)[1]
        self.attn = attention(dim, spec.num_heads, spec.qkv_bias, attn_drop, drop,
                              eps if spec.attn_sub_ln else None, rotate_half)
        self.ls1 = LayerScale(dim, spec.layer_scale) if spec.layer_scale else nn.Identity()
        self.norm2 = build_norm_layer(norm_cfg, dim)[1]
        self.mlp = build_mlp(spec, drop, act_cfg)
        self.ls2 = LayerScale(dim, spec.layer_scale) if spec.layer_scale else nn.Identity()
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: Tensor, layout: TokenLayout) -> Tensor:
        """``(B, P + h * w, C)`` -> the same."""
        b, _, c = x.shape
        p, (h, w) = layout.num_prefix, layout.grid
        shortcut = x
        x = self.norm1(x)
        if self.window_size is None:  # global attention over all tokens
            x = self.attn(x, (h, w), p, layout.rope_global)
        else:  # window attention; the prefix tokens join every window
            windows, padded = to_windows(x[:, p:].reshape(b, h, w, c),
                                         self.window_size)           # (B * nW, N, C)
            nw = windows.shape[0] // b
            if p:
                prefix = x[:, None, :p].expand(b, nw, p, c).reshape(b * nw, p, c)
                windows = torch.cat([prefix, windows], dim=1)        # (B * nW, P + N, C)
            windows = self.attn(windows, self.window_size, p, layout.rope_window)
            x = from_windows(windows[:, p:], padded).reshape(b, h * w, c)  # (B, h * w, C)
            if p:
                prefix = windows[:, :p].reshape(b, nw, p, c).mean(dim=1)  # (B, P, C)
                x = torch.cat([prefix, x], dim=1)                    # (B, P + h * w, C)
        x = shortcut + self.drop_path(self.ls1(x))
        return x + self.drop_path(self.ls2(self.mlp(self.norm2(x))))

    def extra_repr(self) -> str:
        return f'window_size={self.window_size}'
