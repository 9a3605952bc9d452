"""The two residual-branch layers every transformer block here uses: the feed-forward
:class:`Mlp` and per-sample stochastic depth (:class:`DropPath`).

:class:`Mlp` has one CPU training kernel, picked by its own forward (as timm's attention picks
``fused_attn``): :func:`gelu_linear` keeps ``fc1``'s output for backward but not the GELU of it,
and recomputes the GELU there (measured in docs/speed.md: 15-20% fewer saved activations, same
step time). It is a ``torch.library`` custom op (registered backward and fake implementation),
so ``torch.compile`` keeps it as one graph node; exported graphs (``torch.export``, ONNX,
``torch.jit.trace``) take the plain path.
"""
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: Namespace of the custom op (``torch.ops.vitdet_plugin.gelu_linear``).
OPS_NAMESPACE = 'vitdet_plugin'
#: Device types where :func:`gelu_linear` was measured to help (the CPU; CUDA is unmeasured).
RECOMPUTE_GELU_DEVICES = ('cpu',)


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
    g2 = grad_out.reshape(-1, grad_out.shape[-1])                    # (tokens, out)
    grad_w = g2.t() @ F.gelu(h).reshape(-1, h.shape[-1]) if need_weight else h.new_empty(0)
    grad_b = g2.sum(0) if need_bias else h.new_empty(0)  # also with a frozen weight (BitFit)
    grad_h = (torch.ops.aten.gelu_backward(grad_out @ weight, h).contiguous() if need_h
              else h.new_empty(0))
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
    # grad mode is on in a backward only with create_graph=True: then the differentiable ops
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


def exporting_graph() -> bool:
    """True while ``torch.export`` (hence the dynamo ONNX exporter), TorchScript tracing or the
    TorchScript ONNX exporter records the forward: graphs meant to leave PyTorch, which hold
    only standard ops."""
    return (torch.compiler.is_exporting() or torch.jit.is_tracing()
            or torch.onnx.is_in_onnx_export())


class Mlp(nn.Module):
    """``fc1 -> act -> drop -> fc2 -> drop`` on ``(..., C)`` tokens.

    ``recompute_gelu`` (default True; a backbone's ``accel='off'`` clears it): in CPU training
    with an exact GELU and no dropout, ``act -> fc2`` runs as :func:`gelu_linear`.
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
        self.recompute_gelu = True

    def _recomputes_gelu(self, x: Tensor) -> bool:
        """Whether this call takes :func:`gelu_linear` (see the class docstring)."""
        return (self.recompute_gelu and torch.is_grad_enabled()
                and x.device.type in RECOMPUTE_GELU_DEVICES
                and isinstance(self.act, nn.GELU) and self.act.approximate == 'none'
                and isinstance(self.drop, nn.Identity)
                and not torch.is_autocast_enabled(x.device.type) and not exporting_graph())

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)                                              # (..., hidden)
        if self._recomputes_gelu(h):
            return gelu_linear(h, self.fc2.weight, self.fc2.bias)    # (..., out)
        return self.drop(self.fc2(self.drop(self.act(h))))


class DropPath(nn.Module):
    """Stochastic depth: zero whole residual branches per sample with probability
    ``drop_prob``, rescaling the rest (identity in eval mode or when ``drop_prob == 0``)."""

    def __init__(self, drop_prob: float = 0.0) -> None:
        super().__init__()
        if not 0.0 <= drop_prob < 1.0:
            raise ValueError(f'drop_prob must be in [0, 1), got {drop_prob}')
        self.drop_prob = float(drop_prob)

    def forward(self, x: Tensor) -> Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1.0 - self.drop_prob
        shape = (x.shape[0],) + (1,) * (x.ndim - 1)                 # (B, 1, ..., 1)
        mask = x.new_empty(shape).bernoulli_(keep)
        return x * mask.div_(keep)

    def extra_repr(self) -> str:
        return f'drop_prob={self.drop_prob:g}'


def linear_drop_path_rates(drop_path_rate: float, depth: int) -> List[float]:
    """The linear stochastic-depth schedule: block ``i`` of ``depth`` gets
    ``rate * i / (depth - 1)``."""
    if depth <= 0:
        return []
    # an explicit CPU device: models can then be built under a meta default device
    return torch.linspace(0, drop_path_rate, depth, device='cpu').tolist()


def set_recompute_gelu(model: nn.Module, enabled: bool) -> nn.Module:
    """Switch the GELU recompute of every :class:`Mlp` in ``model`` (``accel='off'``: False)."""
    for m in model.modules():
        if isinstance(m, Mlp):
            m.recompute_gelu = enabled
    return model
