"""Training kernels that recompute instead of storing: attention probabilities and GELU.

CPU only (see :mod:`.dispatch`): there ``F.scaled_dot_product_attention`` has no fused kernel
whose backward yields the gradient of ``attn_mask``, so with a trainable bias autograd takes
the math path and keeps every ``(N, N)`` attention matrix until backward; and plain autograd
keeps both the input and the output of an MLP's GELU, its two widest activations.

Each kernel is a ``torch.library`` custom op (``vitdet_plugin::...``) with a registered
backward (itself an op) and a fake (shape-only) implementation, so ``torch.compile`` keeps it
as one node of the graph, symbolic sizes included. The compiled CPU training step keeps the
attention op; for the GELU the compiler's own rematerialisation of a checkpointed region
(:class:`~vitdet_plugin.models.layers.Mlp`) was measured faster (same memory) and replaces
``gelu_linear`` there.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ...functional import window_bias
from .torch_private import gelu_backward, softmax_backward

#: Namespace of the custom ops (``torch.ops.vitdet_plugin.*``).
OPS_NAMESPACE = 'vitdet_plugin'


def _attention_out_layout(b: int, h: int, n: int, dv: int, like: Tensor) -> Tensor:
    """An empty ``(B, heads', N, dv)`` output stored as ``(B, N, heads', dv)``: the layout
    ``out.transpose(1, 2).reshape(B, N, C)`` of the caller reads without a copy."""
    return like.new_empty(b, n, h, dv).transpose(1, 2)


@torch.library.custom_op(f'{OPS_NAMESPACE}::recompute_attention', mutates_args=())
def _attention_op(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, mask: Optional[Tensor],
                  scale: float) -> Tensor:
    """``softmax(q k^T * scale + window_bias(bias, mask)) v`` through the fused kernel."""
    # the bias still says requires_grad in here; detached, SDPA takes its fused kernel (it
    # falls back to the math path for a mask that needs a gradient)
    full = window_bias(bias.detach(), mask).to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=full, scale=scale)
    return out.transpose(1, 2).contiguous().transpose(1, 2)        # stored (B, N, heads', dv)


@_attention_op.register_fake
def _attention_fake(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, mask: Optional[Tensor],
                    scale: float) -> Tensor:
    b, h, n, _ = q.shape
    return _attention_out_layout(b, h, n, v.shape[-1], q)


def _attention_grads(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Tensor,
                     mask: Optional[Tensor], scale: float) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``q, k, v, bias``: the attention of this layer is recomputed (bias
    written once into the logits buffer, the ``q k^T`` GEMM added in place), then the
    softmax-attention gradient formulas (differentiable ops: a double backward works)."""
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
    grad_bias = grad_full.view(-1, bias.shape[1], n, m).sum(0, keepdim=True).to(bias.dtype)
    grad_q = torch.bmm(grad_logits, k3).mul_(scale).view(b, h, n, d)
    grad_k = torch.bmm(grad_logits.transpose(1, 2), q3).mul_(scale).view(b, h, m, d)
    return grad_q, grad_k, grad_v.view(b, h, m, dv), grad_bias


@torch.library.custom_op(f'{OPS_NAMESPACE}::recompute_attention_backward', mutates_args=())
def _attention_backward_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Tensor,
                           mask: Optional[Tensor], scale: float
                           ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`_attention_grads` as one graph node."""
    return _attention_grads(grad_out, q, k, v, bias, mask, scale)


@_attention_backward_op.register_fake
def _attention_backward_fake(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Tensor,
                             mask: Optional[Tensor], scale: float
                             ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            bias.new_empty(bias.shape))


def _attention_setup(ctx, inputs: Tuple, output: Tensor) -> None:
    q, k, v, bias, mask, scale = inputs
    ctx.scale = scale
    ctx.save_for_backward(q, k, v, bias, mask)


def _attention_backward(ctx, grad_out: Tensor) -> Tuple[Optional[Tensor], ...]:
    q, k, v, bias, mask = ctx.saved_tensors
    # grad mode is on in a backward only with create_graph=True: then the differentiable ops
    grads = _attention_grads if torch.is_grad_enabled() else _attention_backward_op
    grad_q, grad_k, grad_v, grad_bias = grads(grad_out, q, k, v, bias, mask, ctx.scale)
    return grad_q, grad_k, grad_v, grad_bias, None, None


_attention_op.register_autograd(_attention_backward, setup_context=_attention_setup)


def recompute_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, mask: Optional[Tensor],
                        scale: float) -> Tensor:
    """``softmax(q k^T * scale + window_bias(bias, mask)) v``, ``q, k, v`` ``(B, heads', N, d)``
    as for :func:`~vitdet_plugin.functional.window_bias`: the fused forward keeps ``q, k, v``,
    the small ``(1, heads, N, N)`` bias and the (cached, shared) mask; the backward recomputes
    the probabilities of the layer it is processing."""
    if torch.compiler.is_compiling():
        # q, k, v in the layout the backward's batched GEMMs read: the compiler writes them so
        # in the kernel that builds the windows (measured: 4% off the compiled training step;
        # in eager it would be one more copy)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _attention_op(q, k, v, bias, mask, scale)


@torch.library.custom_op(f'{OPS_NAMESPACE}::gelu_linear', mutates_args=())
def _gelu_linear_op(h: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``linear(gelu(h), weight, bias)`` (exact GELU)."""
    return F.linear(F.gelu(h), weight, bias)


@_gelu_linear_op.register_fake
def _gelu_linear_fake(h: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    return h.new_empty(*h.shape[:-1], weight.shape[0])


def _gelu_linear_grads(grad_out: Tensor, h: Tensor, weight: Tensor, need_h: bool,
                       need_weight: bool, need_bias: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``h``, ``weight`` and the bias (empty when not needed); ``gelu(h)`` is
    recomputed for the weight's (differentiable ops: a double backward works)."""
    g2 = grad_out.reshape(-1, grad_out.shape[-1])
    grad_w = g2.t() @ F.gelu(h).reshape(-1, h.shape[-1]) if need_weight else h.new_empty(0)
    grad_b = g2.sum(0) if need_bias else h.new_empty(0)  # also with a frozen weight (BitFit)
    grad_h = gelu_backward(grad_out @ weight, h).contiguous() if need_h else h.new_empty(0)
    return grad_h, grad_w, grad_b


@torch.library.custom_op(f'{OPS_NAMESPACE}::gelu_linear_backward', mutates_args=())
def _gelu_linear_backward_op(grad_out: Tensor, h: Tensor, weight: Tensor, need_h: bool,
                             need_weight: bool, need_bias: bool
                             ) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`_gelu_linear_grads` as one graph node."""
    return _gelu_linear_grads(grad_out, h, weight, need_h, need_weight, need_bias)


@_gelu_linear_backward_op.register_fake
def _gelu_linear_backward_fake(grad_out: Tensor, h: Tensor, weight: Tensor, need_h: bool,
                               need_weight: bool, need_bias: bool
                               ) -> Tuple[Tensor, Tensor, Tensor]:
    return (h.new_empty(h.shape) if need_h else h.new_empty(0),
            weight.new_empty(weight.shape) if need_weight else h.new_empty(0),
            weight.new_empty(weight.shape[0]) if need_bias else h.new_empty(0))


def _gelu_linear_setup(ctx, inputs: Tuple, output: Tensor) -> None:
    h, weight, bias = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(h, weight)


def _gelu_linear_backward(ctx, grad_out: Tensor) -> Tuple[Optional[Tensor], ...]:
    h, weight = ctx.saved_tensors
    need_h, need_w, need_b = ctx.needs_input_grad
    grads = _gelu_linear_grads if torch.is_grad_enabled() else _gelu_linear_backward_op
    grad_h, grad_w, grad_b = grads(grad_out, h, weight, need_h, need_w,
                                   ctx.has_bias and need_b)
    return (grad_h if need_h else None, grad_w if need_w else None,
            grad_b if ctx.has_bias and need_b else None)


_gelu_linear_op.register_autograd(_gelu_linear_backward, setup_context=_gelu_linear_setup)


def gelu_linear(h: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``F.linear(F.gelu(h), weight, bias)`` that keeps ``h`` but not ``gelu(h)`` for
    backward."""
    return _gelu_linear_op(h, weight, bias)
