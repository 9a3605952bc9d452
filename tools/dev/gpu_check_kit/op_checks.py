"""mmcv's ops on the compile-free backend (``vitdet_plugin.ops``): CUDA against CPU.

Both sides call ``mmcv.ops`` (so ``mmcv._ext`` is ours on both), measured with the op-parity
module's errors (``tools/dev/op_parity.py``); NMS is also held against torchvision's and
multi-scale deformable attention against mmcv's pure-PyTorch
``multi_scale_deformable_attn_pytorch`` on CPU. bf16 checks compare a bf16 run with an fp32 run
on the same bf16-rounded inputs, so only the op's own arithmetic differs (mmcv's compiled CUDA
kernels have no bf16 for focal loss, NMS or RoIAlign; ours must). Each check raises
``AssertionError`` on a miss (recorded by :func:`.results.run_checks`; the others still run)
and returns what it measured.
"""
import os
from functools import partial
from typing import Callable, Dict, List, Sequence, Tuple

import torch
from torch import Tensor

from dev.op_parity import rel_err, rel_l2  # the op-parity module (tools/ on the steps' path)

#: fp32 CUDA vs CPU: max |cuda - cpu| / max |cpu| of outputs and gradients.
OP_TOL = 1e-4
#: bf16 vs fp32 (same bf16-rounded inputs): outputs by max-abs relative error, gradients by
#: relative L2 error.
BF16_OUT_TOL = 2e-2
BF16_GRAD_TOL = 5e-2
SEED = 0
EXPECTED_BACKEND = 'vitdet_plugin.ops'
# NMS: boxes in a 500 x 500 image, sides 1..101, 5 classes; batched_nms's per-class path
# (split_thr below the box count) and its offset path (the default split_thr, 10000)
NMS_BOXES = 2000
NMS_IOU = 0.5
NMS_CLASSES = 5
NMS_SPLIT_THR = 500
IMAGE_SIDE = 500.0
MAX_BOX_SIDE = 100.0
# RoIAlign: stride-8 features of a 400 x 608 image; RoIs partly outside it
ROI_FEATS = (2, 16, 50, 76)
ROI_STRIDE = 8
ROI_COUNT = 64
#: max mode: fewer RoIs, so that two sampling points of one bin are unlikely to be so close that
#: CPU and CUDA rounding pick different maxima (their gradients then land on other pixels)
ROI_COUNT_MAX = 8
ROI_OUT = (7, 7)
ROI_MARGIN = 40.0
MAX_ROI_SIDE = 250.0
ROI_SAMPLING = 2
# focal losses: 80 classes (sigmoid: label 80 = background), logits of std 2
FOCAL_SAMPLES = 512
FOCAL_CLASSES = 80
FOCAL_GAMMA = 2.0
FOCAL_ALPHA = 0.25
LOGIT_STD = 2.0
# multi-scale deformable attention: 3 levels, sampling locations up to 5% outside the map
MSDA_BATCH = 2
MSDA_HEADS = 4
MSDA_HEAD_DIMS = 8
MSDA_LEVELS = ((24, 32), (12, 16), (6, 8))
MSDA_QUERIES = 300
MSDA_POINTS = 4
MSDA_OUTSIDE = 0.05
IM2COL_STEP = 64
# deformable convolution: 3x3, stride 1, padding 1, 2 offset groups
DCN_SHAPE = (2, 8, 17, 19)
DCN_OUT = 16
DCN_KERNEL = 3
DCN_GROUPS = 2
OFFSET_STD = 2.0
WEIGHT_STD = 0.1


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(SEED)


def _on(device: str, t: Tensor) -> bool:
    return t.device.type == torch.device(device).type


def _bf16_rounded(*ts: Tensor) -> List[Tensor]:
    return [t.bfloat16().float() if t.is_floating_point() else t for t in ts]


def _fwd_bwd(fn: Callable[..., Tensor], inputs: Sequence[Tensor], grad_out: Tensor,
             diff: Sequence[int]) -> Tuple[Tensor, List[Tensor]]:
    """``fn(*inputs)`` and the gradients of ``(out * grad_out).sum()`` wrt ``inputs[i]`` for i
    in ``diff``."""
    xs = [x.detach().clone().requires_grad_(i in diff) for i, x in enumerate(inputs)]
    out = fn(*xs)
    (out.float() * grad_out.to(out.device)).sum().backward()
    grads = []
    for i in diff:
        grad = xs[i].grad
        if grad is None:
            raise AssertionError(f'input {i} got no gradient')
        grads.append(grad.detach())
    return out.detach(), grads


def _parity(name: str, dev: Tuple[Tensor, List[Tensor]], ref: Tuple[Tensor, List[Tensor]],
            labels: Sequence[str], tol: float = OP_TOL) -> str:
    errs = [rel_err(dev[0], ref[0])] + [rel_err(g, r) for g, r in zip(dev[1], ref[1])]
    text = ', '.join(f'{k} {e:.1e}' for k, e in zip(['out', *labels], errs))
    assert all(e <= tol for e in errs), f'{name}: {text} (tol {tol:.0e})'
    return f'{text} (tol {tol:.0e})'


def _bf16_parity(name: str, half: Tuple[Tensor, List[Tensor]],
                 full: Tuple[Tensor, List[Tensor]], labels: Sequence[str]) -> str:
    tensors = [half[0], *half[1]]
    assert half[0].dtype == torch.bfloat16, f'{name}: bf16 inputs gave {half[0].dtype} output'
    assert all(torch.isfinite(t).all() for t in tensors), f'{name}: non-finite bf16 results'
    err_out = rel_err(half[0], full[0])
    err_grads = [rel_l2(g, r) for g, r in zip(half[1], full[1])]
    text = ', '.join([f'out {err_out:.1e}'] + [f'{k} L2 {e:.1e}'
                                                for k, e in zip(labels, err_grads)])
    assert err_out <= BF16_OUT_TOL and all(e <= BF16_GRAD_TOL for e in err_grads), (
        f'{name}: bf16 vs fp32 {text} (tol {BF16_OUT_TOL:.0e} / {BF16_GRAD_TOL:.0e})')
    return f'{text} (tol {BF16_OUT_TOL:.0e} / L2 {BF16_GRAD_TOL:.0e})'


def check_backend() -> str:
    """``mmcv._ext`` is the compile-free backend (mmcv-lite has no compiled extension)."""
    import mmcv.ops  # noqa: F401  (loads mmcv._ext)

    from vitdet_plugin.compat import ops_backend
    backend = ops_backend()
    mode = os.environ.get('VITDET_MMCV_OPS', 'auto')
    assert backend == EXPECTED_BACKEND, f'mmcv._ext is {backend!r} (VITDET_MMCV_OPS={mode})'
    return f'mmcv._ext.BACKEND = {backend} (VITDET_MMCV_OPS={mode})'


def _boxes(n: int) -> Tuple[Tensor, Tensor]:
    g = _gen()
    xy = torch.rand(n, 2, generator=g) * IMAGE_SIDE
    wh = torch.rand(n, 2, generator=g) * MAX_BOX_SIDE + 1
    return torch.cat([xy, xy + wh], 1), torch.rand(n, generator=g)


def check_nms(device: str) -> str:
    import torchvision
    from mmcv.ops import nms
    boxes, scores = _boxes(NMS_BOXES)
    dets_cpu, keep_cpu = nms(boxes, scores, NMS_IOU)
    dets, keep = nms(boxes.to(device), scores.to(device), NMS_IOU)
    ref = torchvision.ops.nms(boxes.to(device), scores.to(device), NMS_IOU)
    assert _on(device, keep), f'nms on {device} returned {keep.device} indices'
    assert torch.equal(keep.cpu(), keep_cpu), (
        f'{device} keeps {len(keep)} boxes, CPU {len(keep_cpu)} (or in another order)')
    assert torch.equal(keep.cpu(), ref.cpu()), f'{device} keeps {len(keep)}, torchvision {len(ref)}'
    assert torch.equal(dets.cpu(), dets_cpu), 'the kept boxes / scores differ from CPU'
    return f'{len(keep)}/{NMS_BOXES} kept: {device} = CPU = torchvision (indices and order)'


def check_batched_nms(device: str) -> str:
    import torchvision
    from mmcv.ops import batched_nms
    boxes, scores = _boxes(NMS_BOXES)
    idxs = torch.randint(0, NMS_CLASSES, (NMS_BOXES,), generator=_gen())
    ref = torchvision.ops.batched_nms(boxes, scores, idxs, NMS_IOU)
    kept = []
    for split in (None, NMS_SPLIT_THR):
        cfg = dict(type='nms', iou_threshold=NMS_IOU)
        if split is not None:
            cfg['split_thr'] = split
        dets_cpu, keep_cpu = batched_nms(boxes, scores, idxs, dict(cfg))
        dets, keep = batched_nms(boxes.to(device), scores.to(device), idxs.to(device), dict(cfg))
        path = 'per-class' if split else 'offset'
        assert _on(device, keep), f'{path} path: indices on {keep.device}'
        assert torch.equal(keep.cpu(), keep_cpu), f'{path} path: {device} != CPU'
        assert torch.equal(dets.cpu(), dets_cpu), f'{path} path: boxes / scores != CPU'
        assert torch.equal(keep.cpu().sort().values, ref.sort().values), (
            f'{path} path: {len(keep)} kept, torchvision.batched_nms {len(ref)}')
        kept.append(len(keep))
    return (f'offset and per-class paths keep {kept[0]} / {kept[1]} of {NMS_BOXES}: '
            f'{device} = CPU = torchvision')


def _roi_inputs(count: int = ROI_COUNT) -> Tuple[Tensor, Tensor, Tensor]:
    g = _gen()
    feats = torch.randn(*ROI_FEATS, generator=g)
    height, width = ROI_FEATS[2] * ROI_STRIDE, ROI_FEATS[3] * ROI_STRIDE
    lo = torch.tensor([-ROI_MARGIN, -ROI_MARGIN])
    span = torch.tensor([width + ROI_MARGIN, height + ROI_MARGIN])
    xy = lo + torch.rand(count, 2, generator=g) * span
    wh = torch.rand(count, 2, generator=g) * MAX_ROI_SIDE + 1
    index = torch.randint(0, ROI_FEATS[0], (count, 1), generator=g).float()
    rois = torch.cat([index, xy, xy + wh], 1)
    grad_out = torch.randn(count, ROI_FEATS[1], *ROI_OUT, generator=g)
    return feats, rois, grad_out


def _roi_fn(mode: str, sampling: int, aligned: bool) -> Callable[..., Tensor]:
    from mmcv.ops import roi_align

    def fn(feats: Tensor, rois: Tensor) -> Tensor:
        return roi_align(feats, rois, ROI_OUT, 1 / ROI_STRIDE, sampling, mode, aligned)
    return fn


def check_roi_align(device: str, mode: str, sampling: int, aligned: bool) -> str:
    feats, rois, grad_out = _roi_inputs(ROI_COUNT_MAX if mode == 'max' else ROI_COUNT)
    fn = _roi_fn(mode, sampling, aligned)
    ref = _fwd_bwd(fn, [feats, rois], grad_out, [0])
    dev = _fwd_bwd(fn, [feats.to(device), rois.to(device)], grad_out, [0])
    assert _on(device, dev[0]), f'roi_align on {device} returned {dev[0].device}'
    return _parity('roi_align', dev, ref, ['feature grad'])


def check_roi_align_bf16(device: str) -> str:
    """bf16 features and RoIs, as mmdet's RoI extractors pass them under bf16 autocast."""
    feats, rois, grad_out = _roi_inputs()
    fn = _roi_fn('avg', 0, True)
    inputs = [t.to(device) for t in _bf16_rounded(feats, rois)]
    full = _fwd_bwd(fn, inputs, grad_out, [0])
    half = _fwd_bwd(fn, [t.bfloat16() for t in inputs], grad_out, [0])
    return _bf16_parity('roi_align', half, full, ['feature grad'])


def _focal_inputs(classes: int, background: bool) -> Tuple[Tensor, Tensor, Tensor]:
    g = _gen()
    logits = torch.randn(FOCAL_SAMPLES, FOCAL_CLASSES, generator=g) * LOGIT_STD
    target = torch.randint(0, classes + int(background), (FOCAL_SAMPLES,), generator=g)
    return logits, target, torch.randn(FOCAL_SAMPLES, FOCAL_CLASSES, generator=g)


def _sigmoid_focal_reference(logits: Tensor, target: Tensor) -> Tensor:
    """mmcv's sigmoid focal loss (label ``C`` = background) in float64 PyTorch, no reduction."""
    x = logits.double()
    onehot = torch.nn.functional.one_hot(target, x.shape[1] + 1)[:, :x.shape[1]].double()
    p = x.sigmoid()
    ce = torch.nn.functional.binary_cross_entropy_with_logits(x, onehot, reduction='none')
    p_t = p * onehot + (1 - p) * (1 - onehot)
    alpha_t = FOCAL_ALPHA * onehot + (1 - FOCAL_ALPHA) * (1 - onehot)
    return ce * (1 - p_t) ** FOCAL_GAMMA * alpha_t


def _sigmoid_focal(reduction: str) -> Callable[..., Tensor]:
    from mmcv.ops import sigmoid_focal_loss

    def fn(logits: Tensor, target: Tensor) -> Tensor:
        return sigmoid_focal_loss(logits, target, FOCAL_GAMMA, FOCAL_ALPHA, None, reduction)
    return fn


def check_sigmoid_focal_loss(device: str) -> str:
    logits, target, grad_out = _focal_inputs(FOCAL_CLASSES, background=True)
    texts = []
    for reduction, grad in (('none', grad_out), ('mean', torch.ones(()))):
        fn = _sigmoid_focal(reduction)
        ref = _fwd_bwd(fn, [logits, target], grad, [0])
        dev = _fwd_bwd(fn, [logits.to(device), target.to(device)], grad, [0])
        text = _parity(f'sigmoid_focal_loss {reduction}', dev, ref, ['grad'])
        texts.append(f'{reduction}: {text}')
    ref_loss = _sigmoid_focal_reference(logits, target)
    dev_loss = _sigmoid_focal('none')(logits.to(device), target.to(device))
    err = rel_err(dev_loss, ref_loss)
    assert err <= OP_TOL, f'sigmoid_focal_loss vs the float64 formula: {err:.1e}'
    return '; '.join(texts) + f'; vs float64 formula {err:.1e}'


def check_sigmoid_focal_loss_bf16(device: str) -> str:
    logits, target, grad_out = _focal_inputs(FOCAL_CLASSES, background=True)
    (logits,) = _bf16_rounded(logits)
    fn = _sigmoid_focal('none')
    target = target.to(device)
    full = _fwd_bwd(fn, [logits.to(device), target], grad_out, [0])
    half = _fwd_bwd(fn, [logits.to(device).bfloat16(), target], grad_out, [0])
    return _bf16_parity('sigmoid_focal_loss', half, full, ['grad'])


def check_softmax_focal_loss(device: str) -> str:
    """Per-sample losses, then the mean's gradient (mmcv's backward for ``'none'`` cannot take
    a per-sample gradient: it multiplies the (N, C) gradient by the (N,) one)."""
    from mmcv.ops import softmax_focal_loss
    logits, target, _ = _focal_inputs(FOCAL_CLASSES, background=False)
    target_dev = target.to(device)
    per_sample = softmax_focal_loss(logits, target, FOCAL_GAMMA, FOCAL_ALPHA, None, 'none')
    per_sample_dev = softmax_focal_loss(logits.to(device), target_dev, FOCAL_GAMMA,
                                        FOCAL_ALPHA, None, 'none')
    err = rel_err(per_sample_dev, per_sample)
    assert err <= OP_TOL, f'softmax_focal_loss none: {device} vs CPU {err:.1e}'

    def fn(x: Tensor, t: Tensor) -> Tensor:
        return softmax_focal_loss(x, t, FOCAL_GAMMA, FOCAL_ALPHA, None, 'mean')
    ref = _fwd_bwd(fn, [logits, target], torch.ones(()), [0])
    dev = _fwd_bwd(fn, [logits.to(device), target_dev], torch.ones(()), [0])
    return f"none: out {err:.1e}; mean: {_parity('softmax_focal_loss', dev, ref, ['grad'])}"


def _msda_inputs() -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    g = _gen()
    shapes = torch.tensor(MSDA_LEVELS, dtype=torch.long)
    areas = shapes.prod(1)
    start = torch.cat([areas.new_zeros(1), areas.cumsum(0)[:-1]])
    levels = len(MSDA_LEVELS)
    value = torch.randn(MSDA_BATCH, int(areas.sum()), MSDA_HEADS, MSDA_HEAD_DIMS, generator=g)
    loc_shape = (MSDA_BATCH, MSDA_QUERIES, MSDA_HEADS, levels, MSDA_POINTS)
    locs = (torch.rand(*loc_shape, 2, generator=g) * (1 + 2 * MSDA_OUTSIDE) - MSDA_OUTSIDE)
    weights = torch.rand(*loc_shape, generator=g).flatten(-2).softmax(-1).view(loc_shape)
    grad_out = torch.randn(MSDA_BATCH, MSDA_QUERIES, MSDA_HEADS * MSDA_HEAD_DIMS, generator=g)
    return value, shapes, start, locs, weights, grad_out


MSDA_GRADS = ['value grad', 'location grad', 'weight grad']


def _msda_fn(shapes: Tensor, start: Tensor) -> Callable[..., Tensor]:
    from mmcv.ops.multi_scale_deform_attn import MultiScaleDeformableAttnFunction

    def fn(value: Tensor, locs: Tensor, weights: Tensor) -> Tensor:
        return MultiScaleDeformableAttnFunction.apply(
            value, shapes.to(value.device), start.to(value.device), locs, weights, IM2COL_STEP)
    return fn


def check_ms_deform_attn(device: str) -> str:
    """Our op on ``device`` (mmcv's ``MultiScaleDeformableAttnFunction``, the path
    ``MultiScaleDeformableAttention`` takes on CUDA) against mmcv's pure-PyTorch version on
    CPU, forward and backward."""
    from mmcv.ops.multi_scale_deform_attn import multi_scale_deformable_attn_pytorch
    value, shapes, start, locs, weights, grad_out = _msda_inputs()

    def reference(v: Tensor, loc: Tensor, w: Tensor) -> Tensor:
        return multi_scale_deformable_attn_pytorch(v, shapes, loc, w)
    ref = _fwd_bwd(reference, [value, locs, weights], grad_out, [0, 1, 2])
    dev = _fwd_bwd(_msda_fn(shapes, start),
                   [value.to(device), locs.to(device), weights.to(device)], grad_out, [0, 1, 2])
    assert _on(device, dev[0]), f'ms_deform_attn on {device} returned {dev[0].device}'
    return _parity('ms_deform_attn', dev, ref, MSDA_GRADS)


def check_ms_deform_attn_bf16(device: str) -> str:
    value, shapes, start, locs, weights, grad_out = _msda_inputs()
    inputs = [t.to(device) for t in _bf16_rounded(value, locs, weights)]
    fn = _msda_fn(shapes, start)
    full = _fwd_bwd(fn, inputs, grad_out, [0, 1, 2])
    half = _fwd_bwd(fn, [t.bfloat16() for t in inputs], grad_out, [0, 1, 2])
    return _bf16_parity('ms_deform_attn', half, full, MSDA_GRADS)


def _dcn_inputs(modulated: bool) -> Tuple[List[Tensor], Tensor]:
    g = _gen()
    n, c, h, w = DCN_SHAPE
    taps = DCN_GROUPS * DCN_KERNEL * DCN_KERNEL
    x = torch.randn(n, c, h, w, generator=g)
    offset = torch.randn(n, 2 * taps, h, w, generator=g) * OFFSET_STD
    weight = torch.randn(DCN_OUT, c, DCN_KERNEL, DCN_KERNEL, generator=g) * WEIGHT_STD
    grad_out = torch.randn(n, DCN_OUT, h, w, generator=g)
    if not modulated:
        return [x, offset, weight], grad_out
    mask = torch.rand(n, taps, h, w, generator=g)
    return [x, offset, mask, weight, torch.randn(DCN_OUT, generator=g)], grad_out


def check_deform_conv(device: str, modulated: bool) -> str:
    from mmcv.ops import deform_conv2d, modulated_deform_conv2d
    pad = DCN_KERNEL // 2
    inputs, grad_out = _dcn_inputs(modulated)
    fn: Callable[..., Tensor]
    if modulated:
        def fn(x: Tensor, off: Tensor, mask: Tensor, w: Tensor, b: Tensor) -> Tensor:
            return modulated_deform_conv2d(x, off, mask, w, b, 1, pad, 1, 1, DCN_GROUPS)
        labels = ['input grad', 'offset grad', 'mask grad', 'weight grad', 'bias grad']
    else:
        def fn(x: Tensor, off: Tensor, w: Tensor) -> Tensor:
            return deform_conv2d(x, off, w, 1, pad, 1, 1, DCN_GROUPS)
        labels = ['input grad', 'offset grad', 'weight grad']
    diff = list(range(len(inputs)))
    ref = _fwd_bwd(fn, inputs, grad_out, diff)
    dev = _fwd_bwd(fn, [t.to(device) for t in inputs], grad_out, diff)
    name = 'modulated_deform_conv2d' if modulated else 'deform_conv2d'
    return _parity(name, dev, ref, labels)


def op_checks(device: str) -> List[Tuple[str, Callable[[], str]]]:
    """The op checks on ``device``, in order (the backend first)."""
    vs = f'{device} vs cpu'
    named: Dict[str, Callable[[], str]] = {
        'mmcv._ext backend': check_backend,
        f'nms {vs}': partial(check_nms, device),
        f'batched_nms {vs}': partial(check_batched_nms, device),
        f'roi_align avg aligned {vs}': partial(check_roi_align, device, 'avg', 0, True),
        f'roi_align avg sampling {ROI_SAMPLING} {vs}':
            partial(check_roi_align, device, 'avg', ROI_SAMPLING, False),
        f'roi_align max {vs}': partial(check_roi_align, device, 'max', ROI_SAMPLING, True),
        f'roi_align bf16 {device}': partial(check_roi_align_bf16, device),
        f'sigmoid_focal_loss {vs}': partial(check_sigmoid_focal_loss, device),
        f'sigmoid_focal_loss bf16 {device}': partial(check_sigmoid_focal_loss_bf16, device),
        f'softmax_focal_loss {vs}': partial(check_softmax_focal_loss, device),
        f'ms_deform_attn {device} vs pytorch cpu': partial(check_ms_deform_attn, device),
        f'ms_deform_attn bf16 {device}': partial(check_ms_deform_attn_bf16, device),
        f'deform_conv2d {vs}': partial(check_deform_conv, device, False),
        f'modulated_deform_conv2d {vs}': partial(check_deform_conv, device, True),
    }
    return list(named.items())
