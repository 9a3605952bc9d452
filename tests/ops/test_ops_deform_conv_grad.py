"""The offset and mask gradients of DCNv1 / DCNv2 at out-of-range samples follow mmcv's rule.

mmcv 2.1's kernels (``pytorch/cpu/deform_conv.cpp``, ``cpu/modulated_deform_conv.cpp``,
``common/cuda/*deform_conv_cuda_kernel.cuh``) return 0 for the offset and mask gradients of a
sample outside ``(-1, H) x (-1, W)`` (``*_col2im_coord*``: ``inv_h <= -1 || inv_w <= -1 ||
inv_h >= height || inv_w >= width``). Samples exactly on ``y == -1`` or ``x == -1`` are the ones
where this matters: every border sample of a padded convolution at zero offsets (mmdet's DCN
init), and integer offsets onto the border. Expected values are worked out by hand (a 3 x 3 map)
or by a loop transcribed from mmcv's ``col2im_coord`` kernel.
"""
import math
from typing import Callable, Dict, Optional, Tuple

import numpy as np
import pytest
import torch
from mmcv.ops import deform_conv2d, modulated_deform_conv2d
from test_ops_deform_conv import (
    FP64_ATOL,
    GEOMETRIES,
    bilinear_sample,
    fractional_offsets,
    grouped_channels,
    layer_shapes,
)

import vitdet_plugin  # noqa: F401  (installs the mmcv._ext stand-in before mmcv.ops)

#: Offset values per sampling point: (dy, dx).
DY, DX = 0, 1
#: Zero offsets put the first kernel row / column on y == -1 / x == -1 (padding 1), also
#: strided and grouped.
STRIDED_PAD1 = dict(stride=2, padding=1, dilation=1, groups=2, deform_groups=2)


# ---- mmcv's col2im_coord, one sample at a time ----------------------------------------------

def coordinate_weight(plane: np.ndarray, y: float, x: float, direction: int) -> float:
    """mmcv's ``dmcn_get_coordinate_weight_cpu``: d(bilinear sample) / d(y or x), corners
    outside the map 0, and 0 for a sample outside (-1, H) x (-1, W)."""
    height, width = plane.shape
    if y <= -1 or y >= height or x <= -1 or x >= width:
        return 0.0
    y_low, x_low = math.floor(y), math.floor(x)

    def value(r: int, q: int) -> float:
        return float(plane[r, q]) if 0 <= r < height and 0 <= q < width else 0.0

    if direction == DY:
        return ((x_low + 1 - x) * (value(y_low + 1, x_low) - value(y_low, x_low))
                + (x - x_low) * (value(y_low + 1, x_low + 1) - value(y_low, x_low + 1)))
    return ((y_low + 1 - y) * (value(y_low, x_low + 1) - value(y_low, x_low))
            + (y - y_low) * (value(y_low + 1, x_low + 1) - value(y_low + 1, x_low)))


def offset_mask_grad_reference(x: np.ndarray, weight: np.ndarray, offset: np.ndarray,
                               mask: Optional[np.ndarray], grad: np.ndarray,
                               geo: Dict[str, int]) -> Tuple[np.ndarray, np.ndarray, int]:
    """d(sum(out * grad)) / d(offset, mask) by mmcv's rule, and how many samples lie exactly on
    y == -1 or x == -1 (where torchvision's own gradient is one-sided)."""
    n, channels, _, _ = x.shape
    kh, kw = weight.shape[2:]
    points = kh * kw
    ho, wo = offset.shape[2:]
    per_group = channels // geo['deform_groups']
    # the output gradient through the weights: mmcv's backward columns (N, C, kH, kW, Ho, Wo)
    columns = np.zeros((n, channels, kh, kw, ho, wo))
    for o, c in grouped_channels(geo['groups'], weight.shape[0], channels):
        columns[:, c] = np.einsum('ocij,nohw->ncijhw', weight[o], grad[:, o])
    grad_offset, on_border = np.zeros(offset.shape), 0
    grad_mask = np.zeros((n, geo['deform_groups'] * points, ho, wo))
    for b in range(n):
        for g in range(geo['deform_groups']):
            for i in range(kh):
                for j in range(kw):
                    k = i * kw + j
                    for h in range(ho):
                        for w in range(wo):
                            y = (h * geo['stride'] - geo['padding'] + i * geo['dilation']
                                 + offset[b, g * 2 * points + 2 * k, h, w])
                            xs = (w * geo['stride'] - geo['padding'] + j * geo['dilation']
                                  + offset[b, g * 2 * points + 2 * k + 1, h, w])
                            on_border += int(y == -1 or xs == -1)
                            m = 1.0 if mask is None else mask[b, g * points + k, h, w]
                            for c in range(g * per_group, (g + 1) * per_group):
                                top = columns[b, c, i, j, h, w]
                                for axis in (DY, DX):
                                    grad_offset[b, g * 2 * points + 2 * k + axis, h, w] += (
                                        top * m * coordinate_weight(x[b, c], y, xs, axis))
                                grad_mask[b, g * points + k, h, w] += top * bilinear_sample(
                                    x[b, c], np.array(y), np.array(xs))
    return grad_offset, grad_mask, on_border


def _gradients(modulated: bool, x: torch.Tensor, weight: torch.Tensor, offset: torch.Tensor,
               mask: torch.Tensor, grad: torch.Tensor, geo: Dict[str, int]
               ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(offset.grad, mask.grad or None) of the op through mmcv's Python API."""
    offset, mask = offset.clone().requires_grad_(), mask.clone().requires_grad_()
    args = (geo['stride'], geo['padding'], geo['dilation'], geo['groups'], geo['deform_groups'])
    if modulated:
        out = modulated_deform_conv2d(x, offset, mask, weight, None, *args)
    else:
        out = deform_conv2d(x, offset, weight, *args)
    out.backward(grad)
    return offset.grad, mask.grad if modulated else None


# ---- hand-worked --------------------------------------------------------------------------

#: A 1 x 1 kernel, padding 1, zero offsets and mask 1 on the 3 x 3 map 1..9: the samples sit
#: at (ho - 1, wo - 1), the border ring on y == -1 / x == -1 or y == 3 / x == 3 (outside: 0).
#: Inside, d/dy = v(y + 1, x) - v(y, x), d/dx = v(y, x + 1) - v(y, x) (the derivative towards
#: the next pixel, 0 past the map); the mask gradient is the sampled value.
HAND_DY = [[0, 0, 0, 0, 0], [0, 3, 3, 3, 0], [0, 3, 3, 3, 0], [0, -7, -8, -9, 0], [0, 0, 0, 0, 0]]
HAND_DX = [[0, 0, 0, 0, 0], [0, 1, 1, -3, 0], [0, 1, 1, -6, 0], [0, 1, 1, -9, 0], [0, 0, 0, 0, 0]]
HAND_MASK = [[0, 0, 0, 0, 0], [0, 1, 2, 3, 0], [0, 4, 5, 6, 0], [0, 7, 8, 9, 0], [0, 0, 0, 0, 0]]


@pytest.mark.parametrize('modulated', [False, True])
def test_zero_offsets_with_padding_by_hand(modulated: bool) -> None:
    geo = dict(stride=1, padding=1, dilation=1, groups=1, deform_groups=1)
    x = torch.arange(1.0, 10.0, dtype=torch.float64).view(1, 1, 3, 3)
    weight = torch.ones(1, 1, 1, 1, dtype=torch.float64)
    d_offset, d_mask = _gradients(modulated, x, weight, torch.zeros(1, 2, 5, 5, dtype=x.dtype),
                                  torch.ones(1, 1, 5, 5, dtype=x.dtype),
                                  torch.ones(1, 1, 5, 5, dtype=x.dtype), geo)
    expected = torch.tensor([[HAND_DY, HAND_DX]], dtype=x.dtype)
    torch.testing.assert_close(d_offset, expected, rtol=0, atol=0)
    if modulated:
        torch.testing.assert_close(d_mask, torch.tensor([[HAND_MASK]], dtype=x.dtype),
                                   rtol=0, atol=0)


# ---- against mmcv's loop ------------------------------------------------------------------

def _zero(shape: Tuple[int, ...]) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.float64)


def _integer(shape: Tuple[int, ...]) -> torch.Tensor:
    return torch.randint(-2, 3, shape).to(torch.float64)


def _mixed(shape: Tuple[int, ...]) -> torch.Tensor:
    """Integer offsets at every other point, fractional ones between."""
    offset = fractional_offsets(shape)
    offset[:, 0::4] = _integer(offset[:, 0::4].shape)
    return offset


@pytest.mark.parametrize('modulated', [False, True])
@pytest.mark.parametrize('offsets,geo', [(_zero, GEOMETRIES[0]), (_zero, STRIDED_PAD1),
                                         (_integer, GEOMETRIES[0]), (_integer, GEOMETRIES[1]),
                                         (_mixed, GEOMETRIES[2])],
                         ids=['zero-pad1', 'zero-pad1-strided', 'integer-pad1',
                              'integer-pad2-strided', 'mixed-pad0'])
def test_offset_and_mask_gradients_follow_mmcv(
        offsets: Callable[[Tuple[int, ...]], torch.Tensor], geo: Dict[str, int],
        modulated: bool) -> None:
    x_shape, w_shape, off_shape, mask_shape = layer_shapes(geo, n=1, size=6)
    x, weight = torch.randn(x_shape, dtype=torch.float64), torch.randn(w_shape,
                                                                       dtype=torch.float64)
    offset, mask = offsets(off_shape), torch.rand(mask_shape, dtype=torch.float64)
    grad = torch.randn(x_shape[0], w_shape[0], *off_shape[2:], dtype=torch.float64)
    d_offset, d_mask = _gradients(modulated, x, weight, offset, mask, grad, geo)
    ref_offset, ref_mask, on_border = offset_mask_grad_reference(
        x.numpy(), weight.numpy(), offset.numpy(), mask.numpy() if modulated else None,
        grad.numpy(), geo)
    assert on_border > 0  # the case reaches the samples the rule is about
    np.testing.assert_allclose(d_offset.numpy(), ref_offset, rtol=0, atol=FP64_ATOL)
    if d_mask is not None:
        np.testing.assert_allclose(d_mask.numpy(), ref_mask, rtol=0, atol=FP64_ATOL)
