"""Window partition / reverse and padding helpers shared by the Swin and ViT backbones."""
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .chunking import chunk_slices


def padded_size(hw: Tuple[int, int], multiple: Tuple[int, int]) -> Tuple[int, int]:
    """``(H, W)`` rounded up to multiples of ``multiple``."""
    return (-(-hw[0] // multiple[0]) * multiple[0], -(-hw[1] // multiple[1]) * multiple[1])


def pad_hw(x: Tensor, multiple: Tuple[int, int],
           value: float = 0.0) -> Tuple[Tensor, Tuple[int, int]]:
    """Pad a ``(B, H, W, C)`` tensor at the bottom/right to multiples of ``multiple``.

    Returns the padded tensor and its ``(Hp, Wp)``.
    """
    h, w = x.shape[1:3]
    hp, wp = padded_size((h, w), multiple)
    if hp != h or wp != w:
        x = F.pad(x, (0, 0, 0, wp - w, 0, hp - h), value=value)
    return x, (hp, wp)


def window_partition(x: Tensor, window_size: Tuple[int, int]) -> Tensor:
    """Split ``(B, H, W, C)`` into windows ``(B * nW, wh * ww, C)``.

    ``H`` and ``W`` must be multiples of the window size (see :func:`pad_hw`). Windows are
    ordered row-major per image, images one after another.
    """
    b, h, w, c = x.shape
    wh, ww = window_size
    x = x.view(b, h // wh, wh, w // ww, ww, c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, wh * ww, c)


def window_reverse(windows: Tensor, window_size: Tuple[int, int], hw: Tuple[int, int]) -> Tensor:
    """Inverse of :func:`window_partition`: ``(B * nW, wh * ww, C)`` -> ``(B, H, W, C)``."""
    wh, ww = window_size
    h, w = hw
    c = windows.shape[-1]
    x = windows.view(-1, h // wh, w // ww, wh, ww, c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, h, w, c)


class WindowIndex(NamedTuple):
    """Gather indices that pad, cyclically shift and partition a flattened ``(H, W)`` token
    grid into windows in one copy, and undo it (see :func:`window_gather_index`)."""
    fwd: Tensor   # (nW * N,) source row of every windowed token (padding rows point at 0)
    rev: Tensor   # (H * W,)  position of every original token among the windowed ones
    pad: Tensor   # (P,)      windowed positions that are padding (to be zeroed)

    def partition(self, tokens: Tensor, window_tokens: int) -> Tensor:
        """``(B, H * W, C)`` -> windows ``(B * nW, N, C)`` with zero padding."""
        windows = _WindowGather.apply(tokens, self, False)
        return windows.view(-1, window_tokens, tokens.shape[-1])

    def reverse(self, windows: Tensor, batch: int) -> Tensor:
        """Windows ``(B * nW, N, C)`` -> ``(B, H * W, C)`` (shift and padding undone)."""
        return _WindowGather.apply(windows.reshape(batch, -1, windows.shape[-1]), self, True)

    def gather(self, tokens: Tensor) -> Tensor:
        """``(B, H * W, C)`` -> ``(B, nW * N, C)``, padding zeroed (no autograd graph)."""
        windows = tokens.index_select(1, self.fwd)
        if self.pad.numel():
            windows.index_fill_(1, self.pad, 0.0)
        return windows

    def ungather(self, windows: Tensor) -> Tensor:
        """``(B, nW * N, C)`` -> ``(B, H * W, C)``, padding dropped (no autograd graph)."""
        return windows.index_select(1, self.rev)


class _WindowGather(torch.autograd.Function):
    """:meth:`WindowIndex.gather` (``inverse=False``) or :meth:`WindowIndex.ungather`
    (``inverse=True``), whose backward is the other one: every image token sits at exactly one
    windowed position and padding is constant (its gradient is zero), so the gradient is a
    gather too (autograd's own would zero-fill a buffer and scatter-add into it)."""

    @staticmethod
    def forward(ctx, x: Tensor, index: 'WindowIndex',  # type: ignore[override]
                inverse: bool) -> Tensor:
        ctx.index, ctx.inverse = index, inverse
        return index.ungather(x) if inverse else index.gather(x)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        back = ctx.index.gather(grad) if ctx.inverse else ctx.index.ungather(grad)
        return back, None, None


class WindowChunk(NamedTuple):
    """A run of windows that the in-place inference path processes together (see
    :func:`window_plan`)."""
    windows: slice            # the windows' range in plan order
    rows: Tensor              # (R,) token-buffer rows of the image tokens, in window order
    real: Optional[Tensor]    # (R,) their positions among the W * N window tokens; None: the
                              # windows hold no padding (R == W * N)


class WindowPlan(NamedTuple):
    """How inference walks the windows of ``B`` images stored in one flat token buffer
    ``(B * H * W, C)`` (images one after another), in chunks of windows that share a kind:
    windows without padding before windows with padding, and windows that need their own
    attention mask (e.g. where a shifted window wraps around) after all the others, from plan
    position ``first_masked`` on. Padding tokens are never stored: a padded chunk lists only
    its image tokens and where they sit among its window tokens.

    ``order[i]``: the index (:func:`window_partition` order, within its image) of the ``i``-th
    window of the plan, e.g. to pick the rows of a per-window mask.
    """
    chunks: Tuple[WindowChunk, ...]
    order: Tensor             # (B * nW,) int64
    first_masked: int


def window_plan(index: WindowIndex, batch: int, window_tokens: int, windows_per_chunk: int,
                masked: Optional[Tensor] = None) -> WindowPlan:
    """The :class:`WindowPlan` of ``batch`` images windowed by ``index``, in chunks of at most
    ``windows_per_chunk`` windows; ``masked``: ``(nW,)`` bool, the windows (of one image) that
    need a mask of their own. Built on the CPU (once per size), moved to ``index``'s device."""
    device = index.fwd.device
    src = index.fwd.cpu().view(-1, window_tokens)                   # (nW, N)
    num_windows, tokens = src.shape[0], index.rev.numel()
    is_pad = torch.zeros(src.numel(), dtype=torch.bool)
    is_pad[index.pad.cpu()] = True
    is_pad = is_pad.view(num_windows, window_tokens)
    padded = is_pad.any(1)
    masked = torch.zeros_like(padded) if masked is None else masked.cpu().bool()
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
                    chunk_rows, real = chunk_rows[real], real.to(device)
                chunks.append(WindowChunk(slice(start + part.start, start + part.stop),
                                          chunk_rows.to(device), real))
            order.append(wins)
            start += wins.numel()
    return WindowPlan(tuple(chunks), torch.cat(order).to(device), first_masked)


def window_gather_index(hw: Tuple[int, int], window_size: Tuple[int, int],
                        shift_size: Tuple[int, int] = (0, 0),
                        device: Optional[torch.device] = None) -> WindowIndex:
    """The :class:`WindowIndex` equal to ``window_partition(roll(pad(x), -shift))`` and back.

    Padding is zeros at the bottom/right, as in :func:`pad_hw`; the shift is a cyclic roll of
    the padded map by ``-shift_size``.
    """
    h, w = hw
    grid = torch.arange(h * w, device='cpu').view(1, h, w, 1)  # CPU: cheap, once per size
    grid, _ = pad_hw(grid, window_size, value=-1)
    if any(shift_size):
        grid = torch.roll(grid, shifts=(-shift_size[0], -shift_size[1]), dims=(1, 2))
    src = window_partition(grid, window_size).reshape(-1)
    valid = src >= 0
    positions = torch.arange(src.numel(), device='cpu')
    rev = torch.empty(h * w, dtype=torch.long, device='cpu')
    rev[src[valid]] = positions[valid]
    return WindowIndex(src.clamp(min=0).to(device), rev.to(device), positions[~valid].to(device))
