"""The Swin V1 block: (shifted) window attention with a relative-position bias, then an MLP.

Detection semantics (Swin-Transformer-Object-Detection / mmdet): a shifted block always shifts,
and every block pads its map to whole windows with zeros at the bottom/right. Parameter names
follow the official layout (``norm1``, ``attn.{qkv,proj,relative_position_bias_table}``,
``norm2``, ``mlp.{fc1,fc2}``).
"""
import math
from functools import partial
from typing import Optional, Tuple

import torch
from mmcv.cnn import build_activation_layer, build_norm_layer
from torch import Tensor, nn

from ...functional.swin_bias import bias_table_size, window_bias
from ...functional.window import from_windows, to_windows, window_attend
from ..layers.arguments import head_dim
from ..layers.drop_path import DropPath
from ..layers.mlp import Mlp


class WindowAttention(nn.Module):
    """Multi-head attention inside ``wh x ww`` windows with a learned relative-position bias.

    Args:
        dim: token channels.
        num_heads: attention heads; ``dim`` must be divisible by it.
        window_size: ``(wh, ww)``.
        qkv_bias: bias on the fused ``qkv`` projection.
        qk_scale: override of the ``head_dim ** -0.5`` logit scale (mmdet's ``qk_scale``;
            as there and in the official code, ``None`` or ``0`` mean the default).
        attn_drop: dropout on the attention weights (training only).
        proj_drop: dropout after ``proj``.
    """

    def __init__(self, dim: int, num_heads: int, window_size: Tuple[int, int],
                 qkv_bias: bool = True, qk_scale: Optional[float] = None,
                 attn_drop: float = 0.0, proj_drop: float = 0.0) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim(dim, num_heads)
        self.scale = qk_scale or self.head_dim ** -0.5  # `qk_scale or head_dim ** -0.5` upstream
        self.window_size: Tuple[int, int] = (int(window_size[0]), int(window_size[1]))
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.relative_position_bias_table = nn.Parameter(
            torch.zeros(int(math.prod(bias_table_size(self.window_size))), num_heads))
        self.attn_drop = float(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop) if proj_drop > 0 else nn.Identity()
        self.fused = True  # SDPA; eager_attention() switches it

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        """``x``: windows ``(B * nW, N, C)``; ``mask``: ``(nW, N, N)`` shift mask or None.

        ``softmax(q k^T * scale + bias (+ mask)) v``, then ``proj``."""
        bw, n, _ = x.shape
        qkv = self.qkv(x).view(bw, n, 3, self.num_heads, self.head_dim)  # (B * nW, N, 3, heads, d)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)               # (B * nW, heads, N, d)
        dropout_p = self.attn_drop if self.training else 0.0
        out = window_attend(q, k, v, self.relative_position_bias(), mask, dropout_p,
                            self.fused, self.scale)                  # (B * nW, N, C)
        return self.proj_drop(self.proj(out))

    def relative_position_bias(self) -> Tensor:
        """The ``(1, heads, N, N)`` bias of one window, gathered from the table."""
        return window_bias(self.relative_position_bias_table, self.window_size)

    def extra_repr(self) -> str:
        return (f'window_size={self.window_size}, num_heads={self.num_heads}, '
                f'fused={self.fused}')


class SwinBlock(nn.Module):
    """One Swin block on ``(B, H, W, C)``: (shifted) window attention, then an MLP.

    Args:
        dim, num_heads: channels and attention heads.
        window_size: ``(wh, ww)``.
        shift: shift the windows by half a window (SW-MSA) instead of W-MSA.
        mlp_ratio: MLP hidden width / ``dim``.
        qkv_bias, qk_scale, attn_drop: see :class:`WindowAttention`.
        drop: dropout after the projections.
        drop_path: stochastic-depth rate of this block.
        norm_cfg, act_cfg: mmcv config dicts for the norms and the MLP activation.
    """

    def __init__(self, dim: int, num_heads: int, window_size: Tuple[int, int], shift: bool,
                 mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 qk_scale: Optional[float] = None, drop: float = 0.0, attn_drop: float = 0.0,
                 drop_path: float = 0.0, norm_cfg: Optional[dict] = None,
                 act_cfg: Optional[dict] = None) -> None:
        super().__init__()
        self.window_size = window_size
        self.shift_size = (window_size[0] // 2, window_size[1] // 2) if shift else (0, 0)
        self.norm1 = build_norm_layer(norm_cfg or dict(type='LN'), dim)[1]
        self.attn = WindowAttention(dim, num_heads, window_size, qkv_bias, qk_scale, attn_drop,
                                    drop)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = build_norm_layer(norm_cfg or dict(type='LN'), dim)[1]
        act = partial(build_activation_layer, act_cfg or dict(type='GELU'))
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act, drop=drop)

    def forward(self, x: Tensor) -> Tensor:
        """``(B, H, W, C)`` -> ``(B, H, W, C)``."""
        # pad to whole windows, roll by -shift (SW-MSA), partition: (B * nW, N, C)
        windows, grid = to_windows(self.norm1(x), self.window_size, self.shift_size)
        windows = self.attn(windows, grid.shift_mask(x.device, x.dtype))  # (B * nW, N, C)
        x = x + self.drop_path(from_windows(windows, grid))          # (B, H, W, C)
        return x + self.drop_path(self.mlp(self.norm2(x)))
