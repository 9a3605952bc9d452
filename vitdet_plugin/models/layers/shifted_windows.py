"""(Shifted) window attention over a ``(B, H, W, C)`` map, with Swin detection semantics."""
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from ...functional import (SizeCache, pad_to_multiple, window_partition, window_reverse,
                           window_shift_mask)

#: ``attn(windows (B * nW, N, C), shift mask (nW, N, N) or None) -> (B * nW, N, C)``.
WindowAttentionFn = Callable[[Tensor, Optional[Tensor]], Tensor]

#: (gather order, inverse) per (padded size, window, shift, device): sizes alone.
_ORDERS: SizeCache[Tuple[Tensor, Tensor]] = SizeCache()


def shifted_window_order(hw: Tuple[int, int], window_size: Tuple[int, int],
                         shift_size: Tuple[int, int],
                         device: torch.device) -> Tuple[Tensor, Tensor]:
    """Flat token indices ``(order, inverse)`` of an ``Hp x Wp`` map: ``tokens[order]`` are the
    windows of the map rolled by ``-shift_size`` (``window_partition`` order), and
    ``windows[inverse]`` puts them back (rolled back). One gather each way instead of a roll
    (a copy per axis) plus the partition copy, and the same for the way back."""
    def build() -> Tuple[Tensor, Tensor]:
        hp, wp = hw
        # the map's flat indices rolled like the map (no `% Hp` on a symbolic size: the ONNX
        # exporter cannot translate a remainder by one)
        flat = torch.arange(hp * wp, device=device).view(hp, wp)         # (Hp, Wp)
        source = torch.roll(flat, (-shift_size[0], -shift_size[1]), dims=(0, 1))
        order = window_partition(source[None, :, :, None], window_size).reshape(-1)
        return order, torch.argsort(order)
    return _ORDERS.get((tuple(hw), tuple(window_size), tuple(shift_size), device), build)


def shifted_window_attention(x: Tensor, attn: WindowAttentionFn, window_size: Tuple[int, int],
                             shift_size: Tuple[int, int], mask_dtype: torch.dtype) -> Tensor:
    """``(B, H, W, C)`` -> ``(B, H, W, C)``: zero-pad at the bottom/right to whole windows, roll
    by ``-shift_size`` (when non-zero), attend within windows (tokens of different regions of a
    rolled window are masked), reverse, roll back and crop to ``H x W``."""
    b, h, w, c = x.shape
    windows = pad_to_multiple(x, window_size)                       # (B, Hp, Wp, C), zeros
    hp, wp = windows.shape[1:3]
    if not any(shift_size):
        out = attn(window_partition(windows, window_size), None)    # (B * nW, N, C)
        return window_reverse(out, window_size, (hp, wp))[:, :h, :w]
    order, inverse = shifted_window_order((hp, wp), window_size, shift_size, x.device)
    mask = window_shift_mask((hp, wp), window_size, shift_size, x.device,
                             mask_dtype)                            # (nW, N, N)
    n = window_size[0] * window_size[1]
    tokens = windows.reshape(b, hp * wp, c).index_select(1, order)  # rolled windows, in order
    out = attn(tokens.view(-1, n, c), mask)                         # (B * nW, N, C)
    out = out.reshape(b, hp * wp, c).index_select(1, inverse)       # the map, rolled back
    return out.view(b, hp, wp, c)[:, :h, :w]                        # (B, H, W, C)
