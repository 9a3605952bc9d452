"""The one table of checkpoint layouts, and the loader every backbone, neck and
``tools/convert_weights.py`` goes through.

Each converter module declares its layouts (``LAYOUTS``, :class:`~.layout.Layout`: a family,
a name, its classifier and its converter for a
:class:`~vitdet_plugin.functional.checkpoint_target.CheckpointTarget`); :data:`LAYOUTS` here is
their sum. Detection does not depend on that order: :func:`find_layout` asks every layout, and
of those a checkpoint fits, the higher priority wins (a transformers class over the family
layout its blocks fit, the DINOv2 / DINOv3 / EVA-02 layouts over the plain ViT's, whose keys
they share); two alike are refused.

:func:`load_checkpoint` reads a checkpoint (``weights_only`` / safetensors / detectron2
``.pkl``, :mod:`.checkpoint_io`), refuses one of another family naming the backbone that loads
it, converts it and checks every key and shape against the target
(:class:`~vitdet_plugin.functional.checkpoint_target.LoadReport`: the keys loaded, dropped and
resampled). The module then loads the returned state dict itself. :mod:`vitdet_plugin.weights`
plugs it into the models' checkpoint contract.
"""
import dataclasses
import logging
import os
from typing import List, Mapping, Optional, Tuple, Union

from torch import Size, Tensor

from ..functional.checkpoint_target import CheckpointTarget, LoadReport
from . import deimv2, dfine_official, rfdetr, swin, swin_v2, transformers_layouts, vit, vit_families
from .arch_read import arch_mismatch, read_arch
from .checkpoint_io import CheckpointError
from .common import StateDict, check_state_dict, checkpoint_state_dict, read_as_saved
from .layout import Layout
from .swin import SWIN_UNRECOGNISED
from .swin_v2 import SWIN_V2_UNRECOGNISED
from .transformers_folder import read_transformers_config
from .transformers_layouts import config_mismatch, config_window
from .vit import NECK, OPTIONAL_PARTS, PYRAMID_KEY, VIT_UNRECOGNISED
from .vit_families import VIT_FAMILIES, VIT_FAMILY_UNRECOGNISED

logger = logging.getLogger('vitdet_plugin')

#: Every checkpoint family and the module type that loads it.
FAMILY_BACKBONES = {'Swin': 'SwinBackbone', 'Swin V2': 'SwinV2Backbone', 'ViT': 'ViTBackbone',
                    'DINOv2': 'DINOv2Backbone', 'DINOv3': 'DINOv3Backbone',
                    'EVA-02': 'EVA02Backbone', NECK: 'ViTSimpleFPN',
                    rfdetr.RFDETR: 'DINOv2Backbone',  # RF-DETR: its backbone part
                    **deimv2.FAMILY_MODULES}  # D-FINE / DEIMv2 parts
#: What each family's loader says when no layout fits.
_UNRECOGNISED = {'Swin': SWIN_UNRECOGNISED, 'Swin V2': SWIN_V2_UNRECOGNISED,
                 'ViT': VIT_UNRECOGNISED, **dict.fromkeys(VIT_FAMILIES, VIT_FAMILY_UNRECOGNISED)}
#: Model keys a checkpoint may lack (they keep their init): Swin's detection output norms.
_OUTPUT_NORMS = (r'^norm\d+\.',)

#: Every layout we load: each converter module declares its own (``LAYOUTS``).
LAYOUTS: Tuple[Layout, ...] = (transformers_layouts.LAYOUTS + vit_families.LAYOUTS
                               + swin_v2.LAYOUTS + swin.LAYOUTS + vit.LAYOUTS + rfdetr.LAYOUTS
                               + deimv2.LAYOUTS + dfine_official.LAYOUTS)


def matching_layouts(sd: Mapping[str, Tensor]) -> List[Layout]:
    """Every layout of :data:`LAYOUTS` that ``sd`` (an unwrapped state dict) fits."""
    return [layout for layout in LAYOUTS if layout.detects(sd)]


def find_layout(sd: Mapping[str, Tensor]) -> Optional[Layout]:
    """The layout ``sd`` is in, or None: of the layouts it fits, the one of highest
    :attr:`~.layout.Layout.priority` (a DINOv2 checkpoint also fits the plain ViT's generic
    layouts); two of the same priority are a :class:`CheckpointError` naming both."""
    found = matching_layouts(sd)
    if not found:
        return None
    top = max(layout.priority for layout in found)
    best = [layout for layout in found if layout.priority == top]
    if len(best) > 1:
        raise CheckpointError(
            f"the checkpoint fits {len(best)} layouts alike: "
            f"{', '.join(layout.describe() for layout in best)}; it mixes the weights of "
            'several models: give the prefix of the one to load (init_cfg prefix=..., '
            'tools/convert_weights.py --prefix)')
    return best[0]


def detect_layout(sd: Mapping[str, Tensor], family: Optional[str] = None,
                  owner: Optional[str] = None) -> Layout:
    """The layout of ``sd``; :class:`CheckpointError` when none fits (saying what ``family``'s
    loader, or every loader, looks for) or when it is not ``family``'s (naming the backbone that
    loads it; ``owner``: who refuses it, default ``family``'s backbone)."""
    layout = find_layout(sd)
    if layout is None:
        wanted = ([_UNRECOGNISED[family]] if family in _UNRECOGNISED
                  else list(dict.fromkeys(_UNRECOGNISED.values())))
        raise CheckpointError(
            f"unrecognised checkpoint format: {'; '.join(wanted)}; first keys: {list(sd)[:5]}. "
            'If the weights sit under a prefix (e.g. encoder.), give it (init_cfg prefix=..., '
            'tools/convert_weights.py --prefix)')
    if family is not None and not layout.loads_into(family):
        raise CheckpointError(refusal(layout, owner or FAMILY_BACKBONES[family], family))
    return layout


def refusal(layout: Layout, owner: str, family: str) -> str:
    """The message refusing ``layout`` for ``owner`` (which loads ``family`` checkpoints)."""
    return (f'the checkpoint is {layout.describe()}; {owner} loads {family} checkpoints: '
            f"build type='{FAMILY_BACKBONES[layout.family]}'")


# ----------------------------------------------------------------------------- loading
def load_checkpoint(checkpoint: Union[str, os.PathLike, Mapping],
                    target: CheckpointTarget,
                    prefix: Optional[str] = None) -> Tuple[StateDict, LoadReport]:
    """Read ``checkpoint`` (a file, a URL or a loaded dict; ``prefix``: its part under that
    prefix) and convert it for ``target``, strictly: the result has exactly the keys and shapes
    of ``target.expected`` (but the optional parts its family allows to be absent), else
    :class:`CheckpointError` names the differences. A checkpoint of another family is refused
    naming the backbone that loads it. Returns the state dict to load and the report (keys
    loaded, keys left at their init, checkpoint keys dropped, tensors resampled)."""
    if target.expected is None:
        raise ValueError('load_checkpoint needs the target\'s expected {name: shape}; convert '
                         'without a module through detect_layout(sd).convert(sd, target)')
    sd = checkpoint_state_dict(checkpoint, prefix)
    layout = (_neck_layout(sd) if target.family == NECK
              else detect_layout(sd, target.family, target.owner))
    resampled: List[str] = []
    converted, dropped = _convert(layout, sd, _folder_target(checkpoint, layout, target),
                                  resampled)
    _log_dropped(layout, dropped, checkpoint)
    allow: Tuple[str, ...] = ()
    if target.family in ('Swin', 'Swin V2'):
        allow = _OUTPUT_NORMS
    elif target.family == 'ViT':
        allow = tuple(p.pattern for p in OPTIONAL_PARTS
                      if not any(p.match(k) for k in converted))
    source = f'{layout.family} checkpoint ({layout.name} layout)'
    mismatch = arch_mismatch(read_arch({k: v.shape for k, v in converted.items()}),
                             read_arch(target.expected), source, target.owner,
                             target.arch_presets)
    if mismatch:
        raise CheckpointError(mismatch)
    report = check_state_dict(converted, target.expected, allow, source=source,
                              owner=target.owner, dropped=dropped)
    return converted, report._replace(layout=f'{layout.family} {layout.name}',
                                      resampled=tuple(resampled))


def read_part(checkpoint: Union[str, os.PathLike, Mapping], prefix: Optional[str],
              expected: Mapping[str, Size], owner: str,
              source: str = 'checkpoint') -> Tuple[StateDict, LoadReport]:
    """:func:`~.common.read_as_saved` (a detector's part under ``prefix`` in our names, strict)
    that also reads an RF-DETR checkpoint: converted to our detector's layout first (its size
    and classes checked against the part, :func:`~.rfdetr.rfdetr_to_detector`)."""
    sd = checkpoint_state_dict(checkpoint)
    if prefix and rfdetr.rfdetr_layout(sd) is not None:
        part = prefix if prefix.endswith('.') else prefix + '.'
        sd, _ = rfdetr.rfdetr_to_detector(sd, {part + k: s for k, s in expected.items()},
                                          owner)
    return read_as_saved(sd, prefix, expected, owner, source)


def _convert(layout: Layout, sd: StateDict, target: CheckpointTarget,
             resampled: List[str]) -> Tuple[StateDict, List[str]]:
    """``layout.convert``; a neck given a checkpoint without a pyramid is told what the
    checkpoint is, when the table knows it."""
    try:
        return layout.convert(sd, target, resampled)
    except CheckpointError as e:
        found = find_layout(sd) if layout.family == NECK else None
        if found is None or found.family == NECK:
            raise
        raise CheckpointError(f'{e}. The checkpoint is {found.describe()}: load it into '
                              f"type='{FAMILY_BACKBONES[found.family]}'") from e


def _folder_target(checkpoint: Union[str, os.PathLike, Mapping], layout: Layout,
                   target: CheckpointTarget) -> CheckpointTarget:
    """``target`` checked against a transformers folder's ``config.json`` (a mismatch is a
    :class:`CheckpointError` naming both and the fix), with the folder's Swin window as the
    source window of the bias tables; ``target`` itself for any other checkpoint."""
    if not isinstance(checkpoint, (str, os.PathLike)):
        return target
    config = read_transformers_config(checkpoint)
    if config is None:
        return target
    mismatch = config_mismatch(config, layout.family, target,
                               f'transformers folder {os.fspath(checkpoint)!r}')
    if mismatch:
        raise CheckpointError(mismatch)
    window = config_window(config)
    if target.src_window_size is None and window is not None:
        return dataclasses.replace(target, src_window_size=window)
    return target


def _neck_layout(sd: StateDict) -> Layout:
    """The neck's layout: detectron2's when the checkpoint has ``simfp_*`` keys, else ours (its
    converter finds the pyramid wherever it sits in the checkpoint)."""
    name = 'detectron2' if any('simfp_' in k for k in sd) else 'ours'
    return next(layout for layout in LAYOUTS if layout.family == NECK and layout.name == name)


def _log_dropped(layout: Layout, dropped: List[str],
                 checkpoint: Union[str, os.PathLike, Mapping]) -> None:
    pyramid = ([k for k in dropped if PYRAMID_KEY.match(k)] if layout.family == 'ViT'
               else [])
    others = [k for k in dropped if k not in set(pyramid)]
    if pyramid:
        source = repr(checkpoint) if isinstance(checkpoint, str) else 'the same checkpoint'
        logger.warning('ViT checkpoint: its %d simple-pyramid keys (%s) are the weights of the '
                       "neck, not of the backbone: load them with the neck's init_cfg=dict("
                       "type='Pretrained', checkpoint=%s) (ViTSimpleFPN reads this layout), or "
                       'convert the file with vitdet_plugin.weights.vit.convert_vitdet_to_mmdet '
                       'into a backbone.* + neck.* checkpoint for load_from',
                       len(pyramid), ', '.join(pyramid[:3]) + (', ...' if len(pyramid) > 3
                                                                else ''), source)
    if others:
        logger.info('%s checkpoint (%s layout): ignored %d keys not used (e.g. %s)',
                    layout.family, layout.name, len(others), ', '.join(others[:5]))
