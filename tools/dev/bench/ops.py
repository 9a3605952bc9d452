"""``--model ops``: the compile-free mmcv ops (``vitdet_plugin.ops``) against compiled mmcv.

Every ``mmcv.ops.*`` module calls the extension as its module global ``ext_module``;
``dev.op_parity.use_ext`` (the op-parity module) points all of them at one extension, so in
ONE process compiled ``mmcv._ext``
and a fresh compile-free one (``new_ext_module()``) run the same mmcv code, alternately on
every repeat, after ``--warmup`` untimed rounds. Each row: the medians, the ratio ours /
reference (< 1 is better) and ``diff``, the largest ``max|ours - ref| / max|ref|`` over the
outputs (results and input gradients; training steps: the loss and all parameter gradients).

The reference is compiled mmcv where mmcv runs its extension on the device. On CPU compiled
mmcv 2.1.0 has no focal-loss or deformable-attention kernel and mmdet / mmcv run PyTorch code
(``py_sigmoid_focal_loss``, ``multi_scale_deformable_attn_pytorch``): those rows compare our
kernel (a GPU's path) with that code, and say so. Without compiled mmcv the rows whose
reference is compiled say so. Training steps (loss + backward, the same random weights and
inputs): the demo Mask R-CNN and a shrunk Mask2Former (:func:`mask2former_setup`).
"""
import argparse
import copy
import json
import os
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..op_parity import (COMPILED_MISSING, M2F_IMAGE, MASK2FORMER_CONFIG, MASK_RCNN_CONFIG,
                         MSDA_IM2COL, SEED, Outputs, build_detector, compiled_ext, ext_dispatch,
                         model_config, ours_ext, rel_err, shapes_batch, shrink_mask2former,
                         use_ext)

Fn = Callable[[], Outputs]
#: ``mmcv._ext`` functions that compiled mmcv 2.1.0 has CPU kernels for (its
#: ``ops/csrc/pytorch/cpu``); elsewhere on CPU mmcv / mmdet call pure-PyTorch code.
COMPILED_CPU_OPS = frozenset({
    'nms', 'softnms', 'nms_match', 'bbox_overlaps', 'roi_align_forward', 'roi_align_backward',
    'deform_conv_forward', 'deform_conv_backward_input', 'deform_conv_backward_parameters',
    'modulated_deform_conv_forward', 'modulated_deform_conv_backward'})
PERTURB_STD = 0.02  # noise on the initialised weights of the training-step rows
COMPILED, PYTORCH = 'compiled mmcv', 'mmcv/mmdet PyTorch (CPU path)'  # kinds of reference
GROUP_OPS, GROUP_MSDA, GROUP_TRAIN = 'ops', 'ms_deform_attn', 'training step'
#: Timed seconds a row aims at: a slower row gets fewer repeats than ``--repeats`` (at least
#: MIN_ROW_REPEATS or the plan's minimum), so that the run takes minutes on a 2-core CPU.
ROW_SECONDS, MIN_ROW_REPEATS = 40.0, 3

# ----------------------------------------------------------------------- shapes of the rows
IMAGE_HW = (800, 1216)            # a COCO training image (mmdet's 1333x800 resize, padded)
NMS_BOXES, NMS_IOU = (2000, 10000), 0.7                 # RPN
BOX_SIDES = (16.0, 256.0)         # random box sides, px
BATCHED_NMS_BOXES, NUM_CLASSES, BATCHED_NMS_IOU = 5000, 80, 0.5   # R-CNN test
SOFT_NMS_BOXES, SOFT_NMS_IOU, OVERLAP_BOXES = 1000, 0.3, 2000
ROIS, ROI_CHANNELS, ROI_OUT = 512, 256, 7      # Mask R-CNN box head: 512 sampled RoIs, 7x7
ROI_STRIDE, P2_BOX_SIDES = 4, (16.0, 112.0)    # FPN P2, where mmdet maps RoIs under 112 px
RETINA_STRIDES, RETINA_ANCHORS, RETINA_BATCH = (8, 16, 32, 64, 128), 9, 2
FOCAL_GAMMA, FOCAL_ALPHA, FOCAL_POSITIVES = 2.0, 0.25, 0.01   # positives: anchors with a class
MSDA_STRIDES = (8, 16, 32, 64)    # DINO / Mask2Former pixel decoder: 4 levels
MSDA_HEADS, MSDA_POINTS, MSDA_CHANNELS = 8, 4, 256
DCN_CHANNELS, DCN_KERNEL, DCN_STRIDE = 256, 3, 16   # a ResNet stage-4 3x3 DCN at stride 16
OFFSET_STD = 2.0                                    # px of the random deformable offsets
DEMO_IMAGE, DEMO_BATCH = 192, 2   # the demo Mask R-CNN's training batch
MSDA_OPS, ROI_OPS = ('ms_deform_attn_forward', 'ms_deform_attn_backward'), ('roi_align_forward',
                                                                             'roi_align_backward')


# ------------------------------------------------------------------------------ the op rows
@dataclass(frozen=True)
class Pair:
    """A row's call through the extension, and what mmcv / mmdet call on CPU instead."""
    ours: Fn
    pytorch: Optional[Fn] = None


@dataclass(frozen=True)
class Case:
    name: str
    group: str
    ext_ops: Tuple[str, ...]        # extension functions the row calls
    setup: Callable[[str], Pair]    # device -> calls


def _gen(device: str) -> torch.Generator:
    return torch.Generator(device).manual_seed(SEED)


def random_boxes(n: int, sides: Tuple[float, float], device: str) -> Tensor:
    """``n`` (x1, y1, x2, y2) boxes in an ``IMAGE_HW`` image, sides uniform in ``sides``."""
    g, room = _gen(device), torch.tensor(IMAGE_HW[::-1], device=device)
    wh = sides[0] + (sides[1] - sides[0]) * torch.rand(n, 2, generator=g, device=device)
    xy = torch.rand(n, 2, generator=g, device=device) * (room - wh)
    return torch.cat([xy, xy + wh], 1)


def _with_grads(out: Tensor, leaves: Sequence[Tensor]) -> Outputs:
    """``out`` and the gradients of ``out.sum()`` with respect to ``leaves``."""
    return [out.detach(), *torch.autograd.grad(out.sum(), list(leaves))]


def box_case(kind: str, n: int) -> Case:
    """``nms``, ``batched_nms``, ``soft_nms`` or ``bbox_overlaps`` of ``n`` random boxes; NMS
    gives the kept indices sorted (boxes of tied scores may be kept in either order)."""
    def setup(device: str) -> Pair:
        from mmcv.ops import batched_nms, bbox_overlaps, nms, soft_nms
        boxes, g = random_boxes(n, BOX_SIDES, device), _gen(device)
        scores = torch.rand(n, generator=g, device=device)
        classes = torch.randint(NUM_CLASSES, (n, ), generator=g, device=device)
        calls: Dict[str, Fn] = {
            'batched_nms': lambda: [batched_nms(boxes, scores, classes, dict(
                type='nms', iou_threshold=BATCHED_NMS_IOU))[1].sort().values],
            'soft_nms': lambda: [soft_nms(boxes, scores, SOFT_NMS_IOU, method='gaussian')[0]],
            'bbox_overlaps': lambda: [bbox_overlaps(boxes, boxes.flip(0))]}
        return Pair(calls.get(kind) or (lambda: [nms(boxes, scores, NMS_IOU)[1].sort().values]))
    detail = {'batched_nms': f' {NUM_CLASSES} classes', 'soft_nms': ' (gaussian)',
              'bbox_overlaps': f' x {n}'}.get(kind, '')
    ops = {'soft_nms': ('softnms', ), 'bbox_overlaps': ('bbox_overlaps', )}
    return Case(f'{kind} {n} boxes{detail}', GROUP_OPS, ops.get(kind, ('nms', )), setup)


def roi_case(mode: str, backward: bool) -> Case:
    def setup(device: str) -> Pair:
        from mmcv.ops import roi_align
        hw = [s // ROI_STRIDE for s in IMAGE_HW]
        feat = torch.randn(1, ROI_CHANNELS, *hw, generator=_gen(device), device=device,
                           requires_grad=backward)
        rois = torch.cat([torch.zeros(ROIS, 1, device=device),
                          random_boxes(ROIS, P2_BOX_SIDES, device)], 1)
        align = (ROI_OUT, 1.0 / ROI_STRIDE, 0, mode, True)   # mmdet: sampling 0, aligned
        return Pair((lambda: _with_grads(roi_align(feat, rois, *align), [feat])) if backward
                    else (lambda: [roi_align(feat, rois, *align)]))
    return Case(f'roi_align {mode} {ROIS}x{ROI_CHANNELS}x{ROI_OUT}x{ROI_OUT} P2 '
                f'{"fwd+bwd" if backward else "fwd"}', GROUP_OPS,
                ROI_OPS if backward else ROI_OPS[:1], setup)


def focal_setup(device: str) -> Pair:
    import torch.nn.functional as F
    from mmdet.models.losses.focal_loss import py_sigmoid_focal_loss, sigmoid_focal_loss
    anchors = RETINA_BATCH * RETINA_ANCHORS * sum(
        -(-IMAGE_HW[0] // s) * -(-IMAGE_HW[1] // s) for s in RETINA_STRIDES)
    g = _gen(device)
    pred = torch.randn(anchors, NUM_CLASSES, generator=g, device=device, requires_grad=True)
    labels = torch.randint(NUM_CLASSES, (anchors, ), generator=g, device=device)
    background = torch.rand(anchors, generator=g, device=device) > FOCAL_POSITIVES
    labels[background] = NUM_CLASSES  # mmdet's background label
    avg = float((~background).sum())

    def ours() -> Outputs:  # mmdet FocalLoss.forward on CUDA: mmcv's op
        return _with_grads(sigmoid_focal_loss(pred, labels, None, FOCAL_GAMMA, FOCAL_ALPHA,
                                              'sum') / avg, [pred])

    def pytorch() -> Outputs:  # mmdet FocalLoss.forward on CPU: one-hot targets
        target = F.one_hot(labels, NUM_CLASSES + 1)[:, :NUM_CLASSES]
        return _with_grads(py_sigmoid_focal_loss(pred, target, None, FOCAL_GAMMA, FOCAL_ALPHA,
                                                 'sum') / avg, [pred])
    return Pair(ours, pytorch)


def msda_setup(device: str) -> Pair:
    from mmcv.ops.multi_scale_deform_attn import (MultiScaleDeformableAttnFunction,
                                                  multi_scale_deformable_attn_pytorch)
    shapes = torch.tensor([[-(-IMAGE_HW[0] // s), -(-IMAGE_HW[1] // s)] for s in MSDA_STRIDES],
                          device=device)
    start = torch.cat([shapes.new_zeros(1), shapes.prod(1).cumsum(0)[:-1]])
    keys, levels, g = int(shapes.prod(1).sum()), len(MSDA_STRIDES), _gen(device)
    value = torch.randn(1, keys, MSDA_HEADS, MSDA_CHANNELS // MSDA_HEADS, generator=g,
                        device=device, requires_grad=True)
    loc = torch.rand(1, keys, MSDA_HEADS, levels, MSDA_POINTS, 2, generator=g, device=device,
                     requires_grad=True)
    attn = torch.rand(1, keys, MSDA_HEADS, levels * MSDA_POINTS, generator=g, device=device)
    attn = attn.softmax(-1).view(1, keys, MSDA_HEADS, levels, MSDA_POINTS).requires_grad_()
    leaves = [value, loc, attn]
    return Pair(lambda: _with_grads(MultiScaleDeformableAttnFunction.apply(
                    value, shapes, start, loc, attn, MSDA_IM2COL), leaves),
                lambda: _with_grads(multi_scale_deformable_attn_pytorch(
                    value, shapes, loc, attn), leaves))


def dcn_case(modulated: bool) -> Case:
    def setup(device: str) -> Pair:
        from mmcv.ops import deform_conv2d, modulated_deform_conv2d
        hw, taps, g = [s // DCN_STRIDE for s in IMAGE_HW], DCN_KERNEL ** 2, _gen(device)
        x = torch.randn(1, DCN_CHANNELS, *hw, generator=g, device=device, requires_grad=True)
        weight = (torch.randn(DCN_CHANNELS, DCN_CHANNELS, DCN_KERNEL, DCN_KERNEL, generator=g,
                              device=device) / (DCN_CHANNELS * taps) ** 0.5).requires_grad_()
        offset = (torch.randn(1, 2 * taps, *hw, generator=g, device=device)
                  * OFFSET_STD).requires_grad_()
        mask = torch.rand(1, taps, *hw, generator=g, device=device, requires_grad=True)
        pad = DCN_KERNEL // 2
        if modulated:
            return Pair(lambda: _with_grads(modulated_deform_conv2d(
                x, offset, mask, weight, None, 1, pad, 1, 1, 1), [x, offset, mask, weight]))
        return Pair(lambda: _with_grads(deform_conv2d(x, offset, weight, 1, pad),
                                        [x, offset, weight]))
    ops = tuple(f'{"modulated_" * modulated}deform_conv_{part}' for part in (
        ('forward', 'backward') if modulated else ('forward', 'backward_input',
                                                   'backward_parameters')))
    return Case(f'{"modulated_" if modulated else ""}deform_conv {DCN_CHANNELS}ch '
                f'{DCN_KERNEL}x{DCN_KERNEL} stride-{DCN_STRIDE} map fwd+bwd', GROUP_OPS, ops, setup)


# ----------------------------------------------------------------------- detector training
def train_step(model: Any, batch: dict) -> Fn:
    """Loss + backward of ``model`` on ``batch``, the RNG reseeded (samplers, point picks);
    returns the loss and all parameter gradients as one vector."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> Outputs:
        torch.manual_seed(SEED)
        model.zero_grad(set_to_none=True)
        data = model.data_preprocessor(copy.deepcopy(batch), True)
        loss, _ = model.parse_losses(model.loss(data['inputs'], data['data_samples']))
        loss.backward()
        return [loss.detach(), torch.cat([p.grad.flatten() for p in params
                                          if p.grad is not None])]
    return step


def mask_rcnn_setup(device: str) -> Pair:
    model = build_detector(model_config(MASK_RCNN_CONFIG), PERTURB_STD).to(device)
    return Pair(train_step(model, shapes_batch(DEMO_BATCH, DEMO_IMAGE)))


def mask2former_setup(device: str) -> Pair:
    """Ours with the deformable attention on our kernel (:func:`ext_dispatch`); on CPU the
    reference is mmcv's PyTorch path (on CUDA both take the extension)."""
    model = build_detector(shrink_mask2former(model_config(MASK2FORMER_CONFIG)),
                           PERTURB_STD).to(device)
    step = train_step(model, shapes_batch(DEMO_BATCH, M2F_IMAGE))
    return Pair(lambda: _dispatched(step), step)


def _dispatched(fn: Fn) -> Outputs:
    with ext_dispatch():
        return fn()


def cases() -> List[Case]:
    return [box_case('nms', n) for n in NMS_BOXES] + [
        box_case('batched_nms', BATCHED_NMS_BOXES), box_case('soft_nms', SOFT_NMS_BOXES),
        box_case('bbox_overlaps', OVERLAP_BOXES),
        roi_case('avg', False), roi_case('avg', True), roi_case('max', True),
        Case(f'sigmoid_focal_loss RetinaNet {RETINA_BATCH}x{IMAGE_HW[0]}x{IMAGE_HW[1]} '
             f'{NUM_CLASSES} cls fwd+bwd', GROUP_OPS,
             ('sigmoid_focal_loss_forward', 'sigmoid_focal_loss_backward'), focal_setup),
        dcn_case(False), dcn_case(True),
        Case(f'ms_deform_attn {len(MSDA_STRIDES)} lvl {MSDA_HEADS} heads {MSDA_POINTS} pts '
             f'{MSDA_CHANNELS}ch {IMAGE_HW[0]}x{IMAGE_HW[1]} fwd+bwd', GROUP_MSDA, MSDA_OPS,
             msda_setup),
        Case(f'Mask R-CNN demo step, {DEMO_BATCH}x{DEMO_IMAGE}px', GROUP_TRAIN,
             ('nms', ) + ROI_OPS, mask_rcnn_setup),
        Case(f'Mask2Former (shrunk) step, {DEMO_BATCH}x{M2F_IMAGE}px', GROUP_TRAIN, MSDA_OPS,
             mask2former_setup)]


# --------------------------------------------------------------------------------- measuring
def reference_kind(case: Case, device: str) -> str:
    no_kernel = torch.device(device).type == 'cpu' and not set(case.ext_ops) <= COMPILED_CPU_OPS
    return PYTORCH if no_kernel else COMPILED


def rel_diff(ours: Outputs, ref: Outputs) -> Optional[float]:
    """Largest ``max|o - r| / max|r|`` over the outputs; None where their shapes differ."""
    if len(ours) != len(ref) or any(o.shape != r.shape for o, r in zip(ours, ref)):
        return None
    return max([rel_err(o, r) for o, r in zip(ours, ref)] or [0.0])


def row_repeats(args: argparse.Namespace, round_seconds: float) -> int:
    """``--repeats``, or fewer (not under :data:`MIN_ROW_REPEATS` or the plan's minimum) where
    one round of the row's calls took ``round_seconds``: its timed calls last ROW_SECONDS."""
    least = max(MIN_ROW_REPEATS, args.plan.min_repeats)
    fit = int(ROW_SECONDS // round_seconds) if round_seconds > 0 else args.repeats
    return min(args.repeats, max(least, fit))


def measure(case: Case, args: argparse.Namespace, ours: Any,
            compiled: Optional[Any]) -> Dict[str, Any]:
    """One row (``args``: ``device``, ``repeats``, ``warmup``, ``timer``, ``plan``): both
    calls interleaved on every repeat, each under its extension."""
    pair, kind = case.setup(args.device), reference_kind(case, args.device)
    calls: Dict[str, Tuple[Any, Fn]] = {'ours': (ours, pair.ours)}
    if kind == PYTORCH and pair.pytorch is not None:
        calls['ref'] = (compiled or ours, pair.pytorch)
    elif compiled is not None:
        calls['ref'] = (compiled, pair.ours)
    outs: Dict[str, Outputs] = {}

    def one_round() -> Dict[str, float]:
        took = {}
        for name, (ext, fn) in calls.items():
            with use_ext(ext):
                took[name] = args.timer(_keeping(outs, name, fn))
        return took

    warm = [sum(one_round().values()) for _ in range(args.warmup)]
    timed = [one_round() for _ in range(row_repeats(args, warm[-1] if warm else 0.0))]
    times = {name: [t[name] for t in timed] for name in calls}
    row: Dict[str, Any] = dict(name=case.name, group=case.group, reference=kind,
                               ext_ops=list(case.ext_ops), times=times,
                               ours=statistics.median(times['ours']))
    if 'ref' in calls:
        row.update(ref=statistics.median(times['ref']), diff=rel_diff(outs['ours'],
                                                                        outs['ref']))
        row['ratio'] = row['ours'] / row['ref']
    return row


def _keeping(outs: Dict[str, Outputs], name: str, fn: Fn) -> Callable[[], None]:
    def call() -> None:
        outs[name] = fn()
    return call


def format_rows(rows: Sequence[Dict[str, Any]], group: str) -> List[str]:
    lines = [f'{group:<60} | {"n":>2} | {"ours s":>8} | {"ref s":>8} | {"ratio":>6} | '
             f'{"diff":>7} | reference']
    for r in (r for r in rows if r['group'] == group):
        head = f'{r["name"]:<60} | {len(r["times"]["ours"]):>2} | {r["ours"]:>8.4g} | '
        if 'ref' not in r:
            lines.append(head + f'{"-":>8} | {"-":>6} | {"-":>7} | {COMPILED_MISSING}')
            continue
        diff = 'shape' if r['diff'] is None else f'{r["diff"]:.0e}'
        lines.append(head + f'{r["ref"]:>8.4g} | {r["ratio"]:>5.2f}x | {diff:>7} | '
                     f'{r["reference"]}')
    return lines


def run_ops(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """``--model ops``: every row, printed as measured and then per group; ``--json``."""
    compiled, ours = compiled_ext(), ours_ext()
    ref = 'compiled mmcv._ext' if compiled is not None else COMPILED_MISSING
    print(f'ops: vitdet_plugin.ops vs {ref} | device={args.device} repeats<={args.repeats} '
          f'warmup={args.warmup} threads={torch.get_num_threads()} torch={torch.__version__} '
          f'load={os.getloadavg()[0]:.1f} | n = timed calls each, ratio = ours / reference '
          '(< 1 better), diff = max|ours - ref| / max|ref| of the outputs', flush=True)
    rows = []
    for case in cases():
        rows.append(measure(case, args, ours, compiled))
        print(format_rows(rows[-1:], case.group)[-1], flush=True)
    for group in (GROUP_OPS, GROUP_MSDA, GROUP_TRAIN):  # ms_deform_attn: a table of its own
        print('\n' + '\n'.join(format_rows(rows, group)), flush=True)
    print(f'load={os.getloadavg()[0]:.1f} at the end', flush=True)
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(model='ops', device=args.device, compiled=compiled is not None,
                           rows=rows), f, indent=1)
    return rows
