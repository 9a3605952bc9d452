"""Compile-free ``mmcv._ext`` focal losses through mmcv's own API, against independent references.

Sigmoid: mmcv's ``sigmoid_focal_loss`` / ``SigmoidFocalLoss`` (and mmdet's wrapper of it) on our
ext functions vs mmdet's pure-PyTorch ``py_sigmoid_focal_loss`` with one-hot targets. Softmax:
mmcv's ``softmax_focal_loss`` vs the paper's formula written below in plain PyTorch (autograd
gives its gradient). mmcv reduces ``mean`` as ``sum / N`` (rows), mmdet as the mean over all
N x C elements.
"""
import math
import re
from typing import Dict, Optional

import mmcv
import pytest
import torch
import torch.nn.functional as F
from mmcv.ops import SigmoidFocalLoss, sigmoid_focal_loss, softmax_focal_loss
from mmcv.ops import focal_loss as mmcv_focal_loss
from mmdet.models.losses import focal_loss as mmdet_focal_loss
from torch import Tensor

import vitdet_plugin  # noqa: F401  (installs the mmcv._ext stand-in before mmcv.ops)
from vitdet_plugin.ops import OpInputError

N, C = 12, 5
#: float64 results vs the references: rounding only.
F64_TOL: Dict[str, float] = dict(rtol=1e-10, atol=1e-12)
#: float16 / bfloat16 (computed in float32, rounded once to the dtype: 2^-11 / 2^-8 relative).
LOW_TOL: Dict[torch.dtype, Dict[str, float]] = {
    torch.float16: dict(rtol=2e-3, atol=1e-6),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-6),
}
#: the kernels clamp probabilities to FLT_MIN before log: the loss of one element is capped.
LOG_FLT_MIN = math.log(torch.finfo(torch.float32).tiny)
EXT = mmcv_focal_loss.ext_module


def test_focal_loss_runs_on_the_stand_in() -> None:
    assert getattr(mmcv._ext, 'BACKEND', None) == 'vitdet_plugin.ops'
    assert EXT is mmcv._ext


def _data(dtype: torch.dtype = torch.float64, scale: float = 4.0, background: bool = True):
    logits = torch.randn(N, C, dtype=torch.float64).mul(scale).to(dtype)
    target = torch.randint(0, C + int(background), (N,))
    if background:
        target[:2] = C                                           # mmdet's background label
    weight = torch.rand(C, dtype=torch.float64).add(0.5).to(dtype)
    return logits, target, weight


def _row_weight(weight: Optional[Tensor], target: Tensor) -> Optional[Tensor]:
    """mmcv's per-class weight as mmdet's (N, 1) sample weight: weight[target], 1 for bg."""
    if weight is None:
        return None
    padded = torch.cat([weight, weight.new_ones(1)])             # index C: background
    return padded[target][:, None]


def _mmdet_reference(logits: Tensor, target: Tensor, weight: Optional[Tensor], gamma: float,
                     alpha: float, reduction: str) -> Tensor:
    one_hot = F.one_hot(target, C + 1)[:, :C]
    red = 'sum' if reduction == 'mean' else reduction
    loss = mmdet_focal_loss.py_sigmoid_focal_loss(logits, one_hot, _row_weight(weight, target),
                                                  gamma, alpha, red)
    return loss / logits.shape[0] if reduction == 'mean' else loss


@pytest.mark.parametrize('reduction', ['none', 'mean', 'sum'])
@pytest.mark.parametrize('with_weight', [False, True])
@pytest.mark.parametrize('gamma,alpha', [(2.0, 0.25), (1.5, 0.6)])
def test_sigmoid_matches_mmdet_py(reduction: str, with_weight: bool, gamma: float,
                                  alpha: float) -> None:
    logits, target, weight = _data()
    w = weight if with_weight else None
    x = logits.clone().requires_grad_()
    ours = sigmoid_focal_loss(x, target, gamma, alpha, w, reduction)
    xr = logits.clone().requires_grad_()
    ref = _mmdet_reference(xr, target, w, gamma, alpha, reduction)
    torch.testing.assert_close(ours, ref, **F64_TOL)
    grad_out = torch.rand_like(ref)
    ours.backward(grad_out)
    ref.backward(grad_out)
    torch.testing.assert_close(x.grad, xr.grad, **F64_TOL)


def test_sigmoid_module_and_mmdet_wrapper() -> None:
    logits, target, weight = _data()
    module = SigmoidFocalLoss(gamma=2.0, alpha=0.25, weight=weight, reduction='sum')
    torch.testing.assert_close(module(logits, target),
                               _mmdet_reference(logits, target, weight, 2.0, 0.25, 'sum'),
                               **F64_TOL)
    # mmdet's CUDA-path wrapper (mmcv op, no class weight) with sample weights and avg_factor
    sample_w = torch.rand(N, dtype=torch.float64)
    one_hot = F.one_hot(target, C + 1)[:, :C]
    got = mmdet_focal_loss.sigmoid_focal_loss(logits, target, sample_w, 2.0, 0.25, 'mean', 7.0)
    ref = mmdet_focal_loss.py_sigmoid_focal_loss(logits, one_hot, sample_w, 2.0, 0.25, 'mean',
                                                 7.0)
    torch.testing.assert_close(got, ref, **F64_TOL)


def test_sigmoid_large_logits_stay_exact_and_capped() -> None:
    """float32 logits up to 60: the loss follows BCE (1 - p is not cancelled to 0); beyond
    -log(FLT_MIN) = 87.3 it is capped as in the kernel."""
    logits = torch.tensor([[-60.0, -20.0, 20.0, 60.0, 0.0], [100.0, -100.0, 3.0, -3.0, 0.5]])
    target = torch.tensor([C, 1])
    out = sigmoid_focal_loss(logits, target, 2.0, 0.25, None, 'none')
    ref = _mmdet_reference(logits, target, None, 2.0, 0.25, 'none')
    torch.testing.assert_close(out[0], ref[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[1, 2:], ref[1, 2:], rtol=1e-6, atol=1e-6)
    capped = torch.tensor([-(1 - 0.25) * LOG_FLT_MIN, -0.25 * LOG_FLT_MIN])
    torch.testing.assert_close(out[1, :2], capped)
    assert torch.isfinite(out).all()


def _softmax_reference(logits: Tensor, target: Tensor, weight: Optional[Tensor], gamma: float,
                       alpha: float) -> Tensor:
    """Per row: -alpha (1 - p_t)^gamma log p_t weight[t]; 0 for a target outside [0, C)."""
    valid = (target >= 0) & (target < logits.shape[1])
    label = target.clamp(0, logits.shape[1] - 1)
    log_p = torch.log_softmax(logits, dim=1).gather(1, label[:, None])[:, 0]
    loss = -alpha * (1 - log_p.exp()) ** gamma * log_p
    if weight is not None:
        loss = loss * weight[label]
    return torch.where(valid, loss, torch.zeros_like(loss))


@pytest.mark.parametrize('reduction', ['none', 'mean', 'sum'])
@pytest.mark.parametrize('with_weight', [False, True])
@pytest.mark.parametrize('gamma,alpha', [(2.0, 0.25), (0.5, 1.0)])
def test_softmax_matches_formula(reduction: str, with_weight: bool, gamma: float,
                                 alpha: float) -> None:
    logits, target, weight = _data(scale=2.0, background=False)
    target[0], target[1] = -1, C                                 # ignored rows: loss 0
    w = weight if with_weight else None
    x = logits.clone().requires_grad_()
    ours = softmax_focal_loss(x, target, gamma, alpha, w, reduction)
    xr = logits.clone().requires_grad_()
    per_row = _softmax_reference(xr, target, w, gamma, alpha)
    ref = {'none': per_row, 'sum': per_row.sum(), 'mean': per_row.sum() / N}[reduction]
    torch.testing.assert_close(ours, ref, **F64_TOL)
    if reduction == 'none':
        return  # mmcv's backward multiplies (N, C) by an (N,) grad_output: broken upstream
    ours.backward()
    ref.backward()
    torch.testing.assert_close(x.grad, xr.grad, **F64_TOL)
    assert (x.grad[:2] == 0).all()


def test_gradcheck_float64() -> None:
    logits, target, weight = _data(scale=2.0)
    x = logits[:6].clone().requires_grad_()
    t = target[:6]
    assert torch.autograd.gradcheck(
        lambda z: sigmoid_focal_loss(z, t, 2.0, 0.25, weight, 'sum'), (x,))
    assert torch.autograd.gradcheck(
        lambda z: softmax_focal_loss(z, t.clamp(max=C - 1), 1.5, 0.25, weight, 'mean'), (x,))


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_low_precision(dtype: torch.dtype) -> None:
    logits, target, weight = _data(dtype=dtype, scale=3.0)
    w = weight
    x = logits.clone().requires_grad_()
    out = sigmoid_focal_loss(x, target, 2.0, 0.25, w, 'none')
    assert out.dtype == dtype
    out.backward(torch.ones_like(out))
    xr = logits.double().requires_grad_()                        # same rounded inputs
    ref = _mmdet_reference(xr, target, w.double(), 2.0, 0.25, 'none')
    ref.backward(torch.ones_like(ref))
    torch.testing.assert_close(out.double(), ref, **LOW_TOL[dtype])
    torch.testing.assert_close(x.grad.double(), xr.grad, **LOW_TOL[dtype])

    tgt = target.clamp(max=C - 1)
    x = logits.clone().requires_grad_()
    out = softmax_focal_loss(x, tgt, 2.0, 0.25, w, 'sum')
    assert out.dtype == dtype
    out.backward()
    xr = logits.double().requires_grad_()
    ref = _softmax_reference(xr, tgt, w.double(), 2.0, 0.25).sum()
    ref.backward()
    torch.testing.assert_close(out.double(), ref, **LOW_TOL[dtype])
    # mmcv's wrapper takes the softmax in the low dtype (rounded probabilities, whose
    # differences make the gradient): tolerance relative to the largest gradient
    rtol = LOW_TOL[dtype]['rtol']
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=rtol,
                               atol=rtol * xr.grad.abs().max().item())


def _tensors(dtype: torch.dtype = torch.float32):
    return (torch.randn(3, C, dtype=dtype), torch.tensor([0, 1, C]), torch.rand(C, dtype=dtype),
            torch.zeros(3, C, dtype=dtype))


def test_bad_input_messages() -> None:
    x, t, w, out = _tensors()
    fwd = 'sigmoid_focal_loss_forward'
    with pytest.raises(OpInputError, match=re.escape(
            f'{fwd}: input must be 2-d (N, C) = (samples, classes), got shape (15,)')):
        EXT.sigmoid_focal_loss_forward(x.flatten(), t, w, out, gamma=2.0, alpha=0.25)
    with pytest.raises(OpInputError, match=re.escape(
            f'{fwd}: target must be int64, got float32')):
        EXT.sigmoid_focal_loss_forward(x, t.float(), w, out, gamma=2.0, alpha=0.25)
    with pytest.raises(OpInputError, match=re.escape(
            f'{fwd}: target must have shape (3) (N,) = class index per sample, got (2,)')):
        EXT.sigmoid_focal_loss_forward(x, t[:2], w, out, gamma=2.0, alpha=0.25)
    with pytest.raises(OpInputError, match=re.escape(
            f'{fwd}: weight must have shape (5) (C,) = weight per class, got (4,)')):
        EXT.sigmoid_focal_loss_forward(x, t, w[:4], out, gamma=2.0, alpha=0.25)
    with pytest.raises(OpInputError, match=re.escape(
            f'{fwd}: all tensors must have one dtype, got input float32, weight float64, '
            'output float32; cast them with .to(dtype)')):
        EXT.sigmoid_focal_loss_forward(x, t, w.double(), out, gamma=2.0, alpha=0.25)
    with pytest.raises(OpInputError, match=re.escape(
            'sigmoid_focal_loss_backward: grad_input must have shape (3, 5) (N, C) = '
            '(samples, classes), got (3, 4)')):
        EXT.sigmoid_focal_loss_backward(x, t, w, out[:, :4], gamma=2.0, alpha=0.25)
    with pytest.raises(OpInputError, match=re.escape(
            'softmax_focal_loss_forward: output must be 1-d (N,) = loss per sample, got shape '
            '(3, 5)')):
        EXT.softmax_focal_loss_forward(x.softmax(1), t, w, out, gamma=2.0, alpha=0.25)
    with pytest.raises(OpInputError, match=re.escape(
            'softmax_focal_loss_backward: buff must have shape (3) (N,) = factor per sample, '
            'got (4,)')):
        EXT.softmax_focal_loss_backward(x.softmax(1), t, w, torch.zeros(4), out, gamma=2.0,
                                        alpha=0.25)
    with pytest.raises(OpInputError, match=re.escape(
            'softmax_focal_loss_forward: all tensors must be on one device, got softmax on cpu, '
            'weight on cpu, output on cpu, target on meta; move them with .to(device)')):
        EXT.softmax_focal_loss_forward(x.softmax(1), t.to('meta'), w, torch.zeros(3), gamma=2.0,
                                       alpha=0.25)
