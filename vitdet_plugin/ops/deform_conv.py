"""``mmcv._ext`` deformable convolution (DCNv1 and modulated DCNv2) on torchvision's kernels.

Signatures are mmcv 2.1's (``pybind.cpp``); results go into the tensors passed in, as mmcv's
kernels write them: ``output`` / ``grad_offset`` / ``grad_mask`` overwritten, ``grad_input`` /
``grad_weight`` / ``grad_bias`` accumulated into (mmcv's wrappers pass zeros). The ``columns`` /
``ones`` scratch buffers are not used.

torchvision's ``deform_conv2d`` is mmcv's kernel (both come from the DCNv2 authors' code; checked
against ``common/cuda/deform_conv_cuda_kernel.cuh``, ``modulated_deform_conv_cuda_kernel.cuh``
and ``pytorch/cpu/deform_conv.cpp``): offsets (N, deformable_group * 2 * kH * kW, Ho, Wo), per
deformable group, per kernel position ``i * kW + j``, (dy, dx); mask (N, deformable_group * kH *
kW, Ho, Wo) in the same order; channel ``c`` in deformable group ``c // (C / deformable_group)``;
sample at ``(ho * stride - pad + i * dilation + dy, ...)``, 0 outside ``(-1, H) x (-1, W)``,
bilinear with out-of-map corners 0. One difference, in the backward: mmcv zeroes the offset and
mask gradients of every sample outside ``(-1, H) x (-1, W)`` (``cpu/deform_conv.cpp``,
``cpu/modulated_deform_conv.cpp``, the CUDA kernels alike), while torchvision's offset gradient
at a sample exactly on ``y == -1`` or ``x == -1`` is the one-sided derivative towards the map.
Zero offsets (mmdet's DCN init) with padding put every border sample there, so the backward
applies mmcv's rule (``_dcn_backward``).

``im2col_step`` (how many images mmcv unfolds per step) changes no result; it is checked as mmcv
does (it divides the batch) and otherwise left to torchvision, which picks its own step.
torchvision has kernels for float16 / float32 / float64 on CPU and CUDA; bfloat16 (no kernel in
torchvision or mmcv) is computed in float32.
"""
from typing import NamedTuple, Optional, Tuple

import torch
import torchvision  # noqa: F401  (registers torch.ops.torchvision)

from .checks import OpInputError, check_same_device, check_same_dtype, check_tensor

#: Dtypes of torchvision's deform_conv2d kernels, on CPU and CUDA alike.
TORCHVISION_DCN_DTYPES = (torch.float16, torch.float32, torch.float64)
#: Offset values per sampling point: (dy, dx).
OFFSET_PER_POINT = 2


class _Conv(NamedTuple):
    """Geometry of one deformable convolution, (height, width) pairs."""
    kernel: Tuple[int, int]
    stride: Tuple[int, int]
    pad: Tuple[int, int]
    dilation: Tuple[int, int]
    groups: int
    offset_groups: int

    def out_size(self, height: int, width: int) -> Tuple[int, int]:
        """(Ho, Wo), as mmcv's ``_output_size`` and kernels compute them."""
        def length(size: int, axis: int) -> int:
            span = self.dilation[axis] * (self.kernel[axis] - 1) + 1
            return (size + 2 * self.pad[axis] - span) // self.stride[axis] + 1
        return length(height, 0), length(width, 1)

    def tv_args(self) -> Tuple[int, ...]:
        """stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w, groups, offset_groups."""
        return (*self.stride, *self.pad, *self.dilation, self.groups, self.offset_groups)


def _check_conv(op: str, conv: _Conv, input: torch.Tensor, weight: torch.Tensor,
                offset: torch.Tensor, mask: Optional[torch.Tensor] = None
                ) -> Tuple[int, int, int, int]:
    """Check the geometry and the layouts mmcv's kernels assume; returns (N, Cout, Ho, Wo)."""
    check_tensor(op, 'input', input, ndim=4, what='(N, C, H, W)')
    check_tensor(op, 'weight', weight, ndim=4, what='(Cout, C / group, kH, kW)')
    check_tensor(op, 'offset', offset, ndim=4,
                 what='(N, deformable_group * 2 * kH * kW, Ho, Wo)')
    for name, pair, least in (('kernel size', conv.kernel, 1), ('stride', conv.stride, 1),
                              ('padding', conv.pad, 0), ('dilation', conv.dilation, 1)):
        if min(pair) < least:
            raise OpInputError(f'{op}: {name} must be >= {least}, got {pair[0]} x {pair[1]}')
    n, channels, height, width = input.shape
    c_out = weight.size(0)
    if conv.groups < 1 or conv.offset_groups < 1:
        raise OpInputError(f'{op}: group and deformable_group must be >= 1, got {conv.groups} '
                           f'and {conv.offset_groups}')
    if tuple(weight.shape[2:]) != conv.kernel:
        raise OpInputError(f'{op}: weight must have kernel size {conv.kernel[0]} x '
                           f'{conv.kernel[1]} (kH x kW), got shape {tuple(weight.shape)}')
    if channels != weight.size(1) * conv.groups or c_out % conv.groups:
        raise OpInputError(f'{op}: input channels ({channels}) must be weight.size(1) '
                           f'({weight.size(1)}) x group ({conv.groups}), and weight.size(0) '
                           f'({c_out}) a multiple of group')
    if channels % conv.offset_groups:
        raise OpInputError(f'{op}: input channels ({channels}) must be a multiple of '
                           f'deformable_group ({conv.offset_groups})')
    out_h, out_w = conv.out_size(height, width)
    if out_h < 1 or out_w < 1:
        raise OpInputError(f'{op}: input {height} x {width} is too small for the kernel '
                           f'(output would be {out_h} x {out_w})')
    points = conv.offset_groups * conv.kernel[0] * conv.kernel[1]
    check_tensor(op, 'offset', offset, shape=(n, OFFSET_PER_POINT * points, out_h, out_w),
                 what='(N, deformable_group * 2 * kH * kW, Ho, Wo)')
    tensors = dict(input=input, weight=weight, offset=offset)
    if mask is not None:
        check_tensor(op, 'mask', mask, shape=(n, points, out_h, out_w),
                     what='(N, deformable_group * kH * kW, Ho, Wo)')
        tensors['mask'] = mask
    check_same_device(op, **tensors)
    check_same_dtype(op, **tensors)
    return n, c_out, out_h, out_w


def _check_like(op: str, name: str, tensor: torch.Tensor, like: torch.Tensor,
                shape: Tuple[int, ...], what: str) -> None:
    check_tensor(op, name, tensor, shape=shape, dtypes=(like.dtype,), what=what)
    check_same_device(op, input=like, **{name: tensor})


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in TORCHVISION_DCN_DTYPES else torch.float32


def _tv_operands(input: torch.Tensor, weight: torch.Tensor, offset: torch.Tensor,
                 mask: Optional[torch.Tensor], bias: Optional[torch.Tensor]
                 ) -> Tuple[torch.Tensor, ...]:
    """(input, weight, offset, mask, bias) for torchvision, in a dtype it has kernels for; an
    unused mask is (N, 1) zeros and a missing bias zeros, as ``torchvision.ops`` passes them."""
    dtype = _compute_dtype(input.dtype)
    if mask is None:
        mask = input.new_zeros((input.size(0), 1))
    if bias is None:
        bias = input.new_zeros(weight.size(0))
    return tuple(t.to(dtype) for t in (input, weight, offset, mask, bias))


def _check_im2col_step(op: str, im2col_step: int, batch: int) -> None:
    if im2col_step < 1 or batch % im2col_step:
        raise OpInputError(f'{op}: im2col_step ({im2col_step}) must be >= 1 and divide the '
                           f'batch size ({batch})')


def _dcn_conv(kW: int, kH: int, dW: int, dH: int, padW: int, padH: int, dilationW: int,
              dilationH: int, group: int, deformable_group: int) -> _Conv:
    return _Conv((int(kH), int(kW)), (int(dH), int(dW)), (int(padH), int(padW)),
                 (int(dilationH), int(dilationW)), int(group), int(deformable_group))


def deform_conv_forward(input: torch.Tensor, weight: torch.Tensor, offset: torch.Tensor,
                        output: torch.Tensor, columns: torch.Tensor, ones: torch.Tensor,
                        kW: int, kH: int, dW: int, dH: int, padW: int, padH: int,
                        dilationW: int, dilationH: int, group: int, deformable_group: int,
                        im2col_step: int) -> None:
    """mmcv's DCNv1 forward (no bias, no mask) into ``output`` (N, Cout, Ho, Wo)."""
    op = 'deform_conv_forward'
    conv = _dcn_conv(kW, kH, dW, dH, padW, padH, dilationW, dilationH, group, deformable_group)
    shape = _check_conv(op, conv, input, weight, offset)
    _check_like(op, 'output', output, input, shape, '(N, Cout, Ho, Wo)')
    _check_im2col_step(op, int(im2col_step), input.size(0))
    x, w, off, mask, bias = _tv_operands(input, weight, offset, None, None)
    output.copy_(torch.ops.torchvision.deform_conv2d(x, w, off, mask, bias, *conv.tv_args(),
                                                     False))


def _inside(conv: _Conv, offset: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Whether each sample lies in ``(-1, H) x (-1, W)``, mmcv's test: (N, G, kH, kW, Ho, Wo)."""
    n, _, out_h, out_w = offset.shape
    (k_h, k_w), (s_h, s_w), (p_h, p_w), (d_h, d_w) = (conv.kernel, conv.stride, conv.pad,
                                                      conv.dilation)
    device = offset.device
    # offset (N, G * kH * kW * 2, Ho, Wo) -> (N, G, kH, kW, 2, Ho, Wo): per point (dy, dx)
    dy_dx = offset.reshape(n, conv.offset_groups, k_h, k_w, OFFSET_PER_POINT, out_h, out_w)
    # the integer grid positions, in int64 as mmcv adds them before the offset
    rows = (torch.arange(k_h, device=device)[:, None] * d_h                     # (kH, Ho)
            + torch.arange(out_h, device=device)[None, :] * s_h - p_h)
    cols = (torch.arange(k_w, device=device)[:, None] * d_w                     # (kW, Wo)
            + torch.arange(out_w, device=device)[None, :] * s_w - p_w)
    y = dy_dx[:, :, :, :, 0] + rows[:, None, :, None]                # (N, G, kH, kW, Ho, Wo)
    x = dy_dx[:, :, :, :, 1] + cols[None, :, None, :]                # (N, G, kH, kW, Ho, Wo)
    return (y > -1) & (y < height) & (x > -1) & (x < width)


def _dcn_backward(conv: _Conv, grad_output: torch.Tensor, input: torch.Tensor,
                  weight: torch.Tensor, offset: torch.Tensor, mask: Optional[torch.Tensor],
                  bias: Optional[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """torchvision's backward with mmcv's rule: the offset and mask gradients of a sample
    outside ``(-1, H) x (-1, W)`` are 0 (torchvision's are already, except on ``y == -1`` /
    ``x == -1``). Returns (grad_input, grad_weight, grad_offset, grad_mask, grad_bias)."""
    x, w, off, m, b = _tv_operands(input, weight, offset, mask, bias)
    d_input, d_weight, d_offset, d_mask, d_bias = torch.ops.torchvision._deform_conv2d_backward(
        grad_output.to(x.dtype), x, w, off, m, b, *conv.tv_args(), mask is not None)
    inside = _inside(conv, off, x.size(2), x.size(3))                # (N, G, kH, kW, Ho, Wo)
    zero = d_offset.new_zeros(())
    # grad_offset (N, G * kH * kW * 2, Ho, Wo) -> (N, G, kH, kW, 2, Ho, Wo), (dy, dx) per point
    per_point = inside.shape[:4] + (OFFSET_PER_POINT,) + inside.shape[4:]
    d_offset = torch.where(inside.unsqueeze(4), d_offset.reshape(per_point),
                           zero).reshape(off.shape)
    if mask is not None:
        # grad_mask (N, G * kH * kW, Ho, Wo) -> (N, G, kH, kW, Ho, Wo)
        d_mask = torch.where(inside, d_mask.reshape(inside.shape), zero).reshape(m.shape)
    return d_input, d_weight, d_offset, d_mask, d_bias


def deform_conv_backward_input(input: torch.Tensor, offset: torch.Tensor,
                               gradOutput: torch.Tensor, gradInput: torch.Tensor,
                               gradOffset: torch.Tensor, weight: torch.Tensor,
                               columns: torch.Tensor, kW: int, kH: int, dW: int, dH: int,
                               padW: int, padH: int, dilationW: int, dilationH: int,
                               group: int, deformable_group: int, im2col_step: int) -> None:
    """mmcv's DCNv1 input / offset gradients: added into ``gradInput``, written to
    ``gradOffset``."""
    op = 'deform_conv_backward_input'
    conv = _dcn_conv(kW, kH, dW, dH, padW, padH, dilationW, dilationH, group, deformable_group)
    shape = _check_conv(op, conv, input, weight, offset)
    _check_like(op, 'gradOutput', gradOutput, input, shape, '(N, Cout, Ho, Wo)')
    _check_like(op, 'gradInput', gradInput, input, tuple(input.shape), '(N, C, H, W)')
    _check_like(op, 'gradOffset', gradOffset, input, tuple(offset.shape),
                '(N, deformable_group * 2 * kH * kW, Ho, Wo)')
    _check_im2col_step(op, int(im2col_step), input.size(0))
    grad_in, _, grad_off, _, _ = _dcn_backward(conv, gradOutput, input, weight, offset, None,
                                               None)
    gradInput.add_(grad_in)
    gradOffset.copy_(grad_off)


def deform_conv_backward_parameters(input: torch.Tensor, offset: torch.Tensor,
                                    gradOutput: torch.Tensor, gradWeight: torch.Tensor,
                                    columns: torch.Tensor, ones: torch.Tensor, kW: int, kH: int,
                                    dW: int, dH: int, padW: int, padH: int, dilationW: int,
                                    dilationH: int, group: int, deformable_group: int,
                                    scale: float, im2col_step: int) -> None:
    """mmcv's DCNv1 weight gradient: ``gradWeight += scale * dL/dweight``. torchvision computes
    every gradient in one backward; mmcv asks for the input and the weight gradients in two
    calls, so this runs it a second time (nothing is kept between the calls)."""
    op = 'deform_conv_backward_parameters'
    conv = _dcn_conv(kW, kH, dW, dH, padW, padH, dilationW, dilationH, group, deformable_group)
    shape = _check_conv(op, conv, input, gradWeight, offset)
    _check_like(op, 'gradOutput', gradOutput, input, shape, '(N, Cout, Ho, Wo)')
    _check_im2col_step(op, int(im2col_step), input.size(0))
    # the weight's values do not enter its own gradient: gradWeight stands in for them
    _, grad_weight, _, _, _ = _dcn_backward(conv, gradOutput, input, gradWeight, offset, None,
                                            None)
    gradWeight.add_(grad_weight, alpha=float(scale))


def _modulated_conv(kernel_h: int, kernel_w: int, stride_h: int, stride_w: int, pad_h: int,
                    pad_w: int, dilation_h: int, dilation_w: int, group: int,
                    deformable_group: int) -> _Conv:
    return _Conv((int(kernel_h), int(kernel_w)), (int(stride_h), int(stride_w)),
                 (int(pad_h), int(pad_w)), (int(dilation_h), int(dilation_w)), int(group),
                 int(deformable_group))


def _check_bias(op: str, bias: torch.Tensor, input: torch.Tensor, c_out: int,
                with_bias: bool) -> Optional[torch.Tensor]:
    if not with_bias:
        return None  # mmcv passes an empty stand-in
    _check_like(op, 'bias', bias, input, (c_out,), '(Cout,)')
    return bias


def modulated_deform_conv_forward(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                                  ones: torch.Tensor, offset: torch.Tensor, mask: torch.Tensor,
                                  output: torch.Tensor, columns: torch.Tensor, kernel_h: int,
                                  kernel_w: int, stride_h: int, stride_w: int, pad_h: int,
                                  pad_w: int, dilation_h: int, dilation_w: int, group: int,
                                  deformable_group: int, with_bias: bool) -> None:
    """mmcv's modulated deformable convolution (DCNv2) forward into ``output``."""
    op = 'modulated_deform_conv_forward'
    conv = _modulated_conv(kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h,
                           dilation_w, group, deformable_group)
    shape = _check_conv(op, conv, input, weight, offset, mask)
    _check_like(op, 'output', output, input, shape, '(N, Cout, Ho, Wo)')
    used_bias = _check_bias(op, bias, input, shape[1], with_bias)
    x, w, off, m, b = _tv_operands(input, weight, offset, mask, used_bias)
    output.copy_(torch.ops.torchvision.deform_conv2d(x, w, off, m, b, *conv.tv_args(), True))


def modulated_deform_conv_backward(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                                   ones: torch.Tensor, offset: torch.Tensor, mask: torch.Tensor,
                                   columns: torch.Tensor, grad_input: torch.Tensor,
                                   grad_weight: torch.Tensor, grad_bias: torch.Tensor,
                                   grad_offset: torch.Tensor, grad_mask: torch.Tensor,
                                   grad_output: torch.Tensor, kernel_h: int, kernel_w: int,
                                   stride_h: int, stride_w: int, pad_h: int, pad_w: int,
                                   dilation_h: int, dilation_w: int, group: int,
                                   deformable_group: int, with_bias: bool) -> None:
    """mmcv's DCNv2 gradients, one torchvision backward: added into ``grad_input``,
    ``grad_weight`` and (``with_bias``) ``grad_bias``; written to ``grad_offset``,
    ``grad_mask``."""
    op = 'modulated_deform_conv_backward'
    conv = _modulated_conv(kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h,
                           dilation_w, group, deformable_group)
    shape = _check_conv(op, conv, input, weight, offset, mask)
    _check_like(op, 'grad_output', grad_output, input, shape, '(N, Cout, Ho, Wo)')
    for name, tensor, like in (('grad_input', grad_input, input),
                               ('grad_weight', grad_weight, weight),
                               ('grad_offset', grad_offset, offset),
                               ('grad_mask', grad_mask, mask)):
        _check_like(op, name, tensor, input, tuple(like.shape), f'shaped like {name[5:]}')
    used_bias = _check_bias(op, bias, input, shape[1], with_bias)
    if with_bias:
        _check_like(op, 'grad_bias', grad_bias, input, (shape[1],), '(Cout,)')
    d_input, d_weight, d_offset, d_mask, d_bias = _dcn_backward(conv, grad_output, input, weight,
                                                                offset, mask, used_bias)
    grad_input.add_(d_input)
    grad_weight.add_(d_weight)
    grad_offset.copy_(d_offset)
    grad_mask.copy_(d_mask)
    if with_bias:
        grad_bias.add_(d_bias)
