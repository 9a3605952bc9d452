"""Swin patch merging: 2x2 neighbourhood concat -> norm -> linear ``4C -> 2C`` (V1), or
concat -> linear -> norm (V2, ``post_norm=True``)."""
import torch.nn.functional as F
from torch import Tensor, nn

from ...functional.sizes import known_zero


class PatchMerging(nn.Module):
    """Downsample ``(B, H, W, C)`` to ``(B, ceil(H/2), ceil(W/2), 2C)``.

    Odd sizes are zero-padded at the bottom/right. The concatenation order is the official
    Swin / timm one: ``(0::2, 0::2), (1::2, 0::2), (0::2, 1::2), (1::2, 1::2)`` along channels
    (mmdet's ``nn.Unfold`` order differs; its converter reorders the weights).

    Args:
        dim: input channels ``C``.
        norm_layer: norm over the ``4C`` concatenation (over the ``2C`` output with
            ``post_norm``).
        post_norm: reduce first, then norm (Swin V2).
    """

    def __init__(self, dim: int, norm_layer: nn.Module, post_norm: bool = False) -> None:
        super().__init__()
        self.post_norm = post_norm
        self.norm = norm_layer
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, h, w, c = x.shape
        h2, w2 = (h + 1) // 2, (w + 1) // 2  # ceil-div: simple symbolic sizes downstream
        if not known_zero(2 * h2 - h, 2 * w2 - w):  # symbolic sizes always pad (maybe by 0)
            x = F.pad(x, (0, 0, 0, 2 * w2 - w, 0, 2 * h2 - h))       # (B, 2 * h2, 2 * w2, C)
        x = x.view(b, h2, 2, w2, 2, c)                               # (B, H/2, 2[h], W/2, 2[w], C)
        x = x.permute(0, 1, 3, 4, 2, 5).reshape(b, h2, w2, 4 * c)   # official order
        if self.post_norm:
            return self.norm(self.reduction(x))                      # (B, H/2, W/2, 2C)
        return self.reduction(self.norm(x))                          # (B, H/2, W/2, 2C)
