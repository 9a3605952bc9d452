"""mmcv's RoIAlign / RoIPool on the compile-free ops (``vitdet_plugin.ops.roi``).

Called through mmcv's own Python API (``mmcv.ops.roi_align``, ``RoIAlign``, ``RoIPool``), which
passes the in-place ``mmcv._ext`` signature, and checked against NumPy loops transcribed from
mmcv 2.1's kernels (``common/cuda/roi_align_cuda_kernel.cuh``, ``roi_pool_cuda_kernel.cuh``,
``common_cuda_helper.hpp``'s bilinear rules).
"""
import math
import re
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pytest
import torch
from mmcv.ops import RoIAlign, RoIPool, roi_align

import vitdet_plugin  # noqa: F401  (installs the mmcv._ext stand-in before mmcv.ops)
from vitdet_plugin.ops import OpInputError
from vitdet_plugin.ops import roi as ops

#: mmcv's CUDA kernels start a bin's maximum here.
FLT_MAX = float(np.finfo(np.float32).max)
#: float64 results against the float64 NumPy loops (only summation order differs).
FP64_ATOL = 1e-10
#: float16 / bfloat16 outputs and input gradients against the float64 reference evaluated on
#: the same (rounded) inputs; features are O(1), so these are a few units in the last place.
FP16_ATOL = 1e-2
BF16_ATOL = 2e-2
POOLED = (3, 4)
SCALE = 0.5
FEATURE_SHAPE = (2, 2, 9, 11)  # N, C, H, W

# Boxes on the input image (SCALE maps them onto the 9 x 11 feature map): inside the map,
# crossing each border, fully outside, of zero and of negative size, on both batch images.
# Coordinates are multiples of 0.25 (exact in float16 / bfloat16); none puts a max-mode
# sample exactly on y == -1, where mmcv's backward drops the gradient (tested separately).
ROIS = [[0, 2.0, 3.0, 15.5, 13.0],
        [1, -6.0, -3.5, 7.0, 9.25],
        [1, 14.5, 10.0, 29.0, 22.5],
        [0, -9.0, 4.0, -4.5, 10.0],
        [1, 5.0, 5.0, 5.0, 5.0],
        [0, 8.0, 6.0, 6.5, 3.0],
        [1, 0.0, 0.0, 21.75, 17.5]]


# ---- NumPy reference, transcribed from mmcv's kernels -------------------------------------

def _bilinear_point(height: int, width: int, y: float, x: float
                    ) -> List[Tuple[int, int, float]]:
    """mmcv's bilinear_interpolate(_gradient): [(row, col, weight)], empty outside."""
    if y < -1.0 or y > height or x < -1.0 or x > width:
        return []
    y, x = max(y, 0.0), max(x, 0.0)
    y_low, x_low = int(y), int(x)
    if y_low >= height - 1:
        y_high = y_low = height - 1
        y = float(y_low)
    else:
        y_high = y_low + 1
    if x_low >= width - 1:
        x_high = x_low = width - 1
        x = float(x_low)
    else:
        x_high = x_low + 1
    ly, lx = y - y_low, x - x_low
    hy, hx = 1.0 - ly, 1.0 - lx
    return [(y_low, x_low, hy * hx), (y_low, x_high, hy * lx), (y_high, x_low, ly * hx),
            (y_high, x_high, ly * lx)]


def _align_samples(roi: Sequence[float], pooled: Tuple[int, int], scale: float,
                   sampling_ratio: int, aligned: bool
                   ) -> Tuple[Dict[Tuple[int, int], List[Tuple[float, float]]], int]:
    """Per bin (i, j): the list of sample points (y, x) and the count mmcv divides by."""
    offset = 0.5 if aligned else 0.0
    start_w, start_h, end_w, end_h = (float(v) * scale - offset for v in roi[1:])
    roi_w, roi_h = end_w - start_w, end_h - start_h
    if not aligned:
        roi_w, roi_h = max(roi_w, 1.0), max(roi_h, 1.0)
    bin_h, bin_w = roi_h / pooled[0], roi_w / pooled[1]
    grid_h = sampling_ratio if sampling_ratio > 0 else math.ceil(roi_h / pooled[0])
    grid_w = sampling_ratio if sampling_ratio > 0 else math.ceil(roi_w / pooled[1])
    samples: Dict[Tuple[int, int], List[Tuple[float, float]]] = {}
    for i in range(pooled[0]):
        for j in range(pooled[1]):
            samples[i, j] = [(start_h + i * bin_h + (iy + 0.5) * bin_h / grid_h,
                              start_w + j * bin_w + (ix + 0.5) * bin_w / grid_w)
                             for iy in range(grid_h) for ix in range(grid_w)]
    return samples, grid_h * grid_w


def roi_align_reference(feat: np.ndarray, rois: Sequence[Sequence[float]],
                        pooled: Tuple[int, int], scale: float, sampling_ratio: int, mode: str,
                        aligned: bool, grad: np.ndarray,
                        store: Callable[[float], float] = float
                        ) -> Tuple[np.ndarray, np.ndarray]:
    """(output, grad_input) of mmcv's RoIAlign for the output gradient ``grad``; ``store``
    rounds the max-mode sample coordinates as the ``argmax_y`` / ``argmax_x`` tensors (of the
    input's dtype) keep them for the backward."""
    n_rois, (_, channels, height, width) = len(rois), feat.shape
    out = np.zeros((n_rois, channels) + pooled)
    grad_in = np.zeros(feat.shape)
    for k, roi in enumerate(rois):
        b = int(roi[0])
        samples, count = _align_samples(roi, pooled, scale, sampling_ratio, aligned)
        for c in range(channels):
            for (i, j), points in samples.items():
                values = [sum(w * feat[b, c, r, q] for r, q, w in _bilinear_point(
                    height, width, y, x)) for y, x in points]
                g = grad[k, c, i, j]
                if mode == 'avg':
                    out[k, c, i, j] = sum(values) / max(count, 1)
                    for y, x in points:
                        for r, q, w in _bilinear_point(height, width, y, x):
                            grad_in[b, c, r, q] += g * w / count
                    continue
                best, arg = -FLT_MAX, (-1.0, -1.0)  # mmcv's CUDA start
                for v, p in zip(values, points):
                    if v > best:
                        best, arg = v, p
                out[k, c, i, j] = best
                arg = (store(arg[0]), store(arg[1]))
                if arg[0] != -1.0:  # mmcv's backward: argmax_y == -1 means "no sample"
                    for r, q, w in _bilinear_point(height, width, *arg):
                        grad_in[b, c, r, q] += g * w
    return out, grad_in


def roi_pool_reference(feat: np.ndarray, rois: Sequence[Sequence[float]],
                       pooled: Tuple[int, int], scale: float, grad: np.ndarray
                       ) -> Tuple[np.ndarray, np.ndarray]:
    """(output, grad_input) of mmcv's RoIPool (output / argmax start as the wrapper's zeros)."""
    n_rois, (_, channels, height, width) = len(rois), feat.shape
    out = np.zeros((n_rois, channels) + pooled)
    argmax = np.zeros(out.shape, dtype=np.int64)
    grad_in = np.zeros(feat.shape)
    for k, roi in enumerate(rois):
        b = int(roi[0])
        x1, y1 = roi[1] * scale, roi[2] * scale
        x2, y2 = (roi[3] + 1) * scale, (roi[4] + 1) * scale
        roi_w, roi_h = x2 - x1, y2 - y1
        if roi_w <= 0 or roi_h <= 0:
            continue
        bin_w, bin_h = roi_w / pooled[1], roi_h / pooled[0]
        for c in range(channels):
            for i in range(pooled[0]):
                for j in range(pooled[1]):
                    hs = min(max(math.floor(i * bin_h + y1), 0), height)
                    he = min(max(math.ceil((i + 1) * bin_h + y1), 0), height)
                    ws = min(max(math.floor(j * bin_w + x1), 0), width)
                    we = min(max(math.ceil((j + 1) * bin_w + x1), 0), width)
                    best = 0.0 if (he <= hs or we <= ws) else -FLT_MAX
                    arg = -1
                    for h in range(hs, he):
                        for w in range(ws, we):
                            if feat[b, c, h, w] > best:
                                best, arg = feat[b, c, h, w], h * width + w
                    out[k, c, i, j], argmax[k, c, i, j] = best, arg
    for (k, c, i, j), arg in np.ndenumerate(argmax):
        if arg != -1:
            grad_in[int(rois[k][0]), c].flat[arg] += grad[k, c, i, j]
    return out, grad_in


# ---- helpers ------------------------------------------------------------------------------

def _inputs(dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    feat = torch.randn(FEATURE_SHAPE, dtype=torch.float64).to(dtype)
    return feat, torch.tensor(ROIS, dtype=dtype)


def _run(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], feat: torch.Tensor,
         rois: torch.Tensor, grad: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    leaf = feat.clone().requires_grad_(True)
    out = fn(leaf, rois)
    out.backward(grad.to(out.dtype))
    return out.detach(), leaf.grad


# ---- RoIAlign -----------------------------------------------------------------------------

@pytest.mark.parametrize('mode', ['avg', 'max'])
@pytest.mark.parametrize('aligned', [True, False])
@pytest.mark.parametrize('sampling_ratio', [0, 2])
def test_roi_align_matches_mmcv_kernel(mode: str, aligned: bool, sampling_ratio: int) -> None:
    feat, rois = _inputs(torch.float64)
    grad = torch.randn((len(ROIS), FEATURE_SHAPE[1]) + POOLED, dtype=torch.float64)
    layer = RoIAlign(POOLED, SCALE, sampling_ratio, mode, aligned)
    out, grad_in = _run(layer, feat, rois, grad)
    ref_out, ref_grad = roi_align_reference(feat.numpy(), ROIS, POOLED, SCALE, sampling_ratio,
                                            mode, aligned, grad.numpy())
    np.testing.assert_allclose(out.numpy(), ref_out, rtol=0, atol=FP64_ATOL)
    np.testing.assert_allclose(grad_in.numpy(), ref_grad, rtol=0, atol=FP64_ATOL)


def test_roi_align_max_empty_bin_and_sentinel() -> None:
    """A bin without samples is -FLT_MAX (mmcv's CUDA kernel); a max sample exactly at y == -1
    gets no gradient, as mmcv's backward reads argmax_y == -1 as "no sample"."""
    feat = torch.randn(1, 1, 6, 6, dtype=torch.float64)
    # aligned, negative height: ceil(h / pooled) <= 0 samples per bin
    out = roi_align(feat, torch.tensor([[0, 1.0, 4.0, 3.0, 2.0]], dtype=torch.float64), 2,
                    1.0, 0, 'max', True)
    assert torch.equal(out, torch.full_like(out, -FLT_MAX))
    # one sample per bin; bin (0, 0) samples at (y, x) = (-1, 2)
    rois = torch.tensor([[0, 1.5, -1.5, 3.5, 0.5]], dtype=torch.float64)
    grad = torch.ones(1, 1, 2, 2, dtype=torch.float64)
    fn = lambda x, r: roi_align(x, r, 2, 1.0, 1, 'max', False)  # noqa: E731
    out, grad_in = _run(fn, feat, rois, grad)
    ref_out, ref_grad = roi_align_reference(feat.numpy(), rois.tolist(), (2, 2), 1.0, 1, 'max',
                                            False, grad.numpy())
    np.testing.assert_allclose(out.numpy(), ref_out, rtol=0, atol=FP64_ATOL)
    np.testing.assert_allclose(grad_in.numpy(), ref_grad, rtol=0, atol=FP64_ATOL)
    # both rows of bins sample row 0 at x = 2, 3; only the bins at y = 0 pass their gradient
    assert grad_in[0, 0, 0, 2:4].tolist() == [1.0, 1.0] and grad_in.sum() == 2.0


@pytest.mark.parametrize('mode', ['avg', 'max'])
def test_roi_align_gradcheck(mode: str) -> None:
    feat = torch.randn(2, 2, 6, 7, dtype=torch.float64, requires_grad=True)
    rois = torch.tensor([[0, 1.3, 0.6, 9.1, 8.2], [1, -2.2, 3.1, 6.4, 13.7]],
                        dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda x: roi_align(x, rois, (2, 3), SCALE, 0, mode, True), (feat,), eps=1e-6,
        atol=1e-6)


@pytest.mark.parametrize('dtype,atol', [(torch.float16, FP16_ATOL), (torch.bfloat16, BF16_ATOL)])
@pytest.mark.parametrize('mode', ['avg', 'max'])
def test_roi_align_low_precision(dtype: torch.dtype, atol: float, mode: str) -> None:
    feat, rois = _inputs(dtype)
    grad = torch.randn((len(ROIS), FEATURE_SHAPE[1]) + POOLED, dtype=torch.float64).to(dtype)
    out, grad_in = _run(RoIAlign(POOLED, SCALE, 0, mode, True), feat, rois, grad)
    assert out.dtype == grad_in.dtype == dtype
    ref_out, ref_grad = roi_align_reference(
        feat.double().numpy(), ROIS, POOLED, SCALE, 0, mode, True, grad.double().numpy(),
        store=lambda v: float(torch.tensor(v).to(dtype)))
    finite = np.abs(ref_out) < FLT_MAX  # empty max bins: -FLT_MAX, -inf in 16 bits
    np.testing.assert_allclose(out.double().numpy()[finite], ref_out[finite], rtol=0, atol=atol)
    assert np.all(out.double().numpy()[~finite] < -np.finfo(np.float16).max)
    np.testing.assert_allclose(grad_in.double().numpy(), ref_grad, rtol=0, atol=atol)


@pytest.mark.parametrize('mode', ['avg', 'max'])
def test_roi_align_no_rois(mode: str) -> None:
    feat = torch.randn(FEATURE_SHAPE, requires_grad=True)
    out = roi_align(feat, torch.zeros(0, 5), POOLED, SCALE, 0, mode, True)
    assert out.shape == (0, FEATURE_SHAPE[1]) + POOLED
    out.sum().backward()
    assert torch.equal(feat.grad, torch.zeros(FEATURE_SHAPE))


# ---- RoIPool ------------------------------------------------------------------------------

def test_roi_pool_matches_mmcv_kernel() -> None:
    feat, rois = _inputs(torch.float64)
    rois = torch.cat([rois, torch.tensor([[1, 10.0, 8.0, 4.0, 9.0]], dtype=torch.float64)])
    grad = torch.randn((len(rois), FEATURE_SHAPE[1]) + POOLED, dtype=torch.float64)
    out, grad_in = _run(RoIPool(POOLED, SCALE), feat, rois, grad)
    ref_out, ref_grad = roi_pool_reference(feat.numpy(), rois.tolist(), POOLED, SCALE,
                                           grad.numpy())
    np.testing.assert_array_equal(out.numpy(), ref_out)
    np.testing.assert_allclose(grad_in.numpy(), ref_grad, rtol=0, atol=FP64_ATOL)


def test_roi_pool_argmax_and_empty_bins() -> None:
    feat = torch.randn(1, 2, 5, 6)
    rois = torch.tensor([[0, 1.0, 1.0, 4.0, 3.0], [0, 20.0, 20.0, 30.0, 30.0]])
    out, argmax = torch.zeros(2, 2, 2, 2), torch.zeros(2, 2, 2, 2, dtype=torch.int32)
    ops.roi_pool_forward(feat, rois, out, argmax, pooled_height=2, pooled_width=2,
                         spatial_scale=1.0)
    plane = feat.view(1, 2, -1)[0]                                       # (C, H * W)
    assert torch.equal(out[0], plane.gather(1, argmax[0].long().view(2, -1)).view(2, 2, 2))
    assert torch.equal(argmax[1], torch.full_like(argmax[1], -1))      # outside: empty bins
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_roi_pool_gradcheck() -> None:
    feat = torch.randn(2, 2, 6, 7, dtype=torch.float64, requires_grad=True)
    rois = torch.tensor([[0, 1.3, 0.6, 9.1, 8.2], [1, -2.2, 3.1, 6.4, 13.7]],
                        dtype=torch.float64)
    pool = RoIPool((2, 3), SCALE)
    assert torch.autograd.gradcheck(lambda x: pool(x, rois), (feat,), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_roi_pool_low_precision(dtype: torch.dtype) -> None:
    feat, rois = _inputs(dtype)
    grad = torch.randn((len(ROIS), FEATURE_SHAPE[1]) + POOLED).to(dtype)
    out, grad_in = _run(RoIPool(POOLED, SCALE), feat, rois, grad)
    ref_out, ref_grad = roi_pool_reference(feat.double().numpy(), ROIS, POOLED, SCALE,
                                           grad.double().numpy())
    np.testing.assert_array_equal(out.double().numpy(), ref_out)  # a max picks, no rounding
    np.testing.assert_allclose(grad_in.double().numpy(), ref_grad, rtol=0,
                               atol=FP16_ATOL if dtype == torch.float16 else BF16_ATOL)


# ---- bad input ----------------------------------------------------------------------------

def _align_call(feat: torch.Tensor, rois: torch.Tensor, pool_mode: int = ops.POOL_AVG,
                output: Optional[torch.Tensor] = None) -> None:
    if output is None:
        output = feat.new_zeros((rois.size(0), feat.size(1), 2, 2))
    empty = feat.new_zeros(0)
    ops.roi_align_forward(feat, rois, output, empty, empty, aligned_height=2, aligned_width=2,
                          spatial_scale=1.0, sampling_ratio=0, pool_mode=pool_mode,
                          aligned=True)


BOX = [[0, 1.0, 1.0, 5.0, 5.0]]


@pytest.mark.parametrize('make,message', [
    (lambda: (torch.zeros(1, 2, 8, 8), torch.tensor(BOX)[:, :4]),
     'roi_align_forward: rois must have shape (*, 5) (K, 5) = (batch index, x1, y1, x2, y2), '
     'got (1, 4)'),
    (lambda: (torch.zeros(2, 8, 8), torch.tensor(BOX)),
     'roi_align_forward: input must be 4-d (N, C, H, W), got shape (2, 8, 8)'),
    (lambda: (torch.zeros(1, 2, 8, 8), torch.tensor(BOX, dtype=torch.float64)),
     'roi_align_forward: all tensors must have one dtype, got input float32, rois float64; cast '
     'them with .to(dtype)'),
    (lambda: (torch.zeros(1, 2, 8, 8, dtype=torch.int32), torch.tensor(BOX).int()),
     'roi_align_forward: input must be float16 / bfloat16 / float32 / float64, got int32'),
    (lambda: (torch.zeros(1, 2, 8, 8), torch.tensor(BOX, device='meta')),
     'roi_align_forward: all tensors must be on one device, got input on cpu, rois on meta, '
     'output on cpu; move them with .to(device)'),
    (lambda: (torch.zeros(1, 2, 8, 8), torch.tensor([[1, 1.0, 1.0, 5.0, 5.0]])),
     'roi_align_forward: rois[:, 0] (batch index) must be in [0, 1), got 1.0'),
])
def test_roi_align_bad_input(make: Callable[[], Tuple[torch.Tensor, torch.Tensor]],
                             message: str) -> None:
    feat, rois = make()
    output = torch.zeros(rois.size(0), 2, 2, 2)
    with pytest.raises(OpInputError, match=re.escape(message)):
        _align_call(feat, rois, output=output)


def test_roi_align_bad_mode_and_output() -> None:
    feat, rois = torch.zeros(1, 2, 8, 8), torch.tensor(BOX)
    with pytest.raises(OpInputError, match=re.escape(
            'roi_align_forward: pool_mode must be 0 (max) or 1 (avg), got 2')):
        _align_call(feat, rois, pool_mode=2)
    with pytest.raises(OpInputError, match=re.escape(
            'roi_align_forward: output must have shape (1, 2, 2, 2) (K, C, pooled height, '
            'pooled width), got (1, 2, 3, 2)')):
        _align_call(feat, rois, output=torch.zeros(1, 2, 3, 2))
    with pytest.raises(OpInputError, match=re.escape(
            'roi_align_forward: output must be float32, got float64')):
        _align_call(feat, rois, output=torch.zeros(1, 2, 2, 2, dtype=torch.float64))


def test_roi_pool_bad_argmax() -> None:
    feat, rois = torch.zeros(1, 2, 8, 8), torch.tensor(BOX)
    with pytest.raises(OpInputError, match=re.escape(
            'roi_pool_forward: argmax must be int32, got int64')):
        ops.roi_pool_forward(feat, rois, torch.zeros(1, 2, 2, 2),
                             torch.zeros(1, 2, 2, 2, dtype=torch.long), 2, 2, 1.0)
