"""Checkpoints: safe reading (:mod:`.checkpoint_io`), state-dict handling (:mod:`.common`) and
the converters, pure ``state_dict -> state_dict`` functions (:mod:`.swin`, :mod:`.swin_v2`,
:mod:`.vit`)."""
from .checkpoint_io import CheckpointError, load_checkpoint_file
from .common import (LoadReport, checkpoint_state_dict, drop_keys, load_state_dict_checked,
                     select_prefix, unwrap_state_dict)

__all__ = [
    'CheckpointError', 'LoadReport', 'checkpoint_state_dict', 'drop_keys', 'load_checkpoint_file',
    'load_state_dict_checked', 'select_prefix', 'unwrap_state_dict'
]
