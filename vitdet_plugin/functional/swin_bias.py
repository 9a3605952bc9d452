"""Swin's relative-position bias: a table of one entry per head and relative offset of a
window (learned in V1, computed by an MLP in V2), gathered into the bias of a window."""
from typing import Tuple

import torch
from torch import Tensor

from .size_cache import SizeCache

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
