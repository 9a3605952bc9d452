"""D-FINE / DEIMv2 decoder, query selection and denoising groups against transformers' tiny
``DFineForObjectDetection`` / ``Deimv2ForObjectDetection`` on the same (perturbed) weights."""
import pytest
import torch
from transformers.models.d_fine.modeling_d_fine import (
    DFineModel, get_contrastive_denoising_training_group)

from dfine_reference import (NUM_CLASSES, NUM_QUERIES, capture_decoder_inputs,
                                                our_modules, reference_model, targets)
from vitdet_plugin.models.heads.dfine_decoder import (ANCHOR_GRID_SIZE, DFineDecoder,
                                                      DFineQuerySelector,
                                                      contrastive_denoising_group, grid_anchors)

#: decoder outputs must agree with the reference to this (fp32).
ATOL = 1e-4
#: one square and one non-square input (64x96: 8x12, 4x6, 2x3 memory levels).
SIZES = [(64, 64), (64, 96)]
STYLES = ['dfine', 'deimv2']
#: DEIMv2 options off their defaults: residual + RMSNorm instead of the gate, one shared
#: distribution head, SiLU in the query position MLP.
DEIMV2_OPTIONS = dict(use_gateway=False, share_bbox_head=True, decoder_activation_function='silu')


def _close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = (ours - ref).abs().max().item()
    assert ours.shape == ref.shape and err <= ATOL, f'{what}: max error {err:.2e}'


@pytest.mark.parametrize('style,options', [
    pytest.param('dfine', {}, id='dfine'), pytest.param('deimv2', {}, id='deimv2'),
    pytest.param('deimv2', DEIMV2_OPTIONS, id='deimv2-options'),
    pytest.param('dfine', {'decoder_method': 'discrete'}, id='dfine-discrete')])
@pytest.mark.parametrize('size', SIZES)
def test_every_layer_matches_transformers_with_denoising(style, options, size):
    """Training forward with labels (denoising queries and their attention mask): every layer's
    logits, boxes and corners, and the pre-head outputs, equal the reference's."""
    ref = reference_model(style, **options).train()
    decoder, _, _ = our_modules(ref, style)
    decoder.train()
    if options is DEIMV2_OPTIONS:
        assert decoder.reg_branches[0] is decoder.reg_branches[2]
        assert decoder.layers[0].gateway is None
    seen = capture_decoder_inputs(ref)
    torch.manual_seed(3)
    out = ref(torch.randn(2, 3, *size), labels=targets())
    assert seen['encoder_attention_mask'] is not None
    ours = decoder(seen['inputs_embeds'], seen['reference_points'],
                   seen['encoder_hidden_states'], seen['spatial_shapes_list'],
                   seen['encoder_attention_mask'])
    _close(ours.pre_logits, out.intermediate_logits[:, 0], 'pre logits')
    _close(ours.pre_boxes, out.intermediate_reference_points[:, 0], 'pre boxes')
    for i in range(ours.logits.shape[0]):
        _close(ours.logits[i], out.intermediate_logits[:, i + 1], f'layer {i} logits')
        _close(ours.boxes[i], out.intermediate_reference_points[:, i + 1], f'layer {i} boxes')
        _close(ours.corners[i], out.intermediate_predicted_corners[:, i], f'layer {i} corners')
        _close(ours.initial_boxes, out.initial_reference_points[:, i], 'initial boxes')


@pytest.mark.parametrize('style', STYLES)
@pytest.mark.parametrize('size', SIZES)
def test_selection_and_inference_match_transformers(style, size):
    """Eval: our selector on the reference's memory picks the same queries and anchors, and our
    decoder's final logits / boxes equal the reference model's."""
    ref = reference_model(style).eval()
    decoder, selector, _ = our_modules(ref, style)
    decoder.eval()
    seen = capture_decoder_inputs(ref)
    torch.manual_seed(4)
    with torch.no_grad():
        out = ref(torch.randn(2, 3, *size))
        picked = selector(seen['encoder_hidden_states'], seen['spatial_shapes_list'])
        ours = decoder(picked.query, picked.ref_logits, seen['encoder_hidden_states'],
                       seen['spatial_shapes_list'])
    _close(picked.enc_logits, out.enc_outputs_class, 'encoder logits')
    _close(picked.enc_coord_logits, out.enc_outputs_coord_logits, 'encoder boxes')
    _close(picked.topk_logits, out.enc_topk_logits, 'top-k logits')
    _close(picked.topk_boxes, out.enc_topk_bboxes, 'top-k boxes')
    _close(picked.ref_logits, out.init_reference_points, 'initial references')
    _close(picked.query, seen['inputs_embeds'], 'initial queries')
    assert ours.logits.shape[0] == 1
    _close(ours.logits[0], out.logits, 'logits')
    _close(ours.boxes[0], out.pred_boxes, 'boxes')


def test_anchors_and_valid_mask_match_transformers():
    """Levels with cells at the border (a 100-row map) and anchors larger than the image
    (level 5) are invalid; the rest are inverse-sigmoid cell centres and sizes."""
    shapes = ((100, 3), (4, 6), (2, 3), (1, 2), (1, 1), (1, 1))
    ref_anchors, ref_valid = DFineModel._cached_generate_anchors(shapes, ANCHOR_GRID_SIZE)
    anchors, valid = grid_anchors(shapes, ANCHOR_GRID_SIZE, torch.device('cpu'), torch.float32)
    assert torch.equal(valid, ref_valid) and not valid.all() and valid.any()
    assert torch.allclose(anchors, ref_anchors, atol=1e-6)


def test_denoising_group_matches_transformers_for_the_same_seed():
    ref = reference_model('dfine')
    _, _, embed = our_modules(ref, 'dfine')
    labels = targets()
    torch.manual_seed(5)
    query, box, mask, meta = get_contrastive_denoising_training_group(
        labels, NUM_CLASSES, NUM_QUERIES, embed, num_denoising_queries=8)
    torch.manual_seed(5)
    ours = contrastive_denoising_group([t['class_labels'] for t in labels],
                                       [t['boxes'] for t in labels], NUM_CLASSES, NUM_QUERIES,
                                       embed, num_denoising=8)
    assert ours is not None
    assert torch.equal(ours.query, query) and torch.equal(ours.ref_logits, box)
    assert torch.equal(ours.attn_mask, mask)
    assert ours.num_groups == meta['dn_num_group']
    assert [ours.num_denoising, NUM_QUERIES] == meta['dn_num_split']
    for a, b in zip(ours.positive_idx, meta['dn_positive_idx']):
        assert torch.equal(a, b)
    assert contrastive_denoising_group([torch.zeros(0, dtype=torch.long)], [torch.zeros(0, 4)],
                                       NUM_CLASSES, NUM_QUERIES, embed) is None


def test_eval_idx_returns_that_layer_and_stops_there():
    """``eval_idx=1``: inference returns layer 1's predictions, the ones training computes for
    layer 1 (nothing after it runs)."""
    torch.manual_seed(0)
    decoder = DFineDecoder(NUM_CLASSES, 32, 2, 64, 3, [2, 2], eval_idx=1)
    memory, shapes = torch.randn(1, 20, 32), [(4, 4), (2, 2)]
    query, ref = torch.randn(1, 6, 32), torch.randn(1, 6, 4)
    with torch.no_grad():
        train = decoder.train()(query, ref, memory, shapes)
        infer = decoder.eval()(query, ref, memory, shapes)
    assert train.logits.shape[0] == 3 and infer.logits.shape[0] == 1
    assert torch.allclose(infer.logits[0], train.logits[1], atol=1e-6)
    assert torch.allclose(infer.boxes[0], train.boxes[1], atol=1e-6)


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match=r'layer_scale=2\.0: wider layers after eval_idx are not '
                                         r'implemented; use layer_scale=1\.0'):
        DFineDecoder(NUM_CLASSES, layer_scale=2.0)
    with pytest.raises(ValueError, match=r'eval_idx=6 is outside the 6 decoder layers; use -1 '
                                         r'\(the last\) or 0..5'):
        DFineDecoder(NUM_CLASSES, eval_idx=6)
    with pytest.raises(ValueError, match="style='rtdetr' is not one of"):
        DFineDecoder(NUM_CLASSES, style='rtdetr')
    with pytest.raises(ValueError, match="use_gateway=False exists only in DEIMv2's layer"):
        DFineDecoder(NUM_CLASSES, use_gateway=False)
    with pytest.raises(ValueError, match="sampling='nearest' is not one of"):
        DFineDecoder(NUM_CLASSES, sampling='nearest')


def test_selection_without_enc_output_scores_the_memory_as_it_is():
    """``enc_output=False`` (official DEIMv2): no parameters there; the top-k of the score head
    on the valid-masked memory, boxes from the box MLP on those tokens plus their anchors, the
    queries those tokens (DEIMv2's ``_get_decoder_input``, written out here)."""
    torch.manual_seed(0)
    selector = DFineQuerySelector(NUM_CLASSES, NUM_QUERIES, 32, enc_output=False,
                                  mlp_act='silu')
    assert not any(n.startswith('enc_output') for n, _ in selector.named_parameters())
    shapes = [(4, 6), (2, 3)]
    memory = torch.randn(2, 30, 32)
    out = selector(memory, shapes)
    anchors, valid = grid_anchors(shapes, ANCHOR_GRID_SIZE, memory.device, memory.dtype)
    masked = valid * memory
    logits = selector.enc_score_head(masked)
    index = logits.max(-1).values.topk(NUM_QUERIES, dim=1).indices
    picked = torch.stack([masked[b, index[b]] for b in range(2)])
    layers = selector.enc_bbox_head.layers
    hidden = torch.nn.functional.silu(layers[1](torch.nn.functional.silu(layers[0](picked))))
    boxes = layers[2](hidden) + torch.stack([anchors[0, index[b]] for b in range(2)])
    assert torch.equal(out.query, picked)
    torch.testing.assert_close(out.ref_logits, boxes)
    torch.testing.assert_close(out.topk_logits,
                               torch.stack([logits[b, index[b]] for b in range(2)]))


def test_mlp_act_sets_every_box_mlp_and_quality_estimator():
    decoder = DFineDecoder(NUM_CLASSES, 32, 4, 64, 2, (2, 2), style='deimv2', mlp_act='silu')
    mlps = [decoder.pre_bbox_head, *decoder.reg_branches,
            *(q.reg_conf for q in decoder.lqe_layers)]
    assert all(isinstance(m.act, torch.nn.SiLU) for m in mlps)
    assert all(isinstance(m.act, torch.nn.ReLU) for m in
               DFineDecoder(NUM_CLASSES, 32, 4, 64, 2, (2, 2), style='deimv2').reg_branches)
