"""``LWDETRHead`` against the ``rfdetr`` package's LW-DETR (its ``Transformer`` and heads) with
the same weights (rfdetr's state dict through our key map) on the same projector maps: the same
two-stage proposals (top-k token indices), per-layer ``pred_logits`` / ``pred_boxes`` and
post-processed detections, for RF-DETR N's and S's decoder depths (shrunk widths), two map
sizes, padded batches, several levels, test (1 group) and training (Group DETR) modes."""
import pytest
import torch
from rfdetr.models.postprocess import PostProcess

from lwdetr_reference import (CLASSES, FFN, GROUPS, QUERIES, WIDTH, abs_err, build_pair, inputs,
                              loss_and_predict, random_targets, rel_err, run_reference,
                              tiny_batch, tiny_detector)
from vitdet_plugin.models.heads.detr_memory import flatten_levels, image_sizes
from vitdet_plugin.models.heads.lwdetr_head import LWDETRHead
from vitdet_plugin.weights.lwdetr_keys import rfdetr_head_key, rfdetr_head_state_dict

#: Issue 50's tolerance of ``pred_logits`` / ``pred_boxes`` (absolute).
TOL = 1e-4
#: Two map sizes of the P4 level (RF-DETR N 384 px: 24 x 24; here shrunk), one padded batch
#: (image 2 smaller than the batch), one with a rectangular map.
CASES = [((6, 6), [(96, 96), (96, 96)]), ((5, 8), [(80, 128), (64, 96)])]


#: Largest gradient difference from rfdetr's, relative to its largest value.
GRAD_TOL = 1e-4

#: Largest logit difference of the bf16 head from the fp32 one (bf16 keeps 8 bits).
BF16_TOL = 0.05


def _memory(feats, metas):
    """The head's memory of ``feats`` for images described by ``metas``."""
    img_hw, batch_shape = image_sizes(metas, len(metas), feats[0].device)
    return flatten_levels(feats, img_hw, batch_shape)


def _compare(ours, ref, layers):
    """Every layer's logits / boxes and the proposals' against rfdetr's output dict."""
    expected_cls = [a['pred_logits'] for a in ref['aux_outputs']] + [ref['pred_logits']]
    expected_box = [a['pred_boxes'] for a in ref['aux_outputs']] + [ref['pred_boxes']]
    assert ours.all_cls_scores.shape[0] == layers == len(expected_cls)
    errors = []
    for i in range(layers):
        assert ours.all_cls_scores[i].shape == expected_cls[i].shape
        errors.append(abs_err(ours.all_cls_scores[i], expected_cls[i]))
        errors.append(abs_err(ours.all_bbox_preds[i], expected_box[i]))
    errors.append(abs_err(ours.enc_cls_scores, ref['enc_outputs']['pred_logits']))
    errors.append(abs_err(ours.enc_bbox_preds, ref['enc_outputs']['pred_boxes']))
    assert max(errors) <= TOL, errors


@pytest.mark.parametrize('size', ['N', 'S'])
@pytest.mark.parametrize('shape,img_shapes', CASES)
def test_head_matches_rfdetr_at_test(size, shape, img_shapes):
    pair = build_pair(size)
    pair.ref.eval()
    pair.ours.eval()
    feats, metas, masks = inputs([shape], img_shapes)
    captured = []
    hook = pair.ref.transformer.enc_out_class_embed[0].register_forward_hook(
        lambda module, args, out: captured.append(out))
    with torch.no_grad():
        ref = run_reference(pair, feats, masks)
        ours = pair.ours(feats, metas)
        top = pair.ours.proposals(_memory(feats, metas), 1).token_inds
    hook.remove()
    # rfdetr's proposals: the top QUERIES tokens by the best class logit of its group-0 head
    expected_top = captured[0].max(-1).values.topk(QUERIES, dim=1).indices
    assert torch.equal(top, expected_top)
    layers = len(pair.ours.decoder.layers)
    assert ours.all_cls_scores.shape == (layers, len(img_shapes), QUERIES, CLASSES)
    _compare(ours, ref, layers)


def test_head_matches_rfdetr_in_training_with_groups():
    """Group DETR: GROUPS query sets, their own proposals, self-attention within each."""
    pair = build_pair('N', seed=3)
    pair.ref.train()
    pair.ours.train()
    feats, metas, masks = inputs([(6, 7)], [(96, 112), (80, 96)], seed=4)
    with torch.no_grad():
        ref = run_reference(pair, feats, masks)
        ours = pair.ours(feats, metas)
    assert ours.all_cls_scores.shape == (2, 2, GROUPS * QUERIES, CLASSES)
    assert ours.enc_bbox_preds.shape == (2, GROUPS * QUERIES, 4)
    _compare(ours, ref, 2)


def test_grouped_self_attention_gradients_match_rfdetr():
    """Group DETR's self-attention (the groups folded into the batch, SDPA's kernel) passes
    rfdetr's gradients (its ``nn.MultiheadAttention``) back to every decoder layer's
    projections."""
    pair = build_pair('N', seed=3)
    pair.ref.train()
    pair.ours.train()
    feats, metas, masks = inputs([(6, 7)], [(96, 112), (80, 96)], seed=4)
    ref = run_reference(pair, feats, masks)
    ours = pair.ours(feats, metas)
    gen = torch.Generator().manual_seed(5)
    weights = torch.randn(ours.all_cls_scores[-1].shape, generator=gen)
    (ref['pred_logits'] * weights).sum().backward()
    (ours.all_cls_scores[-1] * weights).sum().backward()
    theirs = pair.ref.transformer.decoder.layers
    for i, layer in enumerate(pair.ours.decoder.layers):
        attn = layer.self_attn
        ours_in = torch.cat([attn.q_proj.weight.grad, attn.k_proj.weight.grad,
                             attn.v_proj.weight.grad])
        expected = theirs[i].self_attn.in_proj_weight.grad
        assert rel_err(ours_in, expected) < GRAD_TOL, i
        assert rel_err(attn.out_proj.weight.grad,
                       theirs[i].self_attn.out_proj.weight.grad) < GRAD_TOL, i


def test_head_matches_rfdetr_on_two_levels():
    """P4 + P5 memory: deformable attention over two levels, proposals on both."""
    pair = build_pair('S', num_levels=2, seed=5)
    pair.ref.eval()
    pair.ours.eval()
    feats, metas, masks = inputs([(6, 6), (3, 3)], [(96, 96), (64, 80)], seed=6)
    with torch.no_grad():
        ref = run_reference(pair, feats, masks)
        ours = pair.ours(feats, metas)
    _compare(ours, ref, 3)


@pytest.mark.parametrize('training', [False, True])
def test_fewer_tokens_than_queries_follow_rfdetr(training):
    """A 3 x 3 map (9 tokens) for 12 queries (RF-DETR N at its 224 / 256 px training scales):
    every token a proposal, the remaining queries on their learned reference boxes, as
    rfdetr's ``Transformer``; in training with Group DETR too."""
    pair = build_pair('N', seed=11)
    pair.ref.train(training)
    pair.ours.train(training)
    feats, metas, masks = inputs([(3, 3)], [(48, 48), (40, 48)], seed=12)
    with torch.no_grad():
        ref = run_reference(pair, feats, masks)
        ours = pair.ours(feats, metas)
    groups = GROUPS if training else 1
    assert ours.all_cls_scores.shape == (2, 2, groups * QUERIES, CLASSES)
    assert ours.enc_cls_scores.shape == (2, groups * 9, CLASSES)
    _compare(ours, ref, 2)


def test_predict_matches_rfdetr_postprocess():
    """Top-k over queries x classes, no NMS: rfdetr's ``PostProcess`` on its outputs gives our
    ``predict_by_feat`` (boxes in the image frame, clipped)."""
    pair = build_pair('N', seed=7)
    pair.ref.eval()
    pair.ours.eval()
    num_select = 20
    pair.ours.test_cfg = dict(max_per_img=num_select)
    feats, metas, masks = inputs([(6, 6)], [(96, 96), (96, 96)], seed=8)
    with torch.no_grad():
        ref = run_reference(pair, feats, masks)
        expected = PostProcess(num_select=num_select)(
            ref, torch.tensor([[96, 96], [96, 96]]))
        got = pair.ours.predict_by_feat(pair.ours(feats, metas), metas, rescale=False)
    for g, e in zip(got, expected):
        assert torch.equal(g.labels, e['labels'])
        assert abs_err(g.scores, e['scores']) <= TOL
        assert abs_err(g.bboxes, e['boxes']) <= 1e-3 * 96
        assert len(g.bboxes) == num_select


def test_head_bad_inputs():
    head = LWDETRHead(num_classes=CLASSES, embed_dims=WIDTH, num_queries=QUERIES,
                      num_groups=1, num_decoder_layers=1, cross_heads=4, self_heads=2,
                      ffn_dims=32)
    head.eval()
    with pytest.raises(ValueError, match=r'expects 1 maps of 32 channels'):
        head([torch.zeros(1, WIDTH + 1, 4, 4)])
    with pytest.raises(KeyError, match=r"'transformer.encoder.x' is not a key of an RF-DETR"):
        rfdetr_head_key('transformer.encoder.x')
    with pytest.raises(ValueError, match=r'RF-DETR keypoint models are not supported'):
        rfdetr_head_state_dict({'_kp_active_mask': torch.ones(2, 3, dtype=torch.bool)})


def test_mmdet_single_stage_detector_trains_and_predicts():
    """mmdet's ``SingleStageDetector`` with a tiny ViT's taps, ``RFDETRProjector`` and
    ``LWDETRHead``: a loss step (every term finite, gradients reach the backbone) and
    ``predict`` (``max_per_img`` detections in the original image frame)."""
    detector = tiny_detector(dict(
        type='LWDETRHead', num_classes=CLASSES, embed_dims=WIDTH, num_queries=QUERIES,
        num_groups=GROUPS, num_decoder_layers=2, self_heads=2, cross_heads=4, ffn_dims=64))
    losses, results = loss_and_predict(detector, tiny_batch(detector))
    assert len(losses) == 9
    for result in results:
        pred = result.pred_instances
        assert pred.bboxes.shape == (7, 4) and pred.labels.max() < CLASSES
        h, w = result.ori_shape
        assert float(pred.bboxes[:, 2].max()) <= w and float(pred.bboxes[:, 3].max()) <= h


def test_dense_one_to_many_adds_a_loss_on_every_usable_token():
    """``dense_one_to_many`` (not RF-DETR's) leaves RF-DETR's losses as they are and adds
    ``enc_dense_`` terms whose gradient reaches every usable memory token, where the two-stage
    loss reaches only the top-k tokens; padded tokens get none."""
    feats, metas, _ = inputs([(6, 6)], [(96, 96), (64, 80)])  # image 2 padded: 4 x 5 tokens
    _, gts = random_targets(3, [3, 2], (64, 80))
    plain = LWDETRHead(num_classes=CLASSES, embed_dims=WIDTH, num_queries=QUERIES,
                       num_groups=GROUPS, num_decoder_layers=2, self_heads=2, cross_heads=4,
                       ffn_dims=FFN)
    dense = LWDETRHead(num_classes=CLASSES, embed_dims=WIDTH, num_queries=QUERIES,
                       num_groups=GROUPS, num_decoder_layers=2, self_heads=2, cross_heads=4,
                       ffn_dims=FFN, dense_one_to_many=2)
    dense.load_state_dict(plain.state_dict())
    x = feats[0].requires_grad_()
    base = plain.loss_by_feat(plain([x], metas), gts, metas)
    losses = dense.loss_by_feat(dense([x], metas), gts, metas)
    assert set(losses) - set(base) == {'enc_dense_loss_cls', 'enc_dense_loss_bbox',
                                       'enc_dense_loss_iou'}
    for name, value in base.items():
        assert torch.equal(losses[name], value), name
    top_k, = torch.autograd.grad(losses['enc_loss_cls'], x, retain_graph=True)
    every, = torch.autograd.grad(losses['enc_dense_loss_cls'], x)
    reached = every.abs().sum(1) > 0                                          # (B, 6, 6)
    usable = torch.zeros(2, 6, 6, dtype=torch.bool)
    usable[0] = True  # every anchor (cell centre, side 0.05) inside (0.01, 0.99) ...
    usable[1, :4, :5] = True  # ... and image 2's 4 x 5 valid tokens, not the padding
    assert torch.equal(reached, usable)
    selected = torch.zeros(2, 36, dtype=torch.bool)
    with torch.no_grad():
        selected.scatter_(1, plain.proposals(_memory([x], metas), GROUPS).token_inds, True)
    selected &= usable.flatten(1)  # a selected padded token's memory is zeroed (RF-DETR's)
    assert torch.equal(top_k.abs().sum(1).flatten(1) > 0, selected)
    assert int(selected.sum()) < int(usable.sum())
    with pytest.raises(ValueError, match=r'dense_one_to_many must be >= 1 \(tokens per ground'):
        LWDETRHead(num_classes=CLASSES, embed_dims=WIDTH, dense_one_to_many=0)


def test_bf16_parameters_without_autocast_run_as_fp32():
    """FSDP2's bf16 ``MixedPrecisionPolicy`` casts the parameters and inputs, no autocast: the
    decoder's reference-point encoding (fp32 boxes) must meet ``ref_point_head`` in its dtype
    and deformable attention sample at fp32 positions. The bf16 head trains (loss, gradients)
    and predicts what the fp32 head does within bf16 rounding, but for the queries whose
    proposal changed (near-tied tokens ranked the other way)."""
    pair = build_pair('N', seed=7)
    head = pair.ours.eval()
    feats, metas, _ = inputs([(6, 7)], [(96, 112), (80, 96)], seed=8)
    with torch.no_grad():
        reference = head(feats, metas)
        low = head.to(torch.bfloat16)([f.bfloat16() for f in feats], metas)
    assert low.all_cls_scores.dtype == torch.bfloat16
    close = (low.all_cls_scores.float() - reference.all_cls_scores).abs() < BF16_TOL
    assert close.float().mean() > 0.8, close.float().mean()
    head.train()
    _, gts = random_targets(9, [2, 1], (96, 112))
    losses = head.loss_by_feat(head([f.bfloat16() for f in feats], metas), gts, metas)
    sum(losses.values()).backward()
    assert all(torch.isfinite(v) for v in losses.values())
    assert head.decoder.ref_point_head.fc1.weight.grad.dtype == torch.bfloat16
