"""Swin V2 checkpoint converters: pure ``state_dict -> state_dict`` functions.

Our layout is the official Microsoft one (``layers.{i}.blocks.{j}.attn.{qkv, q_bias, v_bias,
logit_scale, cpb_mlp.{0,2}, proj}``, downsample at the end of stage ``i``) plus detection output
norms ``norm{i}``. Accepted sources:

* ``official``: microsoft/Swin-Transformer V2 (``{'model': sd}``, ``head.*``, final ``norm.*``,
  ``relative_coords_table`` / ``relative_position_index`` / ``attn_mask`` buffers);
* ``timm``: timm ``swinv2_*`` (downsample at the start of stage ``i + 1``, ``head.fc``, no
  buffers);
* ``mmpretrain``: mmpretrain ``SwinTransformerV2`` (``stages.{i}.blocks.{j}.attn.w_msa``,
  ``ffn.layers``, ``patch_embed.projection``, Unfold-ordered downsample at the start of stages
  ``1..``, ``norm{i}`` output norms, usually under ``backbone.``);
* ``ours``: this package's layout (possibly ``backbone.``-prefixed in a detector checkpoint).

Position-bias tables need no resizing in V2: ``cpb_mlp`` takes coordinates, and the model's
``pretrained_window_sizes`` tell it how the checkpoint normalised them.
"""
import logging
import re
from typing import List, Mapping, Optional, Sequence, Tuple

from torch import Tensor

from ..functional.swin_bias import CPB_COORD_RANGE
from .checkpoint_io import CheckpointError
from .common import StateDict, backbone_part
from ..functional.checkpoint_target import CheckpointTarget
from .layout import Layout, layouts_of
from .swin import (_OUTPUT_NORM, from_mmdet_names, from_timm_layout, is_swin_v2,
                   spare_output_norms)

logger = logging.getLogger('vitdet_plugin')

SWIN_V2_FORMATS = ('official', 'timm', 'mmpretrain', 'ours')

#: Keys of classification heads, final norms and derived buffers (rebuilt from the window).
_NON_BACKBONE = (r'^head\.', r'^norm\.', r'relative_coords_table$', r'relative_position_index$',
                 r'attn_mask$', r'k_bias$', r'^fc_norm\.', r'^avgpool\.')
#: Windows read back from a coordinate table are rounded within this (fp32 log / exp).
WINDOW_TOLERANCE = 1e-2


#: What a Swin V2 loader says when no layout of the table fits a checkpoint.
SWIN_V2_UNRECOGNISED = ("no Swin V2 attention weights found (expected keys like "
                        "'layers.0.blocks.0.attn.logit_scale' (official/timm/ours) or "
                        "'stages.0.blocks.0.attn.w_msa.logit_scale' (mmpretrain))")


def swin_v2_layout(sd: Mapping[str, Tensor]) -> Optional[str]:
    """The layout of a Swin V2 state dict (one of :data:`SWIN_V2_FORMATS`), or None when it
    is no Swin V2 checkpoint."""
    keys = list(sd)
    inner = [k[len('backbone.'):] for k in keys if k.startswith('backbone.')] or keys
    if not is_swin_v2(inner):
        return None
    if any(k.startswith('stages.') for k in inner):
        return 'mmpretrain'
    downs = {int(m.group(1)) for k in inner
             for m in [re.match(r'layers\.(\d+)\.downsample\.', k)] if m}
    if downs and min(downs) > 0:
        return 'timm'
    if any(_OUTPUT_NORM.match(k) for k in inner) and not any(
            re.search(r'relative_coords_table$|^head\.', k) for k in inner):
        return 'ours'
    return 'official'


def _from_mmpretrain(sd: StateDict) -> StateDict:
    """mmpretrain names -> official ones; downsample reduction columns from Unfold order (its
    post-norm acts on the 2C output, in the same order); downsample moved as timm's."""
    return from_timm_layout(from_mmdet_names(sd, r'layers\.\d+\.downsample\.reduction\.'))


def convert_swin_v2(sd: Mapping[str, Tensor], src_format: Optional[str] = None
                    ) -> Tuple[StateDict, List[str]]:
    """Convert a Swin V2 state dict of any supported layout to ours.

    Returns the converted state dict and the names of the dropped keys (classification head,
    final norm, derived buffers, neck/head keys of detection checkpoints).
    """
    fmt = src_format or swin_v2_layout(sd)
    if fmt is None:
        raise CheckpointError(f'unrecognised checkpoint format: {SWIN_V2_UNRECOGNISED}; first '
                              f'keys: {list(sd)[:5]}')
    if fmt not in SWIN_V2_FORMATS:
        raise ValueError(f'unknown Swin V2 format {fmt!r}; one of {SWIN_V2_FORMATS}')
    sd = dict(sd)
    sd, dropped = backbone_part(sd, _NON_BACKBONE)
    if fmt == 'mmpretrain':
        sd = _from_mmpretrain(sd)
    elif fmt == 'timm':
        sd = from_timm_layout(sd)
    return sd, dropped


_COORDS_TABLE = re.compile(
    r'^(?:backbone\.)?(?:layers|stages)\.(\d+)\.blocks\.0\.attn\.(?:w_msa\.)?relative_coords_table$')


def coords_table_window(table: Tensor) -> Tuple[Optional[float], Optional[float]]:
    """The window ``(h, w)`` whose size minus one normalised the offsets of a checkpoint's
    ``relative_coords_table`` ``(1, 2wh - 1, 2ww - 1, 2)`` (its pretrained window, or its own),
    read back from the largest offset; None for a one-token axis."""
    corner = table.reshape(table.shape[-3], table.shape[-2], 2)[-1, -1].double()
    offsets = ((table.shape[-3] - 1) // 2, (table.shape[-2] - 1) // 2)
    # value = log2(8 * offset / norm + 1) / log2(8)  ->  norm = 8 * offset / (8 ** value - 1)
    return tuple(  # type: ignore[return-value]
        CPB_COORD_RANGE * off / (CPB_COORD_RANGE ** v.item() - 1) + 1 if off else None
        for off, v in zip(offsets, corner))


def check_pretrained_windows(sd: Mapping[str, Tensor],
                             windows: Sequence[Tuple[int, int]]) -> List[str]:
    """Warnings for stages whose checkpoint normalised relative offsets by another window than
    the model does: ``windows[i]`` is the window stage ``i`` normalises by (its pretrained
    window, or its own). Only official and mmpretrain checkpoints keep the
    ``relative_coords_table`` this reads."""
    warnings = []
    for key, table in sd.items():
        m = _COORDS_TABLE.match(key)
        if m is None or int(m.group(1)) >= len(windows):
            continue
        stage = int(m.group(1))
        used = windows[stage]
        found = coords_table_window(table)
        if any(f is not None and abs(f - u) > WINDOW_TOLERANCE and max(u, f) > 1
               for f, u in zip(found, used)):
            text = 'x'.join(f'{f:g}' if f is not None else '1' for f in found)
            warnings.append(f'stage {stage}: the checkpoint normalised relative offsets by '
                            f'{text} windows, the model by {used[0]}x{used[1]}; set '
                            f'pretrained_window_sizes[{stage}] to the checkpoint\'s window')
    for w in warnings:
        logger.warning('Swin V2 checkpoint: %s', w)
    return warnings


def convert_swin_v2_layout(sd: StateDict, layout: Layout, target: CheckpointTarget,
                           resampled: Optional[List[str]] = None
                           ) -> Tuple[StateDict, List[str]]:
    """The table's Swin V2 converter: :func:`convert_swin_v2` (nothing is resized: the
    continuous position bias takes any window), the pretraining windows checked against
    ``target``'s, output norms of stages it does not return dropped."""
    del resampled  # nothing to resize
    converted, dropped = convert_swin_v2(sd, layout.name)
    check_pretrained_windows(sd, target.pretrained_windows)
    return converted, dropped + spare_output_norms(converted, target)


#: The Swin V2 layouts of the table.
LAYOUTS = layouts_of('Swin V2', SWIN_V2_FORMATS, swin_v2_layout, convert_swin_v2_layout)
