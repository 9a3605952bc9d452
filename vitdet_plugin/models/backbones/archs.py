"""Architecture presets of the backbones: frozen dataclasses that validate themselves.

``SwinArch.resolve(arch, **overrides)`` / ``ViTArch.resolve(...)`` merge a preset name (or a
dict of fields) with the fields given as constructor arguments (see :class:`~.base.ArchSpec`).
"""
import dataclasses
from typing import Any, ClassVar, Optional, Sequence, Tuple

from ..layers.arguments import check_rate, int_arg, int_tuple, positive_int
from .base import ArchSpec


@dataclasses.dataclass(frozen=True)
class SwinArch(ArchSpec):
    """Embed dims, blocks per stage and heads per stage of a Swin model."""

    embed_dims: int
    depths: Tuple[int, ...]
    num_heads: Tuple[int, ...]

    NAME: ClassVar[str] = 'Swin'
    PRESETS: ClassVar = {
        'tiny': dict(embed_dims=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24)),
        'small': dict(embed_dims=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24)),
        'base': dict(embed_dims=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32)),
        'large': dict(embed_dims=192, depths=(2, 2, 18, 2), num_heads=(6, 12, 24, 48)),
    }

    def __post_init__(self) -> None:
        dims = positive_int(self.embed_dims, 'embed_dims')
        depths, heads = int_tuple(self.depths, 'depths'), int_tuple(self.num_heads, 'num_heads')
        object.__setattr__(self, 'depths', depths)
        object.__setattr__(self, 'num_heads', heads)
        if len(depths) != len(heads) or not depths:
            raise ValueError(f'depths {depths} and num_heads {heads} must be non-empty and of '
                             'equal length (one entry per stage)')
        if any(d <= 0 for d in depths):
            raise ValueError(f'every stage needs at least one block, got depths={depths}')
        for i, h in enumerate(heads):
            if h <= 0 or (dims * 2**i) % h:
                raise ValueError(f'stage {i}: embed dims {dims * 2**i} are not divisible by '
                                 f'num_heads={h}; choose heads that divide embed_dims * 2**stage')


#: The Swin presets (embed dims, depths, heads of the published models).
SWIN_ARCHS = SwinArch.PRESETS


#: Number of evenly spaced global-attention blocks for custom ``arch`` dicts (as the presets).
NUM_GLOBAL_BLOCKS = 4


def index_list(name: str, values: Sequence[int], depth: int,
                negative: bool = False) -> Tuple[int, ...]:
    """Sorted unique block indices; with ``negative``, ``-1`` is the last block."""
    values = int_tuple(values, name)
    low = -depth if negative else 0
    bad = [v for v in values if not low <= v < depth]
    if bad:
        raise ValueError(f'{name}={values} contains {bad}, out of range for depth={depth}: '
                         f'block indices must be in {low}..{depth - 1}')
    return tuple(sorted({v % depth for v in values}))


@dataclasses.dataclass(frozen=True)
class ViTArch(ArchSpec):
    """Width, depth, heads, global blocks and drop path of a ViT; custom archs default to
    global attention in the last block of each quarter and no drop path."""

    embed_dims: int
    depth: int
    num_heads: int
    global_attn_indexes: Optional[Tuple[int, ...]] = None
    drop_path_rate: float = 0.0

    NAME: ClassVar[str] = 'ViT'
    PRESETS: ClassVar = {  # the ViTDet models (detectron2 projects/ViTDet)
        'base': dict(embed_dims=768, depth=12, num_heads=12, global_attn_indexes=(2, 5, 8, 11),
                     drop_path_rate=0.1),
        'large': dict(embed_dims=1024, depth=24, num_heads=16,
                      global_attn_indexes=(5, 11, 17, 23), drop_path_rate=0.4),
        'huge': dict(embed_dims=1280, depth=32, num_heads=16,
                     global_attn_indexes=(7, 15, 23, 31), drop_path_rate=0.5),
    }

    def __post_init__(self) -> None:
        check_plain_vit_arch(self)


#: The ViTDet presets.
VIT_ARCHS = ViTArch.PRESETS


def check_plain_vit_arch(spec: Any) -> None:
    """Check and settle the fields every plain-ViT arch spec (a frozen dataclass: ViT and the
    DINOv2 / DINOv3 / EVA-02 families) has: width, depth and heads (the width a multiple of the
    heads), the global blocks (default :data:`NUM_GLOBAL_BLOCKS` evenly spaced, ending at the
    last block) against the depth, and the drop-path rate."""
    dims = positive_int(spec.embed_dims, 'embed_dims')
    depth = positive_int(spec.depth, 'depth')
    heads = positive_int(spec.num_heads, 'num_heads')
    if dims % heads:
        raise ValueError(f'embed_dims={dims} is not divisible by num_heads={heads}; '
                         'choose a head count that divides it')
    glob = spec.global_attn_indexes
    if glob is None:
        n = min(NUM_GLOBAL_BLOCKS, depth)
        glob = tuple((k + 1) * depth // n - 1 for k in range(n))
    object.__setattr__(spec, 'global_attn_indexes', index_list('global_attn_indexes', glob,
                                                               depth))
    object.__setattr__(spec, 'drop_path_rate', check_rate(spec.drop_path_rate,
                                                          'drop_path_rate'))


def check_out_indices(out_indices: Sequence[int], depth: int) -> Tuple[int, ...]:
    """The blocks a plain ViT returns: a non-empty list of indices (negative from the end) into
    ``depth`` blocks, sorted and without duplicates."""
    indices = int_tuple(out_indices, 'out_indices')
    if not indices:
        raise ValueError('out_indices is empty; give at least one block index (-1: the '
                         'last block)')
    return index_list('out_indices', indices, depth, negative=True)


def check_frozen_blocks(frozen_stages: int, depth: int, stage0: str) -> int:
    """``frozen_stages`` of a plain ViT of ``depth`` blocks: ``-1..depth`` (``stage0``: what
    ``0`` freezes)."""
    if not -1 <= int_arg(frozen_stages, 'frozen_stages') <= depth:
        raise ValueError(f'frozen_stages={frozen_stages} must be in -1..{depth} (-1: train '
                         f'all, 0: {stage0}, k: also the first k blocks)')
    return frozen_stages
