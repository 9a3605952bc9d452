"""Window attention of the ViT families against a reference written here from the official
detection code (EVA-02/det ``vit.py``: zero-padded ``window_partition``, ``rope_win`` built on
the window grid (``ft_seq_len=window_size``) and ``rope_glb`` on the full grid, both rescaled
onto the pretraining grid ``pt_hw_seq_len``; the cls token dropped), per-window Python loops,
no code of ours; and the measured effect of the cls / register token choice."""
import pytest
import torch
import torch.nn.functional as F
from helpers import max_rel_err, randomize_
from timm.layers.pos_embed_sincos import RotaryEmbeddingDinoV3

import vitdet_plugin  # noqa: F401
from vitdet_plugin.models.backbones import DINOv2Backbone, DINOv3Backbone, EVA02Backbone

TOL = 1e-5
DIMS = dict(embed_dims=32, depth=4, num_heads=2)
WINDOW = 3
GLOBAL = (1, 3)


# ---------------------------------------------------------------------------- reference
def eva_det_rope(head_dim, pt, ft):
    """EVA-02/det ``VisionRotaryEmbeddingFast(dim=head_dim // 2, pt_seq_len, ft_seq_len)``,
    per axis (``ft`` may be non-square here): ``(ft_h, ft_w, head_dim)`` sin and cos."""
    dim = head_dim // 2
    freqs = 1.0 / (10000 ** (torch.arange(0, dim, 2)[:dim // 2].float() / dim))
    th = torch.arange(ft[0]) / ft[0] * pt[0]
    tw = torch.arange(ft[1]) / ft[1] * pt[1]
    fh = torch.einsum('i,f->if', th, freqs).repeat_interleave(2, -1)          # (h, dim)
    fw = torch.einsum('i,f->if', tw, freqs).repeat_interleave(2, -1)          # (w, dim)
    f = torch.cat([fh[:, None].expand(-1, ft[1], -1), fw[None].expand(ft[0], -1, -1)], -1)
    return f.sin(), f.cos()


def eva_rotate_half(x):  # EVA's rotate_half: '... (d r) -> ... d r', (-x2, x1)
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((-x2, x1), -1).flatten(-2)


def dinov3_rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def attention(sd, pre, x, heads, rope, rotate, num_prefix):
    """``x`` (T, C) tokens of one window / image; ``rope`` (sin, cos) of its patch tokens."""
    t, c = x.shape
    w = sd[pre + 'qkv.weight']
    bias = torch.cat([sd[pre + 'q_bias'], torch.zeros(c), sd[pre + 'v_bias']]) \
        if pre + 'q_bias' in sd else sd.get(pre + 'qkv.bias')
    q, k, v = F.linear(x, w, bias).reshape(t, 3, heads, c // heads).permute(1, 2, 0, 3)
    if rope is not None:
        sin, cos = rope
        n = num_prefix
        q = torch.cat([q[:, :n], q[:, n:] * cos + rotate(q[:, n:]) * sin], 1)
        k = torch.cat([k[:, :n], k[:, n:] * cos + rotate(k[:, n:]) * sin], 1)
    attn = (q * (c // heads) ** -0.5) @ k.transpose(-2, -1)
    out = (attn.softmax(-1) @ v).transpose(0, 1).reshape(t, c)
    if pre + 'norm.weight' in sd:  # sub-LN
        out = F.layer_norm(out, (c,), sd[pre + 'norm.weight'], sd[pre + 'norm.bias'], EPS[0])
    return F.linear(out, sd[pre + 'proj.weight'], sd[pre + 'proj.bias'])


EPS = [1e-6]


def mlp(sd, pre, x):
    if pre + 'fc1_g.weight' in sd:  # EVA-02/det SwiGLU: w1, w2, ffn_ln, w3
        h = F.silu(F.linear(x, sd[pre + 'fc1_g.weight'], sd[pre + 'fc1_g.bias'])) * \
            F.linear(x, sd[pre + 'fc1_x.weight'], sd[pre + 'fc1_x.bias'])
        if pre + 'norm.weight' in sd:
            h = F.layer_norm(h, h.shape[-1:], sd[pre + 'norm.weight'], sd[pre + 'norm.bias'],
                             EPS[0])
        return F.linear(h, sd[pre + 'fc2.weight'], sd[pre + 'fc2.bias'])
    h = F.gelu(F.linear(x, sd[pre + 'fc1.weight'], sd[pre + 'fc1.bias']))
    return F.linear(h, sd[pre + 'fc2.weight'], sd[pre + 'fc2.bias'])


def reference(model, x, rope_global, rope_window, rotate):
    """The windowed forward from the weights: ``rope_global(h, w)`` / ``rope_window`` give
    ``(h, w, d)`` tables (or None), window blocks loop over the zero-padded windows; prefix
    tokens (if the model keeps them) join every window and are averaged over the windows."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    heads, patch = model.num_heads, model.patch_size
    b = x.shape[0]
    tokens = F.conv2d(x, sd['patch_embed.proj.weight'], sd['patch_embed.proj.bias'],
                      stride=patch)                                  # (B, C, h, w)
    c, h, w = tokens.shape[1:]
    tokens = tokens.flatten(2).transpose(1, 2)
    p = model.num_prefix
    if 'pos_embed' in sd:
        gh, gw = model.pretrain_grid
        grid = sd['pos_embed'][:, 1:].reshape(1, gh, gw, c).permute(0, 3, 1, 2)
        # timm's resize (antialiased bicubic, which PyTorch computes with another cubic
        # kernel than plain bicubic, also when enlarging); EVA-02/det's get_abs_pos resizes
        # without antialiasing: the one place our backbone follows timm instead
        grid = F.interpolate(grid, size=(h, w), mode='bicubic', align_corners=False,
                             antialias=True)
        tokens = tokens + grid.flatten(2).transpose(1, 2)
    prefix = []
    if p:  # cls (+ its position slot), then the registers
        cls = sd['cls_token'][0] + (sd['pos_embed'][0, :1] if 'pos_embed' in sd else 0)
        prefix = [cls] + ([sd['reg_token'][0]] if 'reg_token' in sd else [])
    outs = []
    for i in range(b):
        seq = torch.cat(prefix + [tokens[i]]) if p else tokens[i]    # (P + h * w, C)
        for j in range(model.depth):
            pre = f'blocks.{j}.'
            y = F.layer_norm(seq, (c,), sd[pre + 'norm1.weight'], sd[pre + 'norm1.bias'], EPS[0])
            if j in model.global_attn_indexes:
                table = rope_global(h, w)
                rope = None if table is None else tuple(t.reshape(h * w, -1) for t in table)
                a = attention(sd, pre + 'attn.', y, heads, rope, rotate, p)
            else:
                a = window_attention(sd, pre + 'attn.', y, p, (h, w), heads, rope_global,
                                     rope_window, rotate)
            if pre + 'ls1.gamma' in sd:
                a = a * sd[pre + 'ls1.gamma']
            seq = seq + a
            y = F.layer_norm(seq, (c,), sd[pre + 'norm2.weight'], sd[pre + 'norm2.bias'], EPS[0])
            m = mlp(sd, pre + 'mlp.', y)
            seq = seq + (m * sd[pre + 'ls2.gamma'] if pre + 'ls2.gamma' in sd else m)
        if 'norm.weight' in sd:
            seq = F.layer_norm(seq, (c,), sd['norm.weight'], sd['norm.bias'], EPS[0])
        outs.append(seq[p:].t().reshape(c, h, w))
    return torch.stack(outs)


def window_attention(sd, pre, y, p, hw, heads, rope_global, rope_window, rotate):
    h, w = hw
    c = y.shape[-1]
    hp, wp = -(-h // WINDOW) * WINDOW, -(-w // WINDOW) * WINDOW
    grid = torch.zeros(hp, wp, c)
    grid[:h, :w] = y[p:].reshape(h, w, c)
    d = c // heads
    if rope_window is not None:      # every window: its own grid
        full = tuple(t.repeat(hp // WINDOW, wp // WINDOW, 1) for t in rope_window)
    else:                            # the full grid's table, identity on the padding
        table = rope_global(h, w)
        full = None
        if table is not None:
            full = (torch.zeros(hp, wp, d), torch.ones(hp, wp, d))
            full[0][:h, :w], full[1][:h, :w] = table
    out = torch.zeros(hp, wp, c)
    prefix_sum = torch.zeros(p, c)
    for r in range(0, hp, WINDOW):
        for s in range(0, wp, WINDOW):
            win = grid[r:r + WINDOW, s:s + WINDOW].reshape(-1, c)
            rope = None if full is None else tuple(
                t[r:r + WINDOW, s:s + WINDOW].reshape(-1, d) for t in full)
            o = attention(sd, pre, torch.cat([y[:p], win]), heads, rope, rotate, p)
            out[r:r + WINDOW, s:s + WINDOW] = o[p:].reshape(WINDOW, WINDOW, c)
            prefix_sum += o[:p]
    windows = (hp // WINDOW) * (wp // WINDOW)
    return torch.cat([prefix_sum / windows, out[:h, :w].reshape(h * w, c)])


# ---------------------------------------------------------------------------- tests
def eva02(**kw):
    return EVA02Backbone(arch=dict(DIMS, mlp='swiglu', mlp_sub_ln=True, qkv_bias='qv',
                                   mlp_ratio=8 / 3, global_attn_indexes=GLOBAL),
                         window_size=WINDOW, pretrain_img_size=56,
                         rope=dict(temperature=1e4, ref_grid=(4, 4)), **kw)


def dinov3(**kw):
    return DINOv3Backbone(arch=dict(DIMS, qkv_bias='qv', layer_scale=1e-5, num_reg_tokens=4,
                                    norm_eps=1e-5, global_attn_indexes=GLOBAL),
                          window_size=WINDOW, **kw)


@pytest.mark.parametrize('hw', [(70, 98), (84, 84)])
def test_eva02_det_windows_equal_the_reference(hw):
    """EVA-02-det: cls dropped, rope of window blocks on the window grid, of global blocks on
    the full grid, both relative to the 4 x 4 pretraining grid; padded windows (5 x 7)."""
    model = randomize_(eva02(prefix_tokens='drop', rope_coords='window')).eval()
    x = torch.randn(2, 3, *hw)
    with torch.no_grad():
        (out,) = model(x)
        ref = reference(model, x, lambda h, w: eva_det_rope(16, (4, 4), (h, w)),
                        eva_det_rope(16, (4, 4), (WINDOW, WINDOW)), eva_rotate_half)
    assert max_rel_err(out, ref) <= TOL


@pytest.mark.parametrize('coords', ['global', 'window'])
def test_dinov3_windows_with_prefix_tokens_equal_the_reference(coords):
    """DINOv3: cls + 4 registers in every window (averaged), rope on global or window
    coordinates (timm's DINOv3 rope module), padded windows, non-square grid."""
    model = randomize_(dinov3(prefix_tokens='keep', rope_coords=coords)).eval()
    EPS[0] = 1e-5
    rope = RotaryEmbeddingDinoV3(dim=16, temperature=100)

    def table(h, w):
        sin, cos = rope.get_embed([h, w]).chunk(2, -1)
        return sin.reshape(h, w, -1), cos.reshape(h, w, -1)

    x = torch.randn(2, 3, 80, 112)
    try:
        with torch.no_grad():
            (out,) = model(x)
            ref = reference(model, x, table, table(WINDOW, WINDOW) if coords == 'window'
                            else None, dinov3_rotate_half)
    finally:
        EPS[0] = 1e-6
    assert max_rel_err(out, ref) <= TOL


def test_dinov2_windows_keep_the_cls_and_register_tokens():
    model = randomize_(DINOv2Backbone(arch=dict(DIMS, num_reg_tokens=4, layer_scale=1e-5,
                                                global_attn_indexes=GLOBAL),
                                      window_size=WINDOW, pretrain_img_size=56)).eval()
    x = torch.randn(1, 3, 70, 84)
    with torch.no_grad():
        (out,) = model(x)
        ref = reference(model, x, lambda h, w: None, None, None)
    assert max_rel_err(out, ref) <= TOL


def _relative_difference(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_prefix_token_choice_measured(capsys):
    """Patch features of each prefix choice vs the all-global model with the same weights
    (relative L2 difference, random weights, 2 of 4 blocks global, 5 x 7 grid, window 3).
    Printed for the report; the chosen default ('keep') must be the closer one."""
    results = {}
    x = torch.randn(2, 3, 80, 112)
    for family, build in (('DINOv3', dinov3), ('EVA-02', eva02)):
        ref_model = randomize_(build(prefix_tokens='keep'))
        sd = ref_model.state_dict()
        every = build(prefix_tokens='keep', global_attn_indexes=range(4)).eval()
        every.load_state_dict(sd)
        with torch.no_grad():
            (target,) = every(x)
            for choice in ('keep', 'drop'):
                model = build(prefix_tokens=choice).eval()
                model.load_state_dict(sd, strict=choice == 'keep')  # 'drop': no tokens
                (out,) = model(x)
                results[family, choice] = _relative_difference(out, target)
    with capsys.disabled():
        print('\nprefix tokens vs all-global (relative L2):',
              ', '.join(f'{f} {c}: {v:.4f}' for (f, c), v in results.items()))
    for family in ('DINOv3', 'EVA-02'):
        assert results[family, 'keep'] < results[family, 'drop'], results
