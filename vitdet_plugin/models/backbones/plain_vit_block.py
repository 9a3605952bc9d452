"""The block the DINOv2, DINOv3 and EVA-02 backbones share: pre-norm attention with optional
rotary embedding, q / v biases and sub-LN, LayerScale, a GELU or SwiGLU MLP; global attention
over all tokens or window attention over the patch grid (the prefix tokens joining every
window).
"""
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...functional import apply_rope, attend, from_windows, to_windows
from ..layers import Attention, DropPath, LayerScale, Mlp, SwiGLU, SwiGLUPacked
from .vit_family_archs import PlainViTArch

#: ``(sin, cos)`` rotary tables, each ``(G, N, head_dim)``: one table for every window / image
#: (``G = 1``) or one per window of an image (``G = nW``).
RopeTables = Tuple[Tensor, Tensor]


class TokenLayout(NamedTuple):
    """What the blocks of one forward share (built once per forward by the backbone)."""
    grid: Tuple[int, int]                  # (h, w) patch grid
    num_prefix: int                        # cls / register tokens leading the sequence
    rope_global: Optional[RopeTables]      # G = 1, N = h * w
    rope_window: Optional[RopeTables]      # N = wh * ww


class PlainViTAttention(Attention):
    """Multi-head attention over ``(B, P + N, C)``: the ``P`` prefix tokens, then ``N`` patch
    tokens, which alone are rotated by the rotary tables.

    Args:
        qkv_bias: ``'qkv'`` (one bias of the fused projection), ``'qv'`` (``q_bias`` and
            ``v_bias``, no k bias) or ``'none'``.
        sub_ln_eps: eps of the sub-LN ``norm`` on the attention output before ``proj``
            (EVA-02's ``inner_attn_ln``); None: none.
        rotate_half: the rotary layout (DINOv3: halves; EVA-02: interleaved pairs).
    """

    def __init__(self, dim: int, num_heads: int, qkv_bias: str, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, fused: bool = True, sub_ln_eps: Optional[float] = None,
                 rotate_half: bool = False) -> None:
        super().__init__(dim, num_heads, qkv_bias == 'qkv', attn_drop, proj_drop, fused)
        self.qkv_bias_mode = qkv_bias
        if qkv_bias == 'qv':
            self.q_bias: Optional[nn.Parameter] = nn.Parameter(torch.zeros(dim))
            self.v_bias: Optional[nn.Parameter] = nn.Parameter(torch.zeros(dim))
        else:
            self.q_bias = self.v_bias = None
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

    def forward(self, x: Tensor, num_prefix: int = 0,  # type: ignore[override]
                rope: Optional[RopeTables] = None) -> Tensor:
        b, n, c = x.shape                                            # (B', P + N, C)
        q, k, v = self.qkv_heads(x)                                  # (B', heads, P + N, d)
        if rope is not None:
            q, k = self.rotate(q, num_prefix, rope), self.rotate(k, num_prefix, rope)
            # q and k are new tensors now: a v of its own, so backward keeps (B', P + N, C)
            # instead of the whole (B', P + N, 3C) projection alive (measured: EVA-02-B saved
            # activations at 512 px 883 -> 811 MB; timm 809 MB)
            v = v.contiguous()
        out = attend(q, k, v, None, self.dropout_p, self.fused, self.scale)
        out = out.transpose(1, 2).reshape(b, n, c)                   # (B', P + N, C)
        return self.project_out(self.norm(out))

    def extra_repr(self) -> str:
        return f'{super().extra_repr()}, qkv_bias={self.qkv_bias_mode!r}'


def build_mlp(spec: PlainViTArch, drop: float) -> nn.Module:
    """The block MLP of ``spec``: GELU ``Mlp``, ``SwiGLU`` (with EVA-02's sub-LN if set) or
    ``SwiGLUPacked``."""
    dim, hidden = spec.embed_dims, spec.mlp_hidden
    if spec.mlp == 'swiglu':
        return SwiGLU(dim, hidden, spec.norm_eps if spec.mlp_sub_ln else None, drop)
    if spec.mlp == 'swiglu_packed':
        return SwiGLUPacked(dim, hidden, drop)
    return Mlp(dim, hidden, drop=drop)


class PlainViTBlock(nn.Module):
    """Pre-norm block on the token sequence ``(B, P + h * w, C)``.

    ``x + ls1(attn(norm1(x)))``, then ``x + ls2(mlp(norm2(x)))`` (LayerScale ``ls1`` / ``ls2``
    when the arch has it). Window blocks (``window_size`` given) cut the patch grid into
    windows, zero-padded at the bottom/right to whole windows (ViTDet); the ``P`` prefix tokens
    join every window as extra keys and queries, and their outputs are averaged over the
    windows of their image.
    """

    def __init__(self, spec: PlainViTArch, window_size: Optional[Tuple[int, int]],
                 rotate_half: bool, drop: float = 0.0, attn_drop: float = 0.0,
                 drop_path: float = 0.0, fused_attn: bool = True) -> None:
        super().__init__()
        dim, eps = spec.embed_dims, spec.norm_eps
        self.window_size = window_size
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = PlainViTAttention(dim, spec.num_heads, spec.qkv_bias, attn_drop, drop,
                                      fused_attn, eps if spec.attn_sub_ln else None,
                                      rotate_half)
        self.ls1 = LayerScale(dim, spec.layer_scale) if spec.layer_scale else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = build_mlp(spec, drop)
        self.ls2 = LayerScale(dim, spec.layer_scale) if spec.layer_scale else nn.Identity()
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: Tensor, layout: TokenLayout) -> Tensor:
        """``(B, P + h * w, C)`` -> the same."""
        x = x + self.drop_path(self.ls1(self.attention(self.norm1(x), layout)))
        return x + self.drop_path(self.ls2(self.mlp(self.norm2(x))))

    def attention(self, x: Tensor, layout: TokenLayout) -> Tensor:
        """Global attention over all tokens, or window attention of the normalised tokens."""
        p = layout.num_prefix
        if self.window_size is None:
            return self.attn(x, p, layout.rope_global)
        b, _, c = x.shape
        h, w = layout.grid
        patches = x[:, p:].reshape(b, h, w, c)                       # (B, h, w, C)
        windows, grid = to_windows(patches, self.window_size)        # (B * nW, N, C)
        nw = windows.shape[0] // b
        if p:
            prefix = x[:, :p, None].expand(b, p, nw, c)              # (B, P, nW, C)
            prefix = prefix.transpose(1, 2).reshape(b * nw, p, c)    # (B * nW, P, C)
            windows = torch.cat([prefix, windows], dim=1)            # (B * nW, P + N, C)
        out = self.attn(windows, p, layout.rope_window)              # (B * nW, P + N, C)
        patches = from_windows(out[:, p:], grid).reshape(b, h * w, c)  # (B, h * w, C)
        if not p:
            return patches
        prefix = out[:, :p].reshape(b, nw, p, c).mean(dim=1)         # (B, P, C)
        return torch.cat([prefix, patches], dim=1)                   # (B, P + h * w, C)

    def extra_repr(self) -> str:
        return f'window_size={self.window_size}'
