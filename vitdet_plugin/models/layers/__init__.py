"""Building blocks shared by the backbones and heads: one copy of each."""
from .arguments import int_arg, int_tuple, positive_int, to_2tuple
from .attention import (MASKED_LOGIT, Attention, attend, eager_attention,
                        register_fusable_attention, set_fused_attention)
from .chunking import (chunk_rows, chunk_slices, inference_fast_path, map_height_chunks,
                       map_row_chunks, rows_per_chunk)
from .conv_stem import ConvStem
from .cross_attention import MultiheadCrossAttention
from .drop_path import DropPath, drop_path, linear_drop_path_rates
from .lean_attention import rel_pos_attention
from .mlp import Mlp
from .norm import LayerNorm2d, masked_group_norm
from .patch_embed import PatchEmbed
from .patch_merging import PatchMerging
from .rel_pos import (bias_table_size, decomposed_rel_pos_bias, decomposed_rel_pos_embeddings,
                      decomposed_rel_pos_terms, relative_position_index, resize_rel_pos)
from .res_bottleneck import ResBottleneckBlock
from .residual import residual_add
from .tensor_watch import TensorWatch, builds_cache
from .window import (WindowChunk, WindowIndex, WindowPlan, pad_hw, padded_size,
                     window_gather_index, window_partition, window_plan, window_reverse)
from .window_attention import WindowAttention, shifted_window_mask

__all__ = [
    'MASKED_LOGIT', 'Attention', 'attend', 'eager_attention', 'register_fusable_attention',
    'set_fused_attention', 'chunk_rows', 'chunk_slices', 'inference_fast_path',
    'map_height_chunks', 'map_row_chunks', 'rows_per_chunk',
    'ConvStem', 'MultiheadCrossAttention',
    'DropPath', 'drop_path', 'linear_drop_path_rates', 'rel_pos_attention', 'Mlp',
    'LayerNorm2d', 'masked_group_norm', 'PatchEmbed', 'PatchMerging',
    'bias_table_size', 'decomposed_rel_pos_bias', 'decomposed_rel_pos_embeddings', 'decomposed_rel_pos_terms',
    'relative_position_index', 'resize_rel_pos', 'ResBottleneckBlock', 'residual_add',
    'TensorWatch', 'builds_cache',
    'int_arg', 'int_tuple', 'positive_int', 'to_2tuple',
    'WindowChunk', 'WindowIndex', 'WindowPlan', 'pad_hw', 'padded_size',
    'window_gather_index', 'window_partition', 'window_plan', 'window_reverse', 'WindowAttention',
    'shifted_window_mask',
]
