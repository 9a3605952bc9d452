"""Training kernels that recompute instead of storing: attention probabilities and GELU.

CPU only (see :mod:`.dispatch`): there ``F.scaled_dot_product_attention`` has no fused kernel
whose backward yields the gradient of ``attn_mask``, so with a trainable bias autograd takes
the math path and keeps every ``(N, N)`` attention matrix until backward; and plain autograd
keeps both the input and the output of an MLP's GELU, its two widest activations.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ...functional import window_bias
from .torch_private import gelu_backward, softmax_backward


class RecomputeAttention(torch.autograd.Function):
    """``softmax(q k^T * scale + window_bias(bias, mask)) v``: fused forward, recomputing
    backward.

    The forward runs the fused kernel without recording a graph and saves ``q, k, v``, the
    small ``(1, heads, N, N)`` bias and the (cached, shared) mask; the backward recomputes the
    attention of the layer it is processing (bias written once into the logits buffer, the
    ``q k^T`` GEMM added in place) and applies the softmax-attention gradient formulas.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor,
                bias: Tensor, mask: Optional[Tensor], scale: float) -> Tensor:
        ctx.scale = scale
        ctx.save_for_backward(q, k, v, bias, mask)
        full = window_bias(bias.detach(), mask).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=full, scale=scale)

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> Tuple[Optional[Tensor], ...]:
        q, k, v, bias, mask = ctx.saved_tensors
        scale = ctx.scale
        b, h, n, d = q.shape
        m, dv = k.shape[-2], v.shape[-1]
        q3, k3, v3 = q.reshape(b * h, n, d), k.reshape(b * h, m, d), v.reshape(b * h, m, dv)
        logits = q.new_empty(b * h, n, m)
        logits.view(b, h, n, m).copy_(window_bias(bias, mask))      # broadcast over B
        probs = torch.softmax(logits.baddbmm_(q3, k3.transpose(1, 2), alpha=scale), dim=-1)
        del logits
        grad3 = grad_out.reshape(b * h, n, dv)
        grad_v = torch.bmm(probs.transpose(1, 2), grad3)
        grad_logits = softmax_backward(torch.bmm(grad3, v3.transpose(1, 2)), probs)
        del probs
        # (B, heads', N, M) summed onto the bias: over images, and over windows when folded
        grad_full = grad_logits.view(b, h, n, m).sum(0, keepdim=True)
        grad_bias = grad_full.view(-1, bias.shape[1], n, m).sum(0, keepdim=True)
        grad_q = torch.bmm(grad_logits, k3).mul_(scale).view(b, h, n, d)
        grad_k = torch.bmm(grad_logits.transpose(1, 2), q3).mul_(scale).view(b, h, m, d)
        return (grad_q, grad_k, grad_v.view(b, h, m, dv), grad_bias.to(bias.dtype), None,
                None)


def recompute_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, mask: Optional[Tensor],
                        scale: float) -> Tensor:
    """:class:`RecomputeAttention`; ``q, k, v`` ``(B, heads', N, d)`` as for
    :func:`~vitdet_plugin.functional.window_bias`."""
    return RecomputeAttention.apply(q, k, v, bias, mask, scale)


class GeluLinear(torch.autograd.Function):
    """``linear(gelu(h))`` that keeps ``h`` but not ``gelu(h)`` for backward (exact GELU)."""

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor,
                bias: Optional[Tensor]) -> Tensor:
        ctx.save_for_backward(h, weight)
        ctx.has_bias = bias is not None
        return F.linear(F.gelu(h), weight, bias)

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> Tuple[Optional[Tensor], ...]:
        h, weight = ctx.saved_tensors
        grad_h = grad_w = grad_b = None
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_w = g2.t() @ F.gelu(h).reshape(-1, h.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:  # also with a frozen weight (BitFit)
            grad_b = g2.sum(0)
        if ctx.needs_input_grad[0]:
            grad_h = gelu_backward(grad_out @ weight, h)
        return grad_h, grad_w, grad_b


def gelu_linear(h: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """:class:`GeluLinear`: ``F.linear(F.gelu(h), weight, bias)`` with a recomputing backward."""
    return GeluLinear.apply(h, weight, bias)
