"""Checkpoints: safe reading (:mod:`.checkpoint_io`; transformers folders,
:mod:`.transformers_folder`), state-dict handling (:mod:`.common`), the
one table of layouts and the loader (:mod:`.layouts`, fed a
:class:`~vitdet_plugin.functional.checkpoint_target.CheckpointTarget`; loaded into a module by
:mod:`.pretrained`)
and the converters it pairs with detectors, pure ``state_dict -> state_dict`` functions
(:mod:`.swin`, :mod:`.swin_v2`, :mod:`.vit`, :mod:`.vit_families`; RF-DETR's detectors,
:mod:`.rfdetr`; the official DINOv2 / DINOv3 / EVA-02 layouts to timm's,
:mod:`.official_vit`; the patch-kernel resample, :mod:`.patch_resample`). Memory-mapped reading,
for loading into shards: :mod:`.lazy`.

Importing this package plugs its loader into the models' checkpoint contract
(:func:`~vitdet_plugin.functional.checkpoint_target.plug_checkpoint_loader`): the models ask the
contract, never this package, so the dependency points from here to them.
"""
from ..functional.checkpoint_target import (CheckpointLoader, CheckpointTarget, LoadReport,
                                            plug_checkpoint_loader)
from .checkpoint_io import CheckpointError
from .common import (check_state_dict, checkpoint_state_dict, drop_keys, load_checkpoint_file,
                     load_state_dict_checked, read_as_saved, select_prefix, unwrap_state_dict)
from .layouts import (FAMILY_BACKBONES, LAYOUTS, Layout, detect_layout, find_layout,
                      load_checkpoint, read_part)
from .lazy import LazyCheckpoint, read_lazily
from .official_vit import OFFICIAL_VIT_LAYOUTS, detect_official_vit_layout, official_to_timm
from .patch_resample import resample_patch_kernel
from .pretrained import load_init_checkpoint, load_pretrained

__all__ = [
    'CheckpointError', 'LoadReport', 'check_state_dict', 'checkpoint_state_dict', 'drop_keys',
    'load_checkpoint_file', 'load_state_dict_checked', 'read_as_saved', 'select_prefix',
    'unwrap_state_dict',
    'FAMILY_BACKBONES', 'LAYOUTS', 'Layout', 'detect_layout', 'find_layout', 'load_checkpoint',
    'OFFICIAL_VIT_LAYOUTS', 'detect_official_vit_layout', 'official_to_timm',
    'resample_patch_kernel', 'CheckpointTarget', 'load_init_checkpoint', 'load_pretrained',
    'LazyCheckpoint', 'read_lazily',
]

plug_checkpoint_loader(CheckpointLoader(convert=load_checkpoint, read_as_saved=read_part,
                                        load_init=load_init_checkpoint))
