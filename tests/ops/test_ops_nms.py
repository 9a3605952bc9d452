"""Compile-free nms / batched_nms / soft_nms / nms_match / bbox_overlaps through mmcv's own
Python API, against NumPy transcriptions of mmcv 2.1's C++ kernels (``nms.cpp``,
``bbox_overlaps_cuda_kernel.cuh``) and torchvision."""
import re

import numpy as np
import pytest
import torch
import torchvision
from mmcv import ops

import vitdet_plugin  # noqa: F401  (the compile-free ops)
from vitdet_plugin.ops import OpInputError

#: boxes per random set; several sets so the greedy order matters
NUM_BOXES = 300
IOU_THRESHOLDS = (0.3, 0.5, 0.7)


def _boxes(n: int = NUM_BOXES, seed: int = 0, size: float = 100.0):
    """Clustered boxes (so many overlap) with distinct scores."""
    g = np.random.default_rng(seed)
    centers = g.uniform(0, size, (8, 2))[g.integers(0, 8, n)] + g.normal(0, 4, (n, 2))
    wh = g.uniform(5, 30, (n, 2))
    boxes = np.concatenate([centers - wh / 2, centers + wh / 2], 1).astype(np.float32)
    scores = g.permutation(n).astype(np.float32) / n + 0.001  # distinct
    return boxes, scores


def _iou_np(box, boxes, offset=0):
    xx1 = np.maximum(box[0], boxes[:, 0])
    yy1 = np.maximum(box[1], boxes[:, 1])
    xx2 = np.minimum(box[2], boxes[:, 2])
    yy2 = np.minimum(box[3], boxes[:, 3])
    inter = np.maximum(0, xx2 - xx1 + offset) * np.maximum(0, yy2 - yy1 + offset)
    area = (box[2] - box[0] + offset) * (box[3] - box[1] + offset)
    areas = (boxes[:, 2] - boxes[:, 0] + offset) * (boxes[:, 3] - boxes[:, 1] + offset)
    return inter / (area + areas - inter)


def _greedy_nms_np(boxes, scores, thr, offset=0):
    order = np.argsort(-scores, kind='stable')
    keep, suppressed = [], np.zeros(len(boxes), bool)
    for i in order:
        if suppressed[i]:
            continue
        keep.append(i)
        suppressed |= _iou_np(boxes[i], boxes, offset) > thr
    return np.array(keep, dtype=np.int64)


def _softnms_np(boxes, scores, thr, sigma, min_score, method, offset):
    """mmcv's softnms_cpu, statement by statement (swaps and discards included)."""
    b = boxes.astype(np.float32).copy()
    sc = scores.astype(np.float32).copy()
    area = (b[:, 2] - b[:, 0] + offset) * (b[:, 3] - b[:, 1] + offset)
    inds = np.arange(len(b))
    n, dets = len(b), np.zeros((len(b), 5), np.float32)
    i = 0
    while i < n:
        m = i + int(np.argmax(sc[i:n]))
        dets[i] = [*b[m], sc[m]]
        for arr in (b, sc, area, inds):
            arr[[i, m]] = arr[[m, i]]
        pos = i + 1
        while pos < n:
            ovr = _iou_np(b[i], b[pos:pos + 1], offset)[0]
            if method == 0:
                w = 0.0 if ovr >= thr else 1.0
            elif method == 1:
                w = 1 - ovr if ovr >= thr else 1.0
            else:
                w = np.exp(-(ovr * ovr) / sigma)
            sc[pos] *= w
            if sc[pos] < min_score:
                for arr in (b, sc, area, inds):
                    arr[pos] = arr[n - 1]
                n -= 1
                pos -= 1
            pos += 1
        i += 1
    return dets[:n], inds[:n]


@pytest.mark.parametrize('thr', IOU_THRESHOLDS)
@pytest.mark.parametrize('offset', [0, 1])
def test_nms_equals_greedy_numpy_and_torchvision(thr, offset):
    boxes, scores = _boxes(seed=int(thr * 10) + offset)
    dets, keep = ops.nms(torch.from_numpy(boxes), torch.from_numpy(scores), thr, offset=offset)
    ref = _greedy_nms_np(boxes, scores, thr, offset)
    assert keep.dtype == torch.long and keep.tolist() == ref.tolist()
    np.testing.assert_array_equal(dets.numpy(), np.concatenate(
        [boxes[ref], scores[ref, None]], 1))
    if offset == 0:
        tv = torchvision.ops.nms(torch.from_numpy(boxes), torch.from_numpy(scores), thr)
        assert keep.tolist() == tv.tolist()


def test_nms_score_threshold_max_num_and_empty():
    boxes, scores = _boxes(seed=3)
    _, keep = ops.nms(torch.from_numpy(boxes), torch.from_numpy(scores), 0.5,
                      score_threshold=0.4, max_num=10)
    valid = np.nonzero(scores > 0.4)[0]
    ref = valid[_greedy_nms_np(boxes[valid], scores[valid], 0.5)][:10]
    assert keep.tolist() == ref.tolist()
    dets, keep = ops.nms(torch.zeros(0, 4), torch.zeros(0), 0.5)
    assert dets.shape == (0, 5) and keep.shape == (0,) and keep.dtype == torch.long


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16, torch.float64])
def test_nms_other_dtypes_keep_what_float32_keeps(dtype):
    boxes, scores = _boxes(seed=4)
    b, s = torch.from_numpy(boxes).to(dtype), torch.from_numpy(scores).to(dtype)
    dets, keep = ops.nms(b, s, 0.5)
    ref = _greedy_nms_np(b.double().numpy(), s.double().numpy(), 0.5)
    assert dets.dtype == dtype and keep.tolist() == ref.tolist()


def test_batched_nms_per_class():
    boxes, scores = _boxes(seed=5)
    idxs = np.random.default_rng(5).integers(0, 4, len(boxes))
    dets, keep = ops.batched_nms(torch.from_numpy(boxes), torch.from_numpy(scores),
                                 torch.from_numpy(idxs), dict(type='nms', iou_threshold=0.5))
    ref = []
    for c in range(4):
        members = np.nonzero(idxs == c)[0]
        ref += members[_greedy_nms_np(boxes[members], scores[members], 0.5)].tolist()
    ref = sorted(ref, key=lambda i: -scores[i])
    assert keep.tolist() == ref
    assert dets.shape == (len(ref), 5)


@pytest.mark.parametrize('method', ['naive', 'linear', 'gaussian'])
@pytest.mark.parametrize('offset', [0, 1])
def test_soft_nms_equals_mmcv_algorithm(method, offset):
    boxes, scores = _boxes(n=120, seed=6)
    thr, sigma, min_score = 0.3, 0.5, 0.05
    dets, keep = ops.soft_nms(torch.from_numpy(boxes), torch.from_numpy(scores), thr,
                              sigma=sigma, min_score=min_score, method=method, offset=offset)
    ref_dets, ref_inds = _softnms_np(boxes, scores, thr, sigma, min_score,
                                     ['naive', 'linear', 'gaussian'].index(method), offset)
    assert keep.tolist() == ref_inds.tolist()
    np.testing.assert_allclose(dets.numpy(), ref_dets, rtol=1e-6, atol=1e-7)


def test_nms_match_groups():
    boxes, scores = _boxes(n=80, seed=7)
    dets = np.concatenate([boxes, scores[:, None]], 1)
    groups = ops.nms_match(torch.from_numpy(dets), 0.4)
    order, suppressed, ref = np.argsort(-scores, kind='stable'), np.zeros(80, bool), []
    for k, i in enumerate(order):
        if suppressed[i]:
            continue
        later = [j for j in order[k + 1:] if not suppressed[j]]
        matched = [j for j in later if _iou_np(boxes[i], boxes[j:j + 1])[0] >= 0.4]
        suppressed[matched] = True
        ref.append([i] + matched)
    assert [g.tolist() for g in groups] == ref
    assert ops.nms_match(np.zeros((0, 5), np.float32), 0.5) == []


@pytest.mark.parametrize('mode', ['iou', 'iof'])
@pytest.mark.parametrize('aligned', [False, True])
@pytest.mark.parametrize('offset', [0, 1])
def test_bbox_overlaps(mode, aligned, offset):
    b1, _ = _boxes(n=20, seed=8)
    b2, _ = _boxes(n=20, seed=9)
    got = ops.bbox_overlaps(torch.from_numpy(b1), torch.from_numpy(b2), mode, aligned, offset)
    pairs = [(i, i) for i in range(20)] if aligned else [(i, j) for i in range(20)
                                                         for j in range(20)]
    ref = []
    for i, j in pairs:
        inter_iou = _iou_np(b1[i], b2[j:j + 1], offset)[0]
        a1 = (b1[i, 2] - b1[i, 0] + offset) * (b1[i, 3] - b1[i, 1] + offset)
        a2 = (b2[j, 2] - b2[j, 0] + offset) * (b2[j, 3] - b2[j, 1] + offset)
        inter = inter_iou * (a1 + a2) / (1 + inter_iou)
        ref.append(inter_iou if mode == 'iou' else inter / a1)
    np.testing.assert_allclose(got.numpy().reshape(-1), np.array(ref), rtol=1e-5, atol=1e-6)


def test_bad_input_names_the_op_and_the_fix():
    """At the extension's level (mmcv's wrappers assert some of it before, without a message)."""
    from mmcv import _ext as ext
    boxes, scores = torch.rand(4, 4), torch.rand(4)
    with pytest.raises(OpInputError, match=re.escape(
            'nms: boxes must have shape (*, 4) (N, 4) = (x1, y1, x2, y2), got (4, 5)')):
        ext.nms(torch.rand(4, 5), scores, 0.5)
    with pytest.raises(OpInputError, match=re.escape(
            'nms: boxes and scores must hold the same number of boxes, got 4 boxes and 3 '
            'scores')):
        ext.nms(boxes, scores[:3], 0.5)
    with pytest.raises(OpInputError, match=re.escape(
            'nms: boxes must be float16 / bfloat16 / float32 / float64, got int64')):
        ext.nms(boxes.long(), scores, 0.5)
    with pytest.raises(OpInputError, match=re.escape(
            'nms: all tensors must be on one device, got boxes on cpu, scores on meta; move '
            'them with .to(device)')):
        ext.nms(boxes, scores.to('meta'), 0.5)
    with pytest.raises(OpInputError, match=re.escape(
            'softnms: method must be 0 (naive), 1 (linear) or 2 (gaussian), got 7')):
        ext.softnms(boxes, scores, torch.empty(4, 5), 0.3, 0.5, 0.0, 7, 0)
    with pytest.raises(OpInputError, match=re.escape(
            'nms: offset must be 0 or 1 (1: legacy x2 - x1 + 1 widths), got 2')):
        ext.nms(boxes, scores, 0.5, offset=2)
