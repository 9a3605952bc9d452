"""``mmcv._ext`` sigmoid / softmax focal loss, forward and backward, with mmcv's kernel math.

Reproduces ``common/cuda/sigmoid_focal_loss_cuda_kernel.cuh`` and
``softmax_focal_loss_cuda_kernel.cuh`` of mmcv 2.1.0, as ``mmcv.ops.focal_loss`` calls them
(results written into the tensors passed in; ``gamma`` / ``alpha`` by keyword; ``weight`` a
per-class ``(C,)`` weight or an empty tensor for none):

* sigmoid, element ``(n, c)`` with ``p = sigmoid(x)``, ``t = target[n]``: the loss is
  ``-alpha (1-p)^gamma log(max(p, FLT_MIN))`` where ``t == c`` and
  ``-(1-alpha) p^gamma log(max(1-p, FLT_MIN))`` elsewhere; the gradient is the kernel's
  closed form; a row whose ``t`` is outside ``[0, C)`` (mmdet's background ``t == C``) is all
  negatives. With ``weight``, row ``n`` is scaled by ``weight[t]``.
* softmax, row ``n`` with ``p = softmax[n, t]``: ``-alpha (1-p)^gamma log(max(p, FLT_MIN))``,
  scaled by ``weight[t]``; the backward writes the kernel's per-row factor into ``buff`` and
  ``buff[n] * (onehot(t) - softmax[n])`` into ``grad_input``.

Where the kernel reads out of bounds this module defines the result (mmcv's is garbage): a
sigmoid background row takes weight 1 (the kernel reads ``weight[C]``), and a softmax row whose
target is outside ``[0, C)`` gives 0 (the kernel zeroes only negative targets and reads the next
row's probability for ``t == C``).

Precision: float16 / bfloat16 inputs are computed in float32 and written back in their dtype
(mmcv's CUDA kernel computes in half, where ``FLT_MIN`` underflows to 0 and ``log`` gives
``-inf``, and it has no bfloat16 at all); float32 / float64 are computed in their own dtype,
clamped at the float32 ``FLT_MIN`` like the kernel. Two deliberate changes, both where the
kernel's own arithmetic breaks down: ``1 - p`` of the sigmoid loss is computed as
``sigmoid(-x)``, which equals the kernel's ``1 - sigmoid(x)`` up to rounding but does not cancel
to 0 for large logits (the kernel's float32 loss of a negative jumps from about 17 to
``-log(FLT_MIN)`` = 87.3 near ``x = 17``; its gradient is unaffected); and the softmax
backward takes ``g (1-p)^(g-1) p log p`` as its limit 0 at ``p = 1``, where the kernel's
``inf * 0`` is NaN for ``gamma < 1``.
No host synchronisation (mmcv's launcher syncs on ``target.max()`` to assert labels <= C).
"""
from typing import Tuple

import torch

from .checks import INDEX, check_same_device, check_same_dtype, check_tensor

#: ``FLT_MIN`` of the kernels: probabilities are clamped to it before ``log`` (in every dtype).
FLT_MIN = torch.finfo(torch.float32).tiny
#: dtypes computed in float32 (their own precision loses the clamp and the small terms).
LOW_PRECISION: Tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)

_SIGMOID_FWD = 'sigmoid_focal_loss_forward'
_SIGMOID_BWD = 'sigmoid_focal_loss_backward'
_SOFTMAX_FWD = 'softmax_focal_loss_forward'
_SOFTMAX_BWD = 'softmax_focal_loss_backward'
_LOGITS = '(N, C) = (samples, classes)'
_TARGET = '(N,) = class index per sample'


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in LOW_PRECISION else dtype


def _check_common(op: str, scores: torch.Tensor, scores_name: str, target: torch.Tensor,
                  weight: torch.Tensor, **outputs: Tuple[torch.Tensor, Tuple[int, ...], str]
                  ) -> Tuple[int, int]:
    """Check scores (N, C), target (N,), weight (C,) or empty, and each output's shape; all on
    one device, floating tensors of one dtype. Returns (N, C)."""
    check_tensor(op, scores_name, scores, ndim=2, what=_LOGITS)
    num, classes = scores.shape
    check_tensor(op, 'target', target, shape=(num,), dtypes=INDEX, what=_TARGET)
    check_tensor(op, 'weight', weight, what='(C,) = weight per class, or empty for none')
    has_weight = weight.numel() > 0
    if has_weight:
        check_tensor(op, 'weight', weight, shape=(classes,), what='(C,) = weight per class')
    floats = {scores_name: scores, **({'weight': weight} if has_weight else {})}
    for name, (tensor, shape, what) in outputs.items():
        check_tensor(op, name, tensor, shape=shape, what=what)
        floats[name] = tensor
    check_same_device(op, **floats, target=target)
    check_same_dtype(op, **floats)
    return num, classes


def _row_weight(weight: torch.Tensor, label: torch.Tensor, valid: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """(N,) ``weight[label]`` where ``valid``, else 1 (``label`` already clamped to [0, C))."""
    return torch.where(valid, weight.to(dtype)[label], torch.ones((), dtype=dtype,
                                                                     device=weight.device))


def _sigmoid_terms(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor,
                   alpha: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                          torch.Tensor]:
    """The kernel's per-element factors, (N, C) in the compute dtype: the probability of the
    true outcome ``t`` (p where ``target == c``, else 1-p), of the false one ``f``, the class
    coefficient (alpha where ``target == c``, else 1-alpha; times the row weight) and the
    positive mask (the kernel's ``flag_p``)."""
    dtype = _compute_dtype(input.dtype)
    logits = input.to(dtype)
    prob = torch.sigmoid(logits)                                    # p
    comp = torch.sigmoid(-logits)                                   # 1 - p, without cancellation
    num_classes = input.shape[1]
    classes = torch.arange(num_classes, device=input.device)
    positive = target[:, None] == classes[None]                     # (N, C): flag_p
    prob_true = torch.where(positive, prob, comp)
    prob_false = torch.where(positive, comp, prob)
    coef = torch.where(positive, torch.full((), alpha, dtype=dtype, device=input.device),
                       torch.full((), 1.0 - alpha, dtype=dtype, device=input.device))
    if weight.numel() > 0:
        valid = (target >= 0) & (target < num_classes)
        label = target.clamp(0, num_classes - 1)
        coef = coef * _row_weight(weight, label, valid, dtype)[:, None]    # (N, 1) row weight
    return prob_true, prob_false, coef, positive


def sigmoid_focal_loss_forward(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor,
                               output: torch.Tensor, gamma: float = 2.0,
                               alpha: float = 0.25) -> None:
    """Write into ``output`` (N, C) mmcv's element-wise sigmoid focal loss of logits ``input``
    (N, C) for class indices ``target`` (N,) (outside [0, C): background), per-class ``weight``
    (C,) or empty: ``-coef f^gamma log(max(t, FLT_MIN))`` (see :func:`_sigmoid_terms`)."""
    _check_common(_SIGMOID_FWD, input, 'input', target, weight,
                  output=(output, tuple(input.shape), _LOGITS))
    prob_true, prob_false, coef, _ = _sigmoid_terms(input, target, weight, float(alpha))
    loss = -coef * prob_false.pow(float(gamma)) * prob_true.clamp_min(FLT_MIN).log()
    output.copy_(loss)


def sigmoid_focal_loss_backward(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor,
                                grad_input: torch.Tensor, gamma: float = 2.0,
                                alpha: float = 0.25) -> None:
    """Write into ``grad_input`` (N, C) the derivative of :func:`sigmoid_focal_loss_forward`'s
    loss with respect to the logits, in the kernel's closed form: positive
    ``-alpha (1-p)^g (1 - p - g p log(max(p, FLT_MIN)))``, negative
    ``-(1-alpha) p^g (g (1-p) log(max(1-p, FLT_MIN)) - p)``, times the row weight; that is
    ``sign coef f^g (f - g t log(max(t, FLT_MIN)))`` with sign -1 positive, +1 negative."""
    _check_common(_SIGMOID_BWD, input, 'input', target, weight,
                  grad_input=(grad_input, tuple(input.shape), _LOGITS))
    gamma = float(gamma)
    prob_true, prob_false, coef, positive = _sigmoid_terms(input, target, weight, float(alpha))
    sign = torch.where(positive, -1.0, 1.0).to(coef.dtype)
    inner = prob_false - gamma * prob_true * prob_true.clamp_min(FLT_MIN).log()
    grad_input.copy_(sign * coef * prob_false.pow(gamma) * inner)


def _softmax_terms(softmax: torch.Tensor, target: torch.Tensor, weight: torch.Tensor
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probabilities (N, C) in the compute dtype, probability of the target class (N,), the
    valid-target mask (N,), the row weight (N,): ``weight[target]`` or 1)."""
    dtype = _compute_dtype(softmax.dtype)
    probs = softmax.to(dtype)
    num_classes = softmax.shape[1]
    valid = (target >= 0) & (target < num_classes)
    label = torch.where(valid, target, 0)
    pred = probs.gather(1, label[:, None])[:, 0]                    # (N, 1) -> (N,)
    if weight.numel() > 0:
        row_weight = _row_weight(weight, label, valid, dtype)
    else:
        row_weight = torch.ones((), dtype=dtype, device=softmax.device).expand_as(pred)
    return probs, pred, valid, row_weight


def softmax_focal_loss_forward(softmax: torch.Tensor, target: torch.Tensor, weight: torch.Tensor,
                               output: torch.Tensor, gamma: float = 2.0,
                               alpha: float = 0.25) -> None:
    """Write into ``output`` (N,) mmcv's softmax focal loss of probabilities ``softmax`` (N, C):
    ``-alpha (1-p)^gamma log(max(p, FLT_MIN)) weight[t]`` with ``p = softmax[n, t]``; 0 where
    the target is outside [0, C)."""
    _check_common(_SOFTMAX_FWD, softmax, 'softmax', target, weight,
                  output=(output, (softmax.shape[0],), '(N,) = loss per sample'))
    _, pred, valid, row_weight = _softmax_terms(softmax, target, weight)
    loss = -float(alpha) * (1.0 - pred).pow(float(gamma)) * pred.clamp_min(FLT_MIN).log()
    output.copy_(torch.where(valid, loss * row_weight, 0.0))


def softmax_focal_loss_backward(softmax: torch.Tensor, target: torch.Tensor,
                                weight: torch.Tensor, buff: torch.Tensor,
                                grad_input: torch.Tensor, gamma: float = 2.0,
                                alpha: float = 0.25) -> None:
    """Write the kernel's per-row factor into ``buff`` (N,),
    ``alpha (-(1-p)^g + g (1-p)^(g-1) p log(max(p, FLT_MIN))) weight[t]`` (the derivative of
    the loss with respect to ``log p``), and ``buff[n] (onehot(t) - softmax[n])`` into
    ``grad_input`` (N, C), the derivative with respect to the logits; rows whose target is
    outside [0, C) get 0. At ``p = 1`` the term ``g (1-p)^(g-1) p log p`` is taken as its
    limit 0, where the kernel computes ``inf * 0`` = NaN for ``gamma < 1`` (plain cross-entropy
    ``gamma = 0`` included)."""
    _check_common(_SOFTMAX_BWD, softmax, 'softmax', target, weight,
                  buff=(buff, (softmax.shape[0],), '(N,) = factor per sample'),
                  grad_input=(grad_input, tuple(softmax.shape), _LOGITS))
    gamma = float(gamma)
    probs, pred, valid, row_weight = _softmax_terms(softmax, target, weight)
    comp = 1.0 - pred
    # g (1-p)^(g-1) p log p -> 0 as p -> 1; the kernel's inf * 0 there (gamma < 1) is NaN
    modulated = torch.where(comp > 0, gamma * comp.pow(gamma - 1.0) * pred
                            * pred.clamp_min(FLT_MIN).log(), 0.0)
    factor = float(alpha) * (modulated - comp.pow(gamma))
    factor = torch.where(valid, factor * row_weight, 0.0)           # (N,)
    buff.copy_(factor)
    classes = torch.arange(softmax.shape[1], device=softmax.device)
    onehot = (target[:, None] == classes[None]).to(probs.dtype)     # (N, C)
    grad = factor[:, None] * (onehot - probs)
    grad_input.copy_(torch.where(valid[:, None], grad, 0.0))
