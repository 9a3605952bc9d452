"""Row-chunked evaluation of token-wise functions for inference.

Large temporaries (the ``4C``-wide MLP hidden layer, the ``3C``-wide ``qkv``) cost more than
their arithmetic on CPU: every fresh multi-megabyte allocation is page-faulted in again
(glibc serves blocks above its mmap threshold, at most 32 MiB, straight from the kernel), and
the elementwise pass that follows a GEMM finds the data already evicted from cache. Evaluating
token-independent functions over chunks of rows keeps those temporaries small and reused.
Only for inference: under autograd every chunk's activations would be kept anyway.
"""
from typing import Callable, List

import torch
from torch import Tensor

#: Target size of the largest temporary of one chunk.
CHUNK_BYTES = 8 << 20


def inference_fast_path(x: Tensor) -> bool:
    """Whether the chunked / in-place inference paths may run on ``x``: no autograd graph is
    being recorded and no autocast is active on ``x``'s device. Those paths write results
    into buffers of the input's dtype; under autocast the plain path runs, so every op gets
    autocast's dtype exactly as in eager PyTorch."""
    if x.device.type == 'meta':  # shapes only: the plain path gives them
        return False
    return not torch.is_grad_enabled() and not torch.is_autocast_enabled(x.device.type)


def rows_per_chunk(widest: int, element_size: int = 4) -> int:
    """Rows per chunk so that a ``(rows, widest)`` temporary stays near :data:`CHUNK_BYTES`."""
    return max(1, CHUNK_BYTES // max(1, widest * element_size))


def chunk_slices(n: int, rows: int) -> List[slice]:
    """``range(n)`` in the fewest chunks of at most ``rows``, of (nearly) equal size: no small
    remainder chunk, whose GEMMs would run far below peak."""
    count = max(1, -(-n // max(1, rows)))
    bounds = [i * n // count for i in range(count + 1)]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def chunk_rows(a: Tensor, part: slice, n: int) -> Tensor:
    """``a[part]`` when ``a`` has ``n`` rows (chunked alongside the data), else ``a`` whole
    (a broadcast operand, e.g. a bias shared by every window)."""
    return a[part] if a.dim() and a.shape[0] == n else a


def map_row_chunks(fn: Callable[..., Tensor], x: Tensor, rows: int, out_features: int,
                   *args: Tensor) -> Tensor:
    """``fn(x, *args)`` evaluated over chunks of ``rows`` along dim 0; same result.

    ``fn`` must treat rows independently and return ``(rows, ..., out_features)`` with the
    trailing shape of ``x`` otherwise unchanged. Each of ``args`` whose dim 0 matches ``x`` is
    chunked alongside (e.g. a per-window bias); the others are passed whole (broadcast).
    """
    n = x.shape[0]
    if n <= rows or not inference_fast_path(x):
        return fn(x, *args)
    out = x.new_empty(*x.shape[:-1], out_features)
    for part in chunk_slices(n, rows):
        out[part] = fn(x[part], *(chunk_rows(a, part, n) for a in args))
    return out


def map_height_chunks(fn: Callable[[Tensor], Tensor], x: Tensor, out: Tensor) -> Tensor:
    """Inference: ``out[:, i] = fn(x[:, i])`` for ``(B, H, ...)`` tensors, over chunks of ``H``
    whose temporaries stay near :data:`CHUNK_BYTES`. ``out`` may be any strided view, e.g. an
    NCHW result seen as NHWC, so ``fn``'s output is written straight into its final layout."""
    step = rows_per_chunk(x[:, :1].numel(), x.element_size())
    for part in chunk_slices(x.shape[1], step):
        out[:, part] = fn(x[:, part])
    return out
