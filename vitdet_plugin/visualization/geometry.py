"""Where tokens, windows and shift regions lie on a padded token map.

Conventions of the models (``vitdet_plugin.functional.window``): the map is zero-padded at the
bottom/right to whole windows (``padded_size``), a shifted block rolls it by ``-shift`` before
partitioning, and windows are numbered row-major. Positions here are on the unshifted, padded
``(Hp, Wp)`` map unless a name says otherwise.
"""
from dataclasses import dataclass
from typing import List, Sequence, SupportsInt, Tuple

import torch
from torch import Tensor

from . import VisualizeError
from ..functional import MASKED_LOGIT, window_partition

# The model's per-axis region rule is private (no public accessor yet): reused, not copied.
from ..functional.window import NUM_REGIONS, region_labels


@dataclass(frozen=True)
class WindowLayout:
    """The windows of one block on a padded map.

    ``index``: ``(Hp, Wp)`` window number of every map position (after the block's shift);
    ``token``: its position inside that window (row-major, ``0..N-1``).
    """

    padded_hw: Tuple[int, int]
    window: Tuple[int, int]
    shift: Tuple[int, int]
    index: Tensor
    token: Tensor

    @property
    def num_windows(self) -> int:
        return (self.padded_hw[0] // self.window[0]) * (self.padded_hw[1] // self.window[1])

    @property
    def windows_per_row(self) -> int:
        return self.padded_hw[1] // self.window[1]

    def positions(self, index: int) -> Tuple[Tensor, Tensor]:
        """Map rows and columns ``(N,)`` of the tokens of window ``index``, in token order."""
        rows, cols = torch.nonzero(self.index == index, as_tuple=True)
        order = torch.argsort(self.token[rows, cols])
        return rows[order], cols[order]


def window_layout(padded_hw: Sequence[SupportsInt], window: Sequence[SupportsInt],
                  shift: Sequence[SupportsInt]) -> WindowLayout:
    """:class:`WindowLayout` of ``window`` windows shifted by ``shift`` on ``padded_hw``."""
    hp, wp = int(padded_hw[0]), int(padded_hw[1])
    wh, ww = int(window[0]), int(window[1])
    sh, sw = int(shift[0]), int(shift[1])
    rows = (torch.arange(hp) - sh) % hp                            # row after the roll
    cols = (torch.arange(wp) - sw) % wp
    index = (rows // wh)[:, None] * (wp // ww) + (cols // ww)[None, :]
    token = (rows % wh)[:, None] * ww + (cols % ww)[None, :]
    return WindowLayout((hp, wp), (wh, ww), (sh, sw), index, token)


def shift_region_labels(padded_hw: Sequence[int], window: Sequence[int],
                        shift: Sequence[int]) -> Tensor:
    """``(Hp, Wp)`` region labels ``0..8`` of the rolled, padded map (Swin's ``img_mask``):
    tokens of different labels meet inside a shifted window and must not attend to each other.
    Built from the model's own per-axis rule (``functional.window.region_labels``, which its
    shift mask is made of); :func:`check_labels_match_mask` checks them against the mask the
    model used."""
    rows = region_labels(int(padded_hw[0]), int(window[0]), int(shift[0]), None)
    cols = region_labels(int(padded_hw[1]), int(window[1]), int(shift[1]), None)
    return rows[:, None] * NUM_REGIONS + cols[None, :]


def check_labels_match_mask(labels: Tensor, mask: Tensor, window: Sequence[int]) -> None:
    """Raise if two tokens of one window share a label exactly where ``mask`` (the model's
    ``(nW, N, N)`` shift mask) does not let them attend (it is 0 or :data:`MASKED_LOGIT`)."""
    wh, ww = int(window[0]), int(window[1])
    per_window = window_partition(labels[None, :, :, None], (wh, ww)).squeeze(-1)
    different = per_window[:, :, None] != per_window[:, None, :]   # (nW, N, N)
    if per_window.shape[0] != mask.shape[0] or not torch.equal(different, mask != 0) \
            or not torch.all((mask == 0) | (mask == MASKED_LOGIT)):
        raise RuntimeError('the region labels drawn here disagree with the shift mask the '
                           'model used; update shift_region_labels in '
                           "vitdet_plugin/visualization/geometry.py to the model's rule")


def corner_windows(layout: WindowLayout) -> List[int]:
    """Windows showing each kind of shift mask: top-left, top-right (right edge), bottom-left
    (bottom edge) and bottom-right (corner), without repeats."""
    per_row, n = layout.windows_per_row, layout.num_windows
    picks = [0, per_row - 1, n - per_row, n - 1]
    return list(dict.fromkeys(picks))


def check_windows(windows: Sequence[int], layout: WindowLayout, where: str) -> List[int]:
    """``windows`` if each is a window number of ``layout``, else an error naming the range."""
    n = layout.num_windows
    for k in windows:
        if not 0 <= k < n:
            raise VisualizeError(f'window {k} is out of range: {where} has {n} windows '
                                 f'(0..{n - 1}) on its {layout.padded_hw[0]} x '
                                 f'{layout.padded_hw[1]} padded token map')
    return list(windows)


def check_query(query: Sequence[int], map_hw: Sequence[int], where: str) -> Tuple[int, int]:
    """``(y, x)`` if it lies on the ``map_hw`` token map of ``where``, else an error naming the
    valid range."""
    y, x = int(query[0]), int(query[1])
    h, w = int(map_hw[0]), int(map_hw[1])
    if not (0 <= y < h and 0 <= x < w):
        raise VisualizeError(f'query ({y}, {x}) is off the token map of {where}: it has {h} x '
                             f'{w} tokens, so y must be in 0..{h - 1} and x in 0..{w - 1}')
    return y, x
