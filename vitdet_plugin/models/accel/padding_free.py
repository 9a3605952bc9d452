"""Window attention that projects only the image tokens: the compiled form of (shifted)
window attention.

The plain path (``backbones/swin.py``, ``layers/shifted_windows.py``) zero-pads the normalised
map to whole windows and then projects every window token with ``qkv`` and every output token
with ``proj``: padding tokens cost GEMM rows (Swin-T at 512x512: 8% of stage 1, 20% of stages
2-3, 72% of stage 4). A zero token projects to the ``qkv`` bias, so the same attention is:
``qkv`` of the ``H x W`` image tokens, padded to whole windows with that bias, rolled and
partitioned; after attention the windows are reversed, rolled back and cropped, and only the
``H x W`` tokens go through ``proj``.

Under ``torch.compile`` the pad / roll / partition of the ``3C``-channel projections fuse into
one kernel. In eager mode they are separate copies of three times the channels the plain path
moves (measured: a 20% slower CPU training step), so this form runs only where
:mod:`.dispatch` says ``compiled``. The attention modules are typed ``Any``: accel sits below
the model layers in the import graph and uses only their public methods (``project_qkv``,
``padding_qkv``, ``attend_windows``, ``project_out``).
"""
from typing import Any, Tuple

import torch
from torch import Tensor

from ...functional import pad_to_multiple, window_partition, window_reverse, window_shift_mask


def padding_free_window_attention(x: Tensor, attn: Any, window_size: Tuple[int, int],
                                  shift_size: Tuple[int, int],
                                  mask_dtype: torch.dtype) -> Tensor:
    """``(B, H, W, C)`` -> ``(B, H, W, C)``: the (shifted, when ``shift_size`` is non-zero)
    window attention of ``attn`` over the map ``x``, ``proj`` included, with the values of the
    plain path (zero-pad, roll, partition, ``attn``, reverse, roll back, crop)."""
    b, h, w, c = x.shape
    qkv = attn.project_qkv(x)                                       # (B, H, W, 3C)
    windows = pad_to_multiple(qkv, window_size, fill=attn.padding_qkv())  # (B, Hp, Wp, 3C)
    hp, wp = windows.shape[1:3]
    mask = None
    if any(shift_size):
        windows = torch.roll(windows, (-shift_size[0], -shift_size[1]), dims=(1, 2))
        mask = window_shift_mask((hp, wp), window_size, shift_size, x.device,
                                 mask_dtype)                        # (nW, N, N)
    out = attn.attend_windows(window_partition(windows, window_size), mask)  # (B * nW, N, C)
    out = window_reverse(out, window_size, (hp, wp))                # (B, Hp, Wp, C)
    if any(shift_size):
        out = torch.roll(out, shift_size, dims=(1, 2))
    return attn.project_out(out[:, :h, :w])                         # (B, H, W, C)
