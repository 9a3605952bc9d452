"""Multi-head self-attention through ``F.scaled_dot_product_attention``.

One attention core serves both backbones: Swin's window attention adds its relative-position
bias and shift mask, the ViT adds decomposed relative positions; both pass that as a single
additive ``attn_mask`` to the fused kernel. An eager path (explicit softmax) computes the same
thing for debugging and for the parity test of the fused path.
"""
from contextlib import contextmanager
from typing import Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: Logit added to attention pairs that must not attend (e.g. across a shifted-window
#: boundary). The same value as the reference Swin implementations; finite, so rows never
#: become all ``-inf`` and it is representable without overflow in fp16 and bf16.
MASKED_LOGIT = -100.0


def combine_bias(bias: Optional[Tensor], mask: Optional[Tensor], batch: int) -> Optional[Tensor]:
    """Sum a bias ``(1 | B, heads, N, N)`` and a window-periodic mask ``(nW, 1 | heads, N, N)``
    into one ``attn_mask`` for ``batch`` (``= images * nW``) attention rows."""
    if mask is None:
        return bias
    full = mask if bias is None else bias + mask                    # (nW, heads, N, N)
    if batch != full.shape[0]:
        full = full.unsqueeze(0).expand(batch // full.shape[0], *full.shape).flatten(0, 1)
    return full


def _math_attention(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], scale: float,
                    dropout_p: float = 0.0) -> Tensor:
    attn = (q * scale) @ k.transpose(-2, -1)
    if bias is not None:
        attn = attn + bias
    attn = attn.softmax(dim=-1)
    if dropout_p > 0:
        attn = F.dropout(attn, dropout_p)
    return attn @ v


class _FusedAttentionRecompute(torch.autograd.Function):
    """Fused forward, recomputing backward, for a bias that needs a gradient.

    ``F.scaled_dot_product_attention`` has no fused CPU kernel whose backward yields the
    gradient of ``attn_mask``, so with a trainable bias (relative positions) autograd would
    take the math path and keep every ``(N, N)`` attention matrix alive until backward. Here
    the forward runs the fused kernel without recording a graph and saves only ``q, k, v``
    (views of the ``qkv`` output, stored anyway), the small bias and the cached mask; the
    backward recomputes the attention of the one layer it is processing (bias and mask added
    inside the ``q k^T`` GEMM) and applies the softmax-attention gradient formulas directly,
    without building a second autograd graph.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, mask: Optional[Tensor],
                scale: float) -> Tensor:
        ctx.scale = scale
        ctx.save_for_backward(q, k, v, bias, mask)
        # detached: SDPA picks its backend from requires_grad (grad mode aside), and a mask
        # that requires grad would send it to the slow math path
        full = combine_bias(bias.detach(), mask, q.shape[0]).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=full, scale=scale)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, bias, mask = ctx.saved_tensors
        scale = ctx.scale
        b, h, n, d = q.shape
        m, dv_dim = k.shape[-2], v.shape[-1]
        # the attention of this layer, recomputed: logits = bias + mask + scale * q k^T, the
        # bias written once into the logits buffer (in q's dtype) and the GEMM added in place
        q3, k3, v3 = q.reshape(b * h, n, d), k.reshape(b * h, m, d), v.reshape(b * h, m, dv_dim)
        logits = q.new_empty(b * h, n, m)
        logits.view(b, h, n, m).copy_(combine_bias(bias, mask, b))
        probs = torch.softmax(logits.baddbmm_(q3, k3.transpose(1, 2), alpha=scale), dim=-1)
        del logits
        grad3 = grad_out.reshape(b * h, n, dv_dim)
        grad_v = torch.bmm(probs.transpose(1, 2), grad3)
        grad_logits = torch._softmax_backward_data(torch.bmm(grad3, v3.transpose(1, 2)), probs,
                                                   -1, probs.dtype)
        del probs
        grad_bias = grad_logits.view(b, h, n, m).sum_to_size(bias.shape).to(bias.dtype)
        # d(q k^T) = scale * d(logits); scaled on the (smaller) products, since grad_bias may
        # be grad_logits itself
        grad_q = torch.bmm(grad_logits, k3).mul_(scale).view(b, h, n, d)
        grad_k = torch.bmm(grad_logits.transpose(1, 2), q3).mul_(scale).view(b, h, m, d)
        return grad_q, grad_k, grad_v.view(b, h, m, dv_dim), grad_bias, None, None


def attend(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor] = None,
           dropout_p: float = 0.0, fused: bool = True, scale: Optional[float] = None,
           mask: Optional[Tensor] = None) -> Tensor:
    """Scaled dot-product attention ``softmax(q k^T * scale + bias + mask) v``.

    Args:
        q, k, v: ``(B, heads, N, head_dim)``.
        bias: additive logits broadcastable to ``(B, heads, N, N)``; cast to ``q``'s dtype
            (so it works under fp16/bf16 autocast).
        dropout_p: attention dropout (apply only in training).
        fused: use ``F.scaled_dot_product_attention``; False runs the explicit eager path.
        scale: logit scale; ``head_dim ** -0.5`` when None.
        mask: optional window-periodic additive mask ``(nW, 1 | heads, N, N)`` with
            ``B % nW == 0`` (rows ordered image-major), e.g. Swin's shift mask; kept apart from
            ``bias`` so it is never materialised per image in the autograd graph.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if (fused and dropout_p == 0 and bias is not None and bias.requires_grad
            and torch.is_grad_enabled() and q.device.type == 'cpu'):
        return _FusedAttentionRecompute.apply(q, k, v, bias, mask, scale)
    full = combine_bias(bias, mask, q.shape[0])
    if full is not None and full.dtype != q.dtype:
        full = full.to(q.dtype)
    if fused:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=full, dropout_p=dropout_p,
                                              scale=scale)
    return _math_attention(q, k, v, full, scale, dropout_p)


class Attention(nn.Module):
    """Multi-head self-attention over tokens ``(B, N, C)`` with an optional additive bias.

    Parameter names (``qkv``, ``proj``) follow the official Swin / timm / SAM layouts.

    Args:
        dim: token channels ``C``.
        num_heads: attention heads; ``dim`` must be divisible by it.
        qkv_bias: bias on the fused ``qkv`` projection.
        attn_drop: dropout on attention weights (training only).
        proj_drop: dropout after the output projection.
        fused: default for :attr:`fused`; see :func:`set_fused_attention`.
        scale: logit scale; ``head_dim ** -0.5`` when None.
    """

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, fused: bool = True,
                 scale: Optional[float] = None) -> None:
        super().__init__()
        if num_heads <= 0 or dim % num_heads:
            raise ValueError(f'embed dims {dim} must be divisible by num_heads={num_heads}; '
                             'choose a head count that divides the channel count')
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = float(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop) if proj_drop > 0 else nn.Identity()
        self.fused = fused
        self.scale = scale

    def qkv_heads(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """``(..., N, C)`` -> q, k, v each ``(..., heads, N, head_dim)``."""
        return self.split_heads(self.qkv(x))

    def split_heads(self, qkv: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """The ``qkv`` projection ``(..., N, 3C)`` -> q, k, v (views) ``(..., heads, N, d)``."""
        *lead, n, _ = qkv.shape
        qkv = qkv.view(*lead, n, 3, self.num_heads, self.head_dim)
        qkv = qkv.movedim(-3, 0).transpose(-3, -2)
        return qkv[0], qkv[1], qkv[2]

    def attend_and_project(self, q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor],
                           mask: Optional[Tensor] = None) -> Tensor:
        """Attention of ``(..., heads, N, d)`` inputs, merged and projected to ``(..., N, C)``."""
        out = attend(q, k, v, bias, self.attn_drop if self.training else 0.0, self.fused,
                     self.scale, mask)
        return self.project(self.merge_heads(out))

    @staticmethod
    def merge_heads(out: Tensor) -> Tensor:
        """Attention output ``(..., heads, N, d)`` -> ``(..., N, heads * d)``."""
        return out.transpose(-3, -2).flatten(-2)

    def project(self, x: Tensor) -> Tensor:
        """The output projection (and its dropout) of merged heads ``(..., C)``."""
        return self.proj_drop(self.proj(x))

    def forward(self, x: Tensor, bias: Optional[Tensor] = None,
                mask: Optional[Tensor] = None) -> Tensor:
        """``(B, N, C)`` tokens; ``bias`` / ``mask`` as in :func:`attend`."""
        q, k, v = self.qkv_heads(x)
        return self.attend_and_project(q, k, v, bias, mask)

    def extra_repr(self) -> str:
        return f'num_heads={self.num_heads}, fused={self.fused}'


#: Module classes whose ``fused`` flag :func:`set_fused_attention` and :func:`eager_attention`
#: switch; other attention modules built on :func:`attend` join via
#: :func:`register_fusable_attention`.
_FUSABLE_ATTENTION_TYPES: list = [Attention]


def register_fusable_attention(cls: type) -> type:
    """Let :func:`set_fused_attention` / :func:`eager_attention` switch ``cls.fused``."""
    if cls not in _FUSABLE_ATTENTION_TYPES:
        _FUSABLE_ATTENTION_TYPES.append(cls)
    return cls


def _is_fusable(m: nn.Module) -> bool:
    return isinstance(m, tuple(_FUSABLE_ATTENTION_TYPES))


def set_fused_attention(model: nn.Module, fused: bool) -> nn.Module:
    """Switch every :class:`Attention` (and registered attention module) in ``model`` to the
    fused (SDPA) or eager path."""
    for m in model.modules():
        if _is_fusable(m):
            m.fused = fused
    return model


@contextmanager
def eager_attention(model: nn.Module) -> Iterator[nn.Module]:
    """Context manager running ``model`` with the eager attention path, then restoring it."""
    saved = [(m, m.fused) for m in model.modules() if _is_fusable(m)]
    set_fused_attention(model, False)
    try:
        yield model
    finally:
        for m, fused in saved:
            m.fused = fused
