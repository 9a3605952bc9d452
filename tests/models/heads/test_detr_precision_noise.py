"""SdpaDETRHead: the denoising queries' noise bands and label-noise rate, and autocast
(bf16 / fp16) outputs and losses compared with fp32 within stated tolerances."""
import pytest
import torch
from mmengine.structures import InstanceData
from test_detr_head import NUM_CLASSES, padded_batch, small_head

import vitdet_plugin  # noqa: F401  (registers our modules)

#: box noise of the band test, in half box sizes (small enough that no box is clamped)
BAND_NOISE = 0.4
#: normalised xyxy of the band test's object (centred: noised boxes stay inside the image)
BAND_BOX = (0.35, 0.4, 0.6, 0.7)
#: one object: this many groups of one positive and one negative query
BAND_QUERIES = 1000
#: how close the sampled offsets must come to each band's edges (4000 uniform draws each)
BAND_COVERAGE = 0.97


def _band_batch(box_noise: float, label_noise: float):
    torch.manual_seed(0)
    head = small_head(dn_cfg=dict(num_dn_queries=BAND_QUERIES, box_noise_scale=box_noise,
                                  label_noise_scale=label_noise))
    h, w = 100, 200
    gt = InstanceData()
    gt.bboxes = torch.tensor([BAND_BOX]) * torch.tensor([w, h, w, h])
    gt.labels = torch.tensor([2])
    dn = head.dn([gt], [dict(img_shape=(h, w))], num_matching=20)
    return head, dn


def test_denoising_box_noise_bands():
    """Positive queries move each coordinate by less than ``box_noise_scale`` half-sizes of
    the box (per axis); negatives by one to two times that, in both directions."""
    _, dn = _band_batch(BAND_NOISE, 0.0)
    cx, cy, bw, bh = dn.ref_boxes[0].unbind(-1)
    xyxy = torch.stack([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2], -1)
    x1, y1, x2, y2 = BAND_BOX
    half = torch.tensor([x2 - x1, y2 - y1, x2 - x1, y2 - y1]) / 2
    offset = (xyxy - torch.tensor(BAND_BOX)).abs() / (half * BAND_NOISE)  # in band units
    groups = BAND_QUERIES
    assert dn.ref_boxes.shape == (1, 2 * groups, 4)
    pos, neg = offset[0::2], offset[1::2]      # one object: slots alternate positive/negative
    eps = 1e-4                                 # cxcywh round trip in fp32
    assert pos.max() < 1 + eps and neg.min() > 1 - eps and neg.max() < 2 + eps
    assert pos.max() > BAND_COVERAGE and neg.min() < 1 + (1 - BAND_COVERAGE)
    assert neg.max() > 1 + BAND_COVERAGE
    # both directions occur in both bands
    signed = xyxy - torch.tensor(BAND_BOX)
    for part in (signed[0::2], signed[1::2]):
        assert (part > 0).any(0).all() and (part < 0).any(0).all()
    # the positives are the known matches, the negatives are background
    assert dn.matches[0][0].tolist() == list(range(0, 2 * groups, 2))


def test_denoising_label_noise_rate():
    """``label_noise_scale`` is twice the probability that a label is replaced by a random
    class (which may be the same class): changed fraction 0.5 * scale * (1 - 1 / classes)."""
    for scale in (0.0, 0.5, 1.0):
        head, dn = _band_batch(0.0, scale)
        emb = head.dn.label_embedding.weight
        labels = torch.cdist(dn.query[0], emb).argmin(-1)     # back from the embeddings
        changed = (labels != 2).float().mean().item()
        expected = 0.5 * scale * (1 - 1 / NUM_CLASSES)
        # binomial standard deviation over 2 * BAND_QUERIES draws is <= 0.011: allow 4 of it
        assert abs(changed - expected) < 0.045, (scale, changed, expected)


#: max |autocast - fp32| / max |fp32| of the decoder outputs and relative error of each loss,
#: in machine epsilons of the autocast dtype (bf16 2^-7, fp16 2^-10). Measured on CPU with a
#: randomised head: outputs <= 0.9 eps, losses <= 0.1 eps
HEAD_OUT_EPS, HEAD_LOSS_EPS = 2, 1


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16], ids=['bf16', 'fp16'])
def test_autocast_matches_fp32(dtype):
    """Learned reference boxes (``two_stage=False``): the two-stage top-k proposal selection
    is discrete, so a rounding difference may pick another proposal and no tolerance applies;
    ``test_autocast_finite`` covers that path."""
    from helpers import max_rel_err, randomize_
    eps = torch.finfo(dtype).eps
    head = randomize_(small_head(two_stage=False), seed=2)
    feats, samples = padded_batch()
    metas = [s.metainfo for s in samples]

    def run(enabled: bool):
        head.eval()
        with torch.no_grad(), torch.autocast('cpu', dtype=dtype, enabled=enabled):
            outs = head(feats, metas)
        head.train()
        torch.manual_seed(1)  # the same denoising queries in both runs
        with torch.no_grad(), torch.autocast('cpu', dtype=dtype, enabled=enabled):
            losses = head.loss(feats, samples)
        return outs, losses
    ref_outs, ref_losses = run(False)
    outs, losses = run(True)
    assert outs.all_cls_scores.dtype == dtype
    for name in ('all_cls_scores', 'all_bbox_preds'):
        err = max_rel_err(getattr(outs, name).float(), getattr(ref_outs, name))
        assert err <= HEAD_OUT_EPS * eps, f'{name}: relative error {err:.3g} vs fp32'
    assert losses.keys() == ref_losses.keys()
    for k, ref in ref_losses.items():
        assert losses[k].dtype == torch.float32
        assert abs(losses[k] - ref) <= HEAD_LOSS_EPS * eps * abs(ref), (k, losses[k], ref)
