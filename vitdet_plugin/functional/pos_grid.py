"""Resizing of stored position grids (absolute position embeddings, relative-position tables)."""
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .sizes import known_equal


def interpolation_dtype(t: Tensor) -> Tensor:
    """``t`` in a dtype ``F.interpolate`` resizes accurately: fp16 / bf16 as fp32, fp32 / fp64
    as they are (resizing fp64 tables in fp32 would lose its precision)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def resize_pos_grid(pos: Tensor, size: Tuple[int, int], mode: str = 'bicubic',
                    antialias: bool = False) -> Tensor:
    """Resize a ``(1, C, H, W)`` position grid to ``size`` (dtype preserved).

    ``antialias``: as timm resizes the DINOv2 / EVA-02 position embeddings (low-passed when
    shrinking; another cubic kernel, a = -0.5, so it differs when enlarging too)."""
    if known_equal(pos.shape[-2], size[0]) and known_equal(pos.shape[-1], size[1]):
        return pos  # symbolic sizes resize (maybe to the same size, which is exact)
    out = F.interpolate(interpolation_dtype(pos), size=size, mode=mode, align_corners=False,
                        antialias=antialias)
    return out.to(pos.dtype)
