"""mmcv's deformable convolutions (DCNv1, modulated DCNv2) on the compile-free ops.

Called through mmcv's Python API (``mmcv.ops.DeformConv2d``, ``ModulatedDeformConv2d``, the
``*Pack`` layers mmdet builds, ``deform_conv2d`` / ``modulated_deform_conv2d``), so the in-place
``mmcv._ext`` signatures are exercised, and checked against ``F.conv2d`` (zero / integer
offsets) and a NumPy loop transcribed from mmcv 2.1's ``deformable_im2col_bilinear`` and
im2col kernels (``common/cuda/deform_conv_cuda_kernel.cuh``).
"""
import re
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mmcv.cnn import build_conv_layer
from mmcv.ops import (
    DeformConv2d,
    DeformConv2dPack,
    ModulatedDeformConv2d,
    ModulatedDeformConv2dPack,
    deform_conv2d,
    modulated_deform_conv2d,
)

import vitdet_plugin  # noqa: F401  (installs the mmcv._ext stand-in before mmcv.ops)
from vitdet_plugin.ops import OpInputError
from vitdet_plugin.ops import deform_conv as ops

#: float64 results against float64 references (summation order only).
FP64_ATOL = 1e-10
#: float32 against F.conv2d (another summation order).
FP32_ATOL = 1e-5
#: float16 / bfloat16 outputs and weight gradients against the float64 reference on the same
#: rounded inputs: sums of tens of O(1) products, values up to ~5 (a few units in the last
#: place; measured: 1e-2 in both).
FP16_ATOL = 3e-2
BF16_ATOL = 6e-2
KERNEL = 3


# ---- NumPy reference ----------------------------------------------------------------------

def bilinear_sample(plane: np.ndarray, h: np.ndarray, w: np.ndarray) -> np.ndarray:
    """mmcv's deformable_im2col_bilinear at the points (h, w): 0 outside (-1, H) x (-1, W),
    corners outside the map count 0."""
    height, width = plane.shape
    inside = (h > -1) & (h < height) & (w > -1) & (w < width)
    h_low, w_low = np.floor(h).astype(int), np.floor(w).astype(int)
    lh, lw = h - h_low, w - w_low
    total = np.zeros(h.shape)
    for r, q, weight in ((h_low, w_low, (1 - lh) * (1 - lw)), (h_low, w_low + 1, (1 - lh) * lw),
                         (h_low + 1, w_low, lh * (1 - lw)), (h_low + 1, w_low + 1, lh * lw)):
        ok = inside & (r >= 0) & (r <= height - 1) & (q >= 0) & (q <= width - 1)
        total += np.where(ok, weight * plane[r.clip(0, height - 1), q.clip(0, width - 1)], 0.0)
    return total


def deform_columns(x: np.ndarray, offset: np.ndarray, mask: Optional[np.ndarray],
                   kernel: Tuple[int, int], stride: int, pad: int, dilation: int,
                   deform_groups: int) -> np.ndarray:
    """mmcv's (modulated) deformable im2col: (N, C, kH, kW, Ho, Wo), offsets per deformable
    group, per kernel point ``i * kW + j``, (dy, dx)."""
    n, channels, _, _ = x.shape
    kh, kw = kernel
    ho, wo = offset.shape[2:]
    points = kh * kw
    base_h = (np.arange(ho) * stride - pad)[:, None]                    # (Ho, 1)
    base_w = (np.arange(wo) * stride - pad)[None, :]                    # (1, Wo)
    columns = np.zeros((n, channels, kh, kw, ho, wo))
    for b in range(n):
        for c in range(channels):
            g = c // (channels // deform_groups)
            for i in range(kh):
                for j in range(kw):
                    k = i * kw + j
                    dy = offset[b, g * 2 * points + 2 * k]
                    dx = offset[b, g * 2 * points + 2 * k + 1]
                    m = 1.0 if mask is None else mask[b, g * points + k]
                    columns[b, c, i, j] = m * bilinear_sample(
                        x[b, c], base_h + i * dilation + dy, base_w + j * dilation + dx)
    return columns


def grouped_channels(groups: int, c_out: int, channels: int) -> List[Tuple[slice, slice]]:
    """(output channels, input channels) of each group."""
    cout_g, cin_g = c_out // groups, channels // groups
    return [(slice(g * cout_g, (g + 1) * cout_g), slice(g * cin_g, (g + 1) * cin_g))
            for g in range(groups)]


def deform_conv_reference(x: np.ndarray, weight: np.ndarray, offset: np.ndarray,
                          mask: Optional[np.ndarray], bias: Optional[np.ndarray],
                          stride: int, pad: int, dilation: int, groups: int,
                          deform_groups: int) -> np.ndarray:
    """mmcv's deformable convolution: im2col, then one GEMM per group, plus the bias."""
    columns = deform_columns(x, offset, mask, weight.shape[2:], stride, pad, dilation,
                             deform_groups)
    out = np.zeros((x.shape[0], weight.shape[0]) + offset.shape[2:])
    for o, c in grouped_channels(groups, weight.shape[0], x.shape[1]):
        out[:, o] = np.einsum('ocij,ncijhw->nohw', weight[o], columns[:, c])
    if bias is not None:
        out += bias[None, :, None, None]
    return out


def weight_grad_reference(x: np.ndarray, grad: np.ndarray, offset: np.ndarray,
                          mask: Optional[np.ndarray], weight_shape: Tuple[int, ...],
                          stride: int, pad: int, dilation: int, groups: int,
                          deform_groups: int) -> np.ndarray:
    """d(sum(out * grad)) / d weight: the output gradient against mmcv's columns, per group."""
    columns = deform_columns(x, offset, mask, weight_shape[2:], stride, pad, dilation,
                             deform_groups)
    out = np.zeros(weight_shape)
    for o, c in grouped_channels(groups, weight_shape[0], x.shape[1]):
        out[o] = np.einsum('nohw,ncijhw->ocij', grad[:, o], columns[:, c])
    return out


# ---- helpers ------------------------------------------------------------------------------

GEOMETRIES = [dict(stride=1, padding=1, dilation=1, groups=1, deform_groups=1),
              dict(stride=2, padding=2, dilation=2, groups=2, deform_groups=2),
              dict(stride=1, padding=0, dilation=1, groups=1, deform_groups=4)]


def layer_shapes(geo: Dict[str, int], n: int = 2, c_in: int = 4, c_out: int = 4, size: int = 7
                 ) -> Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]:
    """Shapes of input, weight, offset and mask for ``geo``."""
    span = geo['dilation'] * (KERNEL - 1) + 1
    out = (size + 2 * geo['padding'] - span) // geo['stride'] + 1
    points = geo['deform_groups'] * KERNEL * KERNEL
    return ((n, c_in, size, size), (c_out, c_in // geo['groups'], KERNEL, KERNEL),
            (n, 2 * points, out, out), (n, points, out, out))


def fractional_offsets(shape: Tuple[int, ...], dtype: torch.dtype = torch.float64
                       ) -> torch.Tensor:
    """Offsets in (-2, 2) at least 0.2 from an integer (bilinear sampling is not
    differentiable on integer coordinates)."""
    whole = torch.randint(-2, 2, shape).to(dtype)
    return whole + 0.2 + 0.6 * torch.rand(shape, dtype=dtype)


def _dcn(geo: Dict[str, int], modulated: bool, **kwargs: object) -> torch.nn.Module:
    layer_cls = ModulatedDeformConv2d if modulated else DeformConv2d
    extra = dict(bias=True) if modulated else dict(bias=False)
    extra.update(kwargs)  # type: ignore[arg-type]
    return layer_cls(4, 4, KERNEL, geo['stride'], geo['padding'], geo['dilation'], geo['groups'],
                     geo['deform_groups'], **extra)


def _call(layer: torch.nn.Module, x: torch.Tensor, offset: torch.Tensor,
          mask: torch.Tensor) -> torch.Tensor:
    return layer(x, offset, mask) if isinstance(layer, ModulatedDeformConv2d) else layer(x, offset)


# ---- forward ------------------------------------------------------------------------------

@pytest.mark.parametrize('modulated', [False, True])
@pytest.mark.parametrize('geo', GEOMETRIES)
def test_zero_offsets_are_conv2d(geo: Dict[str, int], modulated: bool) -> None:
    x_shape, _, off_shape, mask_shape = layer_shapes(geo)
    layer = _dcn(geo, modulated)
    if modulated:
        torch.nn.init.normal_(layer.bias)
    x = torch.randn(x_shape)
    out = _call(layer, x, torch.zeros(off_shape), torch.ones(mask_shape))
    ref = F.conv2d(x, layer.weight, getattr(layer, 'bias', None), geo['stride'],
                   geo['padding'], geo['dilation'], geo['groups'])
    torch.testing.assert_close(out, ref, rtol=0, atol=FP32_ATOL)


@pytest.mark.parametrize('modulated', [False, True])
def test_integer_offsets_shift_the_input(modulated: bool) -> None:
    """The same offset (dy, dx) = (1, -2) at every point samples the input shifted by it."""
    geo = GEOMETRIES[0]
    x_shape, _, off_shape, mask_shape = layer_shapes(geo)
    layer = _dcn(geo, modulated)
    x = torch.randn(x_shape)
    offset = torch.zeros(off_shape)
    offset[:, 0::2], offset[:, 1::2] = 1.0, -2.0
    out = _call(layer, x, offset, torch.ones(mask_shape))
    padded = F.pad(x, [geo['padding']] * 4)             # the map the sampling points index
    shifted = torch.zeros_like(padded)
    shifted[:, :, :-1, 2:] = padded[:, :, 1:, :-2]      # shifted[h, w] = padded[h + 1, w - 2]
    ref = F.conv2d(shifted, layer.weight, getattr(layer, 'bias', None))
    torch.testing.assert_close(out, ref, rtol=0, atol=FP32_ATOL)


@pytest.mark.parametrize('modulated', [False, True])
@pytest.mark.parametrize('geo', GEOMETRIES)
def test_fractional_offsets_match_mmcv_kernel(geo: Dict[str, int], modulated: bool) -> None:
    x_shape, _, off_shape, mask_shape = layer_shapes(geo)
    layer = _dcn(geo, modulated).double()
    if modulated:
        torch.nn.init.normal_(layer.bias)
    x, offset, mask = (torch.randn(x_shape, dtype=torch.float64), fractional_offsets(off_shape),
                       torch.rand(mask_shape, dtype=torch.float64))
    offset[0, 0, 0, 0] = -30.0                              # one sample far outside the map
    out = _call(layer, x, offset, mask)
    ref = deform_conv_reference(
        x.numpy(), layer.weight.detach().numpy(), offset.numpy(),
        mask.numpy() if modulated else None,
        layer.bias.detach().numpy() if modulated else None, geo['stride'], geo['padding'],
        geo['dilation'], geo['groups'], geo['deform_groups'])
    np.testing.assert_allclose(out.detach().numpy(), ref, rtol=0, atol=FP64_ATOL)


@pytest.mark.parametrize('dtype,atol', [(torch.float16, FP16_ATOL), (torch.bfloat16, BF16_ATOL)])
@pytest.mark.parametrize('modulated', [False, True])
def test_low_precision(dtype: torch.dtype, atol: float, modulated: bool) -> None:
    """Output, weight and bias gradients in float16 / bfloat16 (torchvision has no bfloat16
    kernel: computed in float32) against the float64 reference on the same rounded values."""
    geo = GEOMETRIES[1]
    x_shape, w_shape, off_shape, mask_shape = layer_shapes(geo)
    x, weight, offset, mask = (torch.randn(x_shape).to(dtype), torch.randn(w_shape).to(dtype),
                               fractional_offsets(off_shape, torch.float32).to(dtype),
                               torch.rand(mask_shape).to(dtype))
    bias = torch.randn(w_shape[0]).to(dtype).requires_grad_() if modulated else None
    weight.requires_grad_()
    args = (geo['stride'], geo['padding'], geo['dilation'], geo['groups'], geo['deform_groups'])
    if modulated:
        out = modulated_deform_conv2d(x, offset, mask, weight, bias, *args)
    else:
        out = deform_conv2d(x, offset, weight, *args)
    grad = torch.randn(out.shape).to(dtype)
    out.backward(grad)
    assert out.dtype == weight.grad.dtype == dtype
    x64, off64, w64 = x.double().numpy(), offset.double().numpy(), weight.detach().double().numpy()
    mask64 = mask.double().numpy() if modulated else None
    bias64 = bias.detach().double().numpy() if bias is not None else None
    ref = deform_conv_reference(x64, w64, off64, mask64, bias64, *args)
    np.testing.assert_allclose(out.detach().double().numpy(), ref, rtol=0, atol=atol)
    ref_weight = weight_grad_reference(x64, grad.double().numpy(), off64, mask64, w_shape,
                                       *args)
    np.testing.assert_allclose(weight.grad.double().numpy(), ref_weight, rtol=0, atol=atol)
    if bias is not None:
        np.testing.assert_allclose(bias.grad.double().numpy(),
                                   grad.double().sum((0, 2, 3)).numpy(), rtol=0, atol=atol)


# ---- backward -----------------------------------------------------------------------------

@pytest.mark.parametrize('modulated', [False, True])
def test_gradcheck(modulated: bool) -> None:
    geo = dict(stride=1, padding=1, dilation=1, groups=2, deform_groups=2)
    x_shape, w_shape, off_shape, mask_shape = layer_shapes(geo, n=2, c_in=2, c_out=2, size=4)
    x, weight, offset, mask, bias = (
        torch.randn(x_shape, dtype=torch.float64), torch.randn(w_shape, dtype=torch.float64),
        fractional_offsets(off_shape), torch.rand(mask_shape, dtype=torch.float64),
        torch.randn(2, dtype=torch.float64))
    args = (geo['stride'], geo['padding'], geo['dilation'], geo['groups'], geo['deform_groups'])
    if modulated:
        tensors = [t.requires_grad_() for t in (x, offset, mask, weight, bias)]
        fn: Callable[..., torch.Tensor] = lambda *t: modulated_deform_conv2d(*t, *args)  # noqa: E731
    else:
        tensors = [t.requires_grad_() for t in (x, offset, weight)]
        fn = lambda *t: deform_conv2d(*t, *args, False, 1)  # noqa: E731
    assert torch.autograd.gradcheck(fn, tensors, eps=1e-6, atol=1e-6)


def test_weight_gradient_alone() -> None:
    """Only the weight needs a gradient: mmcv calls deform_conv_backward_parameters alone."""
    geo = GEOMETRIES[1]
    x_shape, w_shape, off_shape, _ = layer_shapes(geo)
    x, offset = torch.randn(x_shape, dtype=torch.float64), torch.zeros(off_shape,
                                                                       dtype=torch.float64)
    weight = torch.randn(w_shape, dtype=torch.float64, requires_grad=True)
    args = (geo['stride'], geo['padding'], geo['dilation'], geo['groups'])
    grad = torch.randn(x_shape[0], w_shape[0], *off_shape[2:], dtype=torch.float64)
    deform_conv2d(x, offset, weight, *args, geo['deform_groups']).backward(grad)
    ref_weight = weight.detach().clone().requires_grad_()
    F.conv2d(x, ref_weight, None, *args).backward(grad)
    torch.testing.assert_close(weight.grad, ref_weight.grad, rtol=0, atol=FP64_ATOL)


def test_im2col_step_changes_nothing() -> None:
    geo = GEOMETRIES[1]
    x_shape, _, off_shape, _ = layer_shapes(geo, n=4)
    x, offset = torch.randn(x_shape), fractional_offsets(off_shape, torch.float32)
    results = []
    for step in (1, 2, 4):
        layer = DeformConv2d(4, 4, KERNEL, geo['stride'], geo['padding'], geo['dilation'],
                             geo['groups'], geo['deform_groups'], im2col_step=step)
        layer.weight.data = torch.linspace(-1, 1, layer.weight.numel()).view_as(layer.weight)
        leaves = [t.clone().requires_grad_() for t in (x, offset)]
        out = layer(*leaves)
        out.square().sum().backward()
        results.append([out.detach()] + [t.grad for t in leaves] + [layer.weight.grad])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize('conv_type,pack', [('DCN', DeformConv2dPack),
                                             ('DCNv2', ModulatedDeformConv2dPack)])
def test_mmdet_dcn_layers_train(conv_type: str, pack: type) -> None:
    """The layers mmdet's backbones build for ``dcn=dict(type='DCN' | 'DCNv2')`` (through
    ``build_conv_layer``): forward = conv2d at init (zero offsets; DCNv2 masks sigmoid(0) =
    0.5), and a training step reaches every parameter."""
    layer = build_conv_layer(dict(type=conv_type, deform_groups=2), 4, 6, KERNEL, padding=1)
    assert type(layer) is pack
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    scale = 0.5 if pack is ModulatedDeformConv2dPack else 1.0
    ref = F.conv2d(x, layer.weight * scale, getattr(layer, 'bias', None), padding=1)
    torch.testing.assert_close(layer(x), ref, rtol=0, atol=FP32_ATOL)
    torch.nn.init.normal_(layer.conv_offset.weight, std=0.1)
    out = layer(x)
    out.square().mean().backward()
    grads = [x.grad, layer.weight.grad, layer.conv_offset.weight.grad, layer.conv_offset.bias.grad]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


# ---- bad input ----------------------------------------------------------------------------

def _forward(**change: object) -> None:
    args: Dict[str, object] = dict(
        input=torch.zeros(2, 4, 6, 6), weight=torch.zeros(3, 4, 3, 3),
        offset=torch.zeros(2, 18, 4, 4), output=torch.zeros(2, 3, 4, 4),
        columns=torch.zeros(0), ones=torch.zeros(0), kW=3, kH=3, dW=1, dH=1, padW=0, padH=0,
        dilationW=1, dilationH=1, group=1, deformable_group=1, im2col_step=2)
    args.update(change)
    ops.deform_conv_forward(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize('change,message', [
    (dict(offset=torch.zeros(2, 16, 4, 4)),
     'deform_conv_forward: offset must have shape (2, 18, 4, 4) (N, deformable_group * 2 * kH * '
     'kW, Ho, Wo), got (2, 16, 4, 4)'),
    (dict(offset=torch.zeros(2, 18, 4, 4, dtype=torch.float64)),
     'deform_conv_forward: all tensors must have one dtype, got input float32, weight float32, '
     'offset float64; cast them with .to(dtype)'),
    (dict(weight=torch.zeros(4, 3, 3)),
     'deform_conv_forward: weight must be 4-d (Cout, C / group, kH, kW), got shape (4, 3, 3)'),
    (dict(offset=torch.zeros(2, 18, 4, 4, device='meta')),
     'deform_conv_forward: all tensors must be on one device, got input on cpu, weight on cpu, '
     'offset on meta; move them with .to(device)'),
    (dict(im2col_step=3),
     'deform_conv_forward: im2col_step (3) must be >= 1 and divide the batch size (2)'),
    (dict(deformable_group=3),
     'deform_conv_forward: input channels (4) must be a multiple of deformable_group (3)'),
    (dict(input=torch.zeros(2, 4, 6, 6, dtype=torch.int64)),
     'deform_conv_forward: input must be float16 / bfloat16 / float32 / float64, got int64'),
])
def test_bad_input(change: Dict[str, object], message: str) -> None:
    with pytest.raises(OpInputError, match=re.escape(message)):
        _forward(**change)


def test_bad_mask() -> None:
    x, w, off, out = (torch.zeros(2, 4, 6, 6), torch.zeros(3, 4, 3, 3), torch.zeros(2, 18, 4, 4),
                      torch.zeros(2, 3, 4, 4))
    with pytest.raises(OpInputError, match=re.escape(
            'modulated_deform_conv_forward: mask must have shape (2, 9, 4, 4) (N, '
            'deformable_group * kH * kW, Ho, Wo), got (2, 8, 4, 4)')):
        ops.modulated_deform_conv_forward(x, w, torch.zeros(3), torch.zeros(0), off,
                                          torch.ones(2, 8, 4, 4), out, torch.zeros(0), 3, 3, 1,
                                          1, 0, 0, 1, 1, 1, 1, True)
