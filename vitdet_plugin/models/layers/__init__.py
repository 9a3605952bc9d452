"""Building blocks shared by the backbones and heads: one copy of each (pure functions are in
:mod:`vitdet_plugin.functional`, argument checks in :mod:`.arguments`)."""
from .attention import Attention, eager_attention
from .cross_attention import MultiheadCrossAttention
from .drop_path import DropPath, linear_drop_path_rates
from .mlp import Mlp
from .norm import LayerNorm2d, masked_group_norm
from .patch_embed import ConvStem, PatchEmbed
from .patch_merging import PatchMerging
from .res_bottleneck import ResBottleneckBlock
from .swiglu import SwiGLU, SwiGLUPacked

__all__ = [
    'Attention', 'eager_attention', 'ConvStem', 'MultiheadCrossAttention',
    'DropPath', 'Mlp', 'linear_drop_path_rates', 'LayerNorm2d', 'masked_group_norm',
    'PatchEmbed', 'PatchMerging', 'ResBottleneckBlock', 'SwiGLU', 'SwiGLUPacked',
]
