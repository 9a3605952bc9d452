"""Pure functions: windowing, shift masks, window sizes, relative positions, grid resizing.

A leaf of the package: it imports nothing of ours, so the weight converters (``weights/``) and
the models (``models/``) can both use it without importing each other (the import-graph test
keeps it that way). Caches here hold only what depends on sizes alone
(see :class:`.sizes.SizeCache`).
"""
from .attention import attend
from .decomposed_rel_pos import (decomposed_rel_pos_bias, decomposed_rel_pos_channels,
                                 decomposed_rel_pos_embeddings, decomposed_rel_pos_terms,
                                 resize_rel_pos)
from .pos_grid import interpolation_dtype, resize_pos_grid
from .rope import (ROPE_FORMULATIONS, RopeSpec, apply_rope, check_rope_spec,
                   rope_axis_coords, rope_frequencies, rope_tables)
from .sizes import ArgumentError, SizeCache, known_equal, known_zero, to_2tuple, window_pair
from .swin_bias import bias_table_size, relative_position_index, window_bias
from .window import (MASKED_LOGIT, WindowGrid, from_windows, pad_to_multiple, padded_size,
                     shifted_window_mask, to_windows, window_attend, window_partition,
                     window_reverse)

__all__ = [
    'attend',
    'bias_table_size', 'decomposed_rel_pos_bias', 'decomposed_rel_pos_channels',
    'decomposed_rel_pos_embeddings', 'decomposed_rel_pos_terms', 'interpolation_dtype',
    'relative_position_index', 'resize_pos_grid', 'resize_rel_pos', 'SizeCache',
    'ROPE_FORMULATIONS', 'RopeSpec', 'apply_rope', 'check_rope_spec', 'rope_axis_coords',
    'rope_frequencies', 'rope_tables',
    'ArgumentError', 'to_2tuple', 'window_pair', 'known_equal', 'known_zero',
    'MASKED_LOGIT', 'WindowGrid', 'from_windows', 'pad_to_multiple', 'padded_size',
    'shifted_window_mask', 'to_windows', 'window_attend', 'window_bias', 'window_partition',
    'window_reverse',
]
