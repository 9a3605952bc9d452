"""The plain ViT's arch spec, :class:`PlainViTArch` (what a block needs: width, heads, MLP kind,
q / k / v bias mode, sub-LN, LayerScale), and the checks of its block indices. Each family's
presets live with its backbone (``vit.py``, ``dinov2.py``, ``dinov3.py``, ``eva02.py``).
"""
import dataclasses
from typing import ClassVar, Optional, Sequence, Tuple

from ..layers.arguments import check_rate, int_arg, int_tuple, positive_int, positive_number
from .base import ArchSpec

#: MLP kinds: GELU ``Mlp``, ``SwiGLU``, ``SwiGLUPacked``.
MLP_KINDS = ('gelu', 'swiglu', 'swiglu_packed')
#: Bias of the q / k / v projections: fused (ViTDet, DINOv2), q and v only (EVA-02, DINOv3
#: ``*_qkvb``), none (DINOv3).
QKV_BIAS_MODES = ('qkv', 'qv', 'none')
#: LayerScale init of DINOv2 / DINOv3.
DINO_LAYER_SCALE = 1e-5
#: LayerNorm eps of timm's ViT / ViTDet / EVA-02.
EPS_VIT = 1e-6
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
class PlainViTArch(ArchSpec):
    """Width, depth, heads and block options of a plain ViT. ``mlp_ratio``: MLP (SwiGLU gate)
    width / embed dims, rounded down as timm, then up to a multiple of ``mlp_align`` (0: none);
    ``layer_scale``: LayerScale init (None: none); ``global_attn_indexes``: default
    :data:`NUM_GLOBAL_BLOCKS` evenly spaced, ending at the last block."""

    embed_dims: int
    depth: int
    num_heads: int
    mlp: str = 'gelu'
    mlp_ratio: float = 4.0
    mlp_align: int = 0
    mlp_sub_ln: bool = False
    attn_sub_ln: bool = False
    qkv_bias: str = 'qkv'
    layer_scale: Optional[float] = None
    num_reg_tokens: int = 0
    norm_eps: float = EPS_VIT
    global_attn_indexes: Optional[Tuple[int, ...]] = None
    drop_path_rate: float = 0.0

    NAME: ClassVar[str] = 'plain ViT'

    def __post_init__(self) -> None:
        dims = positive_int(self.embed_dims, 'embed_dims')
        depth = positive_int(self.depth, 'depth')
        heads = positive_int(self.num_heads, 'num_heads')
        if dims % heads:
            raise ValueError(f'embed_dims={dims} is not divisible by num_heads={heads}; '
                             'choose a head count that divides it')
        glob = self.global_attn_indexes
        if glob is None:
            n = min(NUM_GLOBAL_BLOCKS, depth)
            glob = tuple((k + 1) * depth // n - 1 for k in range(n))
        object.__setattr__(self, 'global_attn_indexes',
                           index_list('global_attn_indexes', glob, depth))
        object.__setattr__(self, 'drop_path_rate',
                           check_rate(self.drop_path_rate, 'drop_path_rate'))
        if self.mlp not in MLP_KINDS:
            raise ValueError(f'mlp={self.mlp!r} is not one of {list(MLP_KINDS)}')
        if self.qkv_bias not in QKV_BIAS_MODES:
            raise ValueError(f'qkv_bias={self.qkv_bias!r} is not one of {list(QKV_BIAS_MODES)} '
                             "('qkv': ViTDet / DINOv2, 'qv': EVA-02 / DINOv3 *_qkvb, 'none': "
                             'DINOv3)')
        if self.mlp_sub_ln and self.mlp != 'swiglu':
            raise ValueError(f"mlp_sub_ln=True needs mlp='swiglu' (EVA-02's sub-LN sits between "
                             f"its gate and fc2), got mlp={self.mlp!r}")
        positive_number(self.mlp_ratio, 'mlp_ratio')
        positive_number(self.norm_eps, 'norm_eps')
        if self.mlp_align != 0:
            positive_int(self.mlp_align, 'mlp_align', ' (or 0: no rounding)')
        if self.num_reg_tokens != 0:
            positive_int(self.num_reg_tokens, 'num_reg_tokens', ' (or 0: no registers)')
        if self.layer_scale is not None:
            positive_number(self.layer_scale, 'layer_scale')

    @property
    def mlp_hidden(self) -> int:
        """Hidden width of the MLP (of the gate and of the value for SwiGLU)."""
        hidden = int(self.embed_dims * self.mlp_ratio)
        return hidden + (-hidden % self.mlp_align if self.mlp_align else 0)


def check_out_indices(out_indices: Sequence[int], depth: int) -> Tuple[int, ...]:
    """The blocks a plain ViT returns: a non-empty list of indices (negative from the end) into
    ``depth`` blocks, sorted and without duplicates."""
    indices = int_tuple(out_indices, 'out_indices')
    if not indices:
        raise ValueError('out_indices is empty; give at least one block index (-1: the '
                         'last block)')
    return index_list('out_indices', indices, depth, negative=True)


def check_frozen_blocks(frozen_stages: int, depth: int) -> int:
    """``frozen_stages`` of a plain ViT of ``depth`` blocks: ``-1..depth``."""
    if not -1 <= int_arg(frozen_stages, 'frozen_stages') <= depth:
        raise ValueError(f'frozen_stages={frozen_stages} must be in -1..{depth} (-1: train '
                         'all, 0: the embeddings and tokens, k: also the first k blocks)')
    return frozen_stages
