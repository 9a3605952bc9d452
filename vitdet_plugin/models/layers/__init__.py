"""Building blocks shared by the backbones and heads: one copy of each."""
from ...functional import (MASKED_LOGIT, attend, bias_table_size, decomposed_rel_pos_bias,
                           decomposed_rel_pos_embeddings, decomposed_rel_pos_terms,
                           pad_to_multiple, padded_size, relative_position_index,
                           resize_rel_pos, shifted_window_mask, window_partition,
                           window_reverse)
from .arguments import (ACCEL_MODES, check_accel, check_flag, check_flags, check_rate,
                        check_rates, int_arg, int_tuple, positive_int, positive_number,
                        to_2tuple)
from .attention import Attention, eager_attention, register_fusable_attention, set_fused_attention
from .conv_stem import ConvStem
from .cross_attention import MultiheadCrossAttention
from .layer_scale import LayerScale
from .mlp import DropPath, Mlp, gelu_linear, linear_drop_path_rates, set_recompute_gelu
from .norm import LayerNorm2d, masked_group_norm
from .patch_embed import PatchEmbed
from .patch_merging import PatchMerging
from .res_bottleneck import ResBottleneckBlock
from .swiglu import SwiGLU, SwiGLUPacked

__all__ = [
    'ACCEL_MODES', 'check_accel', 'gelu_linear', 'set_recompute_gelu',
    'MASKED_LOGIT', 'Attention', 'attend', 'eager_attention', 'register_fusable_attention',
    'set_fused_attention', 'ConvStem', 'MultiheadCrossAttention', 'DropPath',
    'linear_drop_path_rates', 'Mlp', 'LayerNorm2d', 'masked_group_norm', 'PatchEmbed',
    'PatchMerging', 'ResBottleneckBlock', 'LayerScale', 'SwiGLU', 'SwiGLUPacked',
    'check_flag', 'check_flags', 'check_rate', 'check_rates', 'int_arg', 'int_tuple',
    'positive_int', 'positive_number', 'to_2tuple',
    # pure functions, re-exported from vitdet_plugin.functional
    'bias_table_size', 'decomposed_rel_pos_bias', 'decomposed_rel_pos_embeddings',
    'decomposed_rel_pos_terms', 'pad_to_multiple', 'padded_size', 'relative_position_index',
    'resize_rel_pos', 'shifted_window_mask', 'window_partition', 'window_reverse',
]
