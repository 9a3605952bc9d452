"""Row-chunked evaluation of token-wise functions for CPU inference.

Large temporaries (the ``4C``-wide MLP hidden layer, the ``3C``-wide ``qkv``) cost more than
their arithmetic on CPU: every fresh multi-megabyte allocation is page-faulted in again
(glibc serves blocks above its mmap threshold, at most 32 MiB, straight from the kernel), and
the elementwise pass that follows a GEMM finds the data already evicted from cache. Evaluating
token-independent functions over chunks of rows keeps those temporaries small and reused.
Only for inference: under autograd every chunk's activations would be kept anyway.
"""
from typing import Callable, List

from torch import Tensor

#: Target size of the largest temporary of one chunk.
CHUNK_BYTES = 8 << 20


def rows_per_chunk(widest: int, element_size: int = 4) -> int:
    """Rows per chunk so that a ``(rows, widest)`` temporary stays near :data:`CHUNK_BYTES`."""
    return max(1, CHUNK_BYTES // max(1, widest * element_size))


def chunk_slices(n: int, rows: int) -> List[slice]:
    """``range(n)`` in the fewest chunks of at most ``rows``, of (nearly) equal size: no small
    remainder chunk, whose GEMMs would run far below peak."""
    count = max(1, -(-n // max(1, rows)))
    bounds = [i * n // count for i in range(count + 1)]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def map_height_chunks(fn: Callable[[Tensor], Tensor], x: Tensor, out: Tensor) -> Tensor:
    """Inference: ``out[:, i] = fn(x[:, i])`` for ``(B, H, ...)`` tensors, over chunks of ``H``
    whose temporaries stay near :data:`CHUNK_BYTES`. ``out`` may be any strided view, e.g. an
    NCHW result seen as NHWC, so ``fn``'s output is written straight into its final layout."""
    step = rows_per_chunk(x[:, :1].numel(), x.element_size())
    for part in chunk_slices(x.shape[1], step):
        out[:, part] = fn(x[:, part])
    return out
