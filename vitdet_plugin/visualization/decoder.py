"""The ``decoder`` picture: how an ``SdpaDETRHead`` refines the boxes of its top queries, and
where one query's cross-attention looks in the multi-scale memory.

One real forward of the detector's backbone, neck and head (eval mode) with hooks: a forward
pre-hook on the decoder records the reference boxes it receives (the encoder proposals with
``two_stage``, else the learned reference boxes), a forward hook on the head's memory records
its :class:`FlatMemory` (level shapes, padding, token centres), and forward pre-hooks on every
decoder layer's cross-attention record its inputs (``query + query_pos``, ``memory_key``,
``memory`` and the additive bias: ``-inf`` at padded tokens plus the Gaussian box prior). The
probabilities are recomputed from those inputs with the module's own projections
(:func:`cross_attention_probs`); :func:`cross_attention_output` turns them back into the module's
output, which the tests compare with what the module returned.

Boxes are normalised ``cxcywh`` in the ``img_shape`` frame inside the head; they are drawn in
input pixels of that frame.
"""
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from torch import Tensor, nn

from . import VisualizeError
from .capture import Call, record_calls
from .figures import (FONT_SIZE, OVERLAY_ALPHA, Picture, colorbar, panel_grid, save,
                             text_panel, title)
from .model import Detector, ModelInput
from .pictures import canvas_hw, draw_input_padded, suptitle, token_extent
from ..models.heads import FlatMemory, HeadOutputs, SdpaDETRHead
from ..models.layers import MultiheadCrossAttention

#: Queries drawn unless ``--top`` says otherwise.
DEFAULT_TOP = 5
#: One colour per query: this qualitative map while it has enough colours, else a spectrum.
QUERY_COLOURS, NUM_QUERY_COLOURS, MANY_QUERY_COLOURS = 'tab10', 10, 'turbo'
#: Line width of the drawn boxes (the reference box on the attention panels: dashed, wider).
BOX_LINE_WIDTH = 1.5
REF_BOX_STYLE: Dict[str, Any] = dict(fill=False, linewidth=2.0, linestyle='--')
#: Boxes are labelled with their rank (and class on the last stage) up to this many queries;
#: the legend lists at most this many.
MAX_BOX_LABELS = 10
#: Colour map and opacity of the attention heat maps over the input.
ATTENTION_COLOURS, ATTENTION_ALPHA = 'inferno', OVERLAY_ALPHA + 0.2
#: Rows of the picture: the refinement stages, then the attention of one query per level.
REFINEMENT_ROW, ATTENTION_ROW, NUM_ROWS = 0, 1, 2


# ----------------------------------------------------------------------------- checks
def detr_head(detector: Detector) -> SdpaDETRHead:
    """The detector's ``SdpaDETRHead``, or an error naming what the config has instead."""
    model = detector.model
    head = getattr(model, 'bbox_head', None)
    if not isinstance(head, SdpaDETRHead):
        what = 'no bbox_head' if head is None else f'bbox_head {type(head).__name__}'
        raise VisualizeError(f'{detector.config_path}: {type(model).__name__} has {what}, not an '
                             'SdpaDETRHead; the decoder picture needs a DETR-style head with '
                             'model.bbox_head.decoder.layers')
    return head


def check_layer(head: SdpaDETRHead, layer: Optional[int]) -> int:
    """Decoder layer ``layer`` (None: the last; negative: from the end) as ``0..L-1``, or an
    error naming the decoder's layer count."""
    n = head.decoder.num_layers
    if layer is None:
        return n - 1
    if not -n <= layer < n:
        raise VisualizeError(f'layer {layer} is out of range: the decoder of SdpaDETRHead has {n} '
                             f'layers (0..{n - 1}, or -{n}..-1 from the end)')
    return layer % n


def check_ranks(num_queries: int, top: int, query: int, where: str) -> None:
    """``1 <= top <= num_queries`` and ``0 <= query < top``, or an error naming the range."""
    if not 1 <= top <= num_queries:
        raise VisualizeError(f'--top {top} is out of range: {where} has {num_queries} queries, '
                             f'so --top must be in 1..{num_queries}')
    if not 0 <= query < top:
        raise VisualizeError(f'--query {query} is out of range: it is a rank among the --top '
                             f'{top} queries, so it must be in 0..{top - 1}')


def cross_attention(head: SdpaDETRHead, layer: int) -> MultiheadCrossAttention:
    """The cross-attention module of decoder layer ``layer`` (``0..L-1``)."""
    module = getattr(head.decoder.layers[layer], 'cross_attn', None)
    if not isinstance(module, MultiheadCrossAttention):
        raise VisualizeError(f'decoder layer {layer} has no MultiheadCrossAttention cross_attn '
                             f'(got {type(module).__name__}); add its formula to '
                             'vitdet_plugin/visualization/decoder.py')
    return module


def check_head_index(module: MultiheadCrossAttention, layer: int, head: Optional[int]) -> None:
    """``head`` is None (the mean) or a head of the layer's cross-attention, else an error."""
    n = module.num_heads
    if head is not None and not 0 <= head < n:
        raise VisualizeError(f'head {head} is out of range: the cross-attention of decoder '
                             f'layer {layer} has {n} heads (0..{n - 1})')


# ----------------------------------------------------------------------------- capture
@dataclass
class DecoderCapture:
    """What one forward of the head gave and passed around (batch of one image).

    ``outs``: the head's outputs; ``memory``: its flattened multi-scale memory;
    ``initial_ref``: the ``(B, Q, 4)`` reference boxes the decoder received; ``cross_calls``:
    the call of each decoder layer's cross-attention.
    """

    outs: HeadOutputs
    memory: FlatMemory
    initial_ref: Tensor
    cross_calls: List[Call]

    @property
    def stage_boxes(self) -> List[Tensor]:
        """``(B, Q, 4)`` boxes of every stage: the initial reference boxes, then the boxes
        after each decoder layer (stage ``i`` is also the reference of layer ``i``'s input)."""
        return [self.initial_ref.float(), *self.outs.all_bbox_preds.float().unbind(0)]


@contextmanager
def record_output(module: nn.Module) -> Iterator[List[Any]]:
    """Record the outputs of ``module``'s calls (a forward hook, removed on exit)."""
    outputs: List[Any] = []
    handle = module.register_forward_hook(lambda m, args, out: outputs.append(out))
    try:
        yield outputs
    finally:
        handle.remove()


def image_metas(inp: ModelInput) -> List[Dict[str, Tuple[int, int]]]:
    """The metas the data preprocessor gives the head: ``img_shape`` and ``batch_input_shape``."""
    return [dict(img_shape=inp.image_hw, batch_input_shape=inp.input_hw)]


def run_decoder(detector: Detector, inp: ModelInput) -> DecoderCapture:
    """One eval forward of backbone, neck and head on ``inp``, read with hooks."""
    model, head = detector.model, detr_head(detector)
    watch: Dict[str, nn.Module] = {'decoder': head.decoder}
    for i in range(head.decoder.num_layers):
        watch[f'cross {i}'] = cross_attention(head, i)
    with torch.no_grad(), record_calls(watch) as calls, record_output(head.memory) as memories:
        outs = head(model.extract_feat(inp.inputs), image_metas(inp))
    missing = sorted(set(watch) - set(calls))
    if missing or not memories:
        raise RuntimeError(f'the forward never called {missing or ["memory"]}: the head took a '
                           'path that bypasses these modules')
    return DecoderCapture(outs, memories[0], calls['decoder'].arg(1, 'ref_boxes'),
                          [calls[f'cross {i}'] for i in range(head.decoder.num_layers)])


def rank_queries(outs: HeadOutputs, top: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Indices, best class scores and classes of the ``top`` queries of image 0, ranked by
    their best sigmoid class score of the last decoder layer (what prediction keeps)."""
    best, labels = outs.all_cls_scores[-1, 0].float().sigmoid().max(dim=-1)   # (Q,)
    scores, index = best.topk(top)
    return index, scores, labels[index]


# ----------------------------------------------------------------------------- attention
@torch.no_grad()
def cross_attention_probs(module: MultiheadCrossAttention, call: Call) -> Tensor:
    """Probabilities ``(B, heads, Q, N)`` of the captured call of ``module``:
    ``softmax(q k^T / sqrt(head_dim) + bias)`` with the module's own q / k projections of the
    captured query and key and the captured additive bias (padding ``-inf`` + box prior)."""
    query, key, bias = call.arg(0, 'query'), call.arg(1, 'key'), call.arg(3, 'bias')
    q = module._heads(module.q_proj(query))                                 # (B, H, Q, d)
    k = module._heads(module.k_proj(key))                                   # (B, H, N, d)
    logits = (q * module.head_dim ** -0.5) @ k.transpose(-2, -1)
    if bias is not None:
        logits = logits + bias.to(logits.dtype)
    return logits.softmax(dim=-1)


@torch.no_grad()
def cross_attention_output(module: MultiheadCrossAttention, call: Call, probs: Tensor) -> Tensor:
    """The module's output ``(B, Q, C)`` from ``probs``: ``out_proj(merge_heads(probs @ v))``."""
    value = call.arg(2, 'value')
    v = module._heads(module.v_proj(call.arg(1, 'key') if value is None else value))
    out = (probs.to(v.dtype) @ v).transpose(-3, -2).flatten(-2)
    return module.proj_drop(module.out_proj(out))


def level_strides(memory: FlatMemory, img_hw: Sequence[int]) -> List[Tuple[float, float]]:
    """``(stride_y, stride_x)`` in input pixels of every memory level, read from the model's
    token centres (token ``(0, 0)`` of a level is centred at half its stride)."""
    starts = [s.start for s in memory.level_slices()]
    centres = memory.token_xy[0, starts].float() * memory.token_xy.new_tensor(
        [float(img_hw[1]), float(img_hw[0])])                                # (levels, 2) x, y
    return [(2 * float(y), 2 * float(x)) for x, y in centres.tolist()]


def level_maps(row: Tensor, memory: FlatMemory) -> List[Tensor]:
    """A ``(N,)`` row over the flattened memory -> one ``(h, w)`` map per level."""
    return [row[s].reshape(hw) for s, hw in zip(memory.level_slices(), memory.spatial_shapes)]


# ----------------------------------------------------------------------------- drawing
def boxes_px(boxes: Tensor, img_hw: Sequence[int]) -> np.ndarray:
    """Normalised ``(..., 4)`` cxcywh in the ``img_shape`` frame -> ``x0, y0, x1, y1`` pixels."""
    h, w = float(img_hw[0]), float(img_hw[1])
    cx, cy, bw, bh = boxes.float().unbind(-1)
    xyxy = torch.stack((cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2), -1)
    return (xyxy * xyxy.new_tensor([w, h, w, h])).numpy()


def query_colours(count: int) -> np.ndarray:
    """``(count, 4)`` RGBA colours, one per query rank."""
    if count <= NUM_QUERY_COLOURS:
        return colormaps[QUERY_COLOURS](np.arange(count))
    return colormaps[MANY_QUERY_COLOURS](np.linspace(0, 1, count))


def class_names(detector: Detector, num_classes: int) -> List[str]:
    """The dataset's class names (``metainfo.classes`` of the test set), else ``class i``."""
    cfg = detector.cfg
    names = cfg.get('test_dataloader', {}).get('dataset', {}).get('metainfo', {}).get(
        'classes') or cfg.get('classes')
    if names is not None and len(names) == num_classes:
        return [str(n) for n in names]
    return [f'class {i}' for i in range(num_classes)]


def _box(ax: Axes, xyxy: np.ndarray, colour: Any, **style: Any) -> None:
    x0, y0, x1, y1 = (float(v) for v in xyxy)
    ax.add_patch(Rectangle((x0, y0), x1 - x0, y1 - y0, **style, edgecolor=colour))


def _draw_stage(ax: Axes, inp: ModelInput, boxes: np.ndarray, colours: np.ndarray,
                labels: Optional[Sequence[str]]) -> None:
    """The input with one box per ranked query (labelled with its rank, or ``labels``)."""
    draw_input_padded(ax, inp, inp.input_hw)
    for rank, (xyxy, colour) in enumerate(zip(boxes, colours)):
        _box(ax, xyxy, colour, fill=False, linewidth=BOX_LINE_WIDTH)
        if len(boxes) <= MAX_BOX_LABELS:
            text = f'#{rank}' if labels is None else labels[rank]
            ax.text(float(xyxy[0]), float(xyxy[1]), text, color=colour, fontsize=FONT_SIZE - 2,
                    va='bottom', ha='left', clip_on=True)


def _draw_level(ax: Axes, inp: ModelInput, attention: Tensor, stride: Tuple[float, float],
                ref_box: np.ndarray, colour: Any) -> Any:
    """One memory level's attention over the input, with the query's reference box."""
    hw = tuple(attention.shape)
    draw_input_padded(ax, inp, canvas_hw(inp, hw, stride))
    image = ax.imshow(attention.numpy(), cmap=ATTENTION_COLOURS, alpha=ATTENTION_ALPHA,
                      interpolation='nearest', extent=token_extent(hw, stride))
    _box(ax, ref_box, colour, **REF_BOX_STYLE)
    return image


def _bias_kind(detr: SdpaDETRHead, cap: DecoderCapture, layer: int) -> str:
    """What the captured cross-attention bias of ``layer`` is made of."""
    if cap.cross_calls[layer].arg(3, 'bias') is None:
        return 'none'
    parts = ['padding -inf'] if bool(cap.memory.padding_mask.any()) else []
    if detr.decoder.priors is not None:
        parts.append('box prior')
    return ' + '.join(parts)


def _stride_label(stride: Tuple[float, float]) -> str:
    return f'{stride[0]:g}' if stride[0] == stride[1] else f'{stride[0]:g}x{stride[1]:g}'


@dataclass
class _Ranked:
    """The ranked queries: indices into the head's queries, colours, final labels, and the
    boxes of every stage in pixels (``(top, 4)`` xyxy each)."""

    index: Tensor
    colours: np.ndarray
    finals: List[str]
    stages: List[np.ndarray]


def _draw_refinement(axes: np.ndarray, inp: ModelInput, ranked: _Ranked, two_stage: bool,
                     arrays: Dict[str, np.ndarray]) -> None:
    initial = 'encoder proposals' if two_stage else 'learned reference boxes'
    for i, (ax, boxes) in enumerate(zip(axes, ranked.stages)):
        ax.axis('on')
        last = i == len(ranked.stages) - 1
        _draw_stage(ax, inp, boxes, ranked.colours, ranked.finals if last else None)
        title(ax, f'initial: {initial}' if i == 0 else
              f'after decoder layer {i - 1}' + (' (prediction)' if last else ''))
        arrays['boxes initial' if i == 0 else f'boxes layer {i - 1}'] = boxes


def _draw_attention(fig: Figure, axes: np.ndarray, inp: ModelInput, row: Tensor,
                    cap: DecoderCapture, ref_box: np.ndarray, colour: Any,
                    arrays: Dict[str, np.ndarray]) -> None:
    strides = level_strides(cap.memory, inp.image_hw)
    for lvl, (ax, attention, stride) in enumerate(zip(axes, level_maps(row, cap.memory),
                                                      strides)):
        ax.axis('on')
        image = _draw_level(ax, inp, attention, stride, ref_box, colour)
        colorbar(fig, image, ax, 'attention probability')
        title(ax, f'level {lvl}: stride {_stride_label(stride)}, {attention.shape[0]}x'
                  f'{attention.shape[1]} tokens\nattention mass {float(attention.sum()):.3f}')
        arrays[f'attention level {lvl}'] = attention.numpy()
    arrays['reference box'] = ref_box


def decoder_picture(detector: Detector, inp: ModelInput, top: int, query: int,
                    layer: Optional[int], head: Optional[int], out: str) -> Picture:
    """Refinement of the ``top`` queries' boxes (initial reference boxes, then after every
    decoder layer) and the cross-attention of rank ``query`` in ``layer`` per memory level."""
    detr = detr_head(detector)
    layer = check_layer(detr, layer)
    module = cross_attention(detr, layer)
    check_head_index(module, layer, head)
    check_ranks(detr.num_queries, top, query, 'SdpaDETRHead')
    cap = run_decoder(detector, inp)
    num_queries = cap.outs.all_cls_scores.shape[2]
    check_ranks(num_queries, top, query, f'the head on this image (two_stage: at most '
                                         f'{cap.memory.memory.shape[1]} memory tokens)')
    index, scores, labels = rank_queries(cap.outs, top)
    names = class_names(detector, detr.num_classes)
    ranked = _Ranked(index, query_colours(top),
                     [f'#{r} {names[int(c)]} {float(s):.2f}'
                      for r, (c, s) in enumerate(zip(labels, scores))],
                     [boxes_px(b[0, index], inp.image_hw) for b in cap.stage_boxes])
    levels = len(cap.memory.spatial_shapes)
    fig, axes = panel_grid(NUM_ROWS, max(len(ranked.stages), levels + 1))
    for ax in axes.flat:
        ax.axis('off')
    arrays: Dict[str, np.ndarray] = {'queries': index.numpy(), 'scores': scores.numpy(),
                                     'labels': labels.numpy()}
    _draw_refinement(axes[REFINEMENT_ROW], inp, ranked, detr.two_stage, arrays)
    # the attention of one query: its row of the (heads, Q, N) probabilities
    probs = cross_attention_probs(module, cap.cross_calls[layer])[0, :, int(index[query])]
    row = (probs.mean(dim=0) if head is None else probs[head]).float()
    _draw_attention(fig, axes[ATTENTION_ROW], inp, row, cap, ranked.stages[layer][query],
                    ranked.colours[query], arrays)
    which = f'mean of {module.num_heads} heads' if head is None else f'head {head}'
    note = axes[ATTENTION_ROW, levels]
    text_panel(note, [f'{type(detr).__name__}, {detector.weights_label}', inp.source, '',
                      f'top: the top-{top} queries (last-layer', 'class score) at every stage',
                      f'bottom: query #{query} (query {int(index[query])}), layer {layer}',
                      f'cross-attention, {which}', f'bias: {_bias_kind(detr, cap, layer)}',
                      'dashed: its reference box at', 'the layer input'])
    shown = min(top, MAX_BOX_LABELS)
    note.legend(handles=[Patch(facecolor='none', edgecolor=ranked.colours[r],
                               label=ranked.finals[r]) for r in range(shown)],
                loc='lower left', fontsize=FONT_SIZE - 2, frameon=False,
                title=None if shown == top else f'first {shown} of {top}')
    suptitle(fig, detector, f'{type(detr).__name__} decoder, {detector.weights_label}, '
                            f'{inp.source}')
    return save(fig, out, arrays)
