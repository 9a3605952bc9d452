"""How the CPU inference kernel walks the windows of a flat token buffer.

Built on the CPU, once per (size, batch, window, shift, chunk), and cached (bounded): the
kernel that uses it runs on the CPU only (see :mod:`.dispatch`).
"""
from typing import List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ...functional import to_windows
from .chunking import chunk_slices


class WindowChunk(NamedTuple):
    """A run of windows processed together."""
    windows: slice            # the windows' range in plan order
    rows: Tensor              # (R,) token-buffer rows of the image tokens, in window order
    real: Optional[Tensor]    # (R,) their positions among the W * N window tokens; None: the
                              # windows hold no padding (R == W * N)


class WindowPlan(NamedTuple):
    """The windows of ``B`` images stored in one flat token buffer ``(B * H * W, C)`` (images
    one after another), in chunks of windows that share a kind: windows without padding
    before windows with padding, and windows that need their own attention mask (where a
    shifted window wraps around) after all the others, from plan position ``first_masked`` on.
    Padding tokens are never stored: a padded chunk lists only its image tokens and where they
    sit among its window tokens.

    ``order[i]``: the index (:func:`window_partition` order, within its image) of the ``i``-th
    window of the plan, e.g. to pick the rows of a per-window mask.
    """
    chunks: Tuple[WindowChunk, ...]
    order: Tensor             # (B * nW,) int64
    first_masked: int


def window_sources(hw: Tuple[int, int], window_size: Tuple[int, int],
                   shift_size: Tuple[int, int]) -> Tensor:
    """``(nW, N)``: the flat ``H * W`` position of every token of every window of
    :func:`~vitdet_plugin.functional.to_windows` (the plain path's window flow), ``-1`` for
    padding."""
    h, w = hw
    grid = torch.arange(h * w).view(1, h, w, 1) + 1                 # 0 marks padding
    windows, _ = to_windows(grid, window_size, shift_size)          # (nW, N, 1)
    return windows.squeeze(-1) - 1                                  # (nW, N)


def window_plan(sources: Tensor, batch: int, windows_per_chunk: int,
                masked: Optional[Tensor] = None) -> WindowPlan:
    """The :class:`WindowPlan` of ``batch`` images windowed as ``sources`` (see
    :func:`window_sources`), in chunks of at most ``windows_per_chunk`` windows; ``masked``:
    ``(nW,)`` bool, the windows (of one image) that need a mask of their own."""
    tokens = int((sources >= 0).sum())
    is_pad = sources < 0
    src = sources.clamp(min=0)
    padded = is_pad.any(1)
    masked = torch.zeros_like(padded) if masked is None else masked.bool()
    chunks: List[WindowChunk] = []
    order: List[Tensor] = []
    start = first_masked = 0
    for kind_masked in (False, True):
        if kind_masked:
            first_masked = start
        for kind_padded in (False, True):
            group = torch.nonzero((masked if kind_masked else ~masked)
                                  & (padded if kind_padded else ~padded)).view(-1)
            if not group.numel():
                continue
            wins = group.repeat(batch)                               # image-major
            image = torch.arange(batch).repeat_interleave(group.numel()).unsqueeze(1)
            rows = src[wins] + image * tokens                        # (B * G, N)
            for part in chunk_slices(wins.numel(), windows_per_chunk):
                chunk_rows, real = rows[part].reshape(-1), None
                if kind_padded:
                    real = torch.nonzero(~is_pad[wins[part]].reshape(-1)).view(-1)
                    chunk_rows = chunk_rows[real]
                chunks.append(WindowChunk(slice(start + part.start, start + part.stop),
                                          chunk_rows, real))
            order.append(wins)
            start += wins.numel()
    return WindowPlan(tuple(chunks), torch.cat(order), first_masked)
