"""Swin's relative-position bias table.

Swin: a learned bias table of ``(2*wh - 1) * (2*ww - 1)`` entries per head, gathered with a
fixed index into a ``(heads, N, N)`` bias for an ``N = wh * ww`` window. ViTDet's decomposed
per-axis tables are in :mod:`.decomposed_rel_pos`.
"""
from typing import Tuple

import torch
from torch import Tensor


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
