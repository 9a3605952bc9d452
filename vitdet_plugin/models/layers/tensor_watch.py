"""Change detection for tensors that derived inference caches are built from.

A cache built from a parameter (Swin's gathered relative-position bias, the ViT's resized
position embedding) must be rebuilt whenever that parameter changes. Autograd's version counter
misses two common ways: a new tensor swapped in (``load_state_dict(..., assign=True)``, a
replaced ``nn.Parameter``) and writes through ``.data`` (mmengine's EMA update and its
``EMAHook`` parameter swap). :class:`TensorWatch` keys on the tensor's identity, storage and
version, and on CPU also compares the contents with a snapshot (the watched tensors are small,
a few KB to a few hundred KB); on accelerators it skips that comparison, which would stall the
stream on every call.
"""
import functools
from typing import Callable, Optional, TypeVar

import torch
from torch import Tensor

F = TypeVar('F', bound=Callable)


def builds_cache(fn: F) -> F:
    """Decorate a method that builds tensors kept across calls (windowing indices, masks,
    gathered biases): they are made as normal tensors even under ``torch.inference_mode()``
    (a later autograd forward may use them) and without autograd history (``inference_mode
    (False)`` alone would switch grad mode on, and a cached bias that requires grad sends
    SDPA to its slow math path)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.inference_mode(False), torch.no_grad():
            return fn(*args, **kwargs)
    return wrapper  # type: ignore[return-value]


class TensorWatch:
    """``changed(t)`` is True on the first call and whenever ``t`` differs from the last call."""

    def __init__(self) -> None:
        self._key: Optional[tuple] = None
        self._snapshot: Optional[Tensor] = None

    def changed(self, t: Tensor) -> bool:
        key = (id(t), t.data_ptr(), t._version, t.device, t.dtype, tuple(t.shape))
        on_cpu = t.device.type == 'cpu'
        if key == self._key and (not on_cpu or torch.equal(t, self._snapshot)):
            return False
        self._key = key
        self._snapshot = t.detach().clone() if on_cpu else None
        return True

    def reset(self) -> None:
        self._key = self._snapshot = None
