"""``mmcv._ext.roi_align_forward`` / ``_backward`` and ``roi_pool_forward`` / ``_backward``.

Signatures are those of mmcv 2.1's ``pybind.cpp``; results are written into the tensors passed in
(``output``, ``argmax*``, ``grad_input``) as mmcv's kernels do.

* RoIAlign, average mode (``pool_mode=1``, what mmdet uses): torchvision's ``roi_align`` /
  ``_roi_align_backward`` kernels. They are mmcv's kernels line for line (both come from
  detectron2 / Caffe2; checked against ``pytorch/cpu/roi_align.cpp`` and
  ``common/cuda/roi_align_cuda_kernel.cuh``): box ``* spatial_scale - 0.5`` when ``aligned``,
  no rounding, size at least 1 when not ``aligned``, ``ceil(roi / pooled)`` samples per bin
  when ``sampling_ratio <= 0``, the same sample positions, ``count = max(grid, 1)`` and the same
  bilinear border rules (a sample outside ``[-1, size]`` is 0, coordinates clamped to ``[0,
  size - 1]``). torchvision has kernels for float16 / float32 / float64 on CPU and CUDA;
  bfloat16 (which no kernel of torchvision or mmcv has) is computed in float32.
* RoIAlign, max mode (``pool_mode=0``): torchvision has none; vectorised PyTorch with the
  semantics of mmcv's CUDA kernel (see :func:`roi_align_forward`).
* RoIPool: torchvision's ``roi_pool`` rounds the box, mmcv's does not (``x2 + 1`` times the
  scale, ``floor`` / ``ceil`` bin edges, ``common/cuda/roi_pool_cuda_kernel.cuh``; mmcv has no
  CPU kernel): vectorised PyTorch with mmcv's semantics (see :func:`roi_pool_forward`).

The PyTorch paths evaluate box geometry and bilinear weights in float32 for float16 / bfloat16
(mmcv's kernels compute in the storage type), and loop over the samples of a bin in chunks
(:data:`CHUNK_ELEMENTS`), so their memory stays bounded. The largest number of samples per bin
decides the loop length: one device-to-host read per call where it depends on the boxes
(``sampling_ratio <= 0`` in max mode, every RoIPool call).
"""
from typing import List, NamedTuple, Tuple

import torch
import torchvision  # noqa: F401  (registers torch.ops.torchvision)

from .checks import OpInputError, check_same_device, check_same_dtype, check_tensor

#: mmcv's ``pool_mode`` values (``RoIAlignFunction``: 'max' -> 0, 'avg' -> 1).
POOL_MAX, POOL_AVG = 0, 1
#: Columns of ``rois``: batch index, x1, y1, x2, y2.
ROI_COLUMNS = 5
#: Initial maximum of a bin in mmcv's CUDA kernels (``-FLT_MAX``; -inf once stored in float16 /
#: bfloat16, as in mmcv's half kernels). mmcv's CPU RoIAlign kernel starts at -10000 instead.
MAX_INIT = float(torch.finfo(torch.float32).min)
#: ``argmax_y`` / ``argmax_x`` of a RoIAlign bin without a sample, and mmcv's backward test.
NO_SAMPLE = -1.0
#: ``argmax`` of an empty RoIPool bin (no gradient flows from it).
NO_INDEX = -1
#: Value of an empty RoIPool bin.
EMPTY_BIN = 0.0
#: Dtypes of torchvision's roi_align kernels, on CPU and CUDA alike.
TORCHVISION_ROI_ALIGN_DTYPES = (torch.float16, torch.float32, torch.float64)
#: Dtypes the PyTorch paths compute geometry and weights in (others: float32).
FULL_PRECISION = (torch.float32, torch.float64)
#: Elements of one chunk of candidates (rois x bins x channels x samples) in the max loops.
CHUNK_ELEMENTS = 1 << 22
#: What ``rois`` holds, for messages.
ROIS_LAYOUT = '(K, 5) = (batch index, x1, y1, x2, y2)'


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in FULL_PRECISION else torch.float32


def _check_common(op: str, feature_name: str, feature: torch.Tensor, rois: torch.Tensor,
                  **others: torch.Tensor) -> None:
    """Device, dtype and layout of a feature map (or its gradient) and its ``rois``."""
    check_tensor(op, feature_name, feature, ndim=4, what='(N, C, H, W)')
    check_tensor(op, 'rois', rois, shape=(None, ROI_COLUMNS), what=ROIS_LAYOUT)
    check_same_device(op, **{feature_name: feature, 'rois': rois}, **others)
    check_same_dtype(op, **{feature_name: feature, 'rois': rois})


def _check_pooled(op: str, name: str, tensor: torch.Tensor, like: torch.Tensor,
                  shape: Tuple[int, int, int, int]) -> None:
    check_tensor(op, name, tensor, shape=shape, dtypes=(like.dtype,),
                 what='(K, C, pooled height, pooled width)')


def _check_batch_index(op: str, rois: torch.Tensor, batch: int) -> None:
    """Batch indices in ``[0, batch)``; checked on the CPU only, where it costs no device sync
    (mmcv reads out of bounds; here an out-of-range index fails in indexing on CUDA)."""
    if rois.device.type != 'cpu' or rois.size(0) == 0:
        return
    index = rois[:, 0].long()  # C's (int) cast: truncation
    bad = (index < 0) | (index >= batch)
    if bool(bad.any()):
        raise OpInputError(f'{op}: rois[:, 0] (batch index) must be in [0, {batch}), got '
                           f'{rois[bad, 0][0].item()!r}')


class _AlignGrid(NamedTuple):
    """Per-RoI sampling grid of mmcv's RoIAlign, all (K,)."""
    batch: torch.Tensor
    start_y: torch.Tensor
    start_x: torch.Tensor
    bin_h: torch.Tensor
    bin_w: torch.Tensor
    grid_h: torch.Tensor
    grid_w: torch.Tensor


def _align_grid(rois: torch.Tensor, pooled: Tuple[int, int], spatial_scale: float,
                sampling_ratio: int, aligned: bool, dtype: torch.dtype) -> _AlignGrid:
    boxes = rois[:, 1:].to(dtype) * spatial_scale - (0.5 if aligned else 0.0)  # (K, 4)
    size_w, size_h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    if not aligned:  # mmcv: malformed RoIs forced to 1 x 1 (backward compatibility)
        size_w, size_h = size_w.clamp(min=1.0), size_h.clamp(min=1.0)
    if sampling_ratio > 0:
        grid_h = grid_w = torch.full_like(size_h, sampling_ratio, dtype=torch.long)
    else:  # ceil(roi / pooled); <= 0 for a negative aligned box: no sample
        grid_h = torch.ceil(size_h / pooled[0]).long().clamp(min=0)
        grid_w = torch.ceil(size_w / pooled[1]).long().clamp(min=0)
    return _AlignGrid(rois[:, 0].long(), boxes[:, 1], boxes[:, 0], size_h / pooled[0],
                      size_w / pooled[1], grid_h, grid_w)


def _axis(coord: torch.Tensor, size: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                    torch.Tensor]:
    """mmcv's bilinear rules along one axis: (low, high, fraction, inside).

    Outside ``[-1, size]`` the sample is empty (``inside`` False); below 0 it is clamped to 0;
    from ``size - 1`` on both neighbours are the last pixel.
    """
    inside = (coord >= -1.0) & (coord <= size)
    coord = torch.where(inside, coord, 0.0).clamp(min=0.0)
    low = coord.floor()
    top = low >= size - 1
    low = torch.where(top, float(size - 1), low)
    frac = torch.where(top, 0.0, coord - low)
    high = torch.where(top, low, low + 1.0)
    return low.long(), high.long(), frac, inside


def _chunks(total: int, per_sample: int) -> List[Tuple[int, int]]:
    step = max(1, CHUNK_ELEMENTS // max(per_sample, 1))
    return [(s, min(s + step, total)) for s in range(0, total, step)]


def _merge_max(best: torch.Tensor, best_aux: List[torch.Tensor], values: torch.Tensor,
               aux: List[torch.Tensor]) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Fold a chunk of candidates into the running maximum of each bin.

    ``values``: (..., S, C), the S samples in mmcv's loop order, excluded ones at -inf;
    ``best``: (..., C). The first maximal sample of the chunk replacing ``best`` only when
    strictly greater is mmcv's sequential ``if (val > maxval)`` scan (NaN never wins there, so
    callers pass NaN as -inf). ``aux`` (broadcastable to ``values``) follow the winner.
    """
    # argmax: the first maximum (and far faster than max(dim) on the CPU)
    position = values.argmax(dim=-2, keepdim=True)                       # (..., 1, C)
    chunk_best = values.gather(-2, position).squeeze(-2)                 # (..., C)
    better = chunk_best > best
    picked = [a.expand_as(values).gather(-2, position).squeeze(-2) for a in aux]
    return (torch.where(better, chunk_best, best),
            [torch.where(better, p, b) for p, b in zip(picked, best_aux)])


def _roi_align_max(input: torch.Tensor, rois: torch.Tensor, pooled: Tuple[int, int],
                   spatial_scale: float, sampling_ratio: int, aligned: bool
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, argmax_y, argmax_x), each (K, C, PH, PW), in the compute dtype."""
    dtype = _opmath(input.dtype)
    n_rois, channels, (height, width) = rois.size(0), input.size(1), input.shape[2:]
    grid = _align_grid(rois, pooled, spatial_scale, sampling_ratio, aligned, dtype)
    if sampling_ratio > 0:
        most_h = most_w = sampling_ratio
    else:  # one device-to-host read: the loop length
        most_h, most_w = (int(v) for v in torch.stack([grid.grid_h.max(), grid.grid_w.max()]))
    shape = (n_rois, pooled[0], pooled[1], channels)
    best = torch.full(shape, MAX_INIT, dtype=dtype, device=input.device)
    best_y = torch.full(shape, NO_SAMPLE, dtype=dtype, device=input.device)
    best_x = torch.full_like(best_y, NO_SAMPLE)
    dev = input.device
    ph = torch.arange(pooled[0], device=dev, dtype=dtype)[None, :, None]  # (1, PH, 1)
    pw = torch.arange(pooled[1], device=dev, dtype=dtype)[None, :, None]  # (1, PW, 1)
    batch = grid.batch[:, None, None, None]                                # (K, 1, 1, 1)
    pixels = input.permute(0, 2, 3, 1).contiguous()  # (N, H, W, C): a gather reads C in a row
    for first, last in _chunks(most_h * most_w, n_rois * pooled[0] * pooled[1] * channels):
        sample = torch.arange(first, last, device=dev)
        iy, ix = (sample // most_w)[None, None, :], (sample % most_w)[None, None, :]  # (1, 1, S)
        gh, gw = grid.grid_h[:, None, None], grid.grid_w[:, None, None]             # (K, 1, 1)
        # mmcv: start + p * bin + (i + .5) * bin / grid, in this order
        y = (grid.start_y[:, None, None] + ph * grid.bin_h[:, None, None]
             + (iy + 0.5) * grid.bin_h[:, None, None] / gh.clamp(min=1))          # (K, PH, S)
        x = (grid.start_x[:, None, None] + pw * grid.bin_w[:, None, None]
             + (ix + 0.5) * grid.bin_w[:, None, None] / gw.clamp(min=1))          # (K, PW, S)
        y0, y1, ly, in_y = _axis(y, height)
        x0, x1, lx, in_x = _axis(x, width)
        y0, y1, ly, in_y = y0[:, :, None], y1[:, :, None], ly[:, :, None], in_y[:, :, None]
        x0, x1, lx, in_x = x0[:, None], x1[:, None], lx[:, None], in_x[:, None]  # (K, 1, PW, S)
        values = torch.zeros((), dtype=dtype, device=dev)
        for yy, xx, w in ((y0, x0, (1 - ly) * (1 - lx)), (y0, x1, (1 - ly) * lx),
                          (y1, x0, ly * (1 - lx)), (y1, x1, ly * lx)):
            # pixels[b, yy, xx]: (K, PH, PW, S, C)
            values = values + w[..., None] * pixels[batch, yy, xx].to(dtype)
        values = torch.where((in_y & in_x)[..., None], values, 0.0)  # empty sample: 0, a candidate
        in_grid = ((iy < gh) & (ix < gw))[:, :, None, :, None]      # (K, 1, 1, S, 1)
        values = torch.where(in_grid & ~values.isnan(), values, float('-inf'))
        best, (best_y, best_x) = _merge_max(best, [best_y, best_x], values,
                                            [y[:, :, None, :, None], x[:, None, :, :, None]])
    # (K, PH, PW, C) -> (K, C, PH, PW)
    return best.permute(0, 3, 1, 2), best_y.permute(0, 3, 1, 2), best_x.permute(0, 3, 1, 2)


def _scatter_bilinear(grad_input: torch.Tensor, batch: torch.Tensor, y: torch.Tensor,
                      x: torch.Tensor, grad: torch.Tensor, keep: torch.Tensor) -> None:
    """Add ``grad`` (K, C, PH, PW) at the points (y, x) of the planes ``batch`` (K,) into
    ``grad_input`` (N, C, H, W), with mmcv's ``bilinear_interpolate_gradient`` weights."""
    n, channels, height, width = grad_input.shape
    dtype = _opmath(grad_input.dtype)
    y0, y1, ly, in_y = _axis(y.to(dtype), height)
    x0, x1, lx, in_x = _axis(x.to(dtype), width)
    grad = torch.where(keep & in_y & in_x, grad.to(dtype), 0.0)
    plane = batch[:, None, None, None] * channels + torch.arange(
        channels, device=batch.device)[None, :, None, None]               # (K, C, 1, 1)
    base = plane * (height * width)
    total = torch.zeros(n * channels * height * width, dtype=dtype, device=grad_input.device)
    for yy, xx, w in ((y0, x0, (1 - ly) * (1 - lx)), (y0, x1, (1 - ly) * lx),
                      (y1, x0, ly * (1 - lx)), (y1, x1, ly * lx)):
        total.index_add_(0, (base + yy * width + xx).reshape(-1), (grad * w).reshape(-1))
    grad_input.add_(total.view(grad_input.shape).to(grad_input.dtype))


def _check_align_args(op: str, pool_mode: int, pooled: Tuple[int, int]) -> None:
    if pool_mode not in (POOL_MAX, POOL_AVG):
        raise OpInputError(f'{op}: pool_mode must be {POOL_MAX} (max) or {POOL_AVG} (avg), got '
                           f'{pool_mode!r}')
    if min(pooled) < 1:
        raise OpInputError(f'{op}: aligned_height and aligned_width must be >= 1, got '
                           f'{pooled[0]} x {pooled[1]}')


def roi_align_forward(input: torch.Tensor, rois: torch.Tensor, output: torch.Tensor,
                      argmax_y: torch.Tensor, argmax_x: torch.Tensor, aligned_height: int,
                      aligned_width: int, spatial_scale: float, sampling_ratio: int,
                      pool_mode: int, aligned: bool) -> None:
    """mmcv's RoIAlign into ``output`` (K, C, aligned_height, aligned_width).

    Average mode: torchvision's kernel (mmcv's semantics, see the module docstring); the
    ``argmax`` tensors are not touched (mmcv passes empty ones). Max mode, as mmcv's CUDA
    kernel: the bilinear samples of a bin (samples outside the map count as 0) are scanned in
    row order and the first strictly greatest wins; a bin's maximum starts at -FLT_MAX and
    its ``argmax_y`` / ``argmax_x`` (the sample's coordinates, which the backward interpolates
    at) at -1, which a bin without samples keeps. mmcv's CPU kernel starts at -10000 instead;
    its ``aligned`` RoIs of negative size fail an assertion there and sample nothing on CUDA
    (here: as on CUDA).
    """
    op = 'roi_align_forward'
    _check_common(op, 'input', input, rois, output=output)
    pooled = (int(aligned_height), int(aligned_width))
    _check_align_args(op, pool_mode, pooled)
    out_shape = (rois.size(0), input.size(1), pooled[0], pooled[1])
    _check_pooled(op, 'output', output, input, out_shape)
    _check_batch_index(op, rois, input.size(0))
    if pool_mode == POOL_AVG:
        dtype = input.dtype if input.dtype in TORCHVISION_ROI_ALIGN_DTYPES else torch.float32
        output.copy_(torch.ops.torchvision.roi_align(
            input.to(dtype), rois.to(dtype), float(spatial_scale), pooled[0], pooled[1],
            int(sampling_ratio), bool(aligned)))
        return
    _check_pooled(op, 'argmax_y', argmax_y, input, out_shape)
    _check_pooled(op, 'argmax_x', argmax_x, input, out_shape)
    check_same_device(op, input=input, argmax_y=argmax_y, argmax_x=argmax_x)
    if rois.size(0) == 0:
        return
    best, best_y, best_x = _roi_align_max(input, rois, pooled, float(spatial_scale),
                                          int(sampling_ratio), bool(aligned))
    output.copy_(best)
    argmax_y.copy_(best_y)
    argmax_x.copy_(best_x)


def roi_align_backward(grad_output: torch.Tensor, rois: torch.Tensor, argmax_y: torch.Tensor,
                       argmax_x: torch.Tensor, grad_input: torch.Tensor, aligned_height: int,
                       aligned_width: int, spatial_scale: float, sampling_ratio: int,
                       pool_mode: int, aligned: bool) -> None:
    """Add the gradient of mmcv's RoIAlign into ``grad_input`` (N, C, H, W).

    Average mode: torchvision's backward kernel (each sample's bilinear weights / count). Max
    mode, as mmcv: each bin's gradient goes to the four pixels around its ``argmax_y`` /
    ``argmax_x``, none where ``argmax_y`` is -1 or the point is outside the map.
    """
    op = 'roi_align_backward'
    _check_common(op, 'grad_input', grad_input, rois, grad_output=grad_output)
    pooled = (int(aligned_height), int(aligned_width))
    _check_align_args(op, pool_mode, pooled)
    n, channels, height, width = grad_input.shape
    out_shape = (rois.size(0), channels, pooled[0], pooled[1])
    _check_pooled(op, 'grad_output', grad_output, grad_input, out_shape)
    _check_batch_index(op, rois, n)
    if pool_mode == POOL_AVG:
        dtype = (grad_output.dtype if grad_output.dtype in TORCHVISION_ROI_ALIGN_DTYPES
                 else torch.float32)
        grad_input.add_(torch.ops.torchvision._roi_align_backward(
            grad_output.to(dtype), rois.to(dtype), float(spatial_scale), pooled[0], pooled[1],
            n, channels, height, width, int(sampling_ratio), bool(aligned)))
        return
    _check_pooled(op, 'argmax_y', argmax_y, grad_input, out_shape)
    _check_pooled(op, 'argmax_x', argmax_x, grad_input, out_shape)
    check_same_device(op, grad_input=grad_input, argmax_y=argmax_y, argmax_x=argmax_x)
    if rois.size(0) == 0:
        return
    _scatter_bilinear(grad_input, rois[:, 0].long(), argmax_y, argmax_x, grad_output,
                      argmax_y != NO_SAMPLE)


class _PoolBins(NamedTuple):
    """mmcv's RoIPool bins: edges (K, PH) / (K, PW), clipped to the map, and valid RoIs (K,)."""
    y1: torch.Tensor
    y2: torch.Tensor
    x1: torch.Tensor
    x2: torch.Tensor
    valid: torch.Tensor


def _pool_bins(rois: torch.Tensor, pooled: Tuple[int, int], spatial_scale: float, height: int,
               width: int) -> _PoolBins:
    # in the dtype's precision (float32 for 16-bit); mmcv's floorf / ceilf take a float
    dtype = _opmath(rois.dtype)
    boxes = rois[:, 1:].to(dtype)                                          # (K, 4)
    x1, y1 = boxes[:, 0] * spatial_scale, boxes[:, 1] * spatial_scale
    x2, y2 = (boxes[:, 2] + 1) * spatial_scale, (boxes[:, 3] + 1) * spatial_scale
    roi_w, roi_h = x2 - x1, y2 - y1
    valid = (roi_w > 0) & (roi_h > 0)  # mmcv skips (leaves untouched) other RoIs

    def edges(start: torch.Tensor, size: torch.Tensor, bins: int, limit: int
              ) -> Tuple[torch.Tensor, torch.Tensor]:
        step = (size / bins)[:, None]                                       # (K, 1)
        p = torch.arange(bins, device=rois.device, dtype=dtype)[None]       # (1, P)
        low = torch.floor(p * step + start[:, None]).clamp(0, limit).long()
        high = torch.ceil((p + 1) * step + start[:, None]).clamp(0, limit).long()
        return low, high

    by1, by2 = edges(y1, roi_h, pooled[0], height)
    bx1, bx2 = edges(x1, roi_w, pooled[1], width)
    return _PoolBins(by1, by2, bx1, bx2, valid)


def roi_pool_forward(input: torch.Tensor, rois: torch.Tensor, output: torch.Tensor,
                     argmax: torch.Tensor, pooled_height: int, pooled_width: int,
                     spatial_scale: float) -> None:
    """mmcv's RoIPool into ``output`` (K, C, PH, PW) and ``argmax`` (int32, flat ``h * W + w``).

    As mmcv's CUDA kernel: the box is ``x1 * scale .. (x2 + 1) * scale`` without rounding, bin
    ``i`` spans ``floor(i * bin + x1) .. ceil((i + 1) * bin + x1)`` clipped to the map; the
    first strictly greatest pixel (row order) wins over a start of -FLT_MAX; an empty bin is
    0 with argmax -1. RoIs of non-positive size are skipped, their ``output`` / ``argmax`` left
    as passed (mmcv's wrapper passes zeros, so their gradient lands on pixel 0, as in mmcv).
    """
    op = 'roi_pool_forward'
    _check_common(op, 'input', input, rois, output=output, argmax=argmax)
    pooled = (int(pooled_height), int(pooled_width))
    if min(pooled) < 1:
        raise OpInputError(f'{op}: pooled_height and pooled_width must be >= 1, got '
                           f'{pooled[0]} x {pooled[1]}')
    n_rois, channels, height, width = rois.size(0), *input.shape[1:]
    out_shape = (n_rois, channels, pooled[0], pooled[1])
    _check_pooled(op, 'output', output, input, out_shape)
    check_tensor(op, 'argmax', argmax, shape=out_shape, dtypes=(torch.int32,),
                 what='(K, C, pooled height, pooled width)')
    _check_batch_index(op, rois, input.size(0))
    if n_rois == 0:
        return
    bins = _pool_bins(rois, pooled, float(spatial_scale), height, width)
    empty = (bins.y2 <= bins.y1)[:, :, None] | (bins.x2 <= bins.x1)[:, None, :]  # (K, PH, PW)
    best = torch.where(empty, EMPTY_BIN, MAX_INIT)[..., None].to(input.dtype).expand(
        n_rois, pooled[0], pooled[1], channels)                           # (K, PH, PW, C)
    best_index = torch.full(best.shape, NO_INDEX, dtype=torch.long, device=input.device)
    # one device-to-host read: the largest bin, the loop length
    most_h, most_w = (int(v) for v in torch.stack([(bins.y2 - bins.y1).max(),
                                                   (bins.x2 - bins.x1).max()]).clamp(min=0))
    batch = rois[:, 0].long()[:, None, None, None]                       # (K, 1, 1, 1)
    pixels = input.permute(0, 2, 3, 1).contiguous()                      # (N, H, W, C)
    for first, last in _chunks(most_h * most_w, n_rois * pooled[0] * pooled[1] * channels):
        sample = torch.arange(first, last, device=input.device)
        h = bins.y1[:, :, None] + sample // most_w                       # (K, PH, S)
        w = bins.x1[:, :, None] + sample % most_w                        # (K, PW, S)
        inside = ((h < bins.y2[:, :, None])[:, :, None] & (w < bins.x2[:, :, None])[:, None])
        h, w = h.clamp(max=height - 1)[:, :, None], w.clamp(max=width - 1)[:, None]
        values = pixels[batch, h, w]                                      # (K, PH, PW, S, C)
        values = torch.where(inside[..., None] & ~values.isnan(), values, float('-inf'))
        best, (best_index,) = _merge_max(best, [best_index], values, [(h * width + w)[..., None]])
    keep = bins.valid[:, None, None, None]
    output.copy_(torch.where(keep, best.permute(0, 3, 1, 2), output))
    argmax.copy_(torch.where(keep, best_index.permute(0, 3, 1, 2).int(), argmax))


def roi_pool_backward(grad_output: torch.Tensor, rois: torch.Tensor, argmax: torch.Tensor,
                      grad_input: torch.Tensor, pooled_height: int, pooled_width: int,
                      spatial_scale: float) -> None:
    """Add each bin's gradient to its ``argmax`` pixel of ``grad_input`` (none for -1), as
    mmcv's kernel (``pooled_*`` and ``spatial_scale`` are not needed, as there)."""
    op = 'roi_pool_backward'
    _check_common(op, 'grad_input', grad_input, rois, grad_output=grad_output, argmax=argmax)
    n, channels, height, width = grad_input.shape
    out_shape = (rois.size(0), channels, int(pooled_height), int(pooled_width))
    _check_pooled(op, 'grad_output', grad_output, grad_input, out_shape)
    check_tensor(op, 'argmax', argmax, shape=out_shape, dtypes=(torch.int32,),
                 what='(K, C, pooled height, pooled width)')
    _check_batch_index(op, rois, n)
    if rois.size(0) == 0:
        return
    dtype = _opmath(grad_input.dtype)
    plane = rois[:, 0].long()[:, None, None, None] * channels + torch.arange(
        channels, device=rois.device)[None, :, None, None]               # (K, C, 1, 1)
    hit = argmax != NO_INDEX
    index = plane * (height * width) + argmax.long().clamp(min=0)        # (K, C, PH, PW)
    total = torch.zeros(n * channels * height * width, dtype=dtype, device=grad_input.device)
    total.index_add_(0, index.reshape(-1), torch.where(hit, grad_output.to(dtype), 0.0).reshape(-1))
    grad_input.add_(total.view(grad_input.shape).to(grad_input.dtype))
