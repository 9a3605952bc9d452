"""``LWDETRSegHead`` against the ``rfdetr`` package's RF-DETR-Seg parts: its ``LWDETR`` with its
``SegmentationHead`` (shrunk, seeded random weights loaded into ours through the key maps), its
``PostProcess``, and its ``SetCriterion`` / ``HungarianMatcher`` with the mask losses and costs.

Both sides draw random points (matching and PointRend's loss points) from ``torch.rand``, in
different orders (rfdetr matches every layer before the losses; we match and weigh one layer
at a time): the training test records rfdetr's draws and hands ours the same ones per layer.
"""
from typing import Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from mmdet.registry import MODELS
from mmengine.structures import InstanceData
from rfdetr.models.criterion import SetCriterion as RefCriterion
from rfdetr.models.heads.segmentation import SegmentationHead
from rfdetr.models.lwdetr import LWDETR
from rfdetr.models.matcher import HungarianMatcher
from rfdetr.models.postprocess import PostProcess
from rfdetr.models.transformer import Transformer
from torch import Tensor

from lwdetr_reference import (CLASSES, CROSS_HEADS, FFN, GROUPS, POINTS, QUERIES, SELF_HEADS,
                              STRIDE, WIDTH, StubBackbone, _randomize, abs_err, inputs,
                              loss_and_predict, our_loss_names, random_targets, rel_err,
                              tiny_batch, tiny_detector)
from vitdet_plugin.weights.lwdetr_keys import rfdetr_head_state_dict
from vitdet_plugin.models.heads.lwdetr_seg_head import LWDETRSegHead, masks_to_image
from vitdet_plugin.weights.lwdetr_seg_keys import split_mask_branch
from vitdet_plugin.models.heads.lwdetr_seg_loss import gt_mask_tensor

#: RF-DETR-Seg N's and S's decoder depth.
LAYERS = 4
#: Issue 50's tolerances: mask logits (abs), losses and head gradients (relative).
LOGIT_TOL = 1e-4
REL_TOL = 1e-5
#: A resized mask pixel may differ only where rfdetr's resized logit is this close to 0 (our
#: one bilinear grid sample vs its interpolate: the same weights, rounded differently).
BOUNDARY_LOGIT = 1e-4
#: Scale of the random query projection of the mask branch: mask logits of about +-20.
MASK_QUERY_SCALE = 0.1
#: Projector map (P4) and the unpadded images it covers; original images (``rescale``).
MAP = (6, 7)
IMG = (MAP[0] * STRIDE, MAP[1] * STRIDE)
ORI = [(120, 150), (70, 80)]
#: RF-DETR-Seg's loss weights and matching costs (``SegmentationTrainConfig``).
WEIGHTS = {'loss_ce': 1.0, 'loss_bbox': 5.0, 'loss_giou': 2.0, 'loss_mask_ce': 5.0,
           'loss_mask_dice': 5.0}
OUR_TERM = {'loss_ce': 'loss_cls', 'loss_bbox': 'loss_bbox', 'loss_giou': 'loss_iou',
            'loss_mask_ce': 'loss_mask', 'loss_mask_dice': 'loss_dice'}
ZERO_GRAD = 'self_attn.k_proj.bias'


def build_seg_pair(seed: int) -> Tuple[LWDETR, StubBackbone, LWDETRSegHead]:
    """rfdetr's LWDETR with its SegmentationHead (shrunk) and our head with its weights."""
    transformer = Transformer(
        d_model=WIDTH, sa_nhead=SELF_HEADS, ca_nhead=CROSS_HEADS, num_queries=QUERIES,
        num_decoder_layers=LAYERS, dim_feedforward=FFN, dropout=0.0,
        return_intermediate_dec=True, group_detr=GROUPS, two_stage=True,
        num_feature_levels=1, dec_n_points=POINTS, lite_refpoint_refine=True,
        decoder_norm_type='LN', bbox_reparam=True)
    stub = StubBackbone()
    ref = LWDETR(stub, transformer, SegmentationHead(WIDTH, LAYERS, downsample_ratio=4),
                 num_classes=CLASSES, num_queries=QUERIES, aux_loss=True, group_detr=GROUPS,
                 two_stage=True, lite_refpoint_refine=True, bbox_reparam=True)
    _randomize(ref, seed)
    with torch.no_grad():  # mask logits of a trained model's scale (tens), not hundreds
        ref.segmentation_head.query_features_proj.weight.mul_(MASK_QUERY_SCALE)
    ours = MODELS.build(dict(
        type='LWDETRSegHead', num_classes=CLASSES, embed_dims=WIDTH, num_queries=QUERIES,
        num_groups=GROUPS, num_decoder_layers=LAYERS, self_heads=SELF_HEADS,
        cross_heads=CROSS_HEADS, num_points=POINTS, ffn_dims=FFN,
        test_cfg=dict(max_per_img=QUERIES)))
    ours.load_state_dict(our_state_dict(ref.state_dict()), strict=True)
    return ref, stub, ours


def our_state_dict(state: Dict[str, Tensor]) -> Dict[str, Tensor]:
    rest, branch = split_mask_branch(state)
    return {**rfdetr_head_state_dict(rest), **branch}


def run_reference(ref: LWDETR, stub: StubBackbone, feats: List[Tensor],
                  masks: List[Tensor]) -> Dict:
    stub.feats, stub.masks = feats, masks
    return ref(torch.zeros(feats[0].shape[0], 3, *IMG))


def test_mask_logits_and_predictions_match_rfdetr():
    ref, stub, ours = build_seg_pair(seed=3)
    ref.eval()
    ours.eval()
    feats, metas, pad_masks = inputs([MAP], [IMG, IMG], seed=4)
    for meta, ori in zip(metas, ORI):
        meta.update(ori_shape=ori, scale_factor=(IMG[1] / ori[1], IMG[0] / ori[0]))
    with torch.no_grad():
        expected = run_reference(ref, stub, feats, pad_masks)
        outs = ours(feats, metas)
        layers = [*expected['aux_outputs'], expected]
        assert len(layers) == LAYERS
        for i, layer in enumerate(layers):
            assert abs_err(outs.masks.logits(i), layer['pred_masks']) <= LOGIT_TOL
        got = ours.predict_by_feat(outs, metas, rescale=True)
        post = PostProcess(num_select=QUERIES)(expected, torch.tensor(ORI))
    # rfdetr's chosen queries and their masks' resized logits, to see where masks may differ
    probs = expected['pred_logits'].sigmoid().flatten(1)
    order = probs.argsort(dim=1, descending=True, stable=True)
    chosen = order[:, :QUERIES] // CLASSES
    for i, (res, exp, ori) in enumerate(zip(got, post, ORI)):
        assert torch.equal(res.labels, exp['labels'])
        assert float((res.scores - exp['scores']).abs().max()) <= 1e-4
        assert float((res.bboxes - exp['boxes']).abs().max()) <= 1e-3 * max(ori)
        exp_masks = exp['masks'][:, 0]
        assert res.masks.dtype == torch.bool and res.masks.shape == exp_masks.shape
        resized = F.interpolate(expected['pred_masks'][i, chosen[i], None], size=ori,
                                mode='bilinear', align_corners=False)[:, 0]
        assert torch.equal(resized > 0, exp_masks)
        differ = res.masks != exp_masks
        assert bool((resized[differ].abs() <= BOUNDARY_LOGIT).all()), int(differ.sum())


def test_masks_to_image_crops_the_padding_and_rescales():
    """A padded image's mask: only the image's part of the batch, resized to the original."""
    inside = torch.zeros(24, 28, dtype=torch.bool)
    inside[:12, :14] = True                       # the image: the top-left quarter of the batch
    # mask 0: +3 on the image, -1 on the padding; mask 1: the opposite signs
    logits = torch.stack((torch.where(inside, 3.0, -1.0), torch.where(inside, -3.0, 1.0)))
    meta = dict(batch_input_shape=(96, 112), img_shape=(48, 56), ori_shape=(24, 28))
    full = masks_to_image(logits, meta, rescale=False)
    assert full.shape == (2, 48, 56) and bool(full[0].all()) and not bool(full[1].any())
    small = masks_to_image(logits, meta, rescale=True)
    assert small.shape == (2, 24, 28) and bool(small[0].all()) and not bool(small[1].any())


class RandReplay:
    """``torch.rand`` recording rfdetr's draws, then serving them to ours in our order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.real = torch.rand
        self.drawn: List[Tensor] = []
        self.queue: List[Tensor] = []
        monkeypatch.setattr(torch, 'rand', self)

    def __call__(self, *size, **kwargs) -> Tensor:
        if self.queue:
            value = self.queue.pop(0)
            assert tuple(value.shape) == tuple(size), (value.shape, size)
            return value
        value = self.real(*size, **kwargs)
        self.drawn.append(value)
        return value

    def reorder(self, layers: int) -> None:
        """For each loss computation recorded (``3 (layers + 1)`` draws): rfdetr draws the
        matcher's of layers [last, aux 0.., enc], then two loss draws per layer in that order;
        ours per layer [aux 0.., last, enc]: matcher, then the loss draws."""
        per_loss = 3 * (layers + 1)
        assert self.drawn and len(self.drawn) % per_loss == 0, (len(self.drawn), per_loss)
        order = [*range(1, layers), 0, layers]
        self.queue = []
        for start in range(0, len(self.drawn), per_loss):
            match = self.drawn[start:start + layers + 1]
            losses = self.drawn[start + layers + 1:start + per_loss]
            self.queue += [d for pos in order for d in (match[pos], *losses[2 * pos:2 * pos + 2])]
        self.drawn = []


def _reference_losses(criterion: RefCriterion, ref_out: Dict, targets) -> Dict[str, Tensor]:
    return our_loss_names(criterion(ref_out, targets), WEIGHTS, OUR_TERM)


@pytest.mark.parametrize('counts', [[3, 1], [2, 0]])
def test_losses_and_gradients_match_rfdetr(counts, monkeypatch):
    ref, stub, ours = build_seg_pair(seed=11)
    ref.train()
    ours.train()
    feats, metas, pad_masks = inputs([MAP], [IMG, IMG], seed=12)
    ref_targets, gts = random_targets(13, counts, IMG, with_masks=True)
    matcher = HungarianMatcher(cost_class=2.0, cost_bbox=5.0, cost_giou=2.0, focal_alpha=0.25,
                               mask_point_sample_ratio=16, cost_mask_ce=5.0, cost_mask_dice=5.0)
    criterion = RefCriterion(CLASSES, matcher, WEIGHTS, focal_alpha=0.25,
                             losses=['labels', 'boxes', 'masks'], group_detr=GROUPS,
                             ia_bce_loss=True, mask_point_sample_ratio=16)
    criterion.train()

    ref_out = run_reference(ref, stub, feats, pad_masks)
    outs = ours(feats, metas)
    rand = RandReplay(monkeypatch)
    expected = _reference_losses(criterion, ref_out, ref_targets)
    rand.reorder(LAYERS)
    got = ours.loss_by_feat(outs, gts, metas)
    assert not rand.queue
    assert sorted(got) == sorted(expected)
    assert len(got) == 5 * (LAYERS + 1)
    errors = {k: rel_err(got[k], expected[k]) for k in got}
    assert max(errors.values()) <= REL_TOL, errors

    sum(expected.values()).backward()
    sum(got.values()).backward()
    ref_grads = our_state_dict(
        {k: p.grad for k, p in ref.named_parameters() if p.grad is not None})
    params = dict(ours.named_parameters())
    assert set(ref_grads) == {k for k, p in params.items() if p.grad is not None}
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    grad_errors = {}
    for key, grad in ref_grads.items():
        if key.endswith(ZERO_GRAD):
            assert float(params[key].grad.abs().max()) <= REL_TOL * scale
        else:
            grad_errors[key] = rel_err(params[key].grad, grad)
    assert max(grad_errors.values()) <= REL_TOL, sorted(grad_errors.items(),
                                                        key=lambda kv: -kv[1])[:5]


def test_mmdet_single_stage_detector_trains_and_predicts_masks():
    """mmdet's ``SingleStageDetector`` (tiny ViT, ``RFDETRProjector``, ``LWDETRSegHead``) on a
    padded batch with ``BitmapMasks`` in the image frame: a loss step with the mask terms of
    every layer and ``predict`` (bool masks in the original image). ``dense_one_to_many`` (box
    proposals of every token) is refused: the seg matching weighs masks."""
    head = dict(type='LWDETRSegHead', num_classes=CLASSES, embed_dims=WIDTH, num_queries=QUERIES,
                num_groups=GROUPS, num_decoder_layers=2, self_heads=2, cross_heads=4, ffn_dims=64)
    with pytest.raises(ValueError, match=r'LWDETRSegHead does not take dense_one_to_many: its '):
        tiny_detector(dict(head, dense_one_to_many=2))
    detector = tiny_detector(head)
    losses, results = loss_and_predict(detector, tiny_batch(detector, with_masks=True))
    assert len(losses) == 5 * 3 and {'loss_mask', 'enc_loss_dice', 'd0.loss_mask'} <= set(losses)
    for result in results:
        pred = result.pred_instances
        assert pred.masks.dtype == torch.bool and pred.masks.shape == (7, *result.ori_shape)
        assert 'query_inds' not in pred


def test_bad_inputs():
    _, _, ours = build_seg_pair(seed=5)
    feats, metas, _ = inputs([MAP], [IMG], seed=6)
    with pytest.raises(ValueError, match=r'LWDETRSegHead needs the image metas '
                                         r'\(batch_input_shape sets the mask resolution\)'):
        ours(feats)
    with pytest.raises(ValueError, match=r'MaskGroupSetCriterion needs the mask embeddings'):
        ours.criterion(torch.zeros(1, QUERIES, CLASSES), torch.rand(1, QUERIES, 4), [], metas)
    big = InstanceData(bboxes=torch.zeros(1, 4), labels=torch.zeros(1, dtype=torch.long),
                       masks=torch.zeros(1, IMG[0] + 1, IMG[1], dtype=torch.bool))
    with pytest.raises(ValueError, match=r'ground-truth masks of 97x112 exceed the batch input '
                                         r'96x112'):
        gt_mask_tensor(big, metas[0], torch.zeros(1))
    with pytest.raises(KeyError, match=r"'segmentation_head.blocks.0.gamma' is not a key of "
                                       r"RF-DETR-Seg's segmentation head"):
        split_mask_branch({'segmentation_head.blocks.0.gamma': torch.zeros(1)})
