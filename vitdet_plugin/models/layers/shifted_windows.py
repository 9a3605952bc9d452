"""(Shifted) window attention over a ``(B, H, W, C)`` map, with Swin detection semantics."""
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from ...functional import pad_to_multiple, window_partition, window_reverse, window_shift_mask

#: ``attn(windows (B * nW, N, C), shift mask (nW, N, N) or None) -> (B * nW, N, C)``.
WindowAttentionFn = Callable[[Tensor, Optional[Tensor]], Tensor]


def shifted_window_attention(x: Tensor, attn: WindowAttentionFn, window_size: Tuple[int, int],
                             shift_size: Tuple[int, int], mask_dtype: torch.dtype) -> Tensor:
    """``(B, H, W, C)`` -> ``(B, H, W, C)``: zero-pad at the bottom/right to whole windows, roll
    by ``-shift_size`` (when non-zero), attend within windows (tokens of different regions of a
    rolled window are masked), reverse, roll back and crop to ``H x W``."""
    b, h, w, c = x.shape
    shifted = any(shift_size)
    windows = pad_to_multiple(x, window_size)                       # (B, Hp, Wp, C), zeros
    hp, wp = windows.shape[1:3]
    mask = None
    if shifted:
        windows = torch.roll(windows, (-shift_size[0], -shift_size[1]), dims=(1, 2))
        mask = window_shift_mask((hp, wp), window_size, shift_size, x.device,
                                 mask_dtype)                        # (nW, N, N)
    out = attn(window_partition(windows, window_size), mask)        # (B * nW, N, C)
    out = window_reverse(out, window_size, (hp, wp))                # (B, Hp, Wp, C)
    if shifted:
        out = torch.roll(out, shift_size, dims=(1, 2))
    return out[:, :h, :w]                                           # (B, H, W, C)
