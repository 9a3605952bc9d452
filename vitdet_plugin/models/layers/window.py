"""Window partition / reverse and padding helpers shared by the Swin and ViT backbones."""
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor


def to_2tuple(value) -> Tuple[int, int]:
    """``7 -> (7, 7)``; ``(7, 9) -> (7, 9)``."""
    if isinstance(value, int):
        return (value, value)
    value = tuple(int(v) for v in value)
    if len(value) != 2:
        raise ValueError(f'expected an int or a pair of ints, got {value!r}')
    return value  # type: ignore[return-value]


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
        windows = tokens.index_select(1, self.fwd)
        if self.pad.numel():
            windows.index_fill_(1, self.pad, 0.0)
        return windows.view(-1, window_tokens, tokens.shape[-1])

    def reverse(self, windows: Tensor, batch: int) -> Tensor:
        """Windows ``(B * nW, N, C)`` -> ``(B, H * W, C)`` (shift and padding undone)."""
        return windows.reshape(batch, -1, windows.shape[-1]).index_select(1, self.rev)

    def batched(self, batch: int) -> 'BatchedWindowIndex':
        """The gather for ``batch`` images stored in one token buffer (see
        :class:`BatchedWindowIndex`)."""
        tokens = self.rev.numel()
        offsets = torch.arange(batch, device=self.fwd.device).mul_(tokens).unsqueeze(1)
        rows = (self.fwd.unsqueeze(0) + offsets)                      # (B, nW * N)
        pad = None
        if self.pad.numel():
            rows[:, self.pad] = batch * tokens
            images = torch.arange(batch, device=self.pad.device).unsqueeze(1)
            pad = (self.pad.unsqueeze(0) + images * self.fwd.numel()).view(-1).cpu()
        return BatchedWindowIndex(rows.view(-1), pad)


class BatchedWindowIndex(NamedTuple):
    """Window rows of ``B`` images in a flat token buffer ``(B * H * W + 1, C)``.

    The buffer holds the images' tokens one after another, then one scratch row. ``rows[i]`` is
    the buffer row of windowed token ``i`` (windows ordered as in :func:`window_partition`);
    padding tokens point at the scratch row, so a gather reads it and a scatter-add writes into
    it, never into an image token. ``pad`` lists those padding positions, ascending, on the
    CPU (None: no padding).
    """
    rows: Tensor             # (B * nW * N,) int64
    pad: Optional[Tensor]    # (P * B,) int64, ascending, CPU

    def pad_in(self, part: slice) -> Optional[Tensor]:
        """Padding positions inside ``rows[part]``, relative to ``part.start`` (None: none)."""
        if self.pad is None:
            return None
        lo, hi = torch.searchsorted(self.pad, torch.tensor([part.start, part.stop])).tolist()
        return self.pad[lo:hi] - part.start if hi > lo else None


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
