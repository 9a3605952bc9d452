"""DINOv2 (Oquab et al., 2023; with registers, Darcet et al., 2024) as a plain ViT backbone:
presets of timm 1.0.31's ``vit_*_patch14_dinov2``, and RF-DETR's windowed DINOv2
(``num_windows``; docs/rfdetr.md)."""
import dataclasses
from typing import Any, ClassVar, Mapping, Optional, Sequence, Tuple, Union

import torch
from mmdet.registry import MODELS
from torch import Tensor, nn

from ...functional.window import window_partition, window_reverse
from ..layers.arguments import positive_int
from .base import run_blocks
from .plain_vit import PlainViTBackbone, family_docs, plain_block
from .vit_archs import DINO_LAYER_SCALE, PlainViTArch
from .vit_block import ViTBlock

#: DINOv2-giant's SwiGLU width (4096 for 1536 channels).
DINOV2_GIANT_MLP_RATIO = 2.66667


@dataclasses.dataclass(frozen=True)
class DINOv2Arch(PlainViTArch):
    """DINOv2 presets (``vit_{small,base,large,giant}_patch14_dinov2``; registers: give
    ``num_reg_tokens=4``); custom arch dicts default to DINOv2's block options."""

    layer_scale: Optional[float] = DINO_LAYER_SCALE

    NAME: ClassVar[str] = 'DINOv2'
    PRESETS: ClassVar = {
        'small': dict(embed_dims=384, depth=12, num_heads=6, drop_path_rate=0.1),
        'base': dict(embed_dims=768, depth=12, num_heads=12, drop_path_rate=0.1),
        'large': dict(embed_dims=1024, depth=24, num_heads=16, drop_path_rate=0.4),
        'giant': dict(embed_dims=1536, depth=40, num_heads=24, mlp='swiglu_packed',
                      mlp_ratio=DINOV2_GIANT_MLP_RATIO, drop_path_rate=0.5),
    }


def tile_block(index: int, window_size: Optional[Tuple[int, int]], **block_args: Any) -> nn.Module:
    """RF-DETR's blocks: attention over the tokens they are given (one window's, or every
    window's joined in a global block)."""
    return ViTBlock(window_size=None, **block_args)


def tile_window(grid: Tuple[int, int], n: int, image: Sequence[int], patch: int,
                owner: str) -> Tuple[int, int]:
    """The ``(h / n, w / n)`` window of ``n x n`` tiles of a patch grid; a ``ValueError``
    naming the nearest valid input sizes when the grid does not split evenly."""
    h, w = grid
    if n == 1 or (h % n == 0 and w % n == 0):
        return h // n, w // n
    step = patch * n
    down = [max(s // step, 1) * step for s in image]
    up = [-(-s // step) * step for s in image]
    raise ValueError(f'{owner}(num_windows={n}): a {image[0]}x{image[1]} input gives a {h}x{w} '
                     f'patch grid (patch {patch}), which does not split into {n} x {n} windows; '
                     f'the nearest valid sizes are {down[0]}x{down[1]} and {up[0]}x{up[1]} '
                     f'(multiples of patch {patch} x num_windows {n} = {step})')


@MODELS.register_module()
@family_docs
class DINOv2Backbone(PlainViTBackbone):
    """DINOv2 (with registers: ``num_reg_tokens=4``): patch 14, position grid 518 / 14 = 37,
    LayerScale, fused qkv bias; no rotary embedding. Presets: small / base / large / giant.

    Args:
        num_windows: RF-DETR's windowed DINOv2: after the position embedding the patch grid
            is cut into ``n x n`` tiles, each with its own copy of the cls / register tokens;
            the global blocks (default RF-DETR's: the block after each ``out_indices`` block)
            attend over all tiles joined, the others within their tile (no ``window_size``).
            The patch grid must split evenly (any size, square or not). None: no tiling.
        kwargs: the plain ViT's arguments (below).
    """

    ARCH = DINOv2Arch
    FAMILY = 'DINOv2'
    DEFAULT_PATCH = 14
    DEFAULT_PRETRAIN_IMG = 518
    ROPE = None

    def __init__(self, arch: Union[str, dict, None] = 'base', num_windows: Optional[int] = None,
                 **kwargs: Any) -> None:
        tiled = num_windows is not None
        n = 1 if num_windows is None else positive_int(num_windows, 'num_windows')
        if tiled and kwargs.get('window_size') is not None:
            raise ValueError(f"DINOv2Backbone(num_windows={n}): window_size is ViTDet's window, "
                             "but RF-DETR's tiles cover the whole map; remove window_size")
        super().__init__(arch, make_block=tile_block if tiled else plain_block, **kwargs)
        self.num_windows = n
        given = (kwargs.get('global_attn_indexes') is not None
                 or (isinstance(arch, Mapping) and 'global_attn_indexes' in arch))
        if tiled and not given:  # RF-DETR: global attention in the block after each tap
            self.global_attn_indexes = tuple(i + 1 for i in self.out_indices if i + 1 < self.depth)

    def fit_input(self, size: Tuple[int, int]) -> Tuple[int, int]:
        """The smallest sides, at least ``size``'s, whose patch grid splits into
        :attr:`num_windows` tiles (:func:`tile_window`)."""
        p, n = self.patch_size, self.num_windows
        grid = [-(-s // p) for s in size]
        h, w = (s if g % n == 0 else (-(-g // n) * n - 1) * p + 1 for s, g in zip(size, grid))
        return h, w

    def forward(self, x: Tensor) -> Tuple[Tensor, ...]:
        """``(B, C_in, H, W)`` -> ``(B, C, ceil(H / p), ceil(W / p))`` per output index; the
        tokens run in ``n x n`` tiles (:attr:`num_windows`; 1: the whole map), joined in the
        global blocks."""
        n, image = self.num_windows, x.shape[-2:]
        x, (h, w) = self.embed(x)                                    # (B, P + h * w, C)
        b, c, p = x.shape[0], x.shape[-1], self.num_prefix
        window = tile_window((h, w), n, image, self.patch_size, type(self).__name__)
        tiles = window_partition(x[:, p:].reshape(b, h, w, c), window)  # (B * n * n, N, C)
        prefix = x[:, None, :p].expand(b, n * n, p, c).reshape(b * n * n, p, c)
        x = torch.cat([prefix, tiles], dim=1)                        # (B * n * n, P + N, C)
        layout = self.token_layout(window, x.device, x.dtype)
        joined = [self.blocks[i] for i in self.global_attn_indexes]

        def block_fn(block: nn.Module, tokens: Tensor) -> Tensor:
            if block not in joined:  # attention within each tile
                return block(tokens, layout)
            out = block(tokens.reshape(b, -1, c), layout)            # (B, n * n * (P + N), C)
            return out.reshape(tokens.shape)                         # (B * n * n, P + N, C)

        outs = []
        start = 0
        for end in self.out_indices:  # sorted: the blocks up to each output, in turn
            x = run_blocks(self.blocks[start:end + 1], x, self.with_cp, self.training, block_fn)
            tokens = x[:, p:]                                        # (B * n * n, N, C)
            if self.norm is not None:
                tokens = self.norm(tokens)
            fmap = window_reverse(tokens, window, (h, w))            # (B, h, w, C)
            outs.append(fmap.permute(0, 3, 1, 2).contiguous())       # (B, C, h, w)
            start = end + 1
        return tuple(outs)
