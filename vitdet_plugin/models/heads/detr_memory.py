"""The decoder's memory: multi-scale maps flattened to tokens, with what is valid in each image.

Images of different sizes are padded to one batch by the data preprocessor; a token is valid
when its cell starts inside its image (nearest-resizing the pixel mask, as RF-DETR and mmdet's
DETRs): along an axis of ``n`` cells covering ``P`` padded pixels, the first
``ceil(img * n / P)`` cells of an image of ``img`` pixels. Every size here is read from tensor
shapes or from the ``(B, 2)`` image-size tensor, never from Python numbers in the metas, so the
same code runs in mmdet's ``predict`` and, traced with symbolic sizes, in the exported graph.
"""
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

#: ``(H, W)`` of a map: Python ints, or the symbolic ints of a traced graph.
Shape = Tuple[Any, Any]


class Memory(NamedTuple):
    """Flattened multi-scale maps of a batch.

    Attributes:
        tokens: ``(B, N, C)`` all levels flattened, row by row.
        padding_mask: ``(B, N)`` bool, True outside each image.
        valid_hw: ``(B, L, 2)`` int64 valid rows and columns of each level in each image.
        shapes: ``(H, W)`` of each level (:data:`Shape`).
        spatial_shapes: ``(L, 2)`` int64, the same as a tensor (mmcv's deformable attention).
        level_start_index: ``(L,)`` int64, the first token of each level.
    """
    tokens: Tensor
    padding_mask: Tensor
    valid_hw: Tensor
    shapes: List[Shape]
    spatial_shapes: Tensor
    level_start_index: Tensor

    @property
    def valid_wh(self) -> Tensor:
        """``(B, L, 2)`` float32 valid ``(w, h)`` in tokens of each level."""
        return self.valid_hw.flip(-1).to(torch.float32)

    @property
    def valid_ratios(self) -> Tensor:
        """``(B, L, 2)`` valid fraction ``(w, h)`` of each level."""
        return self.valid_wh / self.spatial_shapes.flip(-1).to(torch.float32)

    def level_sides(self, anchor_size: float) -> Tensor:
        """``(N,)`` the side of every token's anchor box: ``anchor_size * 2**level``."""
        return torch.cat([torch.full((h * w,), anchor_size * 2.0 ** level,
                                     device=self.tokens.device)
                          for level, (h, w) in enumerate(self.shapes)])

    def cell_centres(self) -> Tensor:
        """``(B, N, 2)`` every token's cell centre ``(x, y)``, normalised by its image's valid
        cells of that level (valid tokens lie in ``(0, 1)``)."""
        centres = []
        for level, (h, w) in enumerate(self.shapes):
            ys = torch.arange(h, dtype=torch.float32, device=self.tokens.device)
            xs = torch.arange(w, dtype=torch.float32, device=self.tokens.device)
            gy, gx = torch.meshgrid(ys, xs, indexing='ij')
            grid = torch.stack((gx, gy), -1).view(1, h * w, 2) + 0.5          # (1, hw, 2)
            centres.append(grid / self.valid_wh[:, level, None])              # (B, hw, 2)
        return torch.cat(centres, 1)


def _size(value: Any, device: torch.device) -> Tensor:
    """A ``()`` int64 tensor of a (symbolic) Python int."""
    return torch.full((), value, dtype=torch.long, device=device)


def size_tensor(hw: Shape, device: torch.device) -> Tensor:
    """``(2,)`` int64 of a (symbolic) ``(h, w)`` (a padded batch's size in a traced graph)."""
    return torch.stack((_size(hw[0], device), _size(hw[1], device)))


def valid_mask(counts: Tensor, hw: Sequence[Any]) -> Tensor:
    """``(B, H, W)`` bool, True inside each image's ``counts (B, 2)`` valid rows / columns."""
    rows = torch.arange(hw[0], device=counts.device)[None, :, None] < counts[:, 0, None, None]
    cols = torch.arange(hw[1], device=counts.device)[None, None, :] < counts[:, 1, None, None]
    return rows & cols


def valid_cells(img_hw: Tensor, batch_shape: Shape, hw: Shape) -> Tensor:
    """``(B, 2)`` int64 valid rows / columns of an ``hw`` map over the padded ``batch_shape``
    for images of ``img_hw`` ``(B, 2)``: ``ceil(img * n / padded)`` (module docstring)."""
    cells, padded = size_tensor(hw, img_hw.device), size_tensor(batch_shape, img_hw.device)
    counts = (img_hw.long() * cells + padded - 1) // padded                     # (B, 2)
    return torch.minimum(counts, cells)


def flatten_levels(feats: Sequence[Tensor], img_hw: Tensor, batch_shape: Shape) -> Memory:
    """NCHW maps (all at one channel count) covering the padded ``batch_shape`` ``(Hp, Wp)``,
    images of ``img_hw`` ``(B, 2)`` -> :class:`Memory`."""
    device = feats[0].device
    tokens, masks, counts, shapes, starts = [], [], [], [], []
    start: Any = 0
    for x in feats:
        h, w = x.shape[-2], x.shape[-1]
        valid = valid_cells(img_hw, batch_shape, (h, w))                        # (B, 2)
        masks.append(~valid_mask(valid, (h, w)).flatten(1))                     # (B, h*w)
        counts.append(valid)
        tokens.append(x.flatten(2).transpose(1, 2))                             # (B, h*w, C)
        shapes.append((h, w))
        starts.append(_size(start, device))
        start = start + h * w
    spatial_shapes = torch.stack([size_tensor(hw, device) for hw in shapes])   # (L, 2)
    return Memory(torch.cat(tokens, 1), torch.cat(masks, 1), torch.stack(counts, 1), shapes,
                  spatial_shapes, torch.stack(starts))


def _leading_hw(shape: Sequence[int]) -> Tuple[int, int]:
    """The leading ``(h, w)`` of an mmdet shape (``img_shape``, ``batch_input_shape``)."""
    h, w = shape[:2]
    return int(h), int(w)


def image_shapes(batch_img_metas: Optional[Sequence[dict]], batch_size: int,
                 frame: Tuple[int, int]) -> Tuple[Tuple[int, int], List[Tuple[int, int]]]:
    """``(batch_input_shape, [img_shape, ...])`` from mmdet image metas.

    Without metas (``tensor`` mode) the batch is taken as unpadded, of size ``frame``.
    """
    if batch_img_metas is None:
        return frame, [frame] * batch_size
    if len(batch_img_metas) != batch_size:
        raise ValueError(f'got {len(batch_img_metas)} image metas for a batch of {batch_size} '
                         'feature maps; pass one meta dict per image')
    shapes = []
    for meta in batch_img_metas:
        if 'img_shape' not in meta:
            raise KeyError(f"image meta has no 'img_shape' (keys: {sorted(meta)}); the data "
                           'preprocessor (DetDataPreprocessor) must set it')
        shapes.append(_leading_hw(meta['img_shape']))
    batch_shape = batch_img_metas[0].get('batch_input_shape')
    if batch_shape is None:
        batch_shape = (max(s[0] for s in shapes), max(s[1] for s in shapes))
    return _leading_hw(batch_shape), shapes


def image_sizes(batch_img_metas: Optional[Sequence[dict]], batch_size: int,
                device: torch.device, frame: Tuple[int, int] = (1, 1)
                ) -> Tuple[Tensor, Tuple[int, int]]:
    """mmdet's metas -> the ``(B, 2)`` int64 ``(h, w)`` of each image and the padded batch's
    ``(Hp, Wp)``: what a head's sized forward takes (the exported graph builds the same from
    its input's shape). Without metas the batch is unpadded, of size ``frame``."""
    batch_shape, shapes = image_shapes(batch_img_metas, batch_size, frame)
    return torch.tensor(shapes, dtype=torch.long, device=device), batch_shape
