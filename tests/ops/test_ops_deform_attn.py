"""Compile-free ``mmcv._ext`` multi-scale deformable attention through mmcv's own API.

``MultiScaleDeformableAttnFunction.apply`` (mmcv's CUDA path, here on our ext functions) against
mmcv's pure-PyTorch ``multi_scale_deformable_attn_pytorch`` (``F.grid_sample`` per level):
outputs and gradients, several non-square levels, sampling locations outside [0, 1].
"""
import re
from typing import Dict, List, Sequence, Tuple

import mmcv
import pytest
import torch
from mmcv.ops import MultiScaleDeformableAttention
from mmcv.ops import multi_scale_deform_attn as msda
from torch import Tensor

import vitdet_plugin  # noqa: F401  (installs the mmcv._ext stand-in before mmcv.ops)
from vitdet_plugin.ops import OpInputError

MSDA = msda.MultiScaleDeformableAttnFunction.apply
REFERENCE = msda.multi_scale_deformable_attn_pytorch
EXT = msda.ext_module
#: (H, W) per level: non-square, one level a single row.
SHAPES: Tuple[Tuple[int, int], ...] = ((3, 5), (4, 2), (1, 3), (6, 4))
#: sampling locations drawn from [LOC_LOW, LOC_HIGH]: some points off the maps.
LOC_LOW, LOC_HIGH = -0.3, 1.3
#: float64 vs the reference: rounding only.
F64_TOL: Dict[str, float] = dict(rtol=1e-10, atol=1e-12)
#: float16 / bfloat16, relative to the largest magnitude (inputs rounded alike; our coordinates
#: and sums in float32, the value products rounded to the dtype: 2^-11 / 2^-8 each).
LOW_TOL: Dict[torch.dtype, float] = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
#: how far :func:`_off_the_left_edge` moves a point (exact in float16 / bfloat16 near 0.25).
EDGE_STEP = 2.0 ** -6


def test_msda_runs_on_the_stand_in() -> None:
    assert getattr(mmcv._ext, 'BACKEND', None) == 'vitdet_plugin.ops'
    assert EXT is mmcv._ext


def _levels(shapes: Sequence[Tuple[int, int]]) -> Tuple[Tensor, Tensor, int]:
    spatial = torch.tensor(shapes, dtype=torch.long)
    sizes = spatial[:, 0] * spatial[:, 1]
    start = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]])
    return spatial, start, int(sizes.sum())


def _inputs(dtype: torch.dtype = torch.float64, bs: int = 2, heads: int = 2, dim: int = 4,
            queries: int = 5, points: int = 3, shapes: Sequence[Tuple[int, int]] = SHAPES
            ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    spatial, start, keys = _levels(shapes)
    levels = len(shapes)
    value = torch.randn(bs, keys, heads, dim, dtype=torch.float64)
    loc = torch.rand(bs, queries, heads, levels, points, 2, dtype=torch.float64)
    loc = loc * (LOC_HIGH - LOC_LOW) + LOC_LOW
    attn = torch.rand(bs, queries, heads, levels, points, dtype=torch.float64)
    return value.to(dtype), spatial, start, _off_the_left_edge(loc.to(dtype), spatial), \
        attn.to(dtype)


def _off_the_left_edge(loc: Tensor, spatial: Tensor) -> Tensor:
    """Move points at pixel coordinate exactly -1 (likely in float16 / bfloat16) one step
    further out: mmcv's kernel skips them (``h_im > -1``), while the reference's ``grid_sample``
    differentiates them through column 0's zero weight (see :func:`test_left_edge_is_outside`)."""
    size = spatial.flip(-1).to(torch.float64).view(1, 1, 1, -1, 1, 2)  # (W, H) per level
    edge = (loc.double() * size - 0.5) == -1
    return torch.where(edge, loc - EDGE_STEP, loc)


def _run(fn, value: Tensor, loc: Tensor, attn: Tensor, grad_out: Tensor) -> List[Tensor]:
    """Output and gradients (value, sampling locations, attention weights) of ``fn``."""
    leaves = [t.detach().clone().requires_grad_() for t in (value, loc, attn)]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
    return [out.detach(), *grads]


def test_matches_mmcv_pytorch_forward_and_grads() -> None:
    value, spatial, start, loc, attn = _inputs()
    assert ((loc < 0) | (loc > 1)).any()
    grad_out = torch.randn(2, 5, 2 * 4, dtype=torch.float64)
    ours = _run(lambda v, s, a: MSDA(v, spatial, start, s, a, 64), value, loc, attn, grad_out)
    ref = _run(lambda v, s, a: REFERENCE(v, spatial, s, a), value, loc, attn, grad_out)
    for got, want in zip(ours, ref):
        torch.testing.assert_close(got, want, **F64_TOL)


def test_points_off_every_map_give_zero() -> None:
    value, spatial, start, loc, attn = _inputs()
    loc = torch.where(loc < 0.5, loc - 2.0, loc + 2.0)             # far outside every level
    grad_out = torch.randn(2, 5, 8, dtype=torch.float64)
    out, grad_value, grad_loc, grad_attn = _run(
        lambda v, s, a: MSDA(v, spatial, start, s, a, 64), value, loc, attn, grad_out)
    for t in (out, grad_value, grad_loc, grad_attn):
        assert (t == 0).all()


def test_left_edge_is_outside() -> None:
    """The kernel's point test is ``-1 < x < W`` and ``-1 < y < H`` (pixel coordinates): a point
    at exactly x = -1 samples 0 and has zero gradients; one a hair inside does not."""
    value, spatial, start, loc, attn = _inputs(bs=1, heads=1, queries=1, points=1,
                                               shapes=((2, 4),))
    loc[..., 0], loc[..., 1] = -0.5 / 4, 0.5                    # x = -1, y = 0.5
    grad_out = torch.ones(1, 1, 4, dtype=torch.float64)
    run = _run(lambda v, s, a: MSDA(v, spatial, start, s, a, 64), value, loc, attn, grad_out)
    assert all((t == 0).all() for t in run)
    loc[..., 0] += 1e-9
    out, _, grad_loc, _ = _run(lambda v, s, a: MSDA(v, spatial, start, s, a, 64), value, loc,
                               attn, grad_out)
    assert grad_loc[..., 0].abs().item() > 0 and out.abs().max().item() < 1e-6


def test_gradcheck_float64() -> None:
    value, spatial, start, loc, attn = _inputs(bs=1, heads=2, dim=2, queries=2, points=2,
                                               shapes=((2, 3), (3, 2)))
    leaves = tuple(t.requires_grad_() for t in (value, loc, attn))
    assert torch.autograd.gradcheck(lambda v, s, a: MSDA(v, spatial, start, s, a, 1), leaves)


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_low_precision(dtype: torch.dtype) -> None:
    value, spatial, start, loc, attn = _inputs(dtype=dtype)
    grad_out = torch.randn(2, 5, 8, dtype=torch.float64).to(dtype)
    ours = _run(lambda v, s, a: MSDA(v, spatial, start, s, a, 64), value, loc, attn, grad_out)
    assert all(t.dtype == dtype for t in ours)
    ref = _run(lambda v, s, a: REFERENCE(v, spatial, s, a), value.double(), loc.double(),
               attn.double(), grad_out.double())
    for name, got, want in zip(('output', 'grad_value', 'grad_loc', 'grad_attn'), ours, ref):
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err <= LOW_TOL[dtype], f'{name}: relative error {err:.3g}'


def test_im2col_step_does_not_change_results() -> None:
    value, spatial, start, loc, attn = _inputs(bs=4, dtype=torch.float32)
    grad_out = torch.randn(4, 5, 8)
    runs = [_run(lambda v, s, a, step=step: MSDA(v, spatial, start, s, a, step), value, loc,
                 attn, grad_out) for step in (1, 2, 3, 64)]
    for other in runs[1:]:
        for got, want in zip(other, runs[0]):
            assert torch.equal(got, want)


def test_autocast_leaves_float32_alone() -> None:
    """mmcv's kernel computes in the dtype it is given; CPU autocast (bfloat16) would otherwise
    take the ``bmm`` calls down to bfloat16."""
    value, spatial, start, loc, attn = _inputs(dtype=torch.float32)
    grad_out = torch.randn(2, 5, 8)
    plain = _run(lambda v, s, a: MSDA(v, spatial, start, s, a, 64), value, loc, attn, grad_out)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        cast = _run(lambda v, s, a: MSDA(v, spatial, start, s, a, 64), value, loc, attn,
                    grad_out)
    for got, want in zip(cast, plain):
        assert got.dtype == torch.float32 and torch.equal(got, want)


def test_no_queries() -> None:
    value, spatial, start, loc, attn = _inputs(queries=0)
    out, grad_value, grad_loc, grad_attn = _run(
        lambda v, s, a: MSDA(v, spatial, start, s, a, 64), value, loc, attn,
        torch.zeros(2, 0, 8, dtype=torch.float64))
    assert out.shape == (2, 0, 8) and (grad_value == 0).all() and grad_loc.numel() == 0


def test_module_forward_backward_through_ext(monkeypatch: pytest.MonkeyPatch) -> None:
    """mmcv's ``MultiScaleDeformableAttention`` takes the ext path only on CUDA: route its CPU
    path (``multi_scale_deformable_attn_pytorch``) to ``MultiScaleDeformableAttnFunction`` and
    count the ext calls; compare with the module on its own PyTorch path."""
    spatial, start, keys = _levels(SHAPES)
    torch.manual_seed(1)
    module = MultiScaleDeformableAttention(embed_dims=16, num_heads=2, num_levels=len(SHAPES),
                                           num_points=3, dropout=0.0,
                                           batch_first=True).double()
    with torch.no_grad():                                       # non-trivial offsets / weights
        for layer in (module.sampling_offsets, module.attention_weights):
            layer.weight.normal_(0, 0.3)
    query = torch.randn(2, 6, 16, dtype=torch.float64)
    value = torch.randn(2, keys, 16, dtype=torch.float64)
    ref_points = torch.rand(2, 6, len(SHAPES), 2, dtype=torch.float64)

    def run() -> List[Tensor]:
        module.zero_grad()
        q = query.clone().requires_grad_()
        out = module(q, value=value, reference_points=ref_points, spatial_shapes=spatial,
                     level_start_index=start)
        out.square().sum().backward()
        return [out.detach(), q.grad, module.sampling_offsets.weight.grad,
                module.value_proj.weight.grad]

    ref = run()
    calls: List[str] = []
    for name in ('ms_deform_attn_forward', 'ms_deform_attn_backward'):
        impl = getattr(EXT, name)
        monkeypatch.setattr(EXT, name, lambda *a, _impl=impl, _name=name, **k: (
            calls.append(_name), _impl(*a, **k))[1])
    monkeypatch.setattr(msda, 'multi_scale_deformable_attn_pytorch',
                        lambda v, shapes, s, a: MSDA(v, shapes, start, s, a, 64))
    ours = run()
    assert calls == ['ms_deform_attn_forward', 'ms_deform_attn_backward']
    for got, want in zip(ours, ref):
        torch.testing.assert_close(got, want, **F64_TOL)


def _ext_args(dtype: torch.dtype = torch.float32) -> List[Tensor]:
    value, spatial, start, loc, attn = _inputs(dtype=dtype, queries=3)
    return [value, spatial, start, loc, attn]


def test_bad_input_messages() -> None:
    value, spatial, start, loc, attn = _ext_args()
    fwd = 'ms_deform_attn_forward'
    with pytest.raises(OpInputError, match=re.escape(
            f'{fwd}: value must be 4-d (bs, num_keys, num_heads, head_dim), got shape '
            '(2, 50, 8)')):
        EXT.ms_deform_attn_forward(value.flatten(2), spatial, start, loc, attn, im2col_step=64)
    with pytest.raises(OpInputError, match=re.escape(
            f'{fwd}: spatial_shapes must be int64, got int32')):
        EXT.ms_deform_attn_forward(value, spatial.int(), start, loc, attn, im2col_step=64)
    with pytest.raises(OpInputError, match=re.escape(
            f'{fwd}: level_start_index must have shape (4) (num_levels,) = first key of each '
            'level, got (3,)')):
        EXT.ms_deform_attn_forward(value, spatial, start[:3], loc, attn, im2col_step=64)
    with pytest.raises(OpInputError, match=re.escape(
            f'{fwd}: sampling_loc must have shape (2, *, 2, 4, *, 2) (bs, num_queries, '
            'num_heads, num_levels, num_points, 2) = (x, y) in [0, 1], got (2, 3, 2, 3, 3, 2)')):
        EXT.ms_deform_attn_forward(value, spatial, start, loc[:, :, :, :3], attn,
                                   im2col_step=64)
    with pytest.raises(OpInputError, match=re.escape(
            f'{fwd}: attn_weight must have shape (2, 3, 2, 4, 3) (bs, num_queries, num_heads, '
            'num_levels, num_points), got (2, 3, 2, 4, 2)')):
        EXT.ms_deform_attn_forward(value, spatial, start, loc, attn[..., :2], im2col_step=64)
    with pytest.raises(OpInputError, match=re.escape(
            f'{fwd}: all tensors must have one dtype, got value float32, sampling_locations '
            'float64, attention_weights float32; cast them with .to(dtype)')):
        EXT.ms_deform_attn_forward(value, spatial, start, loc.double(), attn, im2col_step=64)
    with pytest.raises(OpInputError, match=re.escape(
            f'{fwd}: all tensors must be on one device, got value on cpu, value_spatial_shapes '
            'on meta, value_level_start_index on cpu, sampling_locations on cpu, '
            'attention_weights on cpu; move them with .to(device)')):
        EXT.ms_deform_attn_forward(value, spatial.to('meta'), start, loc, attn, im2col_step=64)
    with pytest.raises(OpInputError, match=re.escape(
            f'{fwd}: im2col_step must be a positive int, got 0')):
        EXT.ms_deform_attn_forward(value, spatial, start, loc, attn, im2col_step=0)
    with pytest.raises(OpInputError, match=re.escape(
            f'{fwd}: every level must lie within the 50 keys of value: 0 <= level_start_index[l] '
            'and level_start_index[l] + H_l * W_l <= 50')):
        EXT.ms_deform_attn_forward(value, spatial, start + 1, loc, attn, im2col_step=64)
    grads = [torch.zeros_like(value), torch.zeros_like(loc), torch.zeros_like(attn)]
    with pytest.raises(OpInputError, match=re.escape(
            'ms_deform_attn_backward: grad_output must have shape (2, 3, 8) (bs, num_queries, '
            'num_heads * head_dim), got (2, 3, 4)')):
        EXT.ms_deform_attn_backward(value, spatial, start, loc, attn, torch.zeros(2, 3, 4),
                                    *grads, im2col_step=64)
    with pytest.raises(OpInputError, match=re.escape(
            'ms_deform_attn_backward: all tensors must have one dtype, got value float32, '
            'sampling_loc float32, attn_weight float32, grad_output float32, grad_value '
            'float16, grad_sampling_loc float32, grad_attn_weight float32; cast them with '
            '.to(dtype)')):
        EXT.ms_deform_attn_backward(value, spatial, start, loc, attn, torch.zeros(2, 3, 8),
                                    grads[0].half(), *grads[1:], im2col_step=64)
