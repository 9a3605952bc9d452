"""A single-map backbone (plain ViT, DINOv2, DINOv3, EVA-02: one stride-``patch_size`` map)
feeding a multi-level neck (mmdet's FPN, ChannelMapper with extra levels).

Such a neck is built for a pyramid of backbone maps: fed one map it asks first for one
``in_channels`` entry, then makes its extra levels by stride-2 convolutions of the patch map
(strides 14, 28, ..., 224 for patch 14), which trains but is not the ViTDet design. The check
says instead what the README shows for these backbones: ``ViTSimpleFPN`` with the backbone's
width as ``in_channels`` and its patch stride as ``in_stride``, with scale factors that give the
strides the heads already use when the patch stride allows it (:func:`simple_fpn_for`).
"""
from typing import Any, List, Optional, Sequence, Tuple

from ..models.necks.simple_fpn import SUPPORTED_SCALES

#: the neck type the check proposes (vitdet_plugin's simple feature pyramid)
SIMPLE_FPN = 'ViTSimpleFPN'
#: the neck's ``out_channels`` when the replaced neck gives none (mmdet's FPN default)
DEFAULT_OUT_CHANNELS = 256
#: head keys whose anchor / prior generator strides say which pyramid the heads expect
HEAD_KEYS = ('rpn_head', 'bbox_head')


def is_simple_fpn(neck: dict) -> bool:
    kind = neck.get('type')
    name = kind if isinstance(kind, str) else getattr(kind, '__name__', '')
    return name.rsplit('.', 1)[-1] == SIMPLE_FPN


def is_multi_level(neck: dict) -> bool:
    """A neck that reads a list of backbone maps or outputs several levels (FPN, PAFPN,
    ChannelMapper with ``num_outs`` > 1), other than ``ViTSimpleFPN``."""
    if is_simple_fpn(neck):
        return False
    in_channels = neck.get('in_channels')
    num_outs = neck.get('num_outs')
    return (isinstance(in_channels, (list, tuple)) and len(in_channels) > 1) or (
        isinstance(num_outs, int) and num_outs > 1)


def _int_strides(values: Any) -> Optional[List[int]]:
    if not isinstance(values, (list, tuple)) or not values:
        return None
    out = []
    for v in values:
        if isinstance(v, (list, tuple)) and len(v) == 2 and v[0] == v[1]:
            v = v[0]
        if not isinstance(v, int):
            return None
        out.append(v)
    return out


def head_strides(model: dict) -> Optional[List[int]]:
    """The strides the heads are configured for: the first anchor / prior generator's, else
    the RoI extractor's ``featmap_strides``; None when no head names any."""
    for key in HEAD_KEYS:
        head = model.get(key)
        for gen in ('anchor_generator', 'prior_generator'):
            found = _int_strides(((head or {}).get(gen) or {}).get('strides'))
            if found:
                return found
    extractor = (model.get('roi_head') or {}).get('bbox_roi_extractor')
    return _int_strides((extractor or {}).get('featmap_strides'))


def _usable_scales(channels: int, stride: int) -> Tuple[float, ...]:
    """The scale factors ViTSimpleFPN accepts on this map: integer output strides, channels
    divisible by the upsampling factor (its deconvs halve them)."""
    return tuple(s for s in SUPPORTED_SCALES
                 if (stride / s) % 1 == 0 and (s < 2 or channels % int(s) == 0))


def _matching_scales(stride: int, usable: Sequence[float],
                     wanted: Sequence[int]) -> Optional[Tuple[float, ...]]:
    """Scale factors whose levels, with max-pooled levels after them, have exactly the strides
    ``wanted``; None when the patch stride cannot give them."""
    scales: List[float] = []
    for i, t in enumerate(wanted):
        scale = stride / t
        if scale in usable and (not scales or scale < scales[-1]):
            scales.append(scale)
            continue
        if scales and all(b == 2 * a for a, b in zip(wanted[i - 1:], wanted[i:])):
            return tuple(scales)  # the rest: stride-2 max-pools of the last level
        return None
    return tuple(scales) if scales else None


def simple_fpn_for(channels: int, stride: int, neck: dict, model: dict) -> dict:
    """The ``ViTSimpleFPN`` config for a backbone map of ``channels`` at ``stride``: the levels
    of the heads' strides when the stride allows them, else every usable scale factor with as
    many outputs as the replaced neck (``num_outs``) or the heads have."""
    wanted = head_strides(model)
    usable = _usable_scales(channels, stride)
    scales = _matching_scales(stride, usable, wanted) if wanted else None
    given = neck.get('num_outs')
    if scales is not None and wanted is not None:
        num_outs = len(wanted)
    else:
        scales = usable
        num_outs = len(wanted) if wanted else given if isinstance(given, int) else len(usable) + 1
        num_outs = max(num_outs, len(scales))
    out_channels = neck.get('out_channels')
    return dict(type=SIMPLE_FPN, in_channels=channels, in_stride=stride,
                out_channels=out_channels if isinstance(out_channels, int)
                else DEFAULT_OUT_CHANNELS,
                scale_factors=tuple(scales), num_outs=num_outs)
