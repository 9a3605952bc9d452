"""Residual connection."""
from torch import Tensor

from .chunking import inference_fast_path


def residual_add(x: Tensor, branch: Tensor) -> Tensor:
    """``x + branch``. Without autograd the sum is accumulated into ``branch``, which must be a
    fresh tensor (a block's branch output), saving one allocation per residual."""
    return branch.add_(x) if inference_fast_path(x) else x + branch
