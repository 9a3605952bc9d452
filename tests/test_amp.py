"""Mixed precision: both backbones under CPU bf16 / fp16 autocast stay finite and close to fp32.

Train mode exercises the fused-attention-with-recompute path (trainable relative-position bias)
and the shift mask (``MASKED_LOGIT``); eval mode the plain fused path; inference mode (eval
under ``torch.no_grad()``, as mmengine's fp16 val/test loops run) the no-autograd paths, which
must give autocast's dtypes exactly as eval with autograd does. Inputs need window padding.
"""
import pytest
import torch

import vitdet_plugin  # noqa: F401
from helpers import max_rel_err, randomize_
from vitdet_plugin.models.backbones.swin import SwinBackbone
from vitdet_plugin.models.backbones.vit import ViTBackbone

#: loose bounds for 8-bit (bf16) / 11-bit (fp16) mantissas through a 4-block network
OUT_TOL = {torch.bfloat16: 5e-2, torch.float16: 5e-3}
GRAD_TOL = {torch.bfloat16: 1e-1, torch.float16: 1.5e-2}


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
