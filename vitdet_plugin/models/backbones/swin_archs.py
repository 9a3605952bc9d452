"""Architecture presets of Swin V1 and V2 (:class:`~.base.ArchSpec`: ``resolve`` merges a
preset name or dict with the fields given as constructor arguments)."""
import dataclasses
from typing import ClassVar, Tuple

from ...functional.sizes import is_int
from ..layers.arguments import int_tuple, positive_int
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


@dataclasses.dataclass(frozen=True)
class SwinV2Arch(SwinArch):
    """:class:`SwinArch` plus ``extra_norm_every_n_blocks`` (huge / giant: 6)."""

    extra_norm_every_n_blocks: int = 0

    NAME: ClassVar[str] = 'Swin V2'
    PRESETS: ClassVar = {
        **SwinArch.PRESETS,
        # mmpretrain's presets; its source notes the head counts are not certain
        'huge': dict(embed_dims=352, depths=(2, 2, 18, 2), num_heads=(8, 16, 32, 64),
                     extra_norm_every_n_blocks=6),
        'giant': dict(embed_dims=512, depths=(2, 2, 42, 4), num_heads=(16, 32, 64, 128),
                      extra_norm_every_n_blocks=6),
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.extra_norm_every_n_blocks
        if not is_int(n) or n < 0:
            raise ValueError(f'extra_norm_every_n_blocks must be an int >= 0 (0: none), got {n!r}')
