"""Swin checkpoint converters: pure ``state_dict -> state_dict`` functions.

Our parameter layout is the official Microsoft one (downsample at the end of stage ``i``,
official PatchMerging channel order) plus detection output norms ``norm{i}``. Accepted sources:

* ``official``: microsoft/Swin-Transformer classification (``{'model': sd}``, ``head.*``, final
  ``norm.*``, ``relative_position_index`` / ``attn_mask`` buffers);
* ``swin_od``: Swin-Transformer-Object-Detection / mmdet 2.x detection checkpoints
  (``backbone.``-prefixed official names, ``norm{i}`` output norms, neck/head keys);
* ``timm``: timm ``swin_*`` (downsample at the start of stage ``i + 1``, ``head.fc``);
* ``mmdet``: mmdet 3.x / mmpretrain ``SwinTransformer`` (``stages.{i}.blocks.{j}.attn.w_msa``,
  ``ffn.layers``, ``patch_embed.projection``, Unfold-ordered PatchMerging);
* ``ours``: this package's layout (possibly ``backbone.``-prefixed in a detector checkpoint).
"""
import logging
import math
import re
from typing import Iterable, List, Mapping, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..functional import (bias_table_size, interpolation_dtype, relative_position_index,
                          resize_pos_grid, window_pair)
from .checkpoint_io import CheckpointError
from ..functional.checkpoint_target import CheckpointTarget
from .common import StateDict, backbone_part, hw_pair, note_resampled
from .layout import Layout, layouts_of

logger = logging.getLogger('vitdet_plugin')

_OUTPUT_NORM = re.compile(r'^norm(\d+)\.')

SWIN_FORMATS = ('official', 'swin_od', 'timm', 'mmdet', 'ours')

#: Keys that exist only in classification checkpoints or as derived buffers.
_NON_BACKBONE = (r'^head\.', r'^norm\.', r'relative_position_index$', r'attn_mask$',
                 r'^fc_norm\.', r'^avgpool\.')

# mmcv's nn.Unfold PatchMerging orders the 2x2 neighbourhood channel-major and its kernel
# offsets as (0,0),(0,1),(1,0),(1,1); the official order is offset-major (0,0),(1,0),(0,1),(1,1).
_UNFOLD_TO_OFFICIAL = [0, 2, 1, 3]


#: What a Swin loader says when no layout of the table fits a checkpoint.
SWIN_UNRECOGNISED = ("no Swin attention weights found (expected keys like "
                     "'layers.0.blocks.0.attn.qkv.weight' (official/timm/ours) or "
                     "'stages.0.blocks.0.attn.w_msa.qkv.weight' (mmdet/mmpretrain))")


def swin_layout(sd: Mapping[str, Tensor]) -> Optional[str]:
    """The layout of a Swin V1 state dict (one of :data:`SWIN_FORMATS`), or None when it is
    no Swin V1 checkpoint (a Swin V2 one included)."""
    keys = list(sd)
    backbone = [k[len('backbone.'):] for k in keys if k.startswith('backbone.')]
    inner = backbone or keys
    if is_swin_v2(inner):
        return None
    if any(k.startswith('stages.') and '.w_msa.' in k for k in inner):
        return 'mmdet'  # (mmpretrain's ViT shares its patch_embed.projection, not w_msa)
    if not any(re.match(r'layers\.\d+\.blocks\.\d+\.attn\.qkv\.', k) for k in inner):
        return None
    downs = sorted({int(m.group(1)) for k in inner
                    for m in [re.match(r'layers\.(\d+)\.downsample\.', k)] if m})
    if downs and downs[0] > 0:
        return 'timm'
    # downsample at the end of stage i (or one stage: nothing to relocate)
    if backbone:
        return 'swin_od'
    if any(re.match(r'norm\d+\.', k) for k in inner) and not any(
            re.search(r'relative_position_index$|^head\.', k) for k in inner):
        return 'ours'
    return 'official'


_V2_KEY = re.compile(r'(^|\.)(logit_scale|cpb_mlp\.\d+\.weight)$')


def is_swin_v2(keys: Iterable[str]) -> bool:
    """Whether state-dict keys hold Swin V2 attention (``logit_scale`` / ``cpb_mlp``)."""
    return any(_V2_KEY.search(k) for k in keys)


def unfold_to_official(w: Tensor) -> Tensor:
    """Reorder mmcv-Unfold PatchMerging ``(out, 4C)`` weights or ``(4C,)`` norm params."""
    if w.dim() == 1:
        c = w.shape[0] // 4
        return w.reshape(c, 4)[:, _UNFOLD_TO_OFFICIAL].t().reshape(-1)
    out, in4 = w.shape
    c = in4 // 4
    return w.reshape(out, c, 4)[:, :, _UNFOLD_TO_OFFICIAL].transpose(1, 2).reshape(out, in4)


def _official_to_unfold(w: Tensor) -> Tensor:
    """Inverse of :func:`unfold_to_official` (the permutation is its own inverse)."""
    if w.dim() == 1:
        c = w.shape[0] // 4
        return w.reshape(4, c)[_UNFOLD_TO_OFFICIAL].t().reshape(-1)
    out, in4 = w.shape
    c = in4 // 4
    return w.reshape(out, 4, c)[:, _UNFOLD_TO_OFFICIAL].transpose(1, 2).reshape(out, in4)


_MMDET_RENAMES = (
    (r'^patch_embed\.projection\.', 'patch_embed.proj.'),
    (r'^stages\.(\d+)\.blocks\.(\d+)\.attn\.w_msa\.', r'layers.\1.blocks.\2.attn.'),
    (r'^stages\.(\d+)\.blocks\.(\d+)\.ffn\.layers\.0\.0\.', r'layers.\1.blocks.\2.mlp.fc1.'),
    (r'^stages\.(\d+)\.blocks\.(\d+)\.ffn\.layers\.1\.', r'layers.\1.blocks.\2.mlp.fc2.'),
    (r'^stages\.', 'layers.'),
)


def from_mmdet_names(sd: StateDict, unfold_ordered: str) -> StateDict:
    """mmdet / mmpretrain Swin key names -> the official ones; the parameters whose new name
    matches ``unfold_ordered`` are taken from ``nn.Unfold`` channel order (see
    :func:`unfold_to_official`)."""
    out = {}
    for k, v in sd.items():
        for pattern, repl in _MMDET_RENAMES:
            new = re.sub(pattern, repl, k)
            if new != k:
                k = new
                break
        if re.match(unfold_ordered, k):
            v = unfold_to_official(v)
        out[k] = v
    return out


def from_timm_layout(sd: StateDict) -> StateDict:
    out = {}
    for k, v in sd.items():
        m = re.match(r'layers\.(\d+)\.downsample\.(.*)', k)
        if m:
            k = f'layers.{int(m.group(1)) - 1}.downsample.{m.group(2)}'
        out[k] = v
    return out


def _tokens_to_grid(pos: Tensor, grid: Optional[Tuple[int, int]] = None,
                    square_source: bool = False) -> Tensor:
    """``(1, H*W, C)`` token embedding -> ``(1, C, H, W)``.

    The tokens are read on the target ``grid`` when their count fits it (mmdet's own reading:
    a non-square ``pretrain_img_size`` round-trips), else on a square grid. ``square_source``:
    the layout only comes from square images (the official code), so a square token count is
    read as square even when a non-square target grid has as many cells, and then resized.
    """
    n, c = pos.shape[1:]
    side = math.isqrt(n)
    if grid is not None and grid[0] * grid[1] == n and not (square_source and side * side == n):
        h, w = grid
    else:
        h = w = side
        if h * w != n:
            raise CheckpointError(
                f'absolute_pos_embed with {n} tokens is not a square grid'
                + (f' and does not fit the model\'s {grid[0]}x{grid[1]} grid; build the model '
                   f'with the pretrain_img_size the checkpoint was trained at' if grid else
                   '; convert it for a model whose grid it fits'))
    return pos.reshape(1, h, w, c).permute(0, 3, 1, 2)


def window_from_index(index: Tensor) -> Optional[Tuple[int, int]]:
    """The ``(h, w)`` window a ``relative_position_index`` buffer ``(N, N)`` was built for (the
    official and mmdet checkpoints keep it), or None if it is no such index."""
    n = index.shape[-1]
    if index.dim() != 2 or index.shape[0] != n:
        return None
    for h in range(1, n + 1):
        if n % h == 0 and torch.equal(index.long(), relative_position_index((h, n // h))):
            return h, n // h
    return None


def _square_window(rows: int) -> Optional[int]:
    """The side ``s`` of the square window whose bias table has ``rows`` rows (``(2s - 1)**2``),
    or None when no square window has that many."""
    side = (math.isqrt(rows) + 1) // 2
    return side if math.prod(bias_table_size((side, side))) == rows else None


def resize_rel_pos_bias_table(table: Tensor, window_size: Tuple[int, int],
                              src_window_size: Optional[Tuple[int, int]] = None) -> Tensor:
    """Bicubically resize a ``((2wh-1)(2ww-1), heads)`` bias table to another window size."""
    dst = bias_table_size(window_size)
    rows = table.shape[0]
    if src_window_size is None:
        if rows == math.prod(dst):
            return table
        side = math.isqrt(rows)
        if side * side != rows:
            raise CheckpointError(
                f'cannot infer the window size of a bias table with {rows} rows '
                f'(not a square window); give the window the checkpoint was trained with: '
                f"init_cfg=dict(type='Pretrained', checkpoint=..., src_window_size=(h, w)) or "
                f'tools/convert_weights.py --src-window-size H W')
        src = (side, side)
    else:
        src = bias_table_size(src_window_size)
        if rows != math.prod(src):
            square = _square_window(rows)
            raise CheckpointError(
                f'src_window_size={tuple(src_window_size)} does not fit a bias table of {rows} '
                f'rows (a {src_window_size[0]}x{src_window_size[1]} window has '
                f'{math.prod(src)}); give the window the checkpoint was trained with'
                + (f', e.g. {square} (square)' if square is not None else ''))
        if src == dst:
            return table
    heads = table.shape[1]
    grid = table.t().reshape(1, heads, *src)
    grid = F.interpolate(interpolation_dtype(grid), size=dst, mode='bicubic', align_corners=False)
    return grid.reshape(heads, -1).t().to(table.dtype)


def convert_swin(sd: Mapping[str, Tensor], window_size: Optional[Tuple[int, int]] = None,
                 pos_grid: Optional[Tuple[int, int]] = None,
                 src_format: Optional[str] = None,
                 src_window_size: Optional[Tuple[int, int]] = None,
                 resampled: Optional[List[str]] = None) -> Tuple[StateDict, List[str]]:
    """Convert a Swin state dict of any supported layout to ours.

    Args:
        sd: the (unwrapped) state dict.
        window_size: target window; bias tables trained for another window are resized.
        src_window_size: the window the checkpoint was trained with; needed only for
            rectangular windows (a table's size gives a square window's size, not ``(h, w)``).
        pos_grid: target absolute-position grid ``(h, w)``; resized bicubically if different.
        src_format: skip auto-detection.
        resampled: if given, gets ``'<key> <shape> -> <shape>'`` for every tensor resized.

    Returns:
        the converted state dict and the names of the keys dropped (classification head,
        final norm, derived buffers, neck/head keys of detection checkpoints).
    """
    fmt = src_format or swin_layout(sd)
    if fmt is None:
        raise CheckpointError(f'unrecognised checkpoint format: {SWIN_UNRECOGNISED}; first '
                              f'keys: {list(sd)[:5]}')
    if fmt not in SWIN_FORMATS:
        raise ValueError(f'unknown Swin format {fmt!r}; one of {SWIN_FORMATS}')
    sd = dict(sd)
    src_window_size = _source_window(sd, src_window_size)
    sd, dropped = backbone_part(sd, _NON_BACKBONE)
    if fmt == 'mmdet':
        # mmdet's Unfold-based merging concatenates in another order: reduction and its norm
        sd = from_mmdet_names(sd, r'layers\.\d+\.downsample\.(reduction|norm)\.')
    elif fmt == 'timm':
        sd = from_timm_layout(sd)
    if 'absolute_pos_embed' in sd:
        pos = sd['absolute_pos_embed']
        if pos.dim() == 3:
            pos = _tokens_to_grid(pos, hw_pair(pos_grid, 'pos_grid') if pos_grid is not None
                                  else None, square_source=fmt == 'official')
        if pos_grid is not None:
            pos = resize_pos_grid(pos, hw_pair(pos_grid, 'pos_grid'))
        note_resampled(resampled, 'absolute_pos_embed', sd['absolute_pos_embed'].shape, pos.shape)
        sd['absolute_pos_embed'] = pos
    if window_size is not None:
        tables = [k for k in sd if k.endswith('relative_position_bias_table')]
        wh, ww = window_size
        if (src_window_size is None and wh != ww and tables
                and sd[tables[0]].shape[0] == math.prod(bias_table_size(window_size))):
            logger.warning(
                'Swin checkpoint: its bias tables fit the model\'s %dx%d window and also a '
                '%dx%d one, and it records no window; loaded as %dx%d. If it was trained with '
                '%dx%d windows, pass src_window_size=(%d, %d) (init_cfg key, or '
                'tools/convert_weights.py --src-window-size)', wh, ww, ww, wh, wh, ww, ww, wh,
                ww, wh)
        for k in tables:
            table = resize_rel_pos_bias_table(
                sd[k], window_pair(window_size, 'window_size'),
                window_pair(src_window_size, 'src_window_size') if src_window_size is not None
                else None)
            note_resampled(resampled, k, sd[k].shape, table.shape)
            sd[k] = table
    return sd, dropped


def _source_window(sd: Mapping[str, Tensor],
                   given: Optional[Tuple[int, int]]) -> Optional[Tuple[int, int]]:
    """The checkpoint's window: from its ``relative_position_index`` buffers when it keeps
    them (official, mmdet), checked against ``given`` (the user's ``src_window_size``)."""
    index = next((v for k, v in sd.items() if k.endswith('relative_position_index')), None)
    found = window_from_index(index) if index is not None else None
    if found is None:
        return window_pair(given, 'src_window_size') if given is not None else None
    if given is not None and tuple(given) != found:
        raise CheckpointError(
            f'src_window_size={tuple(given)} contradicts the checkpoint, whose '
            f'relative_position_index was built for {found[0]}x{found[1]} windows; drop '
            'src_window_size (the checkpoint tells) or fix it')
    return found


def swin_to_mmdet(sd: Mapping[str, Tensor]) -> StateDict:
    """Our layout -> mmdet 3.x ``SwinTransformer`` state dict (loads there strictly).

    mmdet keeps ``relative_position_index`` as a persistent buffer, so it is added back
    (square windows, inferred from the bias-table size).
    """
    sd = dict(sd)
    stem = sorted(k for k in sd if k.startswith('patch_embed.stem.'))
    if stem:
        raise ValueError(f'this state dict has a convolutional stem ({stem[0]}, ...), which '
                         "mmdet's SwinTransformer does not have; keep it in our layout and load "
                         'it with SwinBackbone(stem_channels=...)')
    for k in [k for k in sd if k.endswith('relative_position_bias_table')]:
        rows = sd[k].shape[0]
        side = _square_window(rows)
        if side is None:
            raise ValueError(f'{k} has {rows} rows, the table of a rectangular window; mmdet\'s '
                             'SwinTransformer only has square windows. Keep this state dict in '
                             'our layout and load it with SwinBackbone(window_size=(h, w))')
        sd[k.replace('_bias_table', '_index')] = relative_position_index((side, side))
    out = {}
    for k, v in sd.items():
        k2 = k.replace('patch_embed.proj.', 'patch_embed.projection.')
        k2 = re.sub(r'^layers\.(\d+)\.blocks\.(\d+)\.attn\.',
                    r'stages.\1.blocks.\2.attn.w_msa.', k2)
        k2 = re.sub(r'^layers\.(\d+)\.blocks\.(\d+)\.mlp\.fc1\.',
                    r'stages.\1.blocks.\2.ffn.layers.0.0.', k2)
        k2 = re.sub(r'^layers\.(\d+)\.blocks\.(\d+)\.mlp\.fc2\.',
                    r'stages.\1.blocks.\2.ffn.layers.1.', k2)
        k2 = re.sub(r'^layers\.', 'stages.', k2)
        if re.match(r'stages\.\d+\.downsample\.(reduction|norm)\.', k2):
            v = _official_to_unfold(v)
        if k2 == 'absolute_pos_embed':
            v = v.flatten(2).transpose(1, 2)
        out[k2] = v
    return out


def drop_unused_output_norms(sd: StateDict, out_indices: Tuple[int, ...]) -> List[str]:
    """Remove from ``sd`` (in place) the output norms ``norm{i}`` of stages the model does not
    return (a checkpoint trained with other ``out_indices``); returns their names."""
    spare = [k for k in sd
             if (m := _OUTPUT_NORM.match(k)) and int(m.group(1)) not in out_indices]
    for k in spare:
        del sd[k]
    return spare


def spare_output_norms(converted: StateDict, target: CheckpointTarget) -> List[str]:
    """:func:`drop_unused_output_norms` for ``target.out_indices`` (logged); [] without them."""
    if target.out_indices is None:
        return []
    spare = drop_unused_output_norms(converted, target.out_indices)
    if spare:
        logger.info('%s checkpoint: output norms of stages outside out_indices=%s not used: %s',
                    target.family, target.out_indices, ', '.join(spare))
    return spare


def convert_swin_layout(sd: StateDict, layout: Layout, target: CheckpointTarget,
                        resampled: Optional[List[str]] = None) -> Tuple[StateDict, List[str]]:
    """The table's Swin converter: :func:`convert_swin` for ``target``'s window, position grid
    and output stages."""
    converted, dropped = convert_swin(sd, target.window_size, target.pos_grid, layout.name,
                                      target.src_window_size, resampled)
    return converted, dropped + spare_output_norms(converted, target)


#: The Swin V1 layouts of the table.
LAYOUTS = layouts_of('Swin', SWIN_FORMATS, swin_layout, convert_swin_layout)
