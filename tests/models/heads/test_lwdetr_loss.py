"""``LWDETRHead``'s losses against the ``rfdetr`` package's ``SetCriterion`` (IA-BCE, L1, GIoU,
Group DETR, its ``HungarianMatcher``) on one training step: the same matches per group, every
term of every decoder layer and of the proposals, and the gradients of every head parameter
(rfdetr's weights through our key map; the same projector maps and targets)."""
from typing import Dict

import pytest
import torch
from mmengine.structures import InstanceData
from rfdetr.models.criterion import SetCriterion as RefCriterion
from rfdetr.models.matcher import HungarianMatcher
from torch import Tensor

from lwdetr_reference import (CLASSES, GROUPS, build_pair, inputs, our_loss_names, random_targets,
                              rel_err, run_reference)
from vitdet_plugin.weights.lwdetr_keys import rfdetr_head_state_dict

#: RF-DETR's loss weights and matching costs (its ``ModelDefaults`` / ``TrainConfig``).
WEIGHTS = {'loss_ce': 1.0, 'loss_bbox': 5.0, 'loss_giou': 2.0}
COSTS = dict(cost_class=2.0, cost_bbox=5.0, cost_giou=2.0, focal_alpha=0.25)
#: Our names of rfdetr's loss terms, and of its layer suffixes (``_<i>`` earlier layers).
OUR_TERM = {'loss_ce': 'loss_cls', 'loss_bbox': 'loss_bbox', 'loss_giou': 'loss_iou'}
#: Issue 50's tolerance of the losses and the head's gradients (relative).
REL_TOL = 1e-5
IMG = (96, 112)
#: Parameters whose exact gradient is 0: a key bias adds one constant to a whole softmax row.
ZERO_GRAD = 'self_attn.k_proj.bias'


def _reference_losses(criterion: RefCriterion, ref_out: Dict, targets) -> Dict[str, Tensor]:
    """rfdetr's weighted losses under our names (``d{i}.`` earlier layers, ``enc_``)."""
    return our_loss_names(criterion(ref_out, targets), WEIGHTS, OUR_TERM)


#: a 3 x 3 map of 48 x 48 images: 9 tokens for 12 queries per group (RF-DETR N at its smallest
#: training scales)
FEW_TOKENS = ((3, 3), (48, 48))


@pytest.mark.parametrize('size,counts,grid,img', [('N', [3, 1], (6, 7), IMG),
                                                  ('S', [2, 4], (6, 7), IMG),
                                                  ('N', [2, 3], *FEW_TOKENS)])
def test_losses_and_gradients_match_rfdetr(size, counts, grid, img):
    pair = build_pair(size, seed=11)
    pair.ref.train()
    pair.ours.train()
    feats, metas, masks = inputs([grid], [img, img], seed=12)
    ref_targets, gts = random_targets(13, counts, img)
    criterion = RefCriterion(CLASSES, HungarianMatcher(**COSTS), WEIGHTS, focal_alpha=0.25,
                             losses=['labels', 'boxes'], group_detr=GROUPS, ia_bce_loss=True)
    criterion.train()

    ref_out = run_reference(pair, feats, masks)
    expected = _reference_losses(criterion, ref_out, ref_targets)
    outs = pair.ours(feats, metas)
    got = pair.ours.loss_by_feat(outs, gts, metas)
    layers = len(pair.ours.decoder.layers)
    assert sorted(got) == sorted(expected)
    assert len(got) == 3 * (layers + 1)
    errors = {k: rel_err(got[k], expected[k]) for k in got}
    assert max(errors.values()) <= REL_TOL, errors

    # per-group Hungarian matching: the same pairs as rfdetr's matcher (last layer)
    with torch.no_grad():
        ref_matches = criterion.matcher(
            {'pred_logits': ref_out['pred_logits'], 'pred_boxes': ref_out['pred_boxes']},
            ref_targets, group_detr=GROUPS)
        for i, (src, tgt) in enumerate(ref_matches):
            q, g = pair.ours.criterion.match_groups(outs.all_cls_scores[-1, i],
                                                    outs.all_bbox_preds[-1, i], gts[i],
                                                    metas[i], GROUPS)
            assert len(q) == GROUPS * counts[i]
            assert sorted(zip(q.tolist(), g.tolist())) == sorted(zip(src.tolist(), tgt.tolist()))

    sum(expected.values()).backward()
    sum(got.values()).backward()
    ref_grads = rfdetr_head_state_dict(
        {k: p.grad for k, p in pair.ref.named_parameters() if p.grad is not None})
    ours = dict(pair.ours.named_parameters())
    assert set(ref_grads) == {k for k, p in ours.items() if p.grad is not None}
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    grad_errors = {}
    for key, grad in ref_grads.items():
        if key.endswith(ZERO_GRAD):  # exactly 0: only rounding noise on both sides
            assert float(ours[key].grad.abs().max()) <= REL_TOL * scale
            assert float(grad.abs().max()) <= REL_TOL * scale
        else:
            grad_errors[key] = rel_err(ours[key].grad, grad)
    assert max(grad_errors.values()) <= REL_TOL, sorted(grad_errors.items(),
                                                        key=lambda kv: -kv[1])[:5]


def test_no_ground_truth_gives_only_the_classification_loss():
    """An image batch without boxes: zero box losses, IA-BCE pushing every score down."""
    pair = build_pair('N', seed=21)
    pair.ours.train()
    feats, metas, _ = inputs([(6, 6)], [(96, 96)], seed=22)
    empty = InstanceData(bboxes=torch.zeros(0, 4), labels=torch.zeros(0, dtype=torch.long))
    losses = pair.ours.loss_by_feat(pair.ours(feats, metas), [empty], metas)
    assert float(losses['loss_bbox']) == 0.0 == float(losses['enc_loss_iou'])
    probs = pair.ours(feats, metas).all_cls_scores[-1].sigmoid()
    # IA-BCE of an all-negative set: sum p^2 * -log(1 - p), divided by max(#gt * groups, 1)
    expected = (probs.pow(2) * -torch.log1p(-probs)).sum()
    assert rel_err(losses['loss_cls'], expected) <= REL_TOL
