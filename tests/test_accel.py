"""The accelerated CPU kernels (``vitdet_plugin.models.accel``) against the plain path.

The contract of the ``accel`` switch: same values and gradients as the model's plain path;
where each kernel runs (the CPU only, never CUDA or meta); the private torch functions agree
with their public fallbacks.
"""
import threading

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close_rel, randomize_

import vitdet_plugin  # noqa: F401
from vitdet_plugin.functional import (MASKED_LOGIT, attend, pad_to_multiple, padded_size,
                                      shifted_window_mask, window_bias, window_partition,
                                      window_reverse)
from vitdet_plugin.models.accel import (PLAIN, AccelPlan, check_accel, chunking, gelu_linear,
                                        padding_free_window_attention, plan_for,
                                        recompute_attention, swin_inference, torch_private)
from vitdet_plugin.models.accel.window_plan import window_plan, window_sources
from vitdet_plugin.models.backbones import SwinBackbone, ViTBackbone
from vitdet_plugin.models.backbones.swin import WindowAttention
from vitdet_plugin.models.layers.cosine_window_attention import CosineWindowAttention

SMALL = dict(arch=dict(embed_dims=32, depths=(2, 2, 2, 2), num_heads=(2, 2, 4, 4)))


# ----------------------------------------------------------------------------- dispatch
@pytest.mark.parametrize('grad', [True, False])
@pytest.mark.parametrize('autocast', [True, False])
@pytest.mark.parametrize('device', ['cuda', 'meta', 'mps', 'xpu'])
def test_every_device_but_the_cpu_runs_the_plain_path(device, grad, autocast):
    assert plan_for(device, 'auto', grad, autocast) == PLAIN


def test_cpu_plans():
    assert plan_for('cpu', 'auto', grad_enabled=False, autocast=False) == AccelPlan(
        chunked_inference=True, recompute_attention=False, recompute_gelu=False)
    assert plan_for('cpu', 'auto', grad_enabled=True, autocast=False) == AccelPlan(
        chunked_inference=False, recompute_attention=True, recompute_gelu=True)
    for grad in (True, False):  # autocast: the plain path gives every op autocast's dtype
        assert plan_for('cpu', 'auto', grad, autocast=True) == PLAIN
        assert plan_for('cpu', 'off', grad, autocast=False) == PLAIN


@pytest.mark.parametrize('bad', ['on', 'Auto', None, True, 1])
def test_bad_accel_mode_is_named(bad):
    with pytest.raises(ValueError, match=r"accel=.* is not supported; choose one of \['auto', "
                                         r"'off'\]"):
        check_accel(bad)
    with pytest.raises(ValueError, match='accel='):
        SwinBackbone(**SMALL, accel=bad)


def test_cuda_model_forward_takes_the_plain_path(monkeypatch):
    """What a CUDA forward runs, without a GPU: the dispatch sees a CUDA tensor and none of
    the CPU kernels is called (the meta device stands in for the data)."""
    calls = []
    monkeypatch.setattr(swin_inference, '_stage_', lambda *a: calls.append('chunked'))
    real_plan_for = plan_for

    def plan_as_cuda(device_type, mode, grad, autocast):
        calls.append(device_type)
        return real_plan_for('cuda', mode, grad, autocast)
    monkeypatch.setattr('vitdet_plugin.models.accel.dispatch.plan_for', plan_as_cuda)
    model = randomize_(SwinBackbone(**SMALL)).eval()
    x = torch.randn(1, 3, 40, 56)
    with torch.no_grad():
        outs = model(x)
    with torch.no_grad():
        ref = SwinBackbone(**SMALL, accel='off').eval()
        ref.load_state_dict(model.state_dict())
        expected = ref(x)
    assert 'chunked' not in calls and 'cpu' in calls
    assert_close_rel(outs, expected, tol=0)


# ----------------------------------------------------------------------------- private torch
def test_private_torch_functions_agree_with_their_public_fallbacks():
    grad, logits = torch.randn(4, 5, 7), torch.randn(4, 5, 7)
    probs = logits.softmax(-1)
    torch.testing.assert_close(torch_private.softmax_backward(grad, probs),
                               torch_private.softmax_backward_public(grad, probs))
    x = logits.clone().requires_grad_()
    (ref,) = torch.autograd.grad(x.softmax(-1), x, grad)
    torch.testing.assert_close(torch_private.softmax_backward_public(grad, probs), ref)
    for approximate in ('none', 'tanh'):
        h = torch.randn(3, 11)
        torch.testing.assert_close(torch_private.gelu_(h.clone(), approximate),
                                   torch_private.gelu_public_(h.clone(), approximate))
        torch.testing.assert_close(torch_private.gelu_public_(h.clone(), approximate),
                                   F.gelu(h, approximate=approximate))


def test_fallbacks_are_used_when_torch_lacks_the_private_function(monkeypatch):
    monkeypatch.setattr(torch_private, '_SOFTMAX_BACKWARD', None)
    monkeypatch.setattr(torch_private, '_GELU_INPLACE', None)
    probs, grad = torch.randn(2, 6).softmax(-1), torch.randn(2, 6)
    torch.testing.assert_close(torch_private.softmax_backward(grad, probs),
                               probs * (grad - (grad * probs).sum(-1, keepdim=True)))
    h = torch.randn(5)
    torch.testing.assert_close(torch_private.gelu_(h.clone()), F.gelu(h))


# ----------------------------------------------------------------------------- recompute
def _qkv(b, h, n, d, dtype=torch.float32):
    return [torch.randn(b, h, n, d, dtype=dtype, requires_grad=True) for _ in range(3)]


@pytest.mark.parametrize('with_mask', [False, True])
def test_recomputing_attention_matches_autograd(with_mask):
    """Unshifted (bias shared by all windows) and shifted (windows folded into the heads,
    bias + mask of one image broadcast over the batch) layouts of window attention."""
    images, windows, heads, n, d = 3, 2, 2, 10, 8
    bias = torch.randn(1, heads, n, n, requires_grad=True)
    mask = None
    if with_mask:
        mask = torch.zeros(windows, n, n)
        mask[1, :4, 6:] = MASKED_LOGIT
        q, k, v = _qkv(images, windows * heads, n, d)
    else:
        q, k, v = _qkv(images * windows, heads, n, d)
    grad = torch.randn_like(q)
    out = recompute_attention(q, k, v, bias, mask, 0.3)
    got = torch.autograd.grad(out, (q, k, v, bias), grad)
    ref = attend(q, k, v, window_bias(bias, mask), fused=False, scale=0.3)
    want = torch.autograd.grad(ref, (q, k, v, bias), grad)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for name, g, w in zip('q k v bias'.split(), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=name)


def test_recomputing_attention_under_bf16_autocast_returns_grads_in_input_dtypes():
    q, k, v = _qkv(4, 2, 7, 8, torch.bfloat16)
    bias = torch.randn(1, 2, 7, 7, requires_grad=True)
    out = recompute_attention(q, k, v, bias, None, 8 ** -0.5)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v, bias))
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3 + [torch.float32]
    want = torch.autograd.grad(attend(q.float(), k.float(), v.float(), bias, fused=False).sum(),
                               (q, k, v, bias))
    for name, g, w in zip('q k v bias'.split(), grads, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=5e-2, atol=5e-2, msg=name)


@pytest.mark.parametrize('frozen_weight', [False, True])
def test_gelu_linear_matches_autograd(frozen_weight):
    h = torch.randn(5, 3, 16, requires_grad=True)
    weight = torch.randn(4, 16, requires_grad=not frozen_weight)
    bias = torch.randn(4, requires_grad=True)
    grad = torch.randn(5, 3, 4)
    wrt = [h, bias] if frozen_weight else [h, weight, bias]
    got = torch.autograd.grad(gelu_linear(h, weight, bias), wrt, grad)
    want = torch.autograd.grad(F.linear(F.gelu(h), weight, bias), wrt, grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_training_saves_less_with_accel_and_gets_the_same_gradients():
    """accel='auto' on the CPU: same outputs and gradients as 'off', fewer saved bytes."""
    x = torch.randn(2, 3, 61, 75)

    def run(accel):
        model = randomize_(SwinBackbone(**SMALL, drop_path_rate=0.0, accel=accel)).train()
        saved = {}

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            outs = model(x)
        sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in outs).backward()
        grads = [p.grad for p in model.parameters()]
        return outs, grads, sum(saved.values())
    outs_a, grads_a, saved_a = run('auto')
    outs_o, grads_o, saved_o = run('off')
    assert_close_rel(outs_a, outs_o, tol=1e-5)
    assert_close_rel(grads_a, grads_o, tol=1e-4)
    assert saved_a < 0.9 * saved_o, (saved_a, saved_o)


def test_double_backward_through_the_training_kernels():
    """create_graph=True (a gradient penalty on the input): the kernels' backward runs as
    differentiable ops, so the second backward gives the plain path's parameter gradients."""
    x = torch.randn(1, 3, 45, 61)

    def run(accel):
        model = randomize_(SwinBackbone(**SMALL, drop_path_rate=0.0, accel=accel)).train()
        torch.manual_seed(0)
        inp = x.clone().requires_grad_(True)
        outs = model(inp)
        loss = sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in outs)
        (grad_x,) = torch.autograd.grad(loss, inp, create_graph=True)
        grad_x.pow(2).sum().backward()
        return [grad_x.detach()] + [p.grad for p in model.parameters()]
    auto, off = run('auto'), run('off')
    # parameters the input gradient does not depend on (e.g. the last biases) get none in both
    assert [g is None for g in auto] == [g is None for g in off]
    assert sum(g is not None for g in auto) > len(auto) // 2
    assert_close_rel([g for g in auto if g is not None], [g for g in off if g is not None],
                     tol=1e-4)


# ----------------------------------------------------------------------------- chunked inference
def _pair(**kw):
    fast = randomize_(SwinBackbone(**SMALL, **kw)).eval()
    plain = SwinBackbone(**SMALL, **kw, accel='off').eval()
    plain.load_state_dict(fast.state_dict())
    return fast, plain


@pytest.mark.parametrize('hw,batch', [((93, 141), 2), ((61, 45), 1), ((224, 224), 1)])
def test_chunked_inference_matches_the_plain_path(monkeypatch, hw, batch):
    """Across chunk boundaries, padded and shifted windows and a batch; the caller's input is
    left untouched."""
    monkeypatch.setattr(chunking, 'CHUNK_BYTES', 1 << 14)       # many chunks per block
    fast, plain = _pair(window_size=(5, 7))
    x = torch.randn(batch, 3, *hw)
    x0 = x.clone()
    with torch.no_grad():
        got, want = fast(x), plain(x)
    assert_close_rel(got, want, tol=1e-5)
    assert torch.equal(x, x0)


def test_chunked_inference_with_abs_pos_stem_and_odd_merging():
    fast, plain = _pair(use_abs_pos_embed=True, pretrain_img_size=64, stem_channels=(8,),
                        out_indices=(0, 2))
    x = torch.randn(1, 3, 77, 51)
    with torch.no_grad():
        assert_close_rel(fast(x), plain(x), tol=1e-5)


def test_chunked_inference_across_sizes_and_threads(monkeypatch):
    """Plans are cached per size: alternating sizes (including transposed ones, whose masks
    have the same shape and other contents) and two threads still give the plain values."""
    monkeypatch.setattr(chunking, 'CHUNK_BYTES', 1 << 15)
    fast, plain = _pair(window_size=7)
    inputs = [torch.randn(1, 3, 56, 112), torch.randn(1, 3, 112, 56), torch.randn(2, 3, 64, 64)]
    with torch.no_grad():
        refs = [plain(x) for x in inputs]
        for x, ref in list(zip(inputs, refs)) * 2:
            assert_close_rel(fast(x), ref, tol=1e-5)
    results = {}

    def run(i):
        with torch.no_grad():
            results[i] = [fast(inputs[i]) for _ in range(3)]
    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in (0, 1):
        for out in results[i]:
            assert_close_rel(out, refs[i], tol=1e-5)


def test_chunked_inference_follows_weight_changes():
    """No cache derived from weights: a table written through ``.data`` (mmengine's EMA swap)
    shows in the next forward."""
    fast, plain = _pair()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        before = fast(x)
        for m in (fast, plain):
            table = m.layers[0].blocks[1].attn.relative_position_bias_table
            table.data.copy_(torch.randn(table.shape, generator=torch.Generator().manual_seed(1)))
        after, want = fast(x), plain(x)
    assert not torch.allclose(before[0], after[0])
    assert_close_rel(after, want, tol=1e-5)


def test_plan_cache_is_bounded_in_a_multiscale_loop():
    fast, _ = _pair()
    swin_inference._PLANS.clear()
    with torch.no_grad():
        for side in range(40, 40 + 8 * 25, 8):
            fast(torch.randn(1, 3, side, side + 4))
    assert 0 < len(swin_inference._PLANS) <= swin_inference._PLANS.maxsize


@pytest.mark.parametrize('hw,window,shift', [((10, 17), (7, 7), (3, 3)),
                                             ((14, 14), (7, 7), (0, 0)),
                                             ((9, 12), (5, 7), (2, 3))])
def test_window_plan_covers_every_token_once_and_no_padding(hw, window, shift):
    """Every image token of every image is in exactly one chunk (the scatter-add residual hits
    each token once), padding is never gathered, windows needing a mask come last, and the
    ``real`` positions place each token where pad -> roll -> partition puts it."""
    batch, n = 2, window[0] * window[1]
    masked = None
    if any(shift):
        masked = shifted_window_mask(padded_size(hw, window), window, shift).flatten(1).ne(0)
        masked = masked.any(1)
    plan = window_plan(window_sources(hw, window, shift), batch, 3, masked)
    tokens = batch * hw[0] * hw[1]
    rows = torch.cat([c.rows for c in plan.chunks])
    assert torch.equal(rows.sort().values, torch.arange(tokens))
    grid = pad_to_multiple(torch.arange(1, tokens + 1).view(batch, *hw, 1), window)
    grid = torch.roll(grid, (-shift[0], -shift[1]), (1, 2))
    num_windows = grid.shape[1] * grid.shape[2] // n
    ref = window_partition(grid, window).view(batch, num_windows, n)
    assert sorted(plan.order.tolist()) == sorted(list(range(num_windows)) * batch)
    seen = 0
    for chunk in plan.chunks:
        assert chunk.windows.start == seen and chunk.windows.stop - chunk.windows.start <= 3
        seen = chunk.windows.stop
        wins = plan.order[chunk.windows]
        image = torch.div(chunk.rows, hw[0] * hw[1], rounding_mode='floor')
        laid = torch.zeros(wins.numel() * n, dtype=torch.long)
        real = torch.arange(wins.numel() * n) if chunk.real is None else chunk.real
        laid[real] = chunk.rows + 1
        for i in range(wins.numel()):
            img = int(image[(real >= i * n) & (real < (i + 1) * n)][0])
            assert torch.equal(laid[i * n:(i + 1) * n], ref[img, int(wins[i])])
        if masked is not None:
            assert bool(masked[wins].all()) == (chunk.windows.start >= plan.first_masked)
    assert seen == plan.order.numel()


def test_vit_accel_trains_like_the_plain_path():
    kw = dict(arch=dict(embed_dims=32, depth=2, num_heads=2), img_size=64, patch_size=8,
              window_size=3, pretrain_img_size=64, drop_path_rate=0.0)
    a = randomize_(ViTBackbone(**kw)).train()
    b = ViTBackbone(**kw, accel='off').train()
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 3, 70, 52)
    outs = [m(x)[0] for m in (a, b)]
    grads = [torch.autograd.grad(o.square().sum(), list(m.parameters()))
             for o, m in zip(outs, (a, b))]
    assert_close_rel(outs[:1], outs[1:], tol=1e-5)
    assert_close_rel(grads[0], grads[1], tol=1e-4)


# ----------------------------------------------------------------------------- padding-free
def _plain_window_attention(attn, x, window, shift):
    """The plain path as the Swin papers' code writes it: zero-pad, roll, partition, attend,
    reverse, roll back, crop."""
    h, w = x.shape[1:3]
    hp, wp = padded_size((h, w), window)
    windows = torch.roll(pad_to_multiple(x, window), (-shift[0], -shift[1]), dims=(1, 2))
    mask = (shifted_window_mask((hp, wp), window, shift, dtype=x.dtype) if any(shift)
            else None)
    out = attn(window_partition(windows, window), mask)             # (B * nW, N, C)
    out = window_reverse(out, window, (hp, wp))
    return torch.roll(out, shift, dims=(1, 2))[:, :h, :w]


@pytest.mark.parametrize('qkv_bias', [True, False], ids=['bias', 'no_bias'])
@pytest.mark.parametrize('hw,window,shift', [((13, 22), (7, 7), (3, 3)),
                                             ((13, 22), (7, 7), (0, 0)),
                                             ((5, 9), (4, 6), (2, 3)),
                                             ((14, 7), (7, 7), (3, 3)),
                                             ((3, 5), (7, 7), (3, 3))])  # smaller than a window
@pytest.mark.parametrize('kind', ['swin', 'swinv2'])
def test_padding_free_window_attention_matches_the_plain_path(kind, hw, window, shift,
                                                              qkv_bias):
    """The compiled form (only the image tokens projected; padding tokens enter attention as
    the qkv bias) has the plain path's outputs and gradients (input and every parameter)."""
    if kind == 'swin':
        attn = WindowAttention(16, 2, window, qkv_bias=qkv_bias)
    else:
        attn = CosineWindowAttention(16, 2, window, (4, 4), qkv_bias=qkv_bias)
    randomize_(attn).double()  # float64: the two forms sum in different orders
    x = torch.randn(2, *hw, 16, dtype=torch.float64)
    results = []
    for fn in (lambda t: _plain_window_attention(attn, t, window, shift),
               lambda t: padding_free_window_attention(t, attn, window, shift, torch.float64)):
        t = x.clone().requires_grad_()
        out = fn(t)
        weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
        grads = torch.autograd.grad((out * weights).sum(), [t] + list(attn.parameters()))
        results.append((out, grads))
    (ref, ref_grads), (got, got_grads) = results
    assert got.shape == ref.shape == x.shape
    assert_close_rel([got, *got_grads], [ref, *ref_grads], 1e-12)
