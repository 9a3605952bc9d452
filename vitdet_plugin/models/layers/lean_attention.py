"""Attention with a decomposed relative-position bias and a memory-lean, recomputing backward.

``softmax(q k^T / sqrt(d) + bias) v`` with ``bias[(qh, qw), (kh, kw)] = rel_h[qh, qw, kh] +
rel_w[qh, qw, kw]`` (MViTv2 / ViTDet / SAM). When the bias needs a gradient, PyTorch's CPU
``scaled_dot_product_attention`` falls back to the math path and keeps the ``(heads, N, N)``
attention probabilities (and the bias) for backward: 0.8 GB per global block of ViT-B at 1024.
:func:`rel_pos_attention` runs the fused kernel forward and saves only ``q, k, v``, the output,
its log-sum-exp and the small per-axis terms; the backward recomputes the probabilities in
query chunks (flash-attention style) and reduces the bias gradient back onto the two axes.
"""
from typing import Tuple

import torch
from torch import Tensor

#: Queries per chunk in the recomputing backward (bounds its ``(chunk, N)`` temporaries).
BACKWARD_QUERY_CHUNK = 1024


def rel_pos_bias_from_terms(rel_h: Tensor, rel_w: Tensor) -> Tensor:
    """``(B, heads, qh, qw, kh)`` and ``(..., kw)`` terms -> bias ``(B, heads, qh*qw, kh*kw)``."""
    b, heads, qh, qw, kh = rel_h.shape
    kw = rel_w.shape[-1]
    return (rel_h[..., :, None] + rel_w[..., None, :]).reshape(b, heads, qh * qw, kh * kw)


class _RelPosAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, rel_h: Tensor,  # type: ignore[override]
                rel_w: Tensor) -> Tensor:
        bias = rel_pos_bias_from_terms(rel_h, rel_w)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias)
        ctx.save_for_backward(q, k, v, rel_h, rel_w, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> Tuple[Tensor, ...]:  # type: ignore[override]
        q, k, v, rel_h, rel_w, out, lse = ctx.saved_tensors
        b, heads, qh, qw, kh = rel_h.shape
        kw = rel_w.shape[-1]
        scale = q.shape[-1] ** -0.5
        grad_out = grad_out.contiguous()
        dq = torch.empty_like(q)
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
        drel_h = torch.empty_like(rel_h)
        drel_w = torch.empty_like(rel_w)
        delta = (grad_out * out).sum(-1, keepdim=True)              # (B, h, N, 1)
        k_t, v_t = k.transpose(-2, -1).flatten(0, 1), v.transpose(-2, -1)
        rows = max(1, BACKWARD_QUERY_CHUNK // qw)
        for r0 in range(0, qh, rows):
            r1 = min(qh, r0 + rows)
            s = slice(r0 * qw, r1 * qw)
            q_c, do_c = q[:, :, s], grad_out[:, :, s]
            logits = rel_pos_bias_from_terms(rel_h[:, :, r0:r1], rel_w[:, :, r0:r1])
            logits = torch.baddbmm(logits.flatten(0, 1), q_c.flatten(0, 1), k_t,
                                   alpha=scale).view_as(logits)
            probs = logits.sub_(lse[:, :, s, None]).exp_()            # (B, h, c, M)
            dv += probs.transpose(-2, -1) @ do_c
            dlogits = (do_c @ v_t).sub_(delta[:, :, s]).mul_(probs)    # d softmax input
            dq[:, :, s] = (dlogits @ k).mul_(scale)
            dk += (dlogits.transpose(-2, -1) @ q_c).mul_(scale)
            grid = dlogits.view(b, heads, r1 - r0, qw, kh, kw)
            drel_h[:, :, r0:r1] = grid.sum(-1)
            drel_w[:, :, r0:r1] = grid.sum(-2)
        return dq, dk, dv, drel_h, drel_w


def rel_pos_attention(q: Tensor, k: Tensor, v: Tensor, rel_h: Tensor, rel_w: Tensor) -> Tensor:
    """Attention of ``(B, heads, N, d)`` inputs with the decomposed bias of ``rel_h``
    ``(B, heads, qh, qw, kh)`` and ``rel_w`` ``(B, heads, qh, qw, kw)``; no dropout.

    Uses the recomputing backward for fp32 CPU tensors (see the module docstring), and
    ``F.scaled_dot_product_attention`` with the materialised bias otherwise.
    """
    if q.device.type == 'cpu' and q.dtype == torch.float32 and k.dtype == v.dtype == q.dtype \
            and rel_h.dtype == rel_w.dtype == q.dtype:
        return _RelPosAttention.apply(q, k, v, rel_h, rel_w)
    bias = rel_pos_bias_from_terms(rel_h, rel_w).to(q.dtype)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
