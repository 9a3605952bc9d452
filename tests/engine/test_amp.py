"""Mixed precision: both backbones under CPU bf16 / fp16 autocast stay finite and close to fp32.

Train mode exercises the fused-attention-with-recompute path (trainable relative-position bias)
and the shift mask (``MASKED_LOGIT``); eval mode the plain fused path; inference mode (eval
under ``torch.no_grad()``, as mmengine's fp16 val/test loops run) the no-autograd paths, which
must give autocast's dtypes exactly as eval with autograd does. Inputs need window padding.
"""
import pytest
import torch
from helpers import max_rel_err, randomize_

import vitdet_plugin  # noqa: F401
from vitdet_plugin.models.backbones.swin import SwinBackbone
from vitdet_plugin.models.backbones.vit import ViTBackbone

#: max |autocast - fp32| / max |fp32| through a 4-block network, in machine epsilons of the
#: autocast dtype (bf16 2^-7, fp16 2^-10); the README states the same bounds. Measured on CPU:
#: outputs <= 1.2 eps (bf16 9.6e-3, fp16 1.2e-3), gradients <= 5.9 eps (bf16 4.6e-2)
OUT_EPS, GRAD_EPS = 2, 8
OUT_TOL = {dt: OUT_EPS * torch.finfo(dt).eps for dt in (torch.bfloat16, torch.float16)}
GRAD_TOL = {dt: GRAD_EPS * torch.finfo(dt).eps for dt in (torch.bfloat16, torch.float16)}


def _swin() -> SwinBackbone:
    # depth 2 per stage: W-MSA and SW-MSA (with the shift mask); 9x9 tokens pad to 12x12
    model = SwinBackbone(arch=dict(embed_dims=32, depths=(2, 2), num_heads=(2, 4)),
                         window_size=4, out_indices=(0, 1), drop_path_rate=0.0)
    return randomize_(model, seed=1)


def _vit() -> ViTBackbone:
    # window blocks (9x9 tokens pad to 12x12: padded qkv rows) and global blocks, rel. pos.
    model = ViTBackbone(arch=dict(embed_dims=32, depth=4, num_heads=2), patch_size=4,
                        img_size=36, pretrain_img_size=36, window_size=4,
                        global_attn_indexes=(1, 3), out_indices=(1, 3), drop_path_rate=0.0)
    return randomize_(model, seed=1)


MODELS = {'swin': _swin, 'vit': _vit}


def _fp16_autocast_supported() -> bool:
    try:
        with torch.autocast('cpu', dtype=torch.float16):
            torch.nn.functional.linear(torch.ones(2, 2), torch.ones(2, 2))
        return True
    except (RuntimeError, AssertionError):
        return False


def _run(model, x, dtype, mode):
    train = mode == 'train'
    model.train(train)
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(train)
    with torch.autocast('cpu', dtype=dtype, enabled=dtype is not None), \
            torch.set_grad_enabled(mode != 'inference'):
        outs = model(x)
    if not train:
        return outs, {}
    g = torch.Generator().manual_seed(0)  # fixed positive weights: no cancelling sums
    loss = sum((o.float() * torch.rand(o.shape, generator=g)).sum() for o in outs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    grads['input'] = x.grad.detach().clone()
    return outs, grads


@pytest.mark.parametrize('dtype', [
    torch.bfloat16,
    pytest.param(torch.float16, marks=pytest.mark.skipif(
        not _fp16_autocast_supported(), reason='this torch has no CPU float16 autocast')),
], ids=['bf16', 'fp16'])
@pytest.mark.parametrize('mode', ['train', 'eval', 'inference'])
@pytest.mark.parametrize('arch', sorted(MODELS))
def test_autocast_matches_fp32(arch, dtype, mode):
    torch.set_num_threads(1)
    model = MODELS[arch]()
    x = torch.randn(2, 3, 36, 36)
    ref, ref_grads = _run(model, x, None, mode)
    outs, grads = _run(model, x, dtype, mode)
    # the dtypes autocast gives with autograd on (Swin: its linear layers' dtype; the ViT
    # ends in convolution-free norms, which autocast runs in fp32)
    expected = [o.dtype for o in _run(model, x, dtype, 'eval')[0]]
    if arch == 'swin':
        assert expected == [dtype] * len(outs)
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert o.dtype == expected[i], f'output {i} dtype {o.dtype}, expected {expected[i]}'
        assert o.shape == r.shape
        assert torch.isfinite(o).all(), f'output {i} has non-finite values'
        err = max_rel_err(o.float(), r)
        assert err < OUT_TOL[dtype], f'output {i}: relative error {err:.3g} vs fp32'
    for name, r in ref_grads.items():
        g = grads[name]
        assert g.dtype == r.dtype == torch.float32, name  # master weights keep fp32 grads
        assert torch.isfinite(g).all(), f'grad of {name} has non-finite values'
        err = max_rel_err(g, r)
        assert err < GRAD_TOL[dtype], f'grad of {name}: relative error {err:.3g} vs fp32'
    if mode == 'train' and arch == 'swin':  # the bias table got its gradient (recompute path)
        assert ref_grads['layers.0.blocks.1.attn.relative_position_bias_table'].abs().sum() > 0


def test_mmcv_nms_and_roi_align_accept_bf16():
    """mmcv 2.1's compiled nms / roi_align have no bf16 kernels; the compat shim runs them in
    fp32 for bf16 inputs (two-stage detectors under bf16 autocast), returning bf16."""
    from mmcv.ops import RoIAlign, batched_nms, nms
    g = torch.Generator().manual_seed(0)
    xy = torch.rand(40, 2, generator=g) * 50
    boxes = torch.cat([xy, xy + 5 + torch.rand(40, 2, generator=g) * 30], 1)
    scores = torch.rand(40, generator=g)
    ref_dets, ref_inds = nms(boxes.bfloat16().float(), scores.bfloat16().float(), 0.5)
    dets, inds = nms(boxes.bfloat16(), scores.bfloat16(), 0.5)
    assert dets.dtype == torch.bfloat16 and torch.equal(inds, ref_inds)
    assert torch.equal(dets.float(), ref_dets)
    idxs = torch.randint(0, 3, (40,), generator=g)
    _, keep = batched_nms(boxes.bfloat16(), scores.bfloat16(), idxs, dict(iou_threshold=0.5))
    _, ref_keep = batched_nms(boxes.bfloat16().float(), scores.bfloat16().float(), idxs,
                              dict(iou_threshold=0.5))
    assert torch.equal(keep, ref_keep)
    feats = torch.randn(1, 4, 16, 16, generator=g)
    rois = torch.tensor([[0., 1., 2., 9., 12.], [0., 4., 0., 15., 7.]])
    align = RoIAlign((3, 3), spatial_scale=1.0, sampling_ratio=2)
    out = align(feats.bfloat16(), rois.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), align(feats.bfloat16().float(),
                                                  rois.bfloat16().float()),
                               rtol=torch.finfo(torch.bfloat16).eps, atol=0)
