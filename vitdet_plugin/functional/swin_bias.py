"""Swin's relative-position bias: a table of one entry per head and relative offset of a
window (learned in V1, computed by an MLP in V2), gathered into the bias of a window.

Swin V2's continuous position bias replaces V1's learned table by a small MLP (``cpb_mlp``)
evaluated on the relative offsets of a window, so the window can change without resizing any
table. The offsets are normalised by the window the model was pretrained with (or its own),
scaled to ``[-CPB_COORD_RANGE, CPB_COORD_RANGE]`` and log-spaced::

    x -> sign(x) * log2(|x| + 1) / log2(CPB_COORD_RANGE)

as in the official code, timm and mmpretrain (:func:`log_spaced_relative_coords`).
"""
import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from .sizes import SizeCache

#: Flattened relative-position indices per (window, device).
_INDEX: SizeCache[Tensor] = SizeCache()


def bias_table_size(window_size: Tuple[int, int]) -> Tuple[int, int]:
    """The ``(2wh - 1, 2ww - 1)`` grid of relative offsets a Swin bias table covers (its rows,
    one per offset, are that grid flattened)."""
    return 2 * window_size[0] - 1, 2 * window_size[1] - 1


def relative_position_index(window_size: Tuple[int, int]) -> Tensor:
    """Index ``(N, N)`` into a ``((2wh-1)(2ww-1), heads)`` Swin bias table (official layout)."""
    wh, ww = window_size
    coords = torch.stack(torch.meshgrid(torch.arange(wh), torch.arange(ww), indexing='ij'))
    coords = coords.flatten(1)                                  # (2, N)
    rel = coords[:, :, None] - coords[:, None, :]               # (2, N, N)
    return (rel[0] + wh - 1) * (2 * ww - 1) + (rel[1] + ww - 1)


def window_bias(table: Tensor, window_size: Tuple[int, int]) -> Tensor:
    """The ``(1, heads, N, N)`` bias of one window, gathered from a ``((2wh-1)(2ww-1), heads)``
    table of relative offsets with :func:`relative_position_index` (derived per device, not
    a buffer: a model built on the meta device and materialised with ``to_empty()`` would
    index with garbage)."""
    index = _INDEX.get((window_size, table.device),
                       lambda: relative_position_index(window_size).view(-1).to(table.device))
    n = window_size[0] * window_size[1]
    return table[index].view(n, n, -1).permute(2, 0, 1).unsqueeze(0)  # (1, heads, N, N)


#: Normalised offsets span ``[-8, 8]`` before the log spacing (the reference value).
CPB_COORD_RANGE = 8.0


def log_spaced_relative_coords(window_size: Tuple[int, int],
                               pretrained_window_size: Tuple[int, int] = (0, 0),
                               device: Optional[torch.device] = None) -> Tensor:
    """The ``(2wh - 1, 2ww - 1, 2)`` fp32 table of log-spaced relative offsets ``(dy, dx)``.

    Offsets are divided by ``pretrained_window_size - 1`` per axis, or by ``window_size - 1``
    when the pretrained size is 0; a divisor of 0 (a one-token axis) counts as 1, as in timm.
    Rows follow :func:`relative_position_index` (the table flattened row-major).
    """
    wh, ww = window_size
    ph, pw = pretrained_window_size
    norm_h = max((ph if ph > 0 else wh) - 1, 1)
    norm_w = max((pw if pw > 0 else ww) - 1, 1)
    dy = torch.arange(-(wh - 1), wh, dtype=torch.float32, device=device) / norm_h
    dx = torch.arange(-(ww - 1), ww, dtype=torch.float32, device=device) / norm_w
    table = torch.stack(torch.meshgrid(dy, dx, indexing='ij'), dim=-1) * CPB_COORD_RANGE
    return torch.sign(table) * torch.log2(table.abs() + 1.0) / math.log2(CPB_COORD_RANGE)
