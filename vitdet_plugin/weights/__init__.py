"""Checkpoints: safe reading (:mod:`.checkpoint_io`), state-dict handling (:mod:`.common`) and
the converters, pure ``state_dict -> state_dict`` functions (:mod:`.swin`, :mod:`.swin_v2`,
:mod:`.vit`; the official DINOv2 / DINOv3 / EVA-02 layouts to timm's, :mod:`.official_vit`; the
patch-kernel resample, :mod:`.patch_resample`)."""
from .checkpoint_io import CheckpointError, load_checkpoint_file
from .common import (LoadReport, checkpoint_state_dict, drop_keys, load_state_dict_checked,
                     select_prefix, unwrap_state_dict)
from .official_vit import OFFICIAL_VIT_LAYOUTS, detect_official_vit_layout, official_to_timm
from .patch_resample import resample_patch_kernel

__all__ = [
    'CheckpointError', 'LoadReport', 'checkpoint_state_dict', 'drop_keys', 'load_checkpoint_file',
    'load_state_dict_checked', 'select_prefix', 'unwrap_state_dict',
    'OFFICIAL_VIT_LAYOUTS', 'detect_official_vit_layout', 'official_to_timm',
    'resample_patch_kernel',
]
