"""The Swin V2 block and its window attention: scaled cosine attention with a continuous
position bias.

``softmax(normalize(q) normalize(k)^T * exp(min(logit_scale, log 100)) + 16 sigmoid(cpb) + mask) v``
as in the official Swin V2 code, timm and mmpretrain. The logit scale is folded into the
normalised queries, so ``F.scaled_dot_product_attention`` runs with ``scale=1`` and the position
bias (plus the shift mask, windows folded into the heads as in Swin V1's
:class:`~.swin_block.WindowAttention`) as its ``attn_mask``.
"""
import math
from functools import partial
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from mmcv.cnn import build_activation_layer, build_norm_layer
from torch import Tensor, nn

from ...functional.swin_bias import log_spaced_relative_coords, window_bias
from ...functional.sizes import SizeCache, Window
from ...functional.window import from_windows, to_windows, window_attend
from ..layers.arguments import head_dim
from ..layers.drop_path import DropPath
from ..layers.mlp import Mlp

#: ``logit_scale`` starts at ``log(10)``: cosine similarities are multiplied by 10 at first.
LOGIT_SCALE_INIT = math.log(10.0)
#: The exponentiated logit scale is clamped at 100 (``logit_scale <= log(100)``).
LOGIT_SCALE_MAX = math.log(100.0)
#: Norms below this count as this when q and k are normalised (``F.normalize``'s default).
NORMALIZE_EPS = 1e-12
#: Hidden width of the position-bias MLP (``cpb_mlp``).
CPB_HIDDEN = 512
#: The position bias is ``CPB_BIAS_SCALE * sigmoid(mlp(coords))``, in ``(0, 16)``.
CPB_BIAS_SCALE = 16.0

#: Log-spaced relative coordinates per (window, pretrained window, device).
_COORDS: SizeCache[Tensor] = SizeCache()


class CosineWindowAttention(nn.Module):
    """Swin V2 multi-head attention inside ``wh x ww`` windows.

    Parameters as in the official layout: ``qkv`` (no bias), ``q_bias`` and ``v_bias`` (the
    key has none), ``logit_scale`` ``(heads, 1, 1)``, ``cpb_mlp`` (``Linear(2, 512)``, ReLU,
    ``Linear(512, heads, bias=False)``), ``proj``. The coordinates and index fed to
    ``cpb_mlp`` are derived from the window per device, not stored (checkpoint buffers
    ``relative_coords_table`` / ``relative_position_index`` are dropped by the converters).

    Args:
        dim, num_heads: token channels and heads (``dim`` divisible by ``num_heads``).
        window_size: ``(wh, ww)``.
        pretrained_window_size: ``(ph, pw)`` the model was pretrained with; relative offsets are
            normalised by it (``(0, 0)``: by the window itself).
        qkv_bias: learn ``q_bias`` and ``v_bias``.
        attn_drop, proj_drop: dropout on the attention weights / after ``proj``.
    """

    def __init__(self, dim: int, num_heads: int, window_size: Tuple[int, int],
                 pretrained_window_size: Tuple[int, int] = (0, 0), qkv_bias: bool = True,
                 attn_drop: float = 0.0, proj_drop: float = 0.0) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim(dim, num_heads)
        self.window_size: Tuple[int, int] = (int(window_size[0]), int(window_size[1]))
        self.pretrained_window_size: Tuple[int, int] = (int(pretrained_window_size[0]),
                                                        int(pretrained_window_size[1]))
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        if qkv_bias:
            self.q_bias = nn.Parameter(torch.zeros(dim))
            self.v_bias = nn.Parameter(torch.zeros(dim))
        else:
            self.register_parameter('q_bias', None)
            self.register_parameter('v_bias', None)
        self.logit_scale = nn.Parameter(torch.full((num_heads, 1, 1), LOGIT_SCALE_INIT))
        self.cpb_mlp = nn.Sequential(nn.Linear(2, CPB_HIDDEN), nn.ReLU(inplace=True),
                                     nn.Linear(CPB_HIDDEN, num_heads, bias=False))
        self.attn_drop = float(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop) if proj_drop > 0 else nn.Identity()
        self.fused = True  # SDPA; eager_attention() switches it

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        """``x``: windows ``(B * nW, N, C)``; ``mask``: ``(nW, N, N)`` shift mask or None."""
        bw, n, _ = x.shape
        qkv_bias = (None if self.q_bias is None else
                    torch.cat([self.q_bias, torch.zeros_like(self.q_bias), self.v_bias]))
        qkv = F.linear(x, self.qkv.weight, qkv_bias).view(bw, n, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)               # (B * nW, heads, N, d)
        # scaled cosine logits: unit q times the clamped logit scale (one pass over q), unit k
        scale = self.logit_scale.clamp(max=LOGIT_SCALE_MAX).exp().to(q.dtype)  # (heads, 1, 1)
        norm = torch.linalg.vector_norm(q, dim=-1, keepdim=True).clamp_min(NORMALIZE_EPS)
        q = q * (scale / norm)
        k = F.normalize(k, dim=-1, eps=NORMALIZE_EPS)
        dropout_p = self.attn_drop if self.training else 0.0
        out = window_attend(q, k, v, self.position_bias(), mask, dropout_p, self.fused,
                            scale=1.0)                               # (B * nW, N, C)
        return self.proj_drop(self.proj(out))

    def position_bias(self) -> Tensor:
        """The ``(1, heads, N, N)`` continuous position bias of one window."""
        weight = self.logit_scale  # the device and dtype of the parameters
        key = (self.window_size, self.pretrained_window_size, weight.device)
        coords = _COORDS.get(key, lambda: log_spaced_relative_coords(
            self.window_size, self.pretrained_window_size, weight.device))
        table = self.cpb_mlp(coords.to(weight.dtype)).view(-1, self.num_heads)  # (T, heads)
        return CPB_BIAS_SCALE * torch.sigmoid(window_bias(table, self.window_size))

    def extra_repr(self) -> str:
        return (f'window_size={self.window_size}, pretrained_window_size='
                f'{self.pretrained_window_size}, num_heads={self.num_heads}, fused={self.fused}')


class SwinV2Block(nn.Module):
    """One Swin V2 block on ``(B, H, W, C)``: post-norm cosine window attention, then MLP.

    Args:
        dim, num_heads, window_size, pretrained_window_size: see
            :class:`CosineWindowAttention`.
        shift: shift the windows by half a window (SW-MSA).
        pad_small_map: see :class:`SwinV2Backbone`.
        extra_norm: a final norm after the block (``norm3``; huge / giant models).
    """

    def __init__(self, dim: int, num_heads: int, window_size: Window,
                 pretrained_window_size: Window, shift: bool, pad_small_map: bool = True,
                 extra_norm: bool = False, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 drop: float = 0.0, attn_drop: float = 0.0, drop_path: float = 0.0,
                 norm_cfg: Optional[dict] = None, act_cfg: Optional[dict] = None) -> None:
        super().__init__()
        norm_cfg = norm_cfg or dict(type='LN')
        self.window_size = window_size
        self.shift_size = (window_size[0] // 2, window_size[1] // 2) if shift else (0, 0)
        self.pad_small_map = pad_small_map
        self.attn = CosineWindowAttention(dim, num_heads, window_size, pretrained_window_size,
                                          qkv_bias, attn_drop, drop)
        self.norm1 = build_norm_layer(norm_cfg, dim)[1]
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        act = partial(build_activation_layer, act_cfg or dict(type='GELU'))
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act, drop=drop)
        self.norm2 = build_norm_layer(norm_cfg, dim)[1]
        self.norm3 = build_norm_layer(norm_cfg, dim)[1] if extra_norm else None

    def shift_for(self, hw: Tuple[int, int]) -> Window:
        """The shift on an ``H x W`` map: always (detection), or mmpretrain's classification
        rule without ``pad_small_map`` (none when a side equals its window)."""
        if not self.pad_small_map:
            if any(s < w for s, w in zip(hw, self.window_size)):
                raise ValueError(
                    f'a {hw[0]}x{hw[1]} feature map is smaller than the {self.window_size[0]}x'
                    f'{self.window_size[1]} window, which pad_small_map=False does not allow; '
                    'set pad_small_map=True (pad and shift, the detection semantics) or use a '
                    'smaller window_size / larger input')
            if any(s == w for s, w in zip(hw, self.window_size)):
                return (0, 0)
        return self.shift_size

    def forward(self, x: Tensor) -> Tensor:
        """``(B, H, W, C)`` -> ``(B, H, W, C)``: residual post-norm attention, then MLP."""
        shift = self.shift_for((x.shape[1], x.shape[2]))
        windows, grid = to_windows(x, self.window_size, shift)       # (B * nW, N, C)
        windows = self.attn(windows, grid.shift_mask(x.device, x.dtype))  # (B * nW, N, C)
        x = x + self.drop_path(self.norm1(from_windows(windows, grid)))  # (B, H, W, C)
        x = x + self.drop_path(self.norm2(self.mlp(x)))
        return self.norm3(x) if self.norm3 is not None else x
