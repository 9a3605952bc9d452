"""``mmcv._ext.ms_deform_attn_forward`` / ``_backward``: multi-scale deformable attention.

Reproduces ``common/cuda/ms_deform_attn_cuda_kernel.cuh`` of mmcv 2.1.0 (Deformable DETR), as
``mmcv.ops.multi_scale_deform_attn.MultiScaleDeformableAttnFunction`` calls it: for each batch
``b``, query ``q``, head ``h``, level ``l`` and point ``p``, the value of level ``l`` (keys
``level_start_index[l]`` onward, an ``H_l x W_l`` map, row-major) is sampled bilinearly at pixel
``(x, y) = (loc_x W_l - 0.5, loc_y H_l - 0.5)`` (``align_corners=False``), with zeros outside
the map: a point contributes only when ``-1 < x < W_l`` and ``-1 < y < H_l``, and each of its
four corners only when it lies on the map. The output is the attention-weighted sum over levels
and points. The backward is the kernel's analytic one: ``grad_value`` accumulates (the kernel's
``atomicAdd``) the weighted ``grad_output`` at each corner, ``grad_attn_weight`` is
``grad_output . sample``, ``grad_sampling_loc`` is ``W_l`` (x) / ``H_l`` (y) times the
attention weight times the derivative of the bilinear weights; points outside get 0.

Implementation: a gather, not ``F.grid_sample``. The four corners of every point of every level
are row indices into the flattened value, computed on the device from ``spatial_shapes`` and
``level_start_index`` (no host synchronisation, no Python loop over levels, the levels located
by ``level_start_index`` exactly as the kernel does); each corner is one ``index_select`` and one
batched matrix product with the attention-times-bilinear weights, the backward one more product
and one ``index_add_`` (deterministic under ``torch.use_deterministic_algorithms``, unlike
``grid_sample``'s backward on CUDA). Corners off the map index an extra zero row, so they read
exactly 0 as in the kernel. ``im2col_step`` (the kernel's batch chunk) does not change the
result and is only validated. Memory: one corner at a time, (S, head_dim) gathered values
(``S = bs*nq*heads*levels*points``), in the backward also an (S, head_dim) compute-dtype
product for ``index_add_``. Level ranges past ``num_keys`` (where mmcv's kernel reads another
batch element's keys or out of bounds) raise on CPU and trip a device-side assert elsewhere
(checked without a host synchronisation).

Precision: float16 / bfloat16 values are gathered in their dtype and multiplied with float32
results (cuBLAS ``out_dtype`` on CUDA, upcast operands elsewhere); pixel coordinates, bilinear
weights, the sums over corners and the ``grad_value`` accumulation are float32 (mmcv's kernel
does all of it in half, ``atomicAdd`` included, and has no bfloat16); float32 / float64 are
computed in their own dtype, with autocast off (mmcv's kernel ignores autocast).
"""
import contextlib
import numbers
from typing import ContextManager, Iterator, NamedTuple, Tuple

import torch

from .checks import INDEX, OpInputError, check_same_device, check_same_dtype, check_tensor

#: dtypes whose coordinates, weights and accumulations are computed in float32.
LOW_PRECISION: Tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
#: pixel centre offset of the ``align_corners=False`` convention: ``x = loc * W - 0.5``.
PIXEL_CENTER = 0.5
#: the four bilinear corners as (dy, dx) offsets from the top-left one, in the kernel's order.
CORNERS: Tuple[Tuple[int, int], ...] = ((0, 0), (0, 1), (1, 0), (1, 1))

_FORWARD = 'ms_deform_attn_forward'
_BACKWARD = 'ms_deform_attn_backward'
_VALUE = '(bs, num_keys, num_heads, head_dim)'
_LOC = '(bs, num_queries, num_heads, num_levels, num_points, 2) = (x, y) in [0, 1]'
_ATTN = '(bs, num_queries, num_heads, num_levels, num_points)'


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in LOW_PRECISION else dtype


class _Corner(NamedTuple):
    """One bilinear corner (``dy``, ``dx``) of every sampling point; the weights are (bs, nq,
    heads, levels, points) in the compute dtype, 0 where the corner is off the map or the point
    outside it (the kernel's tests), so that ``weight_y * weight_x`` is the corner's weight."""
    dy: int
    dx: int
    rows: torch.Tensor        # (S,) = (bs*nq*heads*levels*points,) rows of the value + zero row
    weight_y: torch.Tensor    # 1 - frac(y) (dy = 0) or frac(y) (dy = 1), 0 off the map
    weight_x: torch.Tensor    # 1 - frac(x) (dx = 0) or frac(x) (dx = 1), 0 off the map
    on_y: torch.Tensor        # bool: the corner's row is on the map
    on_x: torch.Tensor        # bool: its column is on the map and the point inside it


class _Sampling(NamedTuple):
    width: torch.Tensor       # (1, 1, 1, levels, 1) W_l in the compute dtype
    height: torch.Tensor      # (1, 1, 1, levels, 1) H_l
    corners: Iterator[_Corner]


def _check(op: str, value: torch.Tensor, spatial_shapes: torch.Tensor,
           level_start_index: torch.Tensor, sampling_loc: torch.Tensor,
           attn_weight: torch.Tensor, im2col_step: object) -> None:
    check_tensor(op, 'value', value, ndim=4, what=_VALUE)
    bs, _, heads, _ = value.shape
    check_tensor(op, 'spatial_shapes', spatial_shapes, shape=(None, 2), dtypes=INDEX,
                 what='(num_levels, 2) = (H, W) per level')
    levels = spatial_shapes.shape[0]
    check_tensor(op, 'level_start_index', level_start_index, shape=(levels,), dtypes=INDEX,
                 what='(num_levels,) = first key of each level')
    check_tensor(op, 'sampling_loc', sampling_loc, shape=(bs, None, heads, levels, None, 2),
                 what=_LOC)
    queries, points = sampling_loc.shape[1], sampling_loc.shape[4]
    check_tensor(op, 'attn_weight', attn_weight, shape=(bs, queries, heads, levels, points),
                 what=_ATTN)
    if (isinstance(im2col_step, bool) or not isinstance(im2col_step, numbers.Integral)
            or im2col_step < 1):
        raise OpInputError(f'{op}: im2col_step must be a positive int, got {im2col_step!r}')


def _check_levels(op: str, value: torch.Tensor, spatial_shapes: torch.Tensor,
                  level_start_index: torch.Tensor) -> None:
    """Every level within the value's keys. On CPU an :class:`OpInputError`; elsewhere a
    device-side assert (``torch._assert_async``: no host synchronisation), as an unchecked
    level would read another batch element's keys (mmcv's kernel does) or fail in
    ``index_select`` with a less telling message."""
    num_keys = value.shape[1]
    ends = level_start_index + spatial_shapes[:, 0] * spatial_shapes[:, 1]
    fits = (level_start_index >= 0).all() & (spatial_shapes >= 0).all() & (ends <= num_keys).all()
    message = (f'{op}: every level must lie within the {num_keys} keys of value: '
               f'0 <= level_start_index[l] and level_start_index[l] + H_l * W_l <= {num_keys}')
    if value.device.type == 'cpu':
        if not bool(fits):
            raise OpInputError(message)
    else:
        torch._assert_async(fits, message)


def _sampling(value: torch.Tensor, spatial_shapes: torch.Tensor,
              level_start_index: torch.Tensor, sampling_loc: torch.Tensor) -> _Sampling:
    """Pixel geometry of every sampling point; the corners are produced one at a time (a
    generator) so that only one corner's rows and gathered values are alive at once."""
    bs, num_keys, heads, _ = value.shape
    levels = spatial_shapes.shape[0]
    dtype = _compute_dtype(value.dtype)
    level_view = (1, 1, 1, levels, 1)
    zero = torch.zeros((), dtype=dtype, device=value.device)
    shapes = spatial_shapes.to(dtype)                               # (levels, 2) = (H, W)
    height, width = shapes[:, 0].view(level_view), shapes[:, 1].view(level_view)
    loc = sampling_loc.to(dtype)                                    # (bs, nq, heads, L, P, 2)
    x = loc[..., 0] * width - PIXEL_CENTER                          # (bs, nq, heads, L, P)
    y = loc[..., 1] * height - PIXEL_CENTER
    inside = (x > -1) & (y > -1) & (x < width) & (y < height)       # the kernel's point test
    # top-left corner, in [-1, W-1] x [-1, H-1] inside (0 outside: finite, never read)
    x0, y0 = torch.where(inside, x.floor(), zero), torch.where(inside, y.floor(), zero)
    frac_x, frac_y = torch.where(inside, x - x0, zero), torch.where(inside, y - y0, zero)
    # (dx = 0, dx = 1): is the column x0 + dx on the map (and the point inside)
    col_on = (inside & (x0 >= 0), inside & (x0 < width - 1))
    row_on = (y0 >= 0, y0 < height - 1)
    weight_x = (torch.where(col_on[0], 1 - frac_x, zero), torch.where(col_on[1], frac_x, zero))
    weight_y = (torch.where(row_on[0], 1 - frac_y, zero), torch.where(row_on[1], frac_y, zero))
    # rows of the flattened (bs, keys, heads) value: ((b*keys + start_l + y*W + x)*heads + h)
    long_w = spatial_shapes[:, 1].view(level_view)                  # (1, 1, 1, L, 1) int64
    batch = torch.arange(bs, device=value.device).view(bs, 1, 1, 1, 1)
    head = torch.arange(heads, device=value.device).view(1, 1, heads, 1, 1)
    first_row = (batch * num_keys + level_start_index.view(level_view)) * heads + head
    top_left = first_row + (y0.long() * long_w + x0.long()) * heads  # (bs, nq, heads, L, P)
    zero_row = bs * num_keys * heads                                # the appended zero row

    def corners() -> Iterator[_Corner]:
        for dy, dx in CORNERS:
            on_map = row_on[dy] & col_on[dx]
            rows = torch.where(on_map, top_left + (dy * long_w + dx) * heads, zero_row)
            yield _Corner(dy=dy, dx=dx, rows=rows.reshape(-1), weight_y=weight_y[dy],
                          weight_x=weight_x[dx], on_y=row_on[dy], on_x=col_on[dx])

    return _Sampling(width=width, height=height, corners=corners())


def _bmm(left: torch.Tensor, right: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Batched ``left @ right`` with the result in ``dtype`` (the compute dtype). float16 /
    bfloat16 operands: on CUDA cuBLAS's float32 output (``out_dtype``: the products accumulate
    in float32 and are not rounded to the low dtype), elsewhere the operands upcast."""
    if left.dtype == dtype:
        return torch.bmm(left, right)
    if left.device.type == 'cuda':
        return torch.bmm(left, right, out_dtype=dtype)
    return torch.bmm(left.to(dtype), right.to(dtype))


def _without_autocast(device: torch.device) -> ContextManager[object]:
    """Autocast off: mmcv's kernel computes in the dtype it is given, and ``torch.bmm`` would
    otherwise run a float32 call in float16 / bfloat16 under ``torch.autocast``."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _value_rows(value: torch.Tensor) -> torch.Tensor:
    """(bs*keys*heads + 1, head_dim): the value flattened by (batch, key, head), then a zero row
    that every off-map corner reads."""
    head_dim = value.shape[3]
    flat = value.reshape(-1, head_dim)                              # (bs*keys*heads, head_dim)
    return torch.cat([flat, flat.new_zeros(1, head_dim)])


def ms_deform_attn_forward(value: torch.Tensor, value_spatial_shapes: torch.Tensor,
                           value_level_start_index: torch.Tensor,
                           sampling_locations: torch.Tensor, attention_weights: torch.Tensor,
                           im2col_step: int) -> torch.Tensor:
    """mmcv's multi-scale deformable attention: (bs, num_queries, num_heads * head_dim) from
    ``value`` (bs, num_keys, num_heads, head_dim), ``value_spatial_shapes`` (levels, 2) = (H, W),
    ``value_level_start_index`` (levels,), ``sampling_locations`` (bs, nq, heads, levels,
    points, 2) = (x, y) normalised and ``attention_weights`` (bs, nq, heads, levels, points)."""
    _check(_FORWARD, value, value_spatial_shapes, value_level_start_index, sampling_locations,
           attention_weights, im2col_step)
    check_same_device(_FORWARD, value=value, value_spatial_shapes=value_spatial_shapes,
                      value_level_start_index=value_level_start_index,
                      sampling_locations=sampling_locations,
                      attention_weights=attention_weights)
    check_same_dtype(_FORWARD, value=value, sampling_locations=sampling_locations,
                     attention_weights=attention_weights)
    _check_levels(_FORWARD, value, value_spatial_shapes, value_level_start_index)
    with _without_autocast(value.device):
        return _forward(value, value_spatial_shapes, value_level_start_index,
                        sampling_locations, attention_weights)


def _forward(value: torch.Tensor, spatial_shapes: torch.Tensor,
             level_start_index: torch.Tensor, sampling_loc: torch.Tensor,
             attn_weight: torch.Tensor) -> torch.Tensor:
    bs, _, heads, head_dim = value.shape
    queries = sampling_loc.shape[1]
    samples = attn_weight.shape[3] * attn_weight.shape[4]          # levels * points
    dtype = _compute_dtype(value.dtype)
    rows_of_value = _value_rows(value)
    attn = attn_weight.to(dtype)
    out = torch.zeros(bs * queries * heads, 1, head_dim, dtype=dtype, device=value.device)
    for corner in _sampling(value, spatial_shapes, level_start_index, sampling_loc).corners:
        # (S, head_dim) -> (bs*nq*heads, L*P, head_dim)
        gathered = rows_of_value.index_select(0, corner.rows).view(-1, samples, head_dim)
        # (bs, nq, heads, L, P) -> (bs*nq*heads, 1, L*P)
        mix = (attn * corner.weight_y * corner.weight_x).to(value.dtype).view(-1, 1, samples)
        out += _bmm(mix, gathered, dtype)
    return out.to(value.dtype).view(bs, queries, heads * head_dim)  # (bs, nq, heads*head_dim)


def ms_deform_attn_backward(value: torch.Tensor, spatial_shapes: torch.Tensor,
                            level_start_index: torch.Tensor, sampling_loc: torch.Tensor,
                            attn_weight: torch.Tensor, grad_output: torch.Tensor,
                            grad_value: torch.Tensor, grad_sampling_loc: torch.Tensor,
                            grad_attn_weight: torch.Tensor, im2col_step: int) -> None:
    """Gradients of :func:`ms_deform_attn_forward` for ``grad_output`` (bs, nq, heads*head_dim),
    in mmcv's kernel's analytic form: added into ``grad_value`` (the kernel's ``atomicAdd``);
    written into ``grad_sampling_loc`` and ``grad_attn_weight`` (as its per-point reduction
    does; mmcv passes zeros for all three)."""
    _check(_BACKWARD, value, spatial_shapes, level_start_index, sampling_loc, attn_weight,
           im2col_step)
    bs, keys, heads, head_dim = value.shape
    queries = sampling_loc.shape[1]
    check_tensor(_BACKWARD, 'grad_output', grad_output, shape=(bs, queries, heads * head_dim),
                 what='(bs, num_queries, num_heads * head_dim)')
    check_tensor(_BACKWARD, 'grad_value', grad_value, shape=tuple(value.shape), what=_VALUE)
    check_tensor(_BACKWARD, 'grad_sampling_loc', grad_sampling_loc,
                 shape=tuple(sampling_loc.shape), what=_LOC)
    check_tensor(_BACKWARD, 'grad_attn_weight', grad_attn_weight, shape=tuple(attn_weight.shape),
                 what=_ATTN)
    floats = dict(value=value, sampling_loc=sampling_loc, attn_weight=attn_weight,
                  grad_output=grad_output, grad_value=grad_value,
                  grad_sampling_loc=grad_sampling_loc, grad_attn_weight=grad_attn_weight)
    check_same_device(_BACKWARD, spatial_shapes=spatial_shapes,
                      level_start_index=level_start_index, **floats)
    check_same_dtype(_BACKWARD, **floats)
    _check_levels(_BACKWARD, value, spatial_shapes, level_start_index)
    with _without_autocast(value.device):
        _backward(value, spatial_shapes, level_start_index, sampling_loc, attn_weight,
                  grad_output, grad_value, grad_sampling_loc, grad_attn_weight)


def _backward(value: torch.Tensor, spatial_shapes: torch.Tensor,
              level_start_index: torch.Tensor, sampling_loc: torch.Tensor,
              attn_weight: torch.Tensor, grad_output: torch.Tensor, grad_value: torch.Tensor,
              grad_sampling_loc: torch.Tensor, grad_attn_weight: torch.Tensor) -> None:
    bs, keys, heads, head_dim = value.shape
    samples = attn_weight.shape[3] * attn_weight.shape[4]          # levels * points
    dtype = _compute_dtype(value.dtype)
    rows_of_value = _value_rows(value)
    attn = attn_weight.to(dtype)
    grad = grad_output.reshape(-1, head_dim, 1)                     # (bs*nq*heads, head_dim, 1)
    grad_acc = grad.to(dtype).view(-1, 1, head_dim)                 # (bs*nq*heads, 1, head_dim)
    value_acc = torch.zeros(rows_of_value.shape, dtype=dtype, device=value.device)
    attn_acc = torch.zeros_like(attn)
    dx_acc = torch.zeros_like(attn)
    dy_acc = torch.zeros_like(attn)
    sampling = _sampling(value, spatial_shapes, level_start_index, sampling_loc)
    for corner in sampling.corners:
        # (S, head_dim) -> (bs*nq*heads, L*P, head_dim)
        gathered = rows_of_value.index_select(0, corner.rows).view(-1, samples, head_dim)
        # grad_output . corner value: (bs*nq*heads, L*P, 1) -> (bs, nq, heads, L, P)
        dot = _bmm(gathered, grad, dtype).view_as(attn)
        weight = corner.weight_y * corner.weight_x
        attn_acc.addcmul_(weight, dot)
        # d weight / dx = +-weight_y (column on the map), d weight / dy = +-weight_x
        dx_acc.addcmul_(corner.weight_y * corner.on_x, dot, value=1 if corner.dx else -1)
        dy_acc.addcmul_(corner.weight_x * corner.on_y, dot, value=1 if corner.dy else -1)
        # (bs*nq*heads, L*P, 1) * (bs*nq*heads, 1, head_dim) -> (S, head_dim)
        contrib = ((attn * weight).view(-1, samples, 1) * grad_acc).view(-1, head_dim)
        value_acc.index_add_(0, corner.rows, contrib)
    grad_value.add_(value_acc[:-1].view(bs, keys, heads, head_dim))  # drop the zero row
    grad_attn_weight.copy_(attn_acc)
    # (bs, nq, heads, L, P, 2) = d/d(loc_x, loc_y): the pixel coordinate is loc * W (resp. H)
    grad_sampling_loc.copy_(torch.stack([dx_acc * sampling.width, dy_acc * sampling.height],
                                        dim=-1) * attn[..., None])
