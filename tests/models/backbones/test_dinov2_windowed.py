"""RF-DETR's windowed DINOv2 (``DINOv2Backbone(num_windows=n)``) against the ``rfdetr`` package's
own ``WindowedDinov2WithRegistersBackbone`` (random init, shrunk: 4 blocks, width 64, 4 heads,
4 registers), its state dict loaded through our transformers layout; its global blocks come from
rfdetr's own rule (``compute_window_block_indexes``), ours from the default."""
import re

import pytest
import torch
from helpers import max_rel_err, randomize_
from rfdetr.models.backbone.dinov2 import compute_window_block_indexes
from rfdetr.models.backbone.dinov2_with_windowed_attn import (
    WindowedDinov2WithRegistersBackbone, WindowedDinov2WithRegistersConfig)

import vitdet_plugin  # noqa: F401
from vitdet_plugin.models.backbones import DINOv2Backbone

TOL = 1e-5
WIDTH, DEPTH, HEADS, REGS = 64, 4, 4, 4
#: Our 0-based tap blocks; rfdetr's stages (1-based) are these + 1.
TAPS = (1, 3)
#: The stored position grid (RF-DETR's ``positional_encoding_size``), per side.
POS_GRID = 6


def rfdetr_backbone(patch: int, windows: int) -> WindowedDinov2WithRegistersBackbone:
    stages = [i + 1 for i in TAPS]
    config = WindowedDinov2WithRegistersConfig(
        hidden_size=WIDTH, num_hidden_layers=DEPTH, num_attention_heads=HEADS,
        image_size=POS_GRID * patch, patch_size=patch, num_register_tokens=REGS,
        out_features=[f'stage{s}' for s in stages], num_windows=windows,
        window_block_indexes=compute_window_block_indexes(stages))
    return randomize_(WindowedDinov2WithRegistersBackbone(config)).eval()


def ours(patch: int, windows: int, **kwargs) -> DINOv2Backbone:
    return DINOv2Backbone(arch=dict(embed_dims=WIDTH, depth=DEPTH, num_heads=HEADS),
                          num_reg_tokens=REGS, patch_size=patch, pretrain_patch_size=patch,
                          pretrain_img_size=POS_GRID * patch, num_windows=windows,
                          out_indices=TAPS, **kwargs).eval()


@pytest.mark.parametrize('patch,windows,sizes', [
    (16, 2, ((96, 96), (64, 128))),
    (14, 2, ((84, 84), (56, 112))),
    (16, 1, ((80, 80), (48, 96))),
])
def test_taps_equal_rfdetr(patch, windows, sizes, tmp_path):
    ref = rfdetr_backbone(patch, windows)
    torch.save(ref.state_dict(), tmp_path / 'rfdetr_backbone.pth')
    model = ours(patch, windows, init_cfg=dict(type='Pretrained',
                                               checkpoint=str(tmp_path / 'rfdetr_backbone.pth')))
    model.init_weights()
    assert model.init_report.layout.endswith('transformers Dinov2WithRegistersModel')
    g = torch.Generator().manual_seed(1)
    for size in sizes:
        x = torch.randn(2, 3, *size, generator=g)
        with torch.no_grad():
            want = ref(x).feature_maps
            got = model(x)
        assert [o.shape for o in got] == [o.shape for o in want]
        for o, r in zip(got, want):
            err = max_rel_err(o, r)
            print(f'patch {patch}, {windows} x {windows} windows, {size}: rel err {err:.2e}')
            assert err <= TOL


def test_global_blocks_follow_rfdetr_unless_given():
    stages = [3, 6, 9, 12]
    windowed = set(compute_window_block_indexes(stages))
    model = DINOv2Backbone(arch='small', patch_size=16, num_windows=2, out_indices=(2, 5, 8, 11))
    run = set(range(12))  # the blocks the taps need: all of them
    assert set(model.global_attn_indexes) == run - windowed
    given = DINOv2Backbone(arch=dict(embed_dims=WIDTH, depth=DEPTH, num_heads=HEADS),
                           num_windows=2, global_attn_indexes=(0,), out_indices=TAPS)
    assert given.global_attn_indexes == (0,)


def test_a_size_the_tiles_do_not_divide_is_refused_naming_the_nearest():
    model = ours(16, 2)
    want = ('DINOv2Backbone(num_windows=2): a 80x96 input gives a 5x6 patch grid (patch 16), '
            'which does not split into 2 x 2 windows; the nearest valid sizes are 64x96 and '
            '96x96 (multiples of patch 16 x num_windows 2 = 32)')
    with pytest.raises(ValueError, match=re.escape(want)):
        model(torch.zeros(1, 3, 80, 96))
    assert model(torch.zeros(1, 3, 64, 96))[0].shape == (1, WIDTH, 4, 6)


def test_window_size_is_refused_with_windows():
    want = ("DINOv2Backbone(num_windows=2): window_size is ViTDet's window, but RF-DETR's tiles "
            'cover the whole map; remove window_size')
    with pytest.raises(ValueError, match=re.escape(want)):
        DINOv2Backbone(arch='small', num_windows=2, window_size=8)


def test_fullgraph_compile_matches_eager():
    """The tiles, the joined global blocks and the size check trace into one graph."""
    model = randomize_(ours(16, 2)).train()
    x = torch.randn(2, 3, 64, 96, requires_grad=True)
    compiled = torch.compile(model, backend='aot_eager', fullgraph=True)
    grads = []
    for m in (model, compiled):
        out = m(x)[-1]
        grads.append(torch.autograd.grad(out.square().sum(), [x] + list(model.parameters())))
        assert max_rel_err(out, model(x)[-1]) <= TOL
    for got, want in zip(grads[1], grads[0]):
        assert max_rel_err(got, want) <= TOL
