"""The one table of checkpoint layouts, and the loader every backbone, neck and
``tools/convert_weights.py`` goes through.

Each :class:`Layout` is a pair of pure functions over state dicts: ``detect`` says whether a
state dict is in this layout, ``convert`` maps it to our parameter names for a
:class:`~.target.CheckpointTarget`. :data:`LAYOUTS` lists them in the order they are asked
(the official DINOv2 / DINOv3 / EVA-02 layouts and the families' timm / our layouts before the
plain ViT, whose keys they share); :func:`detect_layout` names the first that fits.

:func:`load_checkpoint` reads a checkpoint (``weights_only`` / safetensors / detectron2
``.pkl``, :mod:`.checkpoint_io`), refuses one of another family naming the backbone that loads
it, converts it and checks every key and shape against the target (:class:`~.common.LoadReport`).
The module then loads the returned state dict itself.
"""
import dataclasses
import logging
import os
from typing import Callable, Dict, List, Mapping, Optional, Tuple, Union

from torch import Tensor

from .arch_read import arch_mismatch, read_arch
from .checkpoint_io import CheckpointError, read_transformers_config
from .common import LoadReport, StateDict, check_state_dict, checkpoint_state_dict
from .official_vit import OFFICIAL_FAMILIES
from .swin import (SWIN_FORMATS, SWIN_UNRECOGNISED, convert_swin, drop_unused_output_norms,
                   swin_layout)
from .swin_v2 import (SWIN_V2_FORMATS, SWIN_V2_UNRECOGNISED, check_pretrained_windows,
                      convert_swin_v2, swin_v2_layout)
from .target import CheckpointTarget
from .transformers_layouts import (TRANSFORMERS_MODELS, config_mismatch, config_window,
                                   transformers_layout, transformers_to_reference)
from .vit import (OPTIONAL_PARTS, PYRAMID_KEY, VIT_FORMATS, VIT_UNRECOGNISED, convert_vit,
                  simple_fpn_layout, simple_fpn_part, vit_layout)
from .vit_families import (FAMILY_LAYOUTS, VIT_FAMILIES, VIT_FAMILY_UNRECOGNISED,
                           convert_family_checkpoint, family_layout)

logger = logging.getLogger('vitdet_plugin')

#: Every checkpoint family and the module type that loads it.
FAMILY_BACKBONES = {'Swin': 'SwinBackbone', 'Swin V2': 'SwinV2Backbone', 'ViT': 'ViTBackbone',
                    'DINOv2': 'DINOv2Backbone', 'DINOv3': 'DINOv3Backbone',
                    'EVA-02': 'EVA02Backbone', 'simple FPN': 'ViTSimpleFPN'}
#: The neck's family: it reads its pyramid out of any checkpoint that has one.
NECK = 'simple FPN'
#: What each family's loader says when no layout fits.
_UNRECOGNISED = {'Swin': SWIN_UNRECOGNISED, 'Swin V2': SWIN_V2_UNRECOGNISED,
                 'ViT': VIT_UNRECOGNISED, **dict.fromkeys(VIT_FAMILIES, VIT_FAMILY_UNRECOGNISED)}
#: Model keys a checkpoint may lack (they keep their init): Swin's detection output norms.
_OUTPUT_NORMS = (r'^norm\d+\.',)

Convert = Callable[[StateDict, CheckpointTarget], Tuple[StateDict, List[str]]]


@dataclasses.dataclass(frozen=True)
class Layout:
    """One checkpoint layout: its family, its name, and its (detect, convert) pair."""
    family: str
    name: str
    detect: Callable[[Mapping[str, Tensor]], bool]
    convert: Convert

    def describe(self) -> str:
        """``'a Swin checkpoint (mmdet layout)'``."""
        article = 'an' if self.family[0] in 'AEIOU' else 'a'
        return f'{article} {self.family} checkpoint ({self.name} layout)'


# ----------------------------------------------------------------------------- converters
def _swin(sd: StateDict, fmt: str, t: CheckpointTarget) -> Tuple[StateDict, List[str]]:
    converted, dropped = convert_swin(sd, t.window_size, t.pos_grid, fmt, t.src_window_size)
    return converted, dropped + _spare_output_norms(converted, t)


def _swin_v2(sd: StateDict, fmt: str, t: CheckpointTarget) -> Tuple[StateDict, List[str]]:
    converted, dropped = convert_swin_v2(sd, fmt)
    check_pretrained_windows(sd, t.pretrained_windows)
    return converted, dropped + _spare_output_norms(converted, t)


def _spare_output_norms(converted: StateDict, t: CheckpointTarget) -> List[str]:
    if t.out_indices is None:
        return []
    spare = drop_unused_output_norms(converted, t.out_indices)
    if spare:
        logger.info('%s checkpoint: output norms of stages outside out_indices=%s not used: %s',
                    t.family, t.out_indices, ', '.join(spare))
    return spare


def _vit(sd: StateDict, fmt: str, t: CheckpointTarget) -> Tuple[StateDict, List[str]]:
    return convert_vit(sd, t.expected, t.pos_grid, fmt)


def _neck(sd: StateDict, fmt: str, t: CheckpointTarget) -> Tuple[StateDict, List[str]]:
    del fmt  # the pyramid is found by its keys wherever it sits (simple_fpn_part)
    try:
        part, used = simple_fpn_part(sd, t.in_stride)
    except CheckpointError as e:  # no pyramid: name what the checkpoint is, if it is known
        found = find_layout(sd)
        if found is None:
            raise
        raise CheckpointError(f'{e}. The checkpoint is {found.describe()}: load it into '
                              f"type='{FAMILY_BACKBONES[found.family]}'") from e
    taken = set(used)
    return part, [k for k in sd if k not in taken]


def _family(family: str, official: Optional[str]
            ) -> Callable[[StateDict, str, CheckpointTarget], Tuple[StateDict, List[str]]]:
    """The converter of a DINOv2 / DINOv3 / EVA-02 layout (``official`` or timm's / ours)."""
    def convert(sd: StateDict, name: str, t: CheckpointTarget) -> Tuple[StateDict, List[str]]:
        del name  # ``official`` tells the layout
        return convert_family_checkpoint(sd, family, official, t)
    return convert


def _transformers(family: str
                  ) -> Callable[[StateDict, str, CheckpointTarget], Tuple[StateDict, List[str]]]:
    """A transformers layout's converter: renamed to the family's reference layout
    (:mod:`.transformers_layouts`), then that layout's converter."""
    reference: Dict[str, Convert] = {
        'Swin': lambda sd, t: _swin(sd, 'official', t),
        'Swin V2': lambda sd, t: _swin_v2(sd, 'official', t),
        'ViT': lambda sd, t: _vit(sd, 'timm_vit', t),
        'DINOv2': lambda sd, t: convert_family_checkpoint(sd, 'DINOv2', 'dinov2', t),
        'DINOv3': lambda sd, t: convert_family_checkpoint(sd, 'DINOv3', 'dinov3', t)}

    def convert(sd: StateDict, name: str, t: CheckpointTarget) -> Tuple[StateDict, List[str]]:
        renamed, dropped = transformers_to_reference(sd, name)
        converted, more = reference[family](renamed, t)
        return converted, dropped + more
    return convert


def _transformers_layouts() -> List[Layout]:
    """The transformers classes (``'transformers Dinov2Model'``, ...), one layout each."""
    return [layout for model, family in TRANSFORMERS_MODELS.items()
            for layout in _layouts(family, (f'transformers {model}',), transformers_layout,
                                   _transformers(family))]


# ----------------------------------------------------------------------------- the table
def _layouts(family: str, names: Tuple[str, ...],
             classify: Callable[[Mapping[str, Tensor]], Optional[str]],
             convert: Callable[[StateDict, str, CheckpointTarget], Tuple[StateDict, List[str]]]
             ) -> List[Layout]:
    """One :class:`Layout` per name of a family whose ``classify`` names the layout (or None)."""
    def layout(name: str) -> Layout:
        def detect(sd: Mapping[str, Tensor]) -> bool:
            return classify(sd) == name

        def convert_to(sd: StateDict, t: CheckpointTarget) -> Tuple[StateDict, List[str]]:
            return convert(sd, name, t)
        return Layout(family, name, detect, convert_to)
    return [layout(name) for name in names]


def _family_classifier(family: str) -> Callable[[Mapping[str, Tensor]], Optional[str]]:
    def classify(sd: Mapping[str, Tensor]) -> Optional[str]:
        found = family_layout(sd)
        return found[1] if found is not None and found[0] == family else None
    return classify


def _vit_family_layouts() -> List[Layout]:
    """The official layouts of DINOv2 / DINOv3 / EVA-02, then timm's and ours of each."""
    official = [layout for name, family in OFFICIAL_FAMILIES.items()
                for layout in _layouts(family, (f'{name} official',), _family_classifier(family),
                                       _family(family, name))]
    return official + [layout for family in VIT_FAMILIES
                       for layout in _layouts(family, FAMILY_LAYOUTS, _family_classifier(family),
                                              _family(family, None))]


#: Every layout we load, in the order :func:`detect_layout` asks them.
LAYOUTS: Tuple[Layout, ...] = tuple(
    _transformers_layouts()
    + _vit_family_layouts()
    + _layouts('Swin V2', SWIN_V2_FORMATS, swin_v2_layout, _swin_v2)
    + _layouts('Swin', SWIN_FORMATS, swin_layout, _swin)
    + _layouts('ViT', VIT_FORMATS, vit_layout, _vit)
    + _layouts(NECK, ('detectron2', 'ours'), simple_fpn_layout, _neck))


def find_layout(sd: Mapping[str, Tensor]) -> Optional[Layout]:
    """The first layout of :data:`LAYOUTS` that ``sd`` (an unwrapped state dict) is in."""
    return next((layout for layout in LAYOUTS if layout.detect(sd)), None)


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
    if family is not None and layout.family != family:
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
    loaded, keys left at their init, checkpoint keys dropped)."""
    if target.expected is None:
        raise ValueError('load_checkpoint needs the target\'s expected {name: shape}; convert '
                         'without a module through detect_layout(sd).convert(sd, target)')
    sd = checkpoint_state_dict(checkpoint, prefix)
    layout = (_neck_layout(sd) if target.family == NECK
              else detect_layout(sd, target.family, target.owner))
    converted, dropped = layout.convert(sd, _folder_target(checkpoint, layout, target))
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
    return converted, report._replace(layout=f'{layout.family} {layout.name}')


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
