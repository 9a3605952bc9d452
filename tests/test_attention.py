"""The shared attention core: the fused forward / recomputing backward used in training agrees
with plain autograd through the explicit softmax, for every bias layout it accepts."""
import pytest
import torch

from vitdet_plugin.models.layers.attention import MASKED_LOGIT, attend


def _inputs(b, h, n, m, d, bias_shape, dtype):
    q = torch.randn(b, h, n, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, h, m, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, h, m, d + 3, dtype=dtype, requires_grad=True)
    bias = torch.randn(*bias_shape, requires_grad=True)
    return q, k, v, bias


@pytest.mark.parametrize('bias_shape,with_mask', [
    ((1, 3, 10, 10), False), ((1, 3, 10, 10), True),   # shared bias (Swin), shift mask or not
    ((1, 1, 10, 10), True), ((3, 10, 10), True),        # broadcast over heads / no batch dim
    ((6, 3, 10, 10), False)])                           # a bias per row (no periodic mask)
def test_recomputing_backward_matches_autograd(bias_shape, with_mask):
    q, k, v, bias = _inputs(6, 3, 10, 10, 8, bias_shape, torch.float32)
    mask = None
    if with_mask:  # window-periodic, 2 windows per image, some pairs masked out
        mask = torch.zeros(2, 1, 10, 10)
        mask[1, :, :4, 6:] = MASKED_LOGIT
    grad = torch.randn(6, 3, 10, 11)
    out = attend(q, k, v, bias, mask=mask)             # fused forward, recomputing backward
    got = torch.autograd.grad(out, (q, k, v, bias), grad)
    ref_out = attend(q, k, v, bias, mask=mask, fused=False)  # explicit softmax, autograd
    want = torch.autograd.grad(ref_out, (q, k, v, bias), grad)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    for name, g, w in zip('q k v bias'.split(), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=name)


def test_recomputing_backward_with_a_custom_scale_and_keys_of_another_length():
    q, k, v, bias = _inputs(2, 2, 5, 9, 4, (1, 2, 5, 9), torch.float32)
    grad = torch.randn(2, 2, 5, 7)
    got = torch.autograd.grad(attend(q, k, v, bias, scale=0.3), (q, k, v, bias), grad)
    want = torch.autograd.grad(attend(q, k, v, bias, scale=0.3, fused=False), (q, k, v, bias),
                               grad)
    for name, g, w in zip('q k v bias'.split(), got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=name)


def test_recomputing_backward_under_bf16_autocast_returns_grads_in_input_dtypes():
    q, k, v, bias = _inputs(4, 2, 7, 7, 8, (1, 2, 7, 7), torch.bfloat16)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = attend(q, k, v, bias)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v, bias))
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3 + [torch.float32]
    want = torch.autograd.grad(attend(q.float(), k.float(), v.float(), bias, fused=False).sum(),
                               (q, k, v, bias))
    for name, g, w in zip('q k v bias'.split(), grads, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=5e-2, atol=5e-2, msg=name)
