"""Transformer feed-forward block."""
from typing import Callable, Optional

from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..accel import check_accel, gelu_linear, plan_for_tensor


class Mlp(nn.Module):
    """``fc1 -> act -> drop -> fc2 -> drop`` on ``(..., C)`` tokens.

    Args:
        accel: ``'auto'``: on the CPU, training forwards with an exact GELU and no dropout
            recompute the activation in backward instead of storing it (same values and
            gradients, about a quarter less activation memory per transformer block; see
            :mod:`~vitdet_plugin.models.accel`); ``'off'``: the plain path everywhere.
    """

    def __init__(self,
                 in_features: int,
                 hidden_features: Optional[int] = None,
                 out_features: Optional[int] = None,
                 act_layer: Callable[[], nn.Module] = nn.GELU,
                 drop: float = 0.0,
                 accel: str = 'off') -> None:
        super().__init__()
        hidden_features = hidden_features or in_features
        out_features = out_features or in_features
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = act_layer()
        self.fc2 = nn.Linear(hidden_features, out_features)
        self.drop = nn.Dropout(drop) if drop > 0 else nn.Identity()
        self.accel = check_accel(accel)
        self.exact_gelu = (isinstance(self.act, nn.GELU) and self.act.approximate == 'none'
                           and drop == 0)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)                                              # (..., hidden)
        plan = plan_for_tensor(h, self.accel)
        if self.exact_gelu and plan.recompute_gelu:
            if plan.compiled:
                # a checkpointed region: the compiler keeps h and recomputes the GELU inside
                # its fused GELU-backward kernel (its fusion beats the custom op's eager one)
                return checkpoint(self._act_fc2, h, use_reentrant=False)
            return gelu_linear(h, self.fc2.weight, self.fc2.bias)
        return self.drop(self.fc2(self.drop(self.act(h))))

    def _act_fc2(self, h: Tensor) -> Tensor:
        return self.fc2(self.act(h))
