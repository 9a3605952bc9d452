"""Normalisation layers."""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channel dimension of an NCHW tensor ``(B, C, H, W)``."""

    def forward(self, x: Tensor) -> Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


def masked_group_norm(x: Tensor, valid: Optional[Tensor], norm: nn.GroupNorm) -> Tensor:
    """``norm(x)`` with the group statistics taken over valid positions only.

    Batched images are padded to one size; a plain GroupNorm would let the padded area shift
    the statistics of the image itself. Args: ``x (B, C, H, W)``, ``valid (B, H, W)`` bool
    (None: plain ``norm``; the caller decides from the sizes, as reading ``valid`` would be a
    device-to-host sync), ``norm`` a :class:`nn.GroupNorm` over ``C``. Padded positions come
    out as zeros. Statistics are computed in fp32 (autocast-safe).
    """
    if valid is None:
        return norm(x)
    b, c, h, w = x.shape
    g = norm.num_groups
    m = valid[:, None, None].to(torch.float32)                       # (B, 1, 1, H, W)
    xf = x.float().view(b, g, c // g, h, w)
    count = m.sum(dim=(2, 3, 4), keepdim=True).clamp_min(1.0) * (c // g)
    mean = (xf * m).sum(dim=(2, 3, 4), keepdim=True) / count
    var = ((xf - mean).square() * m).sum(dim=(2, 3, 4), keepdim=True) / count
    out = ((xf - mean) * torch.rsqrt(var + norm.eps) * m).view(b, c, h, w)
    if norm.affine:
        out = out * norm.weight.float()[:, None, None] + norm.bias.float()[:, None, None]
        out = out * m[:, 0]
    return out.to(x.dtype)
