"""The four pictures of ``tools/analysis/visualize.py``; each runs one real backbone forward and
draws what hooks read from the model (see :mod:`.capture`)."""
import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from torch import Tensor

from .pyramid import pyramid_rows
from . import VisualizeError
from .capture import (BlockRef, Call, attention_probs, block_map_hw, block_shift,
                             check_block, check_stage, run_backbone, stage_stride)
from .figures import (FONT_SIZE, OVERLAY_ALPHA, Picture, colorbar, draw_input,
                             grid_lines, panel_grid, save, shade_padding, text_panel, title)
from .geometry import (WindowLayout, check_labels_match_mask, check_query, check_windows,
                              corner_windows, shift_region_labels, window_layout)
from .model import Detector, ModelInput
from ..functional import MASKED_LOGIT, padded_size

#: Token grids with more rows or columns than this are drawn without per-token lines.
MAX_GRID_LINES = 96
#: Windows are numbered in the picture when there are at most this many.
MAX_WINDOW_LABELS = 64
#: Qualitative colour map of the windows; neighbours differ (row step 3 within 10 colours).
WINDOW_COLOURS, NUM_WINDOW_COLOURS, ROW_COLOUR_STEP = 'tab10', 10, 3
#: PCA colours: each component is clipped to these quantiles before scaling to 0..1.
PCA_CLIP_QUANTILE = 0.01
#: Components of the feature PCA shown as RGB.
PCA_COMPONENTS = 3
#: Marker of the query token.
QUERY_MARKER = dict(marker='+', color='cyan', markersize=12, markeredgewidth=2)


#: A token stride in input pixels: one for both axes, or ``(stride_y, stride_x)``.
Stride = Union[float, Tuple[float, float]]


def _stride_yx(stride: Stride) -> Tuple[float, float]:
    return (float(stride[0]), float(stride[1])) if isinstance(stride, tuple) else \
        (float(stride), float(stride))


def token_extent(map_hw: Sequence[int], stride: Stride) -> Tuple[float, float, float, float]:
    """imshow extent placing an ``(h, w)`` token map on the input (token ``(r, c)`` covers
    pixels ``[r * s, (r + 1) * s)``)."""
    sy, sx = _stride_yx(stride)
    return (0.0, map_hw[1] * sx, map_hw[0] * sy, 0.0)


def canvas_hw(inp: ModelInput, padded_hw: Sequence[int], stride: Stride) -> Tuple[int, int]:
    """The canvas holding both the padded input and a ``padded_hw`` token map at ``stride``."""
    sy, sx = _stride_yx(stride)
    return (max(inp.input_hw[0], math.ceil(padded_hw[0] * sy)),
            max(inp.input_hw[1], math.ceil(padded_hw[1] * sx)))


def draw_input_padded(ax: Axes, inp: ModelInput, canvas: Sequence[int]) -> None:
    """The input on a ``canvas`` of pixels, its preprocessor padding hatched."""
    draw_input(ax, inp.image, inp.image_hw, canvas)
    shade_padding(ax, 'input padding', inp.image_hw, inp.input_hw)


def suptitle(fig: Figure, detector: Detector, what: str) -> None:
    """The config path over ``what`` the picture shows."""
    fig.suptitle(f'{detector.config_path}\n{what}', fontsize=FONT_SIZE + 1)


# ----------------------------------------------------------------------------- windows
def _window_colours(layout: WindowLayout) -> np.ndarray:
    """``(Hp, Wp, 3)`` colours: one per window, neighbours different, wrapped pieces alike."""
    row, col = layout.index // layout.windows_per_row, layout.index % layout.windows_per_row
    code = ((row * ROW_COLOUR_STEP + col) % NUM_WINDOW_COLOURS).numpy()
    return colormaps[WINDOW_COLOURS](code)[..., :3]


def _draw_windows(ax: Axes, inp: ModelInput, layout: WindowLayout, map_hw: Tuple[int, int],
                  stride: int) -> None:
    hp, wp = layout.padded_hw
    (wh, ww), (sh, sw) = layout.window, layout.shift
    draw_input_padded(ax, inp, canvas_hw(inp, layout.padded_hw, stride))
    shade_padding(ax, 'window padding', (map_hw[0] * stride, map_hw[1] * stride),
                  (hp * stride, wp * stride))
    ax.imshow(_window_colours(layout), extent=token_extent(layout.padded_hw, stride),
              alpha=OVERLAY_ALPHA, interpolation='nearest')
    extent = (hp * stride, wp * stride)
    if max(hp, wp) <= MAX_GRID_LINES:  # the patch (token) grid
        grid_lines(ax, np.arange(1, hp) * stride, np.arange(1, wp) * stride, extent,
                   colors='white', linewidths=0.3)
    grid_lines(ax, ((np.arange(0, hp, wh) + sh) % hp) * stride,
               ((np.arange(0, wp, ww) + sw) % wp) * stride, extent, colors='black',
               linewidths=1.5)
    if layout.num_windows <= MAX_WINDOW_LABELS:
        centre = (wh // 2) * ww + ww // 2
        for k in range(layout.num_windows):
            rows, cols = layout.positions(k)
            ax.text((cols[centre].item() + 0.5) * stride, (rows[centre].item() + 0.5) * stride,
                    str(k), ha='center', va='center', fontsize=FONT_SIZE - 1, color='black')
    if ax.get_legend_handles_labels()[0]:  # some padding to explain
        ax.legend(loc='upper center', bbox_to_anchor=(0.5, -0.06), ncol=2,
                  fontsize=FONT_SIZE - 2, frameon=False)


def windows_picture(detector: Detector, inp: ModelInput, stage: int, out: str) -> Picture:
    """The input with the token grid, the window partition (W-MSA) and the shifted partition
    (SW-MSA, windows wrapping around the map as the cyclic shift makes them) of ``stage``."""
    backbone = detector.backbone
    blocks = list(check_stage(backbone, stage).blocks)
    _, calls = run_backbone(backbone, inp.inputs, {'block': blocks[0]})
    map_hw = block_map_hw(calls['block'])
    stride = stage_stride(backbone, stage)
    first_plain = next((j for j, b in enumerate(blocks) if not any(b.shift_size)), None)
    first_shifted = next((j for j, b in enumerate(blocks) if any(b.shift_size)), None)
    shown = [(j, blocks[j]) for j in (first_plain, first_shifted) if j is not None]
    fig, axes = panel_grid(1, len(shown))
    arrays: Dict[str, np.ndarray] = {}
    for ax, (j, block) in zip(axes[0], shown):
        layout = window_layout(padded_size(map_hw, block.window_size), block.window_size,
                               block_shift(block, map_hw))
        _draw_windows(ax, inp, layout, map_hw, stride)
        kind = 'SW-MSA' if any(block.shift_size) else 'W-MSA'
        title(ax, f'stage {stage} block {j}: {kind}, window {layout.window[0]}x'
                  f'{layout.window[1]}, shift {layout.shift}\n{map_hw[0]}x{map_hw[1]} tokens '
                  f'(stride {stride}), padded to {layout.padded_hw[0]}x{layout.padded_hw[1]}')
        arrays[kind] = layout.index.numpy()
    suptitle(fig, detector, f'{type(backbone).__name__} windows, {inp.source}')
    return save(fig, out, arrays)


# ----------------------------------------------------------------------------- shift mask
def _draw_labels(ax: Axes, labels: Tensor, layout: WindowLayout, chosen: Sequence[int]) -> None:
    hp, wp = layout.padded_hw
    wh, ww = layout.window
    ax.imshow(labels.numpy(), cmap='Pastel1', vmin=0, vmax=8, interpolation='nearest',
              extent=(0, wp, hp, 0))
    for label in torch.unique(labels).tolist():
        rows, cols = torch.nonzero(labels == label, as_tuple=True)
        ax.text(cols.float().mean().item() + 0.5, rows.float().mean().item() + 0.5,
                str(label), ha='center', va='center', fontsize=10, weight='bold')
    grid_lines(ax, np.arange(wh, hp, wh), np.arange(ww, wp, ww), (hp, wp), colors='black',
               linewidths=1.5)
    for k in chosen:
        top, left = (k // layout.windows_per_row) * wh, (k % layout.windows_per_row) * ww
        ax.add_patch(Rectangle((left, top), ww, wh, fill=False, edgecolor='tab:red',
                               linewidth=2.5))
        ax.text(left + 0.3, top + 0.3, f'w{k}', color='tab:red', fontsize=8, va='top')


def shift_mask_picture(detector: Detector, inp: ModelInput, stage: int,
                       windows: Optional[Sequence[int]], out: str) -> Picture:
    """The region labels of the rolled, padded map of ``stage`` and the ``(N, N)`` attention
    mask of each chosen window, as captured from the stage's first shifted block."""
    backbone = detector.backbone
    blocks = list(check_stage(backbone, stage).blocks)
    shifted = [(j, b) for j, b in enumerate(blocks) if any(b.shift_size)]
    if not shifted:
        raise VisualizeError(f'stage {stage} has no shifted block ({len(blocks)} block(s), all '
                             'W-MSA): the shift mask exists only in SW-MSA blocks (odd indices)')
    j, block = shifted[0]
    _, calls = run_backbone(backbone, inp.inputs, {'block': block, 'attn': block.attn})
    mask = calls['attn'].arg(1, 'mask')                             # (nW, N, N)
    map_hw = block_map_hw(calls['block'])
    if mask is None:
        raise VisualizeError(f'stage {stage} block {j} applies no shift on its {map_hw[0]} x '
                             f'{map_hw[1]} token map, so its attention gets no shift mask')
    layout = window_layout(padded_size(map_hw, block.window_size), block.window_size,
                           block_shift(block, map_hw))
    labels = shift_region_labels(layout.padded_hw, layout.window, layout.shift)
    check_labels_match_mask(labels, mask, layout.window)
    chosen = check_windows(windows if windows else corner_windows(layout), layout,
                           f'stage {stage}')
    fig, axes = panel_grid(1, 1 + len(chosen))
    _draw_labels(axes[0, 0], labels, layout, chosen)
    title(axes[0, 0], f'stage {stage} block {j}: shift regions of the\n{layout.padded_hw[0]}x'
                      f'{layout.padded_hw[1]} padded map rolled by {layout.shift}')
    arrays: Dict[str, np.ndarray] = {'labels': labels.numpy()}
    n = mask.shape[-1]
    for ax, k in zip(axes[0, 1:], chosen):
        image = ax.imshow(mask[k].float().numpy(), cmap='viridis', vmin=MASKED_LOGIT, vmax=0,
                          interpolation='nearest', extent=(0, n, n, 0))
        arrays[f'window {k}'] = np.array(image.get_array())
        colorbar(fig, image, ax, 'added logit')
        grid_lines(ax, np.arange(layout.window[1], n, layout.window[1]),
                   np.arange(layout.window[1], n, layout.window[1]), (n, n), colors='white',
                   linewidths=0.3)
        title(ax, f"window {k}: the model's mask ({n}x{n})\nrows: queries, columns: keys; "
                  f'{MASKED_LOGIT:g}: masked')
    suptitle(fig, detector, f'{type(backbone).__name__} shift mask, {inp.source}')
    return save(fig, out, arrays)


# ----------------------------------------------------------------------------- features
def _pca_rgb(feature: Tensor) -> np.ndarray:
    """``(C, h, w)`` -> ``(h, w, 3)``: the top principal components over positions, each
    clipped to its quantiles and scaled to 0..1 (sign fixed: largest loading positive)."""
    c, h, w = feature.shape
    x = feature.reshape(c, h * w).t().double()
    x = x - x.mean(dim=0)
    _, _, vh = torch.linalg.svd(x, full_matrices=False)
    comps = vh[:PCA_COMPONENTS]
    signs = torch.sign(comps.gather(1, comps.abs().argmax(dim=1, keepdim=True)))
    proj = x @ (comps * signs).t()                                 # (h * w, k)
    rgb = torch.zeros(h * w, PCA_COMPONENTS, dtype=torch.float64)
    for i in range(proj.shape[1]):
        lo, hi = torch.quantile(proj[:, i], torch.tensor(
            [PCA_CLIP_QUANTILE, 1 - PCA_CLIP_QUANTILE], dtype=torch.float64))
        rgb[:, i] = ((proj[:, i] - lo) / (hi - lo)).clamp(0, 1) if hi > lo else 0.5
    return rgb.reshape(h, w, PCA_COMPONENTS).numpy()


def _levels(detector: Detector, feats: Sequence[Tensor], input_hw: Tuple[int, int],
            with_neck: bool) -> List[Tuple[str, Tensor, float]]:
    """``(label, map, stride)`` of every backbone output (strides as declared) and, with
    ``with_neck``, every neck output (strides measured)."""
    backbone = detector.backbone
    strides = tuple(getattr(backbone, 'out_strides', ()))
    if len(strides) != len(feats):
        raise VisualizeError(f'{type(backbone).__name__} returned {len(feats)} maps but declares '
                             f'out_strides={strides}; the backbone contract must list one '
                             'stride per output')
    levels = [(f'{name}: stride {s}\n{shape}', f, float(s)) for (name, _, _, shape), f, s
              in zip(pyramid_rows('backbone', feats, input_hw), feats, strides)]
    if with_neck:
        model = detector.model
        if not getattr(model, 'with_neck', False):
            raise VisualizeError(f'--neck: {type(model).__name__} has no neck')
        with torch.no_grad():
            neck = model.neck(tuple(feats))
        for (name, _, stride, shape), f in zip(pyramid_rows('neck', neck, input_hw), neck):
            levels.append((f'{name}: stride {stride}\n{shape}', f,
                           input_hw[0] / f.shape[-2]))
    return levels


def features_picture(detector: Detector, inp: ModelInput, with_neck: bool, out: str) -> Picture:
    """Every pyramid level of one image: the channel norm (heat map) and the top three
    principal components as RGB, labelled with stride and shape."""
    feats, _ = run_backbone(detector.backbone, inp.inputs, {})
    levels = _levels(detector, feats, inp.input_hw, with_neck)
    fig, axes = panel_grid(2, 1 + len(levels))
    draw_input_padded(axes[0, 0], inp, inp.input_hw)
    title(axes[0, 0], f'input {inp.input_hw[0]}x{inp.input_hw[1]}')
    text_panel(axes[1, 0], [f'{type(detector.backbone).__name__}', detector.weights_label,
                            inp.source, '', 'top: channel L2 norm', 'bottom: top-3 PCA',
                            'components as RGB', '(per level, over positions)'])
    arrays: Dict[str, np.ndarray] = {}
    for col, (label, feat, stride) in enumerate(levels, start=1):
        fmap = feat[0].float()
        extent = token_extent(fmap.shape[-2:], stride)
        norm = fmap.norm(dim=0).numpy()
        image = axes[0, col].imshow(norm, cmap='magma', extent=extent, interpolation='nearest')
        colorbar(fig, image, axes[0, col])
        pca = _pca_rgb(fmap)
        axes[1, col].imshow(pca, extent=extent, interpolation='nearest')
        title(axes[0, col], label)
        name = label.split(':')[0]
        arrays[f'{name} norm'], arrays[f'{name} pca'] = norm, pca
    suptitle(fig, detector, f'{type(detector.backbone).__name__} feature maps, '
                             f'{detector.weights_label}, {inp.source}')
    return save(fig, out, arrays)


# ----------------------------------------------------------------------------- attention
def query_attention(ref: BlockRef, block_call: Call, attn_call: Call,
                    query: Sequence[int]) -> Tuple[Tensor, WindowLayout, Tuple[int, int]]:
    """Attention of ``query`` (map row, column) over the keys it attends to in block ``ref``:
    ``(heads, Hp, Wp)`` probabilities on the padded map (NaN where it cannot attend), the
    block's window layout (a global block: one window over the whole map) and the map size."""
    map_hw = block_map_hw(block_call)
    y, x = check_query(query, map_hw, ref.name)
    window = getattr(ref.module, 'window_size', None) or map_hw
    shift = block_shift(ref.module, map_hw) if hasattr(ref.module, 'shift_size') else (0, 0)
    layout = window_layout(padded_size(map_hw, window), window, shift)
    index, token = int(layout.index[y, x]), int(layout.token[y, x])
    window_x = attn_call.arg(0, 'x')[index:index + 1]
    if hasattr(ref.module, 'shift_size'):  # Swin: the window's own shift mask
        mask = attn_call.arg(1, 'mask')
        one = Call((window_x,), {} if mask is None else {'mask': mask[index:index + 1]})
    else:  # plain ViT: the window grid (and the other arguments) as captured
        one = Call((window_x, *attn_call.args[1:]), dict(attn_call.kwargs))
    probs = attention_probs(ref.module.attn, one)[0, :, token]     # (heads, N)
    rows, cols = layout.positions(index)
    maps = torch.full((probs.shape[0], *layout.padded_hw), float('nan'))
    maps[:, rows, cols] = probs.float()
    return maps, layout, map_hw


def attention_picture(detector: Detector, inp: ModelInput, block: int, query: Sequence[int],
                      head: Optional[int], out: str) -> Picture:
    """The attention of one query token of ``block`` over its window (Swin, ViT window
    blocks) or the whole map (ViT global blocks), drawn over the input."""
    backbone = detector.backbone
    ref = check_block(backbone, block)
    _, calls = run_backbone(backbone, inp.inputs, {'block': ref.module,
                                                   'attn': ref.module.attn})
    maps, layout, map_hw = query_attention(ref, calls['block'], calls['attn'], query)
    heads = maps.shape[0]
    if head is not None and not 0 <= head < heads:
        raise VisualizeError(f'head {head} is out of range: {ref.name} has {heads} heads '
                             f'(0..{heads - 1})')
    shown = (maps[head] if head is not None else maps.mean(dim=0)).numpy()
    which = f'head {head}' if head is not None else f'mean of {heads} heads'
    y, x = int(query[0]), int(query[1])
    centre = ((x + 0.5) * ref.stride, (y + 0.5) * ref.stride)
    fig, axes = panel_grid(1, 2)
    draw_input_padded(axes[0, 0], inp, canvas_hw(inp, layout.padded_hw, ref.stride))
    axes[0, 0].imshow(shown, cmap='inferno', alpha=OVERLAY_ALPHA + 0.2, interpolation='nearest',
                      extent=token_extent(layout.padded_hw, ref.stride))
    axes[0, 0].plot(*centre, **QUERY_MARKER)
    title(axes[0, 0], f'{ref.name}, {which}\nquery ({y}, {x}) = pixel ({centre[1]:g}, '
                      f'{centre[0]:g}), on the input')
    image = axes[0, 1].imshow(shown, cmap='inferno', interpolation='nearest',
                              extent=(0, layout.padded_hw[1], layout.padded_hw[0], 0))
    axes[0, 1].plot(x + 0.5, y + 0.5, **QUERY_MARKER)
    colorbar(fig, image, axes[0, 1], 'attention probability')
    kind = 'global' if getattr(ref.module, 'window_size', None) is None else \
        f'window {layout.window[0]}x{layout.window[1]}, shift {layout.shift}'
    title(axes[0, 1], f'{map_hw[0]}x{map_hw[1]} tokens ({kind})\nblank: keys it cannot '
                      'attend to')
    suptitle(fig, detector, f'{type(backbone).__name__} attention, {detector.weights_label}, '
                             f'{inp.source}')
    return save(fig, out, {'attention': shown})
