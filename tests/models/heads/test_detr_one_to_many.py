"""One-to-many matching of the encoder's token proposals (``enc_one_to_many``): the matching
against a brute-force reference on mmdet's own match costs, and the head's dense losses."""
import re

import pytest
import torch
from mmdet.registry import TASK_UTILS
from mmdet.structures.bbox import bbox_cxcywh_to_xyxy
from mmengine.structures import InstanceData

import vitdet_plugin  # noqa: F401  (registers our modules)
from vitdet_plugin.models.heads import SdpaDETRHead
from vitdet_plugin.models.heads.set_criterion import DEFAULT_ASSIGNER, SetCriterion

NUM_CLASSES = 5
IMG = (96, 128)  # img_shape (h, w)


def _gt() -> InstanceData:
    gt = InstanceData()
    gt.bboxes = torch.tensor([[4., 6., 40., 30.], [50., 20., 120., 90.], [60., 30., 110., 80.]])
    gt.labels = torch.tensor([1, 3, 0])
    return gt


def _reference_matches(cls, boxes, gt, k, invalid):
    """Each ground truth takes its k cheapest predictions under the summed mmdet costs, a
    prediction taken twice keeps its cheapest ground truth: written as plain loops."""
    costs = [TASK_UTILS.build(c) for c in DEFAULT_ASSIGNER['match_costs']]
    h, w = IMG
    pred = InstanceData(scores=cls, bboxes=bbox_cxcywh_to_xyxy(boxes) * torch.tensor([w, h, w, h]))
    cost = sum(c(pred_instances=pred, gt_instances=gt, img_meta=dict(img_shape=IMG))
               for c in costs)
    chosen = {}
    for g in range(cost.shape[1]):
        order = sorted((float(cost[q, g]), q) for q in range(cost.shape[0]) if not invalid[q])
        for c, q in order[:k]:
            if q not in chosen or c < chosen[q][0]:
                chosen[q] = (c, g)
    qs = sorted(chosen)
    return qs, [chosen[q][1] for q in qs]


@pytest.mark.parametrize('k', [1, 3, 7])
def test_one_to_many_matching_equals_the_brute_force_reference(k):
    torch.manual_seed(k)
    n = 40
    cls = torch.randn(n, NUM_CLASSES)
    boxes = torch.cat([torch.rand(n, 2) * 0.8 + 0.1, torch.rand(n, 2) * 0.4 + 0.05], 1)
    invalid = torch.zeros(n, dtype=torch.bool)
    invalid[::5] = True
    criterion = SetCriterion(NUM_CLASSES)
    q, g = criterion.match_one_to_many(cls, boxes, _gt(), dict(img_shape=IMG), k, invalid)
    ref_q, ref_g = _reference_matches(cls, boxes, _gt(), k, invalid)
    assert q.tolist() == ref_q and g.tolist() == ref_g
    assert not invalid[q].any()
    assert all(int((g == j).sum()) <= k for j in range(3))
    if k == 1:  # three ground truths, at most one prediction each, none shared here
        assert len(q) <= 3


def test_one_to_many_without_ground_truth_matches_nothing():
    criterion = SetCriterion(NUM_CLASSES)
    empty = InstanceData(bboxes=torch.zeros(0, 4), labels=torch.zeros(0, dtype=torch.long))
    q, g = criterion.match_one_to_many(torch.randn(6, NUM_CLASSES), torch.rand(6, 4), empty,
                                       dict(img_shape=IMG), 3)
    assert q.numel() == 0 and g.numel() == 0


def _head(**kw) -> SdpaDETRHead:
    cfg = dict(num_classes=NUM_CLASSES, in_channels=(16, 32), embed_dims=32, num_heads=2,
               ffn_dims=64, num_decoder_layers=2, num_queries=10)
    cfg.update(kw)
    return SdpaDETRHead(**cfg)


def test_head_trains_every_token_proposal_one_to_many():
    torch.manual_seed(0)
    head = _head(enc_one_to_many=4).train()
    # the second image is padded: 64 x 80 inside the 96 x 128 batch
    feats = [torch.randn(2, 16, 12, 16), torch.randn(2, 32, 6, 8)]
    metas = [dict(img_shape=IMG, batch_input_shape=IMG),
             dict(img_shape=(64, 80), batch_input_shape=IMG)]
    small = InstanceData(bboxes=torch.tensor([[10., 10., 60., 50.]]), labels=torch.tensor([2]))
    gts = [_gt(), small]
    outs = head(feats, metas, gts)
    n = 12 * 16 + 6 * 8
    assert outs.dense_cls_scores.shape == (2, n, NUM_CLASSES)
    assert outs.dense_bbox_preds.shape == (2, n, 4)
    assert outs.dense_unusable[1].sum() > 0 and not outs.dense_unusable[0].any()
    assert outs.enc_cls_scores.shape == (2, 10, NUM_CLASSES)  # the selected proposals
    losses = head.loss_by_feat(outs, gts, metas)
    # the enc_ losses are the dense ones: the criterion on every token with the matches
    matches = [head.criterion.match_one_to_many(outs.dense_cls_scores[i],
                                                outs.dense_bbox_preds[i], gts[i], metas[i], 4,
                                                outs.dense_unusable[i]) for i in range(2)]
    assert sum(len(m[0]) for m in matches) > 2 * 2  # more than one token per object
    ref = head.criterion(outs.dense_cls_scores, outs.dense_bbox_preds, gts, metas, matches)
    for key in ('loss_cls', 'loss_bbox', 'loss_iou'):
        torch.testing.assert_close(losses['enc_' + key], ref[key])
    sum(losses.values()).backward()
    assert head.reg_branches[-1][-1].weight.grad.abs().sum() > 0
    head.eval()
    with torch.no_grad():
        eval_outs = head(feats, metas)
    assert eval_outs.dense_cls_scores is None  # training only


def test_enc_one_to_many_needs_two_stage():
    with pytest.raises(ValueError, match=re.escape(
            'enc_one_to_many=4 needs two_stage=True and a count >= 1 (tokens per ground truth), '
            'or None')):
        _head(enc_one_to_many=4, two_stage=False)
    with pytest.raises(ValueError, match=re.escape('enc_one_to_many=0 needs two_stage=True')):
        _head(enc_one_to_many=0)


def test_proposals_of_partly_valid_edge_tokens_are_not_pinned_to_the_border():
    """A 70 x 90 image in a 96 x 128 batch: at stride 16, token row 4 (cells 64-80 px) is valid
    (its cell starts inside the image) but centred at 72 px > 70 (y = 1.03). With zero box
    deltas a proposal is its anchor, whose centre must stay inside the image (clipped to
    ANCHOR_CENTRE_MAX), not saturate at the border."""
    torch.manual_seed(0)
    head = _head(num_queries=240).eval()  # every valid token becomes a proposal
    feats = [torch.randn(1, 16, 12, 16), torch.randn(1, 32, 6, 8)]
    metas = [dict(img_shape=(70, 90), batch_input_shape=IMG)]
    with torch.no_grad():
        fm = head.memory(feats, metas)
        outs = head(feats, metas)
    valid = ~fm.padding_mask[0]
    assert (fm.token_xy[0][valid] > 1).any()  # the case exists
    boxes = outs.enc_bbox_preds[0]  # zero-initialised deltas: the anchors themselves
    assert float(boxes[:, :2].max()) <= 0.99 + 1e-6
