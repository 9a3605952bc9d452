"""Our two CPU kernels against the plain path: the MLP's GELU recompute in training
(:class:`~vitdet_plugin.models.layers.Mlp`, :func:`~vitdet_plugin.models.layers.gelu_linear`) and
Swin V1's chunked in-place inference (:mod:`vitdet_plugin.models.backbones.swin_inference`).

The contract of the ``accel`` switch: same values and gradients as the plain path; each kernel
runs only where its module's forward picks it (the CPU; never CUDA, meta, autocast, export).
"""
import threading

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close_rel, randomize_

import vitdet_plugin  # noqa: F401
from vitdet_plugin.functional import (
    pad_to_multiple,
    padded_size,
    shifted_window_mask,
    window_partition,
)
from vitdet_plugin.models.backbones import SwinBackbone, ViTBackbone, swin_inference
from vitdet_plugin.models.backbones.swin_inference import window_plan, window_sources
from vitdet_plugin.models.layers import Mlp, check_accel, gelu_linear
from vitdet_plugin.models.layers import mlp as mlp_module

SMALL = dict(arch=dict(embed_dims=32, depths=(2, 2, 2, 2), num_heads=(2, 2, 4, 4)))


# ----------------------------------------------------------------------------- where they run
@pytest.mark.parametrize('bad', ['on', 'Auto', None, True, 1])
def test_bad_accel_mode_is_named(bad):
    with pytest.raises(ValueError, match=r"accel=.* is not supported; choose one of "
                                         r"\['auto', 'off'\]"):
        check_accel(bad)


def _gelu_calls(monkeypatch):
    calls = []
    real = mlp_module.gelu_linear

    def record(*args):
        calls.append(1)
        return real(*args)
    monkeypatch.setattr(mlp_module, 'gelu_linear', record)
    return calls


@pytest.mark.parametrize('case,expected', [
    ('cpu_train', 1), ('no_grad', 0), ('autocast', 0), ('meta', 0), ('switched_off', 0),
    ('tanh_gelu', 0), ('dropout', 0), ('tracing', 0)])
def test_mlp_picks_the_gelu_recompute_only_for_cpu_training(monkeypatch, case, expected):
    calls = _gelu_calls(monkeypatch)
    act = (lambda: torch.nn.GELU(approximate='tanh')) if case == 'tanh_gelu' else torch.nn.GELU
    mlp = Mlp(8, 16, act_layer=act, drop=0.1 if case == 'dropout' else 0.0).train()
    mlp.recompute_gelu = case != 'switched_off'
    x = torch.randn(3, 8, device='meta' if case == 'meta' else 'cpu')
    if case == 'meta':
        mlp = mlp.to('meta')
    if case == 'no_grad':
        with torch.no_grad():
            mlp(x)
    elif case == 'autocast':
        with torch.autocast('cpu', dtype=torch.bfloat16):
            mlp(x)
    elif case == 'tracing':
        torch.jit.trace(mlp, x, check_trace=False)
    else:
        mlp(x)
    assert len(calls) == expected


@pytest.mark.parametrize('case,expected', [
    ('cpu_eval', True), ('grad', False), ('autocast', False), ('meta', False)])
def test_chunked_inference_only_in_cpu_inference(case, expected):
    x = torch.randn(1, 3, 8, 8, device='meta' if case == 'meta' else 'cpu')
    with torch.set_grad_enabled(case == 'grad'), \
            torch.autocast('cpu', dtype=torch.bfloat16, enabled=case == 'autocast'):
        assert swin_inference.chunked_inference_applies(x) is expected


def test_accel_off_runs_the_plain_path_everywhere(monkeypatch):
    calls = _gelu_calls(monkeypatch)
    monkeypatch.setattr(swin_inference, '_stage_', lambda *a: calls.append('chunked'))
    model = randomize_(SwinBackbone(**SMALL, accel='off'))
    x = torch.randn(1, 3, 40, 56)
    with torch.no_grad():
        model.eval()(x)
    model.train()(x)
    assert calls == []


# ----------------------------------------------------------------------------- GELU recompute
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
    """accel='auto' on the CPU: same outputs and gradients as 'off', and exactly the GELU
    outputs (one ``fc1``-sized activation per block) fewer saved bytes."""
    x = torch.randn(2, 3, 61, 75)

    def run(accel):
        model = randomize_(SwinBackbone(**SMALL, drop_path_rate=0.0, accel=accel)).train()
        saved, hidden = {}, []

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        for m in model.modules():
            if isinstance(m, Mlp):
                m.fc1.register_forward_hook(lambda mod, i, out: hidden.append(out.nbytes))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            outs = model(x)
        sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in outs).backward()
        grads = [p.grad for p in model.parameters()]
        return outs, grads, sum(saved.values()), sum(hidden)
    outs_a, grads_a, saved_a, _ = run('auto')
    outs_o, grads_o, saved_o, gelu_bytes = run('off')
    assert_close_rel(outs_a, outs_o, tol=1e-5)
    assert_close_rel(grads_a, grads_o, tol=1e-4)
    assert saved_o - saved_a == gelu_bytes, (saved_a, saved_o, gelu_bytes)


def test_double_backward_through_the_training_kernel():
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
    monkeypatch.setattr(swin_inference, 'CHUNK_BYTES', 1 << 14)       # many chunks per block
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
    monkeypatch.setattr(swin_inference, 'CHUNK_BYTES', 1 << 15)
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
