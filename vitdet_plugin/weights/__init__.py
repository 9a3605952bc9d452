"""Checkpoint converters: pure ``state_dict -> state_dict`` functions and a safe loader."""
from .common import (CheckpointError, LoadReport, checkpoint_state_dict, drop_keys,
                     load_checkpoint_file, load_state_dict_checked, resize_pos_grid,
                     select_prefix, unwrap_state_dict)

__all__ = [
    'CheckpointError', 'LoadReport', 'checkpoint_state_dict', 'drop_keys', 'load_checkpoint_file',
    'load_state_dict_checked', 'resize_pos_grid', 'select_prefix', 'unwrap_state_dict'
]
