"""Multi-scale memory for DETR-style decoders: project, embed, mask and flatten feature maps.

The backbone (or neck) gives NCHW maps at several strides. Each selected level is projected to
``embed_dims`` (1x1 conv + GroupNorm), optional extra coarser levels are made by stride-2 3x3
convs on the last input (as Deformable DETR), and every token gets a 2-D sine positional
encoding of its centre in image-normalised coordinates plus a learned level embedding. Tokens
of all levels are flattened into one memory ``(B, N, C)``.

Images of different sizes are padded to one batch shape by the data preprocessor; tokens
outside an image's ``img_shape`` are flagged in ``padding_mask`` so attention can mask them,
and the projections' GroupNorm statistics are taken over the valid area only, so an image
gives the same memory whatever it is batched with.
"""
import math
from typing import List, NamedTuple, Optional, Sequence, Tuple, cast

import torch
from mmdet.models.layers.transformer.utils import coordinate_to_encoding
from torch import Tensor, nn

from ..layers.norm import masked_group_norm
from .detr_memory import Shape, image_shapes, size_tensor, valid_mask

#: GroupNorm groups of the input projections (Deformable DETR / DINO).
PROJ_NORM_GROUPS = 32


class FlatMemory(NamedTuple):
    """Flattened multi-scale tokens of a batch.

    Attributes:
        memory: token features ``(B, N, C)``.
        pos: sine position + level embedding ``(B, N, C)``.
        padding_mask: ``(B, N)`` bool, True for tokens outside the image (``img_shape``).
        token_xy: token centres ``(B, N, 2)`` as ``(x, y)`` normalised by each image's
            ``img_shape`` (valid tokens lie in ``(0, 1)``).
        level_ids: level index of every token ``(N,)``.
        spatial_shapes: ``(H, W)`` of every level.
        padded: whether an image of the batch may have padded tokens, decided from the sizes
            on the host (an image smaller than the batch); False: ``padding_mask`` is all
            False and attention and norms take their unmasked paths (no device-to-host sync
            to find that out).
    """
    memory: Tensor
    pos: Tensor
    padding_mask: Tensor
    token_xy: Tensor
    level_ids: Tensor
    spatial_shapes: List[Tuple[int, int]]
    padded: bool = True

    def level_slices(self) -> List[slice]:
        """Token ranges of the levels inside the flattened ``N``."""
        slices, start = [], 0
        for h, w in self.spatial_shapes:
            slices.append(slice(start, start + h * w))
            start += h * w
        return slices


def _conv_norm(proj: nn.Module) -> Tuple[nn.Conv2d, nn.GroupNorm]:
    """The ``(conv, GroupNorm)`` pair of one input / extra projection (an ``nn.Sequential``)."""
    conv, norm = cast(nn.Sequential, proj)
    return cast(nn.Conv2d, conv), cast(nn.GroupNorm, norm)


class MultiScaleMemory(nn.Module):
    """Selected backbone levels -> :class:`FlatMemory`.

    Args:
        in_channels: channels of each selected input level.
        embed_dims: memory channels ``C`` (even).
        in_levels: indices into the backbone's output tuple to use (default: all, in order).
        num_extra_levels: extra levels made by stride-2 convs on the last selected input.
        in_strides: stride of each selected input level in input pixels; inferred from the
            batch shape and the map sizes when None (exact with mmdet's ``pad_size_divisor``
            a multiple of the largest stride).
        pos_temperature: temperature of the sine encoding.
    """

    def __init__(self,
                 in_channels: Sequence[int],
                 embed_dims: int = 256,
                 in_levels: Optional[Sequence[int]] = None,
                 num_extra_levels: int = 0,
                 in_strides: Optional[Sequence[int]] = None,
                 pos_temperature: int = 10000) -> None:
        super().__init__()
        in_channels = [int(c) for c in in_channels]
        if not in_channels:
            raise ValueError('in_channels must list the channels of at least one input level')
        if in_levels is not None and len(in_levels) != len(in_channels):
            raise ValueError(f'in_levels={list(in_levels)} selects {len(in_levels)} levels '
                             f'but in_channels={in_channels} has {len(in_channels)} entries; '
                             'give one channel count per selected level')
        if embed_dims % 2 or embed_dims % PROJ_NORM_GROUPS:
            raise ValueError(f'embed_dims={embed_dims} must be even and divisible by '
                             f'{PROJ_NORM_GROUPS} (GroupNorm groups of the input projections)')
        if num_extra_levels < 0:
            raise ValueError(f'num_extra_levels must be >= 0, got {num_extra_levels}')
        if in_strides is not None and (len(in_strides) != len(in_channels)
                                       or min(in_strides) <= 0):
            raise ValueError(f'in_strides={list(in_strides)} must give one positive stride per '
                             f'input level ({len(in_channels)} levels)')
        self.in_channels = in_channels
        self.in_strides = None if in_strides is None else [int(s) for s in in_strides]
        self.in_levels = None if in_levels is None else [int(i) for i in in_levels]
        self.embed_dims = embed_dims
        self.num_levels = len(in_channels) + num_extra_levels
        self.pos_temperature = pos_temperature
        self.input_proj = nn.ModuleList(
            nn.Sequential(nn.Conv2d(c, embed_dims, 1), nn.GroupNorm(PROJ_NORM_GROUPS, embed_dims))
            for c in in_channels)
        extra = []
        for i in range(num_extra_levels):
            c_in = in_channels[-1] if i == 0 else embed_dims
            extra.append(nn.Sequential(nn.Conv2d(c_in, embed_dims, 3, stride=2, padding=1),
                                       nn.GroupNorm(PROJ_NORM_GROUPS, embed_dims)))
        self.extra_proj = nn.ModuleList(extra)
        self.level_embed = nn.Parameter(torch.empty(self.num_levels, embed_dims))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for proj in list(self.input_proj) + list(self.extra_proj):
            conv, _ = _conv_norm(proj)
            nn.init.xavier_uniform_(conv.weight)
            if conv.bias is not None:  # built with bias=True: always there
                nn.init.zeros_(conv.bias)
        nn.init.normal_(self.level_embed)

    def select(self, feats: Sequence[Tensor]) -> List[Tensor]:
        """Pick ``in_levels`` from the backbone outputs and check their channels."""
        if isinstance(feats, Tensor):
            feats = [feats]
        if self.in_levels is None:
            if len(feats) != len(self.in_channels):
                raise ValueError(f'got {len(feats)} feature maps but in_channels='
                                 f'{self.in_channels} expects {len(self.in_channels)}; set '
                                 'in_levels to choose which backbone outputs to use')
            chosen = list(feats)
        else:
            for i in self.in_levels:
                if not -len(feats) <= i < len(feats):
                    raise IndexError(f'in_levels={self.in_levels} indexes level {i} but the '
                                     f'backbone/neck gives {len(feats)} maps')
            chosen = [feats[i] for i in self.in_levels]
        for i, (x, c) in enumerate(zip(chosen, self.in_channels)):
            if x.dim() != 4 or x.shape[1] != c:
                raise ValueError(f'input level {i} has shape {tuple(x.shape)} but in_channels[{i}]'
                                 f'={c}; set in_channels to the backbone/neck out_channels')
        return chosen

    def _strides(self, maps: Sequence[Tensor], batch_shape: Shape) -> List[Tensor]:
        """``(2,)`` float32 ``(stride_y, stride_x)`` in batch-input pixels of every input level,
        as tensors: inferred, they are the padded batch's size over the map's, both read from
        shapes (symbolic in a traced graph)."""
        device = maps[0].device
        if self.in_strides is not None:
            return [torch.full((2,), float(s), device=device) for s in self.in_strides]
        # inferred: exact when the batch is padded to a multiple of the stride (mmdet's
        # pad_size_divisor), which keeps every map at batch_shape / stride
        padded = size_tensor(batch_shape, device).float()
        return [padded / size_tensor((x.shape[-2], x.shape[-1]), device).float() for x in maps]

    def forward(self, feats: Sequence[Tensor],
                batch_img_metas: Optional[Sequence[dict]] = None) -> FlatMemory:
        chosen = self.select(feats)
        b = chosen[0].shape[0]
        device = chosen[0].device
        # without metas the unpadded batch is the frame: the first map times its stride (or
        # the map itself when strides are inferred: only ratios matter)
        s0 = self.in_strides[0] if self.in_strides is not None else 1
        frame = (chosen[0].shape[-2] * s0, chosen[0].shape[-1] * s0)
        batch_shape, img_shapes = image_shapes(batch_img_metas, b, frame)
        img_hw = torch.tensor(img_shapes, dtype=torch.float32, device=device)  # (B, 2) h, w
        padded = any(tuple(shape) != tuple(batch_shape) for shape in img_shapes)
        return self.flatten(chosen, batch_shape, img_hw, padded)

    def flatten(self, chosen: Sequence[Tensor], batch_shape: Shape,
                img_hw: Tensor, padded: bool = True) -> FlatMemory:
        """The selected maps -> :class:`FlatMemory`, each image's valid ``(h, w)`` given as
        ``img_hw`` ``(B, 2)`` float (``forward`` reads it from the metas; the ONNX export
        passes its symbolic input size, and ``batch_shape`` is symbolic there too). ``padded``
        False (every image fills the batch): the norms skip their masks."""
        device = chosen[0].device
        maps, valid_counts, strides = [], [], []
        for proj, x, stride in zip(self.input_proj, chosen, self._strides(chosen, batch_shape)):
            size = torch.tensor(x.shape[-2:], dtype=torch.float32, device=device)
            # a token is valid when its cell starts inside the image (as nearest-resizing a
            # pixel mask, the way mmdet's DETRs do): index < ceil(img / stride)
            counts = torch.minimum(torch.ceil(img_hw / stride).clamp_min(1), size)
            conv, norm = _conv_norm(proj)
            y = conv(x)
            maps.append(masked_group_norm(
                y, valid_mask(counts, y.shape[-2:]) if padded else None, norm))
            valid_counts.append(counts)
            strides.append(stride)
        src, counts, stride = chosen[-1], valid_counts[-1], strides[-1]
        for proj in self.extra_proj:
            # zero the padded area so the stride-2 conv sees it as its own zero padding
            conv, norm = _conv_norm(proj)
            y = conv(src * valid_mask(counts, src.shape[-2:])[:, None].to(src.dtype))
            counts = torch.ceil(counts / 2)
            stride = stride * 2
            src = masked_group_norm(y, valid_mask(counts, y.shape[-2:]) if padded else None,
                                    norm)
            maps.append(src)
            valid_counts.append(counts)
            strides.append(stride)

        memory, xy, pad, lvl, shapes = [], [], [], [], []
        for level, (x, counts, stride) in enumerate(zip(maps, valid_counts, strides)):
            h, w = x.shape[-2:]
            shapes.append((h, w))
            memory.append(x.flatten(2).transpose(1, 2))
            # token centres in batch-input pixels, normalised by each image's own size
            ys = (torch.arange(h, device=device, dtype=torch.float32) + 0.5) * stride[0]
            xs = (torch.arange(w, device=device, dtype=torch.float32) + 0.5) * stride[1]
            gy, gx = torch.meshgrid(ys, xs, indexing='ij')
            grid = torch.stack((gx.flatten(), gy.flatten()), -1)                  # (HW, 2)
            xy.append(grid[None] / img_hw[:, None, [1, 0]])
            pad.append(~valid_mask(counts, (h, w)).flatten(1))
            lvl.append(torch.full((h * w,), level, dtype=torch.long, device=device))
        token_xy = torch.cat(xy, 1)
        level_ids = torch.cat(lvl)
        pos = coordinate_to_encoding(token_xy, self.embed_dims // 2, self.pos_temperature,
                                     2 * math.pi)
        pos = pos + self.level_embed[level_ids].float()
        tokens = torch.cat(memory, 1)
        return FlatMemory(tokens, pos.to(tokens.dtype), torch.cat(pad, 1), token_xy, level_ids,
                          shapes, padded)

    def extra_repr(self) -> str:
        return (f'in_channels={self.in_channels}, in_levels={self.in_levels}, '
                f'num_levels={self.num_levels}')
