"""Window partition / reverse and padding helpers shared by the Swin and ViT backbones."""
from typing import Optional, Tuple

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


def window_gather_index(hw: Tuple[int, int], window_size: Tuple[int, int],
                        shift_size: Tuple[int, int] = (0, 0),
                        device: Optional[torch.device] = None) -> Tuple[Tensor, Tensor]:
    """Index pair that turns padding + cyclic shift + :func:`window_partition` into one gather.

    For a ``(H, W)`` token grid flattened to ``H * W`` rows (plus one extra zero row at index
    ``H * W`` standing for the padding), returns

    * ``fwd`` ``(nW * N,)``: the row of each windowed token, i.e. ``tokens[:, fwd]`` equals
      ``window_partition(roll(pad(x), -shift))`` flattened;
    * ``rev`` ``(H * W,)``: where each original token sits among the windowed ones, i.e.
      ``windows[:, rev]`` undoes the partition, the shift and the padding.
    """
    h, w = hw
    grid = torch.arange(h * w, device='cpu').view(1, h, w, 1)  # CPU: cheap, once per size
    grid, _ = pad_hw(grid, window_size, value=h * w)
    if any(shift_size):
        grid = torch.roll(grid, shifts=(-shift_size[0], -shift_size[1]), dims=(1, 2))
    fwd = window_partition(grid, window_size).reshape(-1)
    valid = fwd < h * w
    rev = torch.empty(h * w, dtype=torch.long, device='cpu')
    rev[fwd[valid]] = torch.arange(fwd.numel(), device='cpu')[valid]
    return fwd.to(device), rev.to(device)
