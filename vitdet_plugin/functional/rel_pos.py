"""Swin's relative-position bias table and the resizing of position grids.

Swin: a learned bias table of ``(2*wh - 1) * (2*ww - 1)`` entries per head, gathered with a
fixed index into a ``(heads, N, N)`` bias for an ``N = wh * ww`` window. ViTDet's decomposed
per-axis tables are in :mod:`.decomposed_rel_pos`.
"""
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .symbolic import known_equal


def interpolation_dtype(t: Tensor) -> Tensor:
    """``t`` in a dtype ``F.interpolate`` resizes accurately: fp16 / bf16 as fp32, fp32 / fp64
    as they are (resizing fp64 tables in fp32 would lose its precision)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


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


def resize_pos_grid(pos: Tensor, size: Tuple[int, int], mode: str = 'bicubic',
                    antialias: bool = False) -> Tensor:
    """Resize a ``(1, C, H, W)`` position grid to ``size`` (dtype preserved; fp16 / bf16 are
    interpolated in fp32, fp32 / fp64 in their own precision).

    ``antialias``: ``F.interpolate(antialias=True)``, as timm resizes the DINOv2 / EVA-02
    position embeddings: low-passed when shrinking, and PyTorch's antialiased bicubic uses
    another cubic kernel (a = -0.5) than plain bicubic (a = -0.75), so it differs when
    enlarging too."""
    if known_equal(pos.shape[-2], size[0]) and known_equal(pos.shape[-1], size[1]):
        return pos  # symbolic sizes resize (maybe to the same size, which is exact)
    out = F.interpolate(interpolation_dtype(pos), size=size, mode=mode, align_corners=False,
                        antialias=antialias)
    return out.to(pos.dtype)
