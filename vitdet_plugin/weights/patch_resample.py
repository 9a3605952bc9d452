"""Patch-size change of a patch-embedding kernel: FlexiViT's pseudo-inverse resize.

A kernel ``w`` of patch size ``p`` reads a patch ``x``; resizing patches to ``p'`` is a linear
map ``R`` (``resize(x) = R x``, bicubic with antialiasing here, timm's default). The kernel
``w'`` for the resized patches should give the same token: ``<w', R x> = <w, x>`` for all
``x``, i.e. ``R^T w' = w``; the least-squares solution is ``w' = pinv(R^T) w`` (Beyer et al.,
FlexiViT, 2023; timm's ``resample_patch_embed``). For upsampling (14 -> 16) this holds exactly;
for downsampling it is the best fit. So a DINOv2 / EVA-02 checkpoint (patch 14) can drive a
patch-16 model and back.

Computed in float32, returned in the kernel's dtype; nothing is cached (the resize matrix
depends only on the sizes, but this runs once per checkpoint load).
"""
from typing import Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .checkpoint_io import CheckpointError
from .common import hw_pair

#: How patches are resized, as timm's ``resample_patch_embed`` does by default.
PATCH_RESIZE_MODE = 'bicubic'
PATCH_RESIZE_ANTIALIAS = True
#: The compute dtype of the resize matrix and its pseudo-inverse.
PATCH_RESAMPLE_DTYPE = torch.float32


def patch_resize_matrix(old_size: Tuple[int, int], new_size: Tuple[int, int],
                        device: torch.device) -> Tensor:
    """``R`` of shape ``(new_h * new_w, old_h * old_w)``: column ``j`` is the resized ``j``-th
    basis patch, so ``R @ x.flatten() == resize(x).flatten()`` for an ``old_size`` patch."""
    old_h, old_w = old_size
    basis = torch.eye(old_h * old_w, device=device, dtype=PATCH_RESAMPLE_DTYPE)
    basis = basis.reshape(old_h * old_w, 1, old_h, old_w)                # (P_old, 1, oh, ow)
    resized = F.interpolate(basis, size=new_size, mode=PATCH_RESIZE_MODE,
                            antialias=PATCH_RESIZE_ANTIALIAS, align_corners=False)
    return resized.reshape(old_h * old_w, -1).T                          # (P_new, P_old)


def resample_patch_kernel(weight: Tensor, new_size: Sequence[int]) -> Tensor:
    """The ``(C_out, C_in, kh, kw)`` patch-embedding kernel ``weight`` resampled to the patch
    size ``new_size`` ``(h, w)``: the FlexiViT pseudo-inverse resize (see the module
    docstring). ``weight`` itself when the size is unchanged."""
    if weight.dim() != 4:
        raise CheckpointError(f'a patch-embedding kernel is (C_out, C_in, kh, kw), got '
                              f'{tuple(weight.shape)}; pass patch_embed.proj.weight')
    new = hw_pair(tuple(int(s) for s in new_size), 'new_size')
    if min(new) < 1:
        raise CheckpointError(f'new_size={new} must be a positive patch size (h, w)')
    c_out, c_in, old_h, old_w = weight.shape
    if (old_h, old_w) == new:
        return weight
    resize = patch_resize_matrix((old_h, old_w), new, weight.device)      # (P_new, P_old)
    solve = torch.linalg.pinv(resize.T)                                   # (P_new, P_old)
    flat = weight.reshape(c_out * c_in, old_h * old_w).to(PATCH_RESAMPLE_DTYPE)
    out = flat @ solve.T                                                  # (C_out*C_in, P_new)
    return out.reshape(c_out, c_in, *new).to(weight.dtype)
