"""Residual connection."""
import torch
from torch import Tensor


def residual_add(x: Tensor, branch: Tensor) -> Tensor:
    """``x + branch``. Without autograd the sum is accumulated into ``branch``, which must be a
    fresh tensor (a block's branch output), saving one allocation per residual."""
    return x + branch if torch.is_grad_enabled() else branch.add_(x)
