"""The one attention-kernel switch: the explicit formula instead of SDPA, for export and FLOPs."""
from contextlib import contextmanager
from typing import Any, Iterator, List

from torch import nn

__all__ = ['eager_attention']


@contextmanager
def eager_attention(model: nn.Module) -> Iterator[nn.Module]:
    """Run ``model`` with the explicit attention formula instead of SDPA, then restore it: the
    one kernel switch, for every attention module of ours (each calls :func:`attend` with its
    ``fused`` flag). ONNX export and FLOP counting use it."""
    modules: List[Any] = list(model.modules())
    saved = [(m, m.fused) for m in modules if isinstance(getattr(m, 'fused', None), bool)]
    for m, _ in saved:
        m.fused = False
    try:
        yield model
    finally:
        for m, fused in saved:
            m.fused = fused
