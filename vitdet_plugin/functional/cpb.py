"""Swin V2's continuous position bias inputs: log-spaced relative coordinates.

Swin V2 replaces V1's learned bias table by a small MLP (``cpb_mlp``) evaluated on the relative
offsets of a window, so the window can change without resizing any table. The offsets are
normalised by the window the model was pretrained with (or its own), scaled to
``[-CPB_COORD_RANGE, CPB_COORD_RANGE]`` and log-spaced::

    x -> sign(x) * log2(|x| + 1) / log2(CPB_COORD_RANGE)

as in the official code, timm and mmpretrain.
"""
import math
from typing import Optional, Tuple

import torch
from torch import Tensor

#: Normalised offsets span ``[-8, 8]`` before the log spacing (the reference value).
CPB_COORD_RANGE = 8.0


def log_spaced_relative_coords(window_size: Tuple[int, int],
                               pretrained_window_size: Tuple[int, int] = (0, 0),
                               device: Optional[torch.device] = None) -> Tensor:
    """The ``(2wh - 1, 2ww - 1, 2)`` fp32 table of log-spaced relative offsets ``(dy, dx)``.

    Offsets are divided by ``pretrained_window_size - 1`` per axis, or by ``window_size - 1``
    when the pretrained size is 0; a divisor of 0 (a one-token axis) counts as 1, as in timm.
    Rows follow :func:`~.swin_bias.relative_position_index` (the table flattened row-major).
    """
    wh, ww = window_size
    ph, pw = pretrained_window_size
    norm_h = max((ph if ph > 0 else wh) - 1, 1)
    norm_w = max((pw if pw > 0 else ww) - 1, 1)
    dy = torch.arange(-(wh - 1), wh, dtype=torch.float32, device=device) / norm_h
    dx = torch.arange(-(ww - 1), ww, dtype=torch.float32, device=device) / norm_w
    table = torch.stack(torch.meshgrid(dy, dx, indexing='ij'), dim=-1) * CPB_COORD_RANGE
    return torch.sign(table) * torch.log2(table.abs() + 1.0) / math.log2(CPB_COORD_RANGE)
