"""LayerScale (CaiT): a learned per-channel scale of a residual branch."""
import torch
from torch import Tensor, nn


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
