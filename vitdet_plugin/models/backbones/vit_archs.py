"""Architecture presets of the plain ViT: one spec type, :class:`PlainViTArch`, and the presets
of each family (:class:`ViTArch`: ViTDet; :class:`DINOv2Arch`, :class:`DINOv3Arch`,
:class:`EVA02Arch`: values of timm 1.0.31's model functions ``vit_*_patch14_dinov2``,
``vit_*_patch16_dinov3``, ``eva02_*_patch14_224``).

The spec holds everything a block needs: width, heads, MLP kind, q / k / v bias mode, sub-LN,
LayerScale, decomposed relative positions, residual conv blocks. Global-attention blocks follow
ViTDet / EVA-02-det (the last block of each quarter). DINOv3 7B (``'7b'``: 4096 wide, 40 blocks,
6.7B parameters; facebookresearch/dinov3 ``dinov3_vit7b16``, timm ``vit_7b_patch16_dinov3``)
trains sharded across GPUs (docs/large_models.md).
"""
import dataclasses
from typing import ClassVar, Optional, Sequence, Tuple

from ..layers.arguments import (check_flag, check_rate, int_arg, int_tuple, positive_int,
                               positive_number)
from .base import ArchSpec

#: MLP kinds: GELU ``fc1/fc2``; SwiGLU with separate gate / value projections
#: ``fc1_g/fc1_x`` (+ optional sub-LN ``norm``) and ``fc2``; packed SwiGLU ``fc1`` (gate rows
#: first) and ``fc2``.
MLP_KINDS = ('gelu', 'swiglu', 'swiglu_packed')
#: Bias of the q / k / v projections: one fused bias (ViTDet, DINOv2); q and v biases and no k
#: bias (EVA-02, DINOv3 ``*_qkvb``: a k bias would only add a per-query constant to the
#: logits); none (DINOv3).
QKV_BIAS_MODES = ('qkv', 'qv', 'none')
#: LayerScale init of DINOv2 / DINOv3.
DINO_LAYER_SCALE = 1e-5
#: LayerNorm eps: timm's ViT / ViTDet / EVA-02 (1e-6) and DINOv3 (1e-5).
EPS_VIT = 1e-6
EPS_DINOV3 = 1e-5
#: EVA-02's SwiGLU width: 2/3 of the 4x GELU MLP (same parameter count).
EVA02_MLP_RATIO = 4 * 2 / 3
#: DINOv2-giant's SwiGLU width (4096 for 1536 channels).
DINOV2_GIANT_MLP_RATIO = 2.66667
#: DINOv3 S+ / H+ round their SwiGLU width up to a multiple of this.
DINOV3_MLP_ALIGN = 8
#: DINOv3 7B (``ffn_ratio=3, ffn_layer='swiglu64'``): SwiGLU width int(3 * 4096 * 2 / 3) = 8192
#: = 2 x 4096, rounded up to a multiple of 64.
DINOV3_7B_MLP_RATIO = 2.0
DINOV3_7B_MLP_ALIGN = 64
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
    """Width, depth, heads and block options of a plain ViT.

    ``mlp_ratio``: hidden width / embed dims of the MLP (of its gate for SwiGLU), rounded down
    as timm does and up to a multiple of ``mlp_align`` (0: none). ``layer_scale``: LayerScale
    init (None: no LayerScale). ``num_reg_tokens``: register tokens after the cls token.
    ``rel_pos``: decomposed relative positions (ViTDet / MViTv2) in every block.
    ``residual_block_indexes``: blocks followed by a residual bottleneck conv block (ViTDet).
    ``global_attn_indexes``: default :data:`NUM_GLOBAL_BLOCKS` evenly spaced, ending at the
    last block.
    """

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
    rel_pos: bool = False
    residual_block_indexes: Tuple[int, ...] = ()
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
        object.__setattr__(self, 'residual_block_indexes',
                           index_list('residual_block_indexes', self.residual_block_indexes,
                                      depth))
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
        check_flag(self.rel_pos, 'rel_pos')
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


@dataclasses.dataclass(frozen=True)
class ViTArch(PlainViTArch):
    """ViTDet presets (detectron2 projects/ViTDet): GELU MLP, fused qkv bias, decomposed
    relative positions; custom arch dicts default to global attention in the last block of
    each quarter and no drop path."""

    rel_pos: bool = True

    NAME: ClassVar[str] = 'ViT'
    PRESETS: ClassVar = {
        'base': dict(embed_dims=768, depth=12, num_heads=12, global_attn_indexes=(2, 5, 8, 11),
                     drop_path_rate=0.1),
        'large': dict(embed_dims=1024, depth=24, num_heads=16,
                      global_attn_indexes=(5, 11, 17, 23), drop_path_rate=0.4),
        'huge': dict(embed_dims=1280, depth=32, num_heads=16,
                     global_attn_indexes=(7, 15, 23, 31), drop_path_rate=0.5),
    }


#: The ViTDet presets.
VIT_ARCHS = ViTArch.PRESETS

_DINOV3_SWIGLU = dict(mlp='swiglu', mlp_align=DINOV3_MLP_ALIGN)
_EVA02_PACKED = dict(mlp='swiglu_packed', mlp_sub_ln=False)


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


@dataclasses.dataclass(frozen=True)
class DINOv3Arch(PlainViTArch):
    """DINOv3 presets (``vit_{small,small_plus,base,large,huge_plus,7b}_patch16_dinov3``; the
    ``*_qkvb`` checkpoints: give ``qkv_bias='qv'``); custom arch dicts default to DINOv3's
    block options."""

    qkv_bias: str = 'none'
    layer_scale: Optional[float] = DINO_LAYER_SCALE
    num_reg_tokens: int = 4
    norm_eps: float = EPS_DINOV3

    NAME: ClassVar[str] = 'DINOv3'
    PRESETS: ClassVar = {
        'small': dict(embed_dims=384, depth=12, num_heads=6, drop_path_rate=0.1),
        'small_plus': dict(_DINOV3_SWIGLU, embed_dims=384, depth=12, num_heads=6,
                           drop_path_rate=0.1),
        'base': dict(embed_dims=768, depth=12, num_heads=12, drop_path_rate=0.1),
        'large': dict(embed_dims=1024, depth=24, num_heads=16, drop_path_rate=0.4),
        'huge_plus': dict(_DINOV3_SWIGLU, embed_dims=1280, depth=32, num_heads=20,
                          drop_path_rate=0.5),
        # no qkv bias; its untied norm (local_cls_norm: cls / storage tokens of local crops) is
        # pretraining-only; the patch tokens' final norm is `norm`, as in every preset
        '7b': dict(mlp='swiglu', mlp_ratio=DINOV3_7B_MLP_RATIO, mlp_align=DINOV3_7B_MLP_ALIGN,
                   embed_dims=4096, depth=40, num_heads=32, drop_path_rate=0.5),
    }


@dataclasses.dataclass(frozen=True)
class EVA02Arch(PlainViTArch):
    """EVA-02 presets (``eva02_{tiny,small,base,large}_patch14_224``): packed SwiGLU for T/S,
    SwiGLU with sub-LN for B/L; q and v biases. Custom arch dicts default to B / L's block
    options."""

    mlp: str = 'swiglu'
    mlp_ratio: float = EVA02_MLP_RATIO
    mlp_sub_ln: bool = True
    qkv_bias: str = 'qv'

    NAME: ClassVar[str] = 'EVA-02'
    PRESETS: ClassVar = {
        'tiny': dict(_EVA02_PACKED, embed_dims=192, depth=12, num_heads=3, drop_path_rate=0.1),
        'small': dict(_EVA02_PACKED, embed_dims=384, depth=12, num_heads=6, drop_path_rate=0.1),
        'base': dict(embed_dims=768, depth=12, num_heads=12, drop_path_rate=0.1),
        'large': dict(embed_dims=1024, depth=24, num_heads=16, drop_path_rate=0.4),
    }


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
