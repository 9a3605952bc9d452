"""tools/analysis/visualize.py: each picture on a tiny config (size, content, and the drawn
arrays against the model's own tensors), attention recomputed from captured inputs against the
modules' outputs, and the error messages for bad arguments."""
import os.path as osp
from typing import Dict, List, Tuple

import numpy as np
import pytest
import torch
from matplotlib.image import imread

from helpers import REPO_ROOT, load_tool

from vitdet_plugin.functional import MASKED_LOGIT, window_partition
from vitdet_plugin.visualization.capture import (Call, attention_output, attention_probs,
                                                 record_calls)
from vitdet_plugin.visualization.figures import PANEL_PX
from vitdet_plugin.visualization.model import build_detector, image_input

ROOT = str(REPO_ROOT)
visualize = load_tool('analysis/visualize.py')

DEMO = osp.join(ROOT, 'configs/demo/swin_retinanet_shapes.py')
#: A zero image of this size is padded to 224 x 192 (pad_size_divisor 32): stage 0 of the demo
#: Swin (stride 8, window 6) has 28 x 24 tokens, padded to 30 x 24 for its windows (20 windows).
SHAPE = ('200', '184')
PADDED_INPUT = (224, 192)
STAGE0_TOKENS, STAGE0_PADDED, WINDOW = (28, 24), (30, 24), (6, 6)
#: A tiny ViT with the simple-pyramid neck (strides 8/16/32) on the demo detector; window 4,
#: global attention in blocks 1 and 3.
VIT_CONFIG = f'''
_base_ = [{osp.join(ROOT, 'configs/demo/swin_retinanet_shapes.py')!r}]
model = dict(
    backbone=dict(_delete_=True, type='ViTBackbone',
                  arch=dict(embed_dims=32, depth=4, num_heads=2, global_attn_indexes=(1, 3)),
                  patch_size=16, window_size=4, img_size=128, pretrain_img_size=128),
    neck=dict(_delete_=True, type='ViTSimpleFPN', in_channels=32, in_stride=16,
              out_channels=64, scale_factors=(2.0, 1.0, 0.5), num_outs=3))  # head: 64
'''


#: A tiny Swin V2 on the demo detector, window 6, strides 8/16.
SWINV2_CONFIG = f'''
_base_ = [{osp.join(ROOT, 'configs/demo/swin_retinanet_shapes.py')!r}]
model = dict(
    backbone=dict(_delete_=True, type='SwinV2Backbone', embed_dims=32, depths=[2, 2],
                  num_heads=[2, 4], patch_size=8, window_size=6, drop_path_rate=0.0,
                  out_indices=(0, 1)),
    neck=dict(in_channels=[32, 64]))
'''


@pytest.fixture(scope='module')
def swinv2_config(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp('cfg') / 'swinv2_tiny.py'
    path.write_text(SWINV2_CONFIG)
    return str(path)


@pytest.fixture(scope='module')
def vit_config(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp('cfg') / 'vit_tiny.py'
    path.write_text(VIT_CONFIG)
    return str(path)


@pytest.fixture(scope='module')
def image(tmp_path_factory) -> str:
    """A 150 x 210 picture with shapes on a gradient (resized to 137 x 192 by the demo's
    test pipeline, padded to 160 x 192: 20 x 24 tokens at stride 8)."""
    import mmcv
    h, w = 150, 210
    img = np.zeros((h, w, 3), np.uint8)
    img[..., 0] = np.linspace(0, 255, w, dtype=np.uint8)[None]
    img[..., 1] = np.linspace(255, 0, h, dtype=np.uint8)[:, None]
    img[30:80, 40:100] = (20, 200, 240)
    img[90:140, 130:190] = (240, 40, 60)
    path = str(tmp_path_factory.mktemp('img') / 'shapes.png')
    mmcv.imwrite(img, path)
    return path


def _png(path: str, cols: int, rows: int) -> np.ndarray:
    """The written PNG, checked to be ``cols x rows`` panels and not of one colour."""
    pixels = imread(path)
    assert pixels.shape[:2] == (rows * PANEL_PX, cols * PANEL_PX), pixels.shape
    assert pixels[..., :3].std() > 0.05, 'the picture is (nearly) one colour'
    return pixels


def _error(argv: List[str]) -> str:
    with pytest.raises(SystemExit) as info:
        visualize.main(argv)
    return str(info.value.code)


def _swin_calls(block_path: Tuple[int, int], inputs: torch.Tensor) -> Dict[str, tuple]:
    """Our own hooks (not the tool's) on a freshly built demo Swin block: the block's input,
    its attention's positional/keyword inputs and output."""
    backbone = build_detector(DEMO).backbone
    block = backbone.layers[block_path[0]].blocks[block_path[1]]
    seen: Dict[str, tuple] = {}
    handles = [
        block.register_forward_pre_hook(lambda m, a: seen.setdefault('block', a)),
        block.attn.register_forward_pre_hook(
            lambda m, a, k: seen.setdefault('attn', (a, k)), with_kwargs=True),
        block.attn.register_forward_hook(lambda m, a, o: seen.setdefault('out', o))]
    with torch.no_grad():
        backbone(inputs)
    for h in handles:
        h.remove()
    seen['module'] = (block,)
    return seen


# ----------------------------------------------------------------------------- pictures
def test_windows_picture_follows_the_models_partition(tmp_path):
    pic = visualize.main(['windows', DEMO, '--shape', *SHAPE, '--stage', '0',
                          '--out', str(tmp_path / 'w.png')])
    assert pic.size_px == (2 * PANEL_PX, PANEL_PX)
    _png(pic.path, cols=2, rows=1)
    hp, wp = STAGE0_PADDED
    positions = torch.arange(hp * wp).view(1, hp, wp, 1)
    for kind, shift in (('W-MSA', (0, 0)), ('SW-MSA', (3, 3))):
        drawn = torch.from_numpy(pic.arrays[kind]).flatten()
        # the model partitions the (rolled) map with window_partition: window k holds these
        rolled = torch.roll(positions, (-shift[0], -shift[1]), dims=(1, 2))
        members = window_partition(rolled, WINDOW).squeeze(-1)     # (nW, N)
        for k, tokens in enumerate(members):
            assert torch.all(drawn[tokens] == k), (kind, k)
    shifted = pic.arrays['SW-MSA']
    assert shifted[0, 0] == shifted[-1, -1]  # the cyclic shift wraps the corner window


def test_windows_picture_on_an_image(tmp_path, image):
    pic = visualize.main(['windows', DEMO, '--image', image, '--stage', '1',
                          '--out', str(tmp_path / 'w.png')])
    _png(pic.path, cols=2, rows=1)


def test_shift_mask_picture_draws_the_models_own_mask(tmp_path):
    windows = ['0', '3', '16', '19', '5']
    pic = visualize.main(['shift-mask', DEMO, '--shape', *SHAPE, '--stage', '0', '--window',
                          *windows, '--out', str(tmp_path / 'm.png')])
    _png(pic.path, cols=1 + len(windows), rows=1)
    seen = _swin_calls((0, 1), torch.zeros(1, 3, *PADDED_INPUT))
    args, kwargs = seen['attn']
    mask = kwargs['mask'] if 'mask' in kwargs else args[1]        # what SwinBlock passed
    assert mask.shape == (20, 36, 36)
    for k in map(int, windows):
        drawn = pic.arrays[f'window {k}']
        assert np.array_equal(drawn, mask[k].numpy()), k
    # the corner window mixes four regions, an inner one none
    assert (pic.arrays['window 19'] == MASKED_LOGIT).any()
    assert not pic.arrays['window 5'].any()
    assert sorted(np.unique(pic.arrays['labels'])) == list(range(9))


def test_shift_mask_default_windows_are_the_corners(tmp_path):
    pic = visualize.main(['shift-mask', DEMO, '--shape', *SHAPE, '--stage', '0',
                          '--out', str(tmp_path / 'm.png')])
    assert sorted(k for k in pic.arrays if k.startswith('window')) == [
        'window 0', 'window 16', 'window 19', 'window 3']
    _png(pic.path, cols=5, rows=1)


def test_features_picture_draws_the_loaded_checkpoints_outputs(tmp_path, image):
    from helpers import randomize_
    detector = build_detector(DEMO)
    randomize_(detector.model, seed=3)
    ckpt = str(tmp_path / 'weights.pth')
    torch.save({'state_dict': detector.model.state_dict()}, ckpt)
    pic = visualize.main(['features', DEMO, ckpt, '--image', image, '--neck',
                          '--out', str(tmp_path / 'f.png')])
    _png(pic.path, cols=1 + 3 + 3, rows=2)  # input, 3 backbone and 3 neck levels
    with torch.no_grad():
        feats = detector.backbone(image_input(detector, image).inputs)
    assert [f.shape[-2:] for f in feats] == [(20, 24), (10, 12), (5, 6)]
    for k, f in enumerate(feats):
        np.testing.assert_allclose(pic.arrays[f'backbone[{k}] norm'], f[0].norm(dim=0).numpy(),
                                   rtol=1e-5)
        pca = pic.arrays[f'backbone[{k}] pca']
        assert pca.shape == (*f.shape[-2:], 3) and pca.min() >= 0 and pca.max() <= 1
        assert pca.std() > 0.05


def test_features_picture_of_the_vit_pyramid(tmp_path, image, vit_config):
    pic = visualize.main(['features', vit_config, '--image', image, '--neck',
                          '--out', str(tmp_path / 'f.png')])
    _png(pic.path, cols=1 + 1 + 3, rows=2)  # input, the ViT's map, the pyramid's 3 levels
    assert pic.arrays['backbone[0] norm'].shape == (10, 12)
    assert [pic.arrays[f'neck[{k}] norm'].shape for k in range(3)] == [
        (20, 24), (10, 12), (5, 6)]


def test_attention_picture_swin_shifted_block(tmp_path, image):
    # block 1 = stage 0 block 1 (SW-MSA, shift 3) on the 20 x 24 map padded to 24 x 24: the
    # top-left token (2, 2) is rolled to (23, 23), the corner of the bottom-right window, in
    # the 3 x 3 region 8 of that window
    pic = visualize.main(['attention', DEMO, '--image', image, '--block', '1',
                          '--query', '2', '2', '--out', str(tmp_path / 'a.png')])
    _png(pic.path, cols=2, rows=1)
    attn = pic.arrays['attention']                                  # padded stage-0 map
    assert attn.shape == (24, 24)
    keys = ~np.isnan(attn)
    assert keys.sum() == WINDOW[0] * WINDOW[1]
    np.testing.assert_allclose(attn[keys].sum(), 1.0, rtol=1e-5)
    # the mask was applied: only the query's own region (rows and columns 0..2) gets weight
    assert np.all(attn[:3, :3] > 1e-6)
    assert np.nansum(attn) - attn[:3, :3].sum() < 1e-30


def test_attention_picture_vit_window_and_global_blocks(tmp_path, image, vit_config):
    window = visualize.main(['attention', vit_config, '--image', image, '--block', '0',
                             '--query', '5', '6', '--head', '1',
                             '--out', str(tmp_path / 'w.png')])
    _png(window.path, cols=2, rows=1)
    assert (~np.isnan(window.arrays['attention'])).sum() == 16     # a 4 x 4 window
    glob = visualize.main(['attention', vit_config, '--image', image, '--block', '1',
                           '--query', '5', '6', '--out', str(tmp_path / 'g.png')])
    _png(glob.path, cols=2, rows=1)
    attn = glob.arrays['attention']
    assert attn.shape == (10, 12) and not np.isnan(attn).any()     # the whole stride-16 map
    np.testing.assert_allclose(attn.sum(), 1.0, rtol=1e-5)


# ----------------------------------------------------------------------------- recomputation
def test_recomputed_swin_attention_gives_the_modules_output():
    seen = _swin_calls((0, 1), torch.randn(1, 3, *PADDED_INPUT))
    attn = seen['module'][0].attn
    call = Call(*seen['attn'])
    assert call.arg(1, 'mask') is not None
    probs = attention_probs(attn, call)
    np.testing.assert_allclose(attention_output(attn, call, probs), seen['out'], atol=1e-5)


@pytest.mark.parametrize('block', [0, 1])  # a window block and a global block
def test_recomputed_vit_attention_gives_the_modules_output(vit_config, block):
    backbone = build_detector(vit_config).backbone
    attn = backbone.blocks[block].attn
    with record_calls({'attn': attn}) as calls, torch.no_grad():
        outs = []
        handle = attn.register_forward_hook(lambda m, a, o: outs.append(o))
        backbone(torch.randn(1, 3, 192, 192))
        handle.remove()
    call: Call = calls['attn']
    probs = attention_probs(attn, call)
    np.testing.assert_allclose(attention_output(attn, call, probs), outs[0], atol=1e-5)


def test_swinv2_pictures_and_recomputed_attention(tmp_path, image, swinv2_config):
    for argv, cols, rows in (
            (['windows', swinv2_config, '--image', image, '--stage', '1'], 2, 1),
            (['shift-mask', swinv2_config, '--image', image, '--stage', '0'], 5, 1),
            (['features', swinv2_config, '--image', image], 3, 2),
            (['attention', swinv2_config, '--image', image, '--block', '1', '--query', '2',
              '2'], 2, 1)):
        pic = visualize.main([*argv, '--out', str(tmp_path / f'{argv[0]}.png')])
        _png(pic.path, cols=cols, rows=rows)
    backbone = build_detector(swinv2_config).backbone
    attn = backbone.layers[0].blocks[1].attn
    outs = []
    with record_calls({'attn': attn}) as calls, torch.no_grad():
        handle = attn.register_forward_hook(lambda m, a, o: outs.append(o))
        backbone(torch.randn(1, 3, 160, 192))
        handle.remove()
    call: Call = calls['attn']
    assert call.arg(1, 'mask') is not None
    probs = attention_probs(attn, call)
    np.testing.assert_allclose(attention_output(attn, call, probs), outs[0], atol=1e-5)


# ----------------------------------------------------------------------------- errors
def test_error_messages(tmp_path, image, vit_config):
    out = ['--out', str(tmp_path / 'x.png')]
    assert _error(['windows', DEMO, '--shape', *SHAPE, '--stage', '3', *out]) == (
        'error: stage 3 is out of range: SwinBackbone has 3 stages (0..2)')
    assert _error(['shift-mask', DEMO, '--shape', *SHAPE, '--stage', '-1', *out]) == (
        'error: stage -1 is out of range: SwinBackbone has 3 stages (0..2)')
    assert _error(['attention', DEMO, '--image', image, '--block', '6', '--query', '0', '0',
                   *out]) == ('error: block 6 is out of range: SwinBackbone has 6 blocks (0..5; '
                              'stage 0: 0..1; stage 1: 2..3; stage 2: 4..5)')
    assert _error(['attention', vit_config, '--image', image, '--block', '4', '--query', '0',
                   '0', *out]) == 'error: block 4 is out of range: ViTBackbone has 4 blocks (0..3)'
    missing = str(tmp_path / 'nope.png')
    assert _error(['features', DEMO, '--image', missing, *out]) == (
        f'error: image {missing!r} does not exist')
    assert _error(['attention', DEMO, '--image', image, '--block', '2', '--query', '12', '3',
                   *out]) == ('error: query (12, 3) is off the token map of block 2 (stage 1 '
                              'block 0): it has 10 x 12 tokens, so y must be in 0..9 and x in '
                              '0..11')
    assert _error(['attention', DEMO, '--image', image, '--block', '0', '--query', '0', '0',
                   '--head', '2', *out]) == (
        'error: head 2 is out of range: block 0 (stage 0 block 0) has 2 heads (0..1)')
    assert _error(['shift-mask', DEMO, '--shape', *SHAPE, '--stage', '0', '--window', '20',
                   *out]) == ('error: window 20 is out of range: stage 0 has 20 windows (0..19) '
                              'on its 30 x 24 padded token map')
    assert _error(['shift-mask', DEMO, '--shape', *SHAPE, '--stage', '2', *out,
                   '--cfg-options', 'model.backbone.depths=[2,2,1]']) == (
        'error: stage 2 has no shifted block (1 block(s), all W-MSA): the shift mask exists '
        'only in SW-MSA blocks (odd indices)')
    assert _error(['windows', vit_config, '--shape', *SHAPE, *out]) == (
        'error: ViTBackbone has no shifted-window stages (backbone.layers[i].blocks[j] with '
        'window_size, shift_size and attn); windows and shift-mask need a Swin-style backbone')
    assert _error(['features', DEMO, '--image', image, '--out', 'x.jpg']) == (
        'error: --out x.jpg: the picture is a PNG; name it *.png')
    assert not (tmp_path / 'x.png').exists()


def test_default_output_path():
    args = visualize.build_parser().parse_args(['shift-mask', DEMO, '--shape', '8', '8',
                                                '--stage', '1'])
    assert visualize.default_out(args) == osp.join(
        'work_dirs', 'visualize', 'swin_retinanet_shapes_shift-mask_stage1.png')
