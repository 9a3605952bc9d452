"""The feed-forward :class:`Mlp` of every transformer block here (stochastic depth, the other
residual-branch layer, is in :mod:`.drop_path`)."""
from typing import Callable, Optional

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
