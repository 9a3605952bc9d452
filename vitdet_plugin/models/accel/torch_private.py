"""The private torch functions our CPU kernels use, each behind a public fallback.

``setup.py`` admits torch >= 2.4; a private function may move or change between releases. Each
one is looked up once, checked to exist, and replaced by a public (slower or more
memory-hungry, same-valued) equivalent when it does not; ``tests/test_accel.py`` checks that
both give the same values.
"""
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def _lookup(owner: object, name: str) -> Optional[Callable]:
    fn = getattr(owner, name, None)
    return fn if callable(fn) else None


_SOFTMAX_BACKWARD = _lookup(torch, '_softmax_backward_data')
_GELU_INPLACE = _lookup(torch._C._nn, 'gelu_')


def softmax_backward_public(grad: Tensor, probs: Tensor) -> Tensor:
    """Gradient of ``softmax`` over the last dim, from its output ``probs``."""
    return probs * (grad - (grad * probs).sum(-1, keepdim=True))


def softmax_backward(grad: Tensor, probs: Tensor) -> Tensor:
    """:func:`softmax_backward_public` through torch's fused kernel when available."""
    if _SOFTMAX_BACKWARD is None:
        return softmax_backward_public(grad, probs)
    return _SOFTMAX_BACKWARD(grad, probs, -1, probs.dtype)


def gelu_public_(h: Tensor, approximate: str = 'none') -> Tensor:
    """``h = gelu(h)`` through a temporary."""
    return h.copy_(F.gelu(h, approximate=approximate))


def gelu_(h: Tensor, approximate: str = 'none') -> Tensor:
    """In-place GELU (no temporary) when torch has it, else :func:`gelu_public_`."""
    if _GELU_INPLACE is None:
        return gelu_public_(h, approximate)
    return _GELU_INPLACE(h, approximate=approximate)


def gelu_backward(grad: Tensor, h: Tensor, approximate: str = 'none') -> Tensor:
    """Gradient of ``gelu`` at its input ``h`` (a public aten op)."""
    return torch.ops.aten.gelu_backward(grad, h, approximate=approximate)
