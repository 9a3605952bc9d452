"""Transformer feed-forward block."""
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .chunking import inference_fast_path, map_row_chunks, rows_per_chunk


class _GeluLinear(torch.autograd.Function):
    """``linear(gelu(h))`` that keeps ``h`` but not ``gelu(h)`` for backward.

    Plain autograd stores both the GELU input (for GELU's backward) and its output (for the
    weight gradient of ``fc2``) — two ``hidden``-wide activations per token, the largest
    tensors of a transformer block. The GELU output is recomputed instead (elementwise, cheap).
    """

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        ctx.save_for_backward(h, weight)
        ctx.has_bias = bias is not None
        return F.linear(F.gelu(h), weight, bias)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        h, weight = ctx.saved_tensors
        grad_h = grad_w = grad_b = None
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_w = g2.t() @ F.gelu(h).reshape(-1, h.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:  # also with a frozen weight (BitFit)
            grad_b = g2.sum(0)
        if ctx.needs_input_grad[0]:
            grad_h = torch.ops.aten.gelu_backward(grad_out @ weight, h)
        return grad_h, grad_w, grad_b


class Mlp(nn.Module):
    """``fc1 -> act -> drop -> fc2 -> drop`` on ``(..., C)`` tokens.

    With an exact GELU and no dropout, training forwards recompute the activation in backward
    instead of storing it (same values and gradients, about a quarter less activation memory
    per transformer block).
    """

    def __init__(self,
                 in_features: int,
                 hidden_features: Optional[int] = None,
                 out_features: Optional[int] = None,
                 act_layer: Callable[[], nn.Module] = nn.GELU,
                 drop: float = 0.0) -> None:
        super().__init__()
        hidden_features = hidden_features or in_features
        out_features = out_features or in_features
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = act_layer()
        self.fc2 = nn.Linear(hidden_features, out_features)
        self.drop = nn.Dropout(drop) if drop > 0 else nn.Identity()
        self.recompute_act = (isinstance(self.act, nn.GELU) and self.act.approximate == 'none'
                              and drop == 0)

    def forward(self, x: Tensor) -> Tensor:
        """``(..., C)`` -> ``(..., out_features)``; inference runs over row chunks."""
        if inference_fast_path(x) and x.dim() >= 2:
            flat = x.reshape(-1, x.shape[-1])
            rows = rows_per_chunk(self.fc1.out_features, x.element_size())
            out = map_row_chunks(self._forward, flat, rows, self.fc2.out_features)
            return out.view(*x.shape[:-1], -1)
        return self._forward(x)

    @torch.no_grad()
    def add_to_(self, out: Tensor, x: Tensor) -> Tensor:
        """Inference: ``out += mlp(x)`` for ``(rows, C)`` tensors, with ``fc2`` accumulated
        straight into ``out`` (no output temporary) and the activation applied in place."""
        h = self.fc1(x)
        h = _act_inplace(self.act, h)
        out.addmm_(h, self.fc2.weight.t())
        if self.fc2.bias is not None:
            out.add_(self.fc2.bias)
        return out

    def _forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        if (self.recompute_act and torch.is_grad_enabled() and h.device.type in ('cpu', 'cuda')
                and not torch.is_autocast_enabled(h.device.type)):
            return _GeluLinear.apply(h, self.fc2.weight, self.fc2.bias)
        return self.drop(self.fc2(self.drop(self.act(h))))


def _act_inplace(act: nn.Module, h: Tensor) -> Tensor:
    """``act(h)``, overwriting ``h`` where the activation has an in-place form."""
    if isinstance(act, nn.GELU):
        return torch._C._nn.gelu_(h, approximate=act.approximate)
    if isinstance(act, nn.ReLU):
        return F.relu_(h)
    if isinstance(act, nn.SiLU):
        return F.silu(h, inplace=True)
    return act(h)
