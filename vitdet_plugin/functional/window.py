"""The one window flow of window attention (Swin V1, V2, ViT): pad, shift, partition
(:func:`to_windows`), attend (:func:`window_attend`) and back (:func:`from_windows`)."""
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention import attend
from .sizes import SizeCache, SizeLike, known_zero

#: Logit added to attention pairs that must not attend (tokens of different regions of a
#: shifted window). The reference Swin implementations' value: finite, so no row is all
#: ``-inf``, and representable in fp16 and bf16.
MASKED_LOGIT = -100.0

#: Regions per axis of a shifted window map (see :func:`shifted_window_mask`).
NUM_REGIONS = 3

_SHIFT_MASKS: SizeCache[Tensor] = SizeCache()


def padded_size(hw: Tuple[int, int], multiple: Tuple[int, int]) -> Tuple[int, int]:
    """``(H, W)`` rounded up to multiples of ``multiple``.

    Written with non-negative operands only: a symbolic size exported to ONNX becomes an
    integer ``Div``, which truncates (``-(-h // m)`` would be off by one for odd ``h``).
    """
    return ((hw[0] + multiple[0] - 1) // multiple[0] * multiple[0],
            (hw[1] + multiple[1] - 1) // multiple[1] * multiple[1])


def pad_to_multiple(x: Tensor, multiple: Tuple[int, int]) -> Tensor:
    """Zero-pad a ``(B, H, W, C)`` tensor at the bottom/right to multiples of ``multiple``."""
    h, w = x.shape[1:3]
    hp, wp = padded_size((h, w), multiple)  # ceil-div: simple symbolic sizes downstream
    pad_h, pad_w = hp - h, wp - w
    if not known_zero(pad_h, pad_w):  # symbolic sizes always pad (maybe by 0): no guard
        x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))                    # (B, Hp, Wp, C)
    return x


def window_partition(x: Tensor, window_size: Tuple[int, int]) -> Tensor:
    """Split ``(B, H, W, C)`` into windows ``(B * nW, wh * ww, C)``.

    ``H`` and ``W`` must be multiples of the window size (see :func:`pad_to_multiple`).
    Windows are ordered row-major per image, images one after another.
    """
    b, h, w, c = x.shape
    wh, ww = window_size
    nh, nw = h // wh, w // ww
    x = x.view(b, nh, wh, nw, ww, c)                      # (B, H/wh, wh, W/ww, ww, C)
    # explicit sizes, no -1: under symbolic shapes inferring it costs the tracer seconds
    return x.permute(0, 1, 3, 2, 4, 5).reshape(b * nh * nw, wh * ww, c)


def window_reverse(windows: Tensor, window_size: Tuple[int, int], hw: Tuple[int, int]) -> Tensor:
    """Inverse of :func:`window_partition`: ``(B * nW, wh * ww, C)`` -> ``(B, H, W, C)``."""
    wh, ww = window_size
    h, w = hw
    c = windows.shape[-1]
    nh, nw = h // wh, w // ww
    b = windows.shape[0] // (nh * nw)  # explicit sizes, no -1 (see window_partition)
    x = windows.view(b, nh, nw, wh, ww, c)                # (B, H/wh, W/ww, wh, ww, C)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)


def region_labels(length: SizeLike, window: int, shift: int,
                  device: Optional[torch.device]) -> Tensor:
    """Region of each position along one padded axis after the cyclic shift: 0 in
    ``[0, L - window)``, 1 in ``[L - window, L - shift)``, 2 in ``[L - shift, L)`` (the Swin
    detection code's slices). Without a shift on this axis, one region: nothing wraps."""
    pos = torch.arange(length, device=device)
    if shift == 0:
        return torch.zeros_like(pos)
    return (pos >= length - window).long() + (pos >= length - shift).long()


def _build_shift_mask(hw: Tuple[SizeLike, SizeLike], window_size: Tuple[int, int],
                      shift_size: Tuple[int, int], device: Optional[torch.device],
                      dtype: torch.dtype) -> Tensor:
    """The mask of :func:`shifted_window_mask`, built from the sizes with tensor ops only (no
    in-place slice writes, no branch on the sizes), so symbolic sizes trace into one graph."""
    hp, wp = hw
    rows = region_labels(hp, window_size[0], shift_size[0], device)      # (Hp,)
    cols = region_labels(wp, window_size[1], shift_size[1], device)      # (Wp,)
    region = (rows[:, None] * NUM_REGIONS + cols[None, :])[None, :, :, None]  # (1, Hp, Wp, 1)
    windows = window_partition(region, window_size).squeeze(-1)     # (nW, N)
    different = windows.unsqueeze(1) != windows.unsqueeze(2)        # (nW, N, N)
    return torch.zeros(different.shape, device=device, dtype=dtype).masked_fill(
        different, MASKED_LOGIT)


def shifted_window_mask(hw: Tuple[SizeLike, SizeLike], window_size: Tuple[int, int],
                        shift_size: Tuple[int, int], device: Optional[torch.device] = None,
                        dtype: torch.dtype = torch.float32) -> Tensor:
    """Additive mask ``(nW, N, N)`` for shifted-window attention on a padded ``(Hp, Wp)`` map,
    cached per (size, window, shift, device, dtype); do not write into it.

    After the cyclic shift by ``-shift_size``, windows on the bottom/right border mix tokens
    from up to four image regions; tokens may only attend within their own region (others get
    :data:`MASKED_LOGIT`). Region layout as in the Swin detection code: ``[0, -w)``,
    ``[-w, -s)``, ``[-s, end)`` per axis.
    """
    key = (tuple(hw), tuple(window_size), tuple(shift_size), device, dtype)
    return _SHIFT_MASKS.get(key, lambda: _build_shift_mask(hw, window_size, shift_size,
                                                           device, dtype))


class WindowGrid(NamedTuple):
    """How :func:`to_windows` cut a ``(B, H, W, C)`` map: what :func:`from_windows` and the
    shift mask need."""
    window: Tuple[int, int]                 # (wh, ww)
    shift: Tuple[int, int]                  # cyclic shift (0, 0): plain windows
    size: Tuple[int, int]                   # (H, W) of the map (symbolic when traced)
    padded: Tuple[int, int]                 # (Hp, Wp): whole windows

    def shift_mask(self, device: torch.device, dtype: torch.dtype) -> Optional[Tensor]:
        """The ``(nW, N, N)`` :func:`shifted_window_mask` of a shifted grid, None unshifted."""
        if not any(self.shift):
            return None
        return shifted_window_mask(self.padded, self.window, self.shift, device, dtype)


def to_windows(x: Tensor, window_size: Tuple[int, int],
               shift_size: Tuple[int, int] = (0, 0)) -> Tuple[Tensor, WindowGrid]:
    """``(B, H, W, C)`` -> windows ``(B * nW, wh * ww, C)`` and their :class:`WindowGrid`:
    zero-pad at the bottom/right to whole windows, roll by ``-shift_size``, partition. Detection
    semantics: a shifted grid always shifts, also when the map is a single window."""
    h, w = x.shape[1:3]
    x = pad_to_multiple(x, window_size)                             # (B, Hp, Wp, C)
    hp, wp = x.shape[1:3]
    if any(shift_size):
        x = torch.roll(x, (-shift_size[0], -shift_size[1]), dims=(1, 2))
    grid = WindowGrid(window_size, shift_size, (h, w), (hp, wp))
    return window_partition(x, window_size), grid                   # (B * nW, N, C)


def from_windows(windows: Tensor, grid: WindowGrid) -> Tensor:
    """Inverse of :func:`to_windows`: ``(B * nW, wh * ww, C)`` -> ``(B, H, W, C)`` (a view of
    the padded map when it was padded)."""
    x = window_reverse(windows, grid.window, grid.padded)           # (B, Hp, Wp, C)
    if any(grid.shift):
        x = torch.roll(x, grid.shift, dims=(1, 2))
    return x[:, :grid.size[0], :grid.size[1]]                       # (B, H, W, C)


def window_attend(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, mask: Optional[Tensor],
                  dropout_p: float, fused: bool, scale: Optional[float]) -> Tensor:
    """Attention inside windows: ``q``, ``k``, ``v`` ``(B * nW, heads, N, d)``, ``bias`` the
    ``(1, heads, N, N)`` bias of one window, ``mask`` the ``(nW, N, N)`` shift mask or None ->
    ``(B * nW, N, heads * d)``. With a mask the windows are folded into the heads, so one
    image's bias + mask ``(1, nW * heads, N, N)`` broadcasts over the batch."""
    bw, heads, n, d = q.shape
    if mask is not None:
        nw = mask.shape[0]
        q, k, v = (t.reshape(bw // nw, nw * heads, n, d) for t in (q, k, v))  # (B, nW*heads, N, d)
        bias = (bias + mask.unsqueeze(1)).reshape(1, nw * heads, n, n)
    out = attend(q, k, v, bias, dropout_p, fused, scale)                     # as q
    return out.reshape(bw, heads, n, d).transpose(1, 2).reshape(bw, n, heads * d)
