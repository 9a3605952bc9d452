"""Building blocks shared by the backbones: one copy of each."""
from .attention import MASKED_LOGIT, Attention, attend, eager_attention, set_fused_attention
from .drop_path import DropPath, drop_path, linear_drop_path_rates
from .mlp import Mlp
from .norm import LayerNorm2d
from .patch_embed import PatchEmbed
from .rel_pos import (decomposed_rel_pos_bias, decomposed_rel_pos_embeddings,
                      relative_position_index, resize_rel_pos)
from .window import (WindowIndex, pad_hw, padded_size, to_2tuple, window_gather_index,
                     window_partition, window_reverse)

__all__ = [
    'MASKED_LOGIT', 'Attention', 'attend', 'eager_attention', 'set_fused_attention', 'DropPath',
    'drop_path', 'linear_drop_path_rates', 'Mlp', 'LayerNorm2d', 'PatchEmbed',
    'decomposed_rel_pos_bias', 'decomposed_rel_pos_embeddings', 'relative_position_index',
    'resize_rel_pos', 'WindowIndex', 'pad_hw', 'padded_size', 'to_2tuple', 'window_gather_index', 'window_partition', 'window_reverse'
]
from .window_attention import WindowAttention  # noqa: E402

__all__ += ['WindowAttention']
from .patch_merging import PatchMerging  # noqa: E402
from .window_attention import shifted_window_mask  # noqa: E402

__all__ += ['PatchMerging', 'shifted_window_mask']
from .cross_attention import MultiheadCrossAttention  # noqa: E402
from .attention import register_fusable_attention  # noqa: E402

__all__ += ['MultiheadCrossAttention', 'register_fusable_attention']
from .res_bottleneck import ResBottleneckBlock  # noqa: E402

__all__ += ['ResBottleneckBlock']
from .norm import masked_group_norm  # noqa: E402

__all__ += ['masked_group_norm']
from .rel_pos import decomposed_rel_pos_terms  # noqa: E402
from .lean_attention import rel_pos_attention  # noqa: E402

__all__ += ['decomposed_rel_pos_terms', 'rel_pos_attention']
from .residual import residual_add  # noqa: E402

__all__ += ['residual_add']
