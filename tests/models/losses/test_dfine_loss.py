"""D-FINE / DEIMv2 losses against transformers' ``DFineForObjectDetectionLoss`` /
``Deimv2ForObjectDetectionLoss`` on one training step's outputs of the tiny reference models
(denoising included): every term of every set, and the gradients w.r.t. the predictions."""
from typing import Dict, List, Tuple

import pytest
import torch
from torch import Tensor
from transformers.loss.loss_d_fine import DFineForObjectDetectionLoss
from transformers.loss.loss_deimv2 import Deimv2ForObjectDetectionLoss

from dfine_reference import NUM_CLASSES, reference_model, targets
from vitdet_plugin.models.heads.dfine_decoder import (DFineDecoder, DFineQuerySelector,
                                                      contrastive_denoising_group)
from vitdet_plugin.models.losses import (DFineCriterion, PredictionSet, dense_one_to_one,
                                         dfine_prediction_sets)

#: loss values and gradients must agree with the reference to this (fp32).
ATOL = 1e-5
#: the reference's outputs the loss reads, by its argument names.
LEAVES = ('outputs_class', 'outputs_coord', 'predicted_corners', 'initial_reference_points',
          'enc_topk_logits', 'enc_topk_bboxes')


def _step(style: str, size: Tuple[int, int]) -> Tuple[object, Dict[str, Tensor], dict]:
    """One training forward with labels: the reference config, its loss-relevant outputs and
    its denoising metadata; checks the model's own loss dict is what the loss function gives."""
    model = reference_model(style).train()
    torch.manual_seed(7)
    out = model(torch.randn(2, 3, *size), labels=targets())
    outputs = {'outputs_class': out.intermediate_logits,
               'outputs_coord': out.intermediate_reference_points,
               'predicted_corners': out.intermediate_predicted_corners,
               'initial_reference_points': out.initial_reference_points,
               'enc_topk_logits': out.enc_topk_logits, 'enc_topk_bboxes': out.enc_topk_bboxes}
    leaves = {k: v.detach().clone() for k, v in outputs.items()}
    assert out.denoising_meta_values is not None
    return model.config, leaves, {'out': out, 'meta': out.denoising_meta_values}


def _reference_losses(style: str, config: object, leaves: Dict[str, Tensor], meta: dict
                      ) -> Dict[str, Tensor]:
    loss_fn = DFineForObjectDetectionLoss if style == 'dfine' else Deimv2ForObjectDetectionLoss
    cls, coord = leaves['outputs_class'], leaves['outputs_coord']
    _, loss_dict, _ = loss_fn(cls[:, -1], targets(), cls.device, coord[:, -1], config,
                              denoising_meta_values=meta, **leaves)
    return loss_dict


def _our_losses(style: str, config: object, leaves: Dict[str, Tensor], meta: dict
                ) -> Dict[str, Tensor]:
    """Our criterion on the prediction sets transformers' loss builds: its class / box list
    starts with the pre-head outputs, so auxiliary set ``k`` pairs entry ``k`` of that list
    (pre-head for ``k = 0``, else layer ``k - 1``) with layer ``k``'s distributions; then the
    encoder's top-k; denoising sets likewise for all layers."""
    cls, coord = leaves['outputs_class'], leaves['outputs_coord'].clamp(0, 1)
    corners, refs = leaves['predicted_corners'], leaves['initial_reference_points']
    nd = meta['dn_num_split'][0]
    layers = corners.shape[1]

    def part(x: Tensor, k: int, dn: bool) -> Tensor:
        return x[:, k, :nd] if dn else x[:, k, nd:]

    def sets(dn: bool, count: int) -> List[PredictionSet]:
        out = []
        for k in range(count):
            teacher = k != layers - 1
            out.append(PredictionSet(
                part(cls, k, dn), part(coord, k, dn), part(corners, k, dn), part(refs, k, dn),
                part(corners, -1, dn) if teacher else None,
                part(cls, -1, dn) if teacher else None))
        return out

    final = PredictionSet(part(cls, -1, False), part(coord, -1, False))
    aux = sets(False, layers - 1) + [
        PredictionSet(leaves['enc_topk_logits'], leaves['enc_topk_bboxes'].clamp(0, 1))]
    criterion = DFineCriterion(
        NUM_CLASSES, 'vfl' if style == 'dfine' else 'mal', focal_alpha=config.focal_loss_alpha,
        focal_gamma=config.focal_loss_gamma, mal_alpha=getattr(config, 'mal_alpha', None),
        reg_max=config.max_num_bins, reg_scale=config.reg_scale, up=config.up,
        dense_one_to_one=style == 'deimv2')
    gt = [(t['boxes'], t['class_labels']) for t in targets()]
    return criterion(final, aux, gt, sets(True, layers), meta['dn_positive_idx'],
                     meta['dn_num_group'])


@pytest.mark.parametrize('style', ['dfine', 'deimv2'])
@pytest.mark.parametrize('size', [(64, 64), (64, 96)])
def test_losses_and_gradients_match_transformers(style, size):
    config, leaves, extra = _step(style, size)
    model_losses = extra['out'].loss_dict
    ref_leaves = {k: v.clone().requires_grad_() for k, v in leaves.items()}
    our_leaves = {k: v.clone().requires_grad_() for k, v in leaves.items()}
    ref = _reference_losses(style, config, ref_leaves, extra['meta'])
    ours = _our_losses(style, config, our_leaves, extra['meta'])
    assert sorted(ours) == sorted(ref) == sorted(model_losses)
    for key in ref:
        assert torch.allclose(ref[key], model_losses[key], atol=ATOL), key
        err = (ours[key] - ref[key]).abs().item()
        assert err <= ATOL, f'{key}: ours {ours[key].item():.6f} ref {ref[key].item():.6f}'
    assert any(ref[k].item() > 0 for k in ref if k.startswith('loss_ddf'))
    assert any(ref[k].item() > 0 for k in ref if k.startswith('loss_fgl'))
    sum(ref.values()).backward()
    sum(ours.values()).backward()
    for name in LEAVES:
        if name == 'initial_reference_points':  # only read detached, by both
            assert our_leaves[name].grad is None and ref_leaves[name].grad is None
            continue
        err = (our_leaves[name].grad - ref_leaves[name].grad).abs().max().item()
        assert err <= ATOL, f'gradient w.r.t. {name}: max error {err:.2e}'


def test_dense_one_to_one_keeps_the_most_frequent_target_per_query():
    t = torch.tensor
    final = [(t([0, 4]), t([0, 1]))]
    aux = [[(t([0, 5]), t([1, 0]))], [(t([0, 4]), t([1, 1]))]]
    (queries, targets_), = dense_one_to_one([final, *aux])
    got = dict(zip(queries.tolist(), targets_.tolist()))
    assert got == {0: 1, 4: 1, 5: 0}


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="class_loss='focal' is not one of"):
        DFineCriterion(NUM_CLASSES, 'focal')
    with pytest.raises(ValueError, match=r"loss_weights has keys \['bbox', 'ddf', 'fgl', "
                                         r"'giou', 'l1', 'vfl'\]"):
        DFineCriterion(NUM_CLASSES, loss_weights={'l1': 5.0})


def test_prediction_sets_pair_each_layer_with_its_own_distributions():
    """The authors' pairing: auxiliary set k is layer k (logits, boxes and distributions), the
    final set carries the last layer's distributions, pre-head and encoder sets follow; one
    training step through it reaches every decoder head."""
    torch.manual_seed(0)
    decoder = DFineDecoder(NUM_CLASSES, 32, 2, 64, 3, [2, 2]).train()
    nd, nq = 4, 6
    out = decoder(torch.randn(2, nd + nq, 32), torch.randn(2, nd + nq, 4),
                  torch.randn(2, 20, 32), [(4, 4), (2, 2)])
    enc_logits, enc_boxes = torch.randn(2, nq, NUM_CLASSES), torch.rand(2, nq, 4)
    final, aux, dn = dfine_prediction_sets(out, enc_logits, enc_boxes, nd)
    assert len(aux) == 4 and len(dn) == 4
    assert torch.equal(final.corners, out.corners[2][:, nd:]) and final.teacher_corners is None
    for k in range(2):
        assert torch.equal(aux[k].logits, out.logits[k][:, nd:])
        assert torch.equal(aux[k].corners, out.corners[k][:, nd:])
        assert torch.equal(aux[k].teacher_corners, out.corners[2][:, nd:])
        assert torch.equal(dn[k].boxes, out.boxes[k][:, :nd].clamp(0, 1))
    assert torch.equal(aux[2].logits, out.pre_logits[:, nd:]) and aux[2].corners is None
    assert torch.equal(aux[3].logits, enc_logits) and torch.equal(dn[3].logits,
                                                                  out.pre_logits[:, :nd])
    gt = [(torch.tensor([[0.5, 0.5, 0.2, 0.3], [0.3, 0.3, 0.1, 0.1]]), torch.tensor([1, 2])),
          (torch.tensor([[0.6, 0.4, 0.3, 0.3]]), torch.tensor([0]))]
    positives = [torch.tensor([0, 1]), torch.tensor([0])]
    losses = DFineCriterion(NUM_CLASSES)(final, aux, gt, dn, positives, 1)
    assert losses['loss_ddf'].item() == 0 and losses['loss_fgl'].item() > 0
    assert losses['loss_ddf_aux_0'].item() > 0 and 'loss_fgl_aux_2' not in losses
    sum(losses.values()).backward()
    for name in ('cls_branches.0', 'reg_branches.2', 'pre_bbox_head', 'lqe_layers.1',
                 'layers.0.cross_attn'):
        grads = [p.grad for n, p in decoder.named_parameters() if n.startswith(name)]
        assert grads and all(g is not None and g.abs().sum() > 0 for g in grads), name


@pytest.mark.parametrize('style', ['dfine', 'deimv2'])
def test_one_step_under_bfloat16_autocast_is_finite(style):
    """Selector -> denoising group -> decoder -> criterion -> backward under CPU autocast."""
    torch.manual_seed(0)
    decoder = DFineDecoder(NUM_CLASSES, 32, 2, 64, 3, [3, 6, 3], style=style).train()
    selector = DFineQuerySelector(NUM_CLASSES, 10, 32)
    embed = torch.nn.Embedding(NUM_CLASSES + 1, 32, padding_idx=NUM_CLASSES)
    memory, shapes = torch.randn(2, 84, 32), [(8, 8), (4, 4), (2, 2)]
    gt = [(torch.tensor([[0.5, 0.5, 0.2, 0.3]]), torch.tensor([1])),
          (torch.tensor([[0.6, 0.4, 0.3, 0.3], [0.2, 0.2, 0.1, 0.1]]), torch.tensor([0, 4]))]
    with torch.autocast('cpu', dtype=torch.bfloat16):
        picked = selector(memory, shapes)
        group = contrastive_denoising_group([lab for _, lab in gt], [b for b, _ in gt],
                                            NUM_CLASSES, 10, embed, 8)
        out = decoder(torch.cat([group.query, picked.query], 1),
                      torch.cat([group.ref_logits, picked.ref_logits], 1), memory, shapes,
                      group.attn_mask)
        final, aux, dn = dfine_prediction_sets(out, picked.topk_logits, picked.topk_boxes,
                                               group.num_denoising)
        losses = DFineCriterion(NUM_CLASSES, 'vfl' if style == 'dfine' else 'mal',
                                dense_one_to_one=style == 'deimv2')(
            final, aux, gt, dn, group.positive_idx, group.num_groups)
    assert out.logits.dtype == torch.bfloat16
    assert all(torch.isfinite(v) for v in losses.values())
    sum(losses.values()).backward()
    assert all(torch.isfinite(p.grad).all() for p in decoder.parameters() if p.grad is not None)
