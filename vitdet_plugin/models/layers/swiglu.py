"""SwiGLU feed-forward layers (Shazeer, *GLU Variants Improve Transformer*): ``silu(gate) *
value -> fc2``, in the two parameter layouts the ViT families' checkpoints use (and DEIMv2's
decoder FFN)."""
from typing import Optional

import torch.nn.functional as F
from torch import Tensor, nn


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
