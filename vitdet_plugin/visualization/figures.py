"""Matplotlib plumbing: fixed-size panel grids, the input drawn on a padded canvas, saving.

Every picture is a grid of square panels of :data:`PANEL_PX` pixels, so a picture of
``rows x cols`` panels is exactly ``cols * PANEL_PX`` by ``rows * PANEL_PX`` pixels (saved
without tight bounding boxes, which would change the size).
"""
import os
import os.path as osp
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import matplotlib

matplotlib.use('Agg')  # files only, no display needed

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.image import AxesImage
from matplotlib.patches import Rectangle
from matplotlib.ticker import ScalarFormatter

#: Side of one square panel, pixels.
PANEL_PX = 320
#: Resolution of the saved PNG (figure inches * DPI = pixels).
DPI = 100
#: Grey of the canvas where there is no image (a zero input given by size), 0..1.
CANVAS_GREY = 0.85
#: Opacity of overlays drawn over the input (window colours, attention).
OVERLAY_ALPHA = 0.45
#: Hatching of the preprocessor's padding (to ``pad_size_divisor``) and of the window padding.
PAD_STYLES: Dict[str, Dict[str, Any]] = {
    'input padding': dict(hatch='//', edgecolor='0.35'),
    'window padding': dict(hatch='xx', edgecolor='tab:red'),
}
#: Font size of titles and labels in the panels.
FONT_SIZE = 8
#: Colour bars span this fraction of their panel's height.
COLORBAR_SHRINK = 0.7


@dataclass
class Picture:
    """A written picture: its file, its size in pixels ``(width, height)`` and the arrays
    that were drawn, by panel name (what the tests compare with the model's tensors)."""

    path: str
    size_px: Tuple[int, int]
    arrays: Dict[str, np.ndarray] = field(default_factory=dict)


def panel_grid(rows: int, cols: int) -> Tuple[Figure, np.ndarray]:
    """A figure of ``rows x cols`` square panels of :data:`PANEL_PX` pixels; axes ``(rows,
    cols)``."""
    fig = plt.figure(figsize=(cols * PANEL_PX / DPI, rows * PANEL_PX / DPI), dpi=DPI,
                     layout='constrained')
    axes = np.asarray(fig.subplots(rows, cols, squeeze=False))
    for ax in axes.flat:
        ax.tick_params(labelsize=FONT_SIZE - 1)
    return fig, axes


def save(fig: Figure, path: str, arrays: Optional[Dict[str, np.ndarray]] = None) -> Picture:
    """Write ``fig`` as a PNG at ``path`` (folders created) and close it."""
    folder = osp.dirname(osp.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    width, height = fig.canvas.get_width_height()
    plt.close(fig)
    return Picture(path, (int(width), int(height)), dict(arrays or {}))


def title(ax: Axes, text: str) -> None:
    ax.set_title(text, fontsize=FONT_SIZE)


def draw_input(ax: Axes, image: Optional[np.ndarray], image_hw: Sequence[int],
               canvas_hw: Sequence[int]) -> None:
    """The input on a canvas of ``canvas_hw`` pixels (image at the top left, grey canvas
    where there is no image); axes in input pixels, y down."""
    ch, cw = canvas_hw
    canvas = np.full((ch, cw, 3), CANVAS_GREY)
    if image is not None:
        h, w = min(image.shape[0], ch), min(image.shape[1], cw)
        canvas[:h, :w] = image[:h, :w] / 255.0
    ax.imshow(canvas, extent=(0, cw, ch, 0), interpolation='nearest')
    ax.set_xlim(0, cw)
    ax.set_ylim(ch, 0)


def shade_padding(ax: Axes, kind: str, valid_hw: Sequence[int], outer_hw: Sequence[int]) -> None:
    """Hatch the L-shaped area between ``valid_hw`` and ``outer_hw`` (bottom/right padding)."""
    vh, vw = valid_hw
    oh, ow = outer_hw
    style = PAD_STYLES[kind]
    boxes = []
    if ow > vw:
        boxes.append(((vw, 0), ow - vw, oh))
    if oh > vh:
        boxes.append(((0, vh), vw, oh - vh))
    for i, (xy, w, h) in enumerate(boxes):
        ax.add_patch(Rectangle(xy, w, h, fill=False, linewidth=0, label=kind if i == 0 else None,
                               **style))


def grid_lines(ax: Axes, positions_y: Union[np.ndarray, Sequence[float]],
               positions_x: Union[np.ndarray, Sequence[float]], extent_hw: Sequence[int],
               **style: Any) -> None:
    """Horizontal lines at ``positions_y`` and vertical lines at ``positions_x`` across
    ``extent_hw``."""
    h, w = extent_hw
    if len(positions_y):
        ax.hlines(positions_y, 0, w, **style)
    if len(positions_x):
        ax.vlines(positions_x, 0, h, **style)


def colorbar(fig: Figure, image: AxesImage, ax: Axes, label: str = '') -> None:
    """A slim colour bar beside ``ax`` with plain tick labels (no offset notation)."""
    bar = fig.colorbar(image, ax=ax, shrink=COLORBAR_SHRINK)
    bar.formatter = ScalarFormatter(useOffset=False)
    bar.ax.tick_params(labelsize=FONT_SIZE - 2)
    if label:
        bar.set_label(label, fontsize=FONT_SIZE - 1)


def text_panel(ax: Axes, lines: Sequence[str]) -> None:
    """An axis-less panel of text lines (legends, notes)."""
    ax.axis('off')
    ax.text(0.0, 1.0, '\n'.join(lines), va='top', ha='left', fontsize=FONT_SIZE,
            transform=ax.transAxes, wrap=True)
