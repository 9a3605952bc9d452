"""The residual-branch layers of the transformer blocks here: the feed-forward :class:`Mlp`,
its SwiGLU forms (Shazeer, *GLU Variants Improve Transformer*: ``silu(gate) * value -> fc2``, in
the two parameter layouts the ViT families' checkpoints use), the branch's learned per-channel
scale (:class:`LayerScale`, CaiT) and per-sample stochastic depth (:class:`DropPath`)."""
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Mlp(nn.Module):
    """``fc1 -> act -> drop -> fc2 -> drop`` on ``(..., C)`` tokens."""

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

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


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


class SwiGLU(nn.Module):
    """``fc2(norm(silu(fc1_g x) * fc1_x x))`` on ``(..., C)`` tokens: separate gate and value
    projections; ``norm_eps``: EVA-02 B/L's sub-LN (``ffn_ln``), None (DINOv3 S+/H+): none."""

    def __init__(self, in_features: int, hidden_features: int, norm_eps: Optional[float] = None,
                 drop: float = 0.0) -> None:
        super().__init__()
        self.fc1_g = nn.Linear(in_features, hidden_features)
        self.fc1_x = nn.Linear(in_features, hidden_features)
        self.norm = (nn.LayerNorm(hidden_features, eps=norm_eps) if norm_eps is not None
                     else nn.Identity())
        self.fc2 = nn.Linear(hidden_features, in_features)
        self.drop = nn.Dropout(drop) if drop > 0 else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        hidden = F.silu(self.fc1_g(x)) * self.fc1_x(x)              # (..., hidden)
        return self.drop(self.fc2(self.norm(self.drop(hidden))))


class SwiGLUPacked(nn.Module):
    """``fc2(silu(g) * v)`` with ``[g, v] = fc1 x``, the gate rows first (timm's
    ``SwiGLUPacked``; DINOv2-giant's ``w12`` / ``w3``, EVA-02 T/S)."""

    def __init__(self, in_features: int, hidden_features: int, drop: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, 2 * hidden_features)
        self.fc2 = nn.Linear(hidden_features, in_features)
        self.drop = nn.Dropout(drop) if drop > 0 else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        gate, value = self.fc1(x).chunk(2, dim=-1)                  # 2 x (..., hidden)
        return self.drop(self.fc2(self.drop(F.silu(gate) * value)))


class LayerScale(nn.Module):
    """``x * gamma`` with ``gamma`` ``(C,)`` initialised to ``init_value`` (DINOv2 / DINOv3:
    ``1e-5``, so every block starts close to the identity)."""

    def __init__(self, dim: int, init_value: float) -> None:
        super().__init__()
        self.init_value = float(init_value)
        self.gamma = nn.Parameter(torch.full((dim,), self.init_value))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma

    def extra_repr(self) -> str:
        return f'{self.gamma.shape[0]}, init_value={self.init_value:g}'
