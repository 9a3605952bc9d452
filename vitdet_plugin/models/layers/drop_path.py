"""Stochastic depth for the backbones' residual branches: :class:`DropPath` and its linear
per-block rate schedule."""
from typing import List

import torch
from torch import Tensor, nn


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
