"""Window partition / reverse and padding helpers shared by the Swin and ViT backbones."""
from typing import Tuple

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


def pad_hw(x: Tensor, multiple: Tuple[int, int]) -> Tuple[Tensor, Tuple[int, int]]:
    """Zero-pad a ``(B, H, W, C)`` tensor at the bottom/right to multiples of ``multiple``.

    Returns the padded tensor and its ``(Hp, Wp)``.
    """
    _, h, w, _ = x.shape
    pad_h = (multiple[0] - h % multiple[0]) % multiple[0]
    pad_w = (multiple[1] - w % multiple[1]) % multiple[1]
    if pad_h or pad_w:
        x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))
    return x, (h + pad_h, w + pad_w)


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
