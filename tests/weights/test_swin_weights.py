"""Swin checkpoint formats: detection, conversion round trips, resizing, strict and safe loading."""
import logging
import os
import pickle
import re

import pytest
import torch
from helpers import assert_close_rel, randomize_
from mmengine.config import ConfigDict

import vitdet_plugin  # noqa: F401
from vitdet_plugin.weights import load_pretrained
from vitdet_plugin.models.backbones.swin import SwinBackbone
from vitdet_plugin.weights import CheckpointError, detect_layout
from vitdet_plugin.weights.swin import convert_swin, resize_rel_pos_bias_table, swin_to_mmdet

ARCH = dict(embed_dims=32, depths=(2, 2, 2, 2), num_heads=(2, 2, 4, 4))


def _ours(**kw):
    return SwinBackbone(arch=ARCH, drop_path_rate=0.0, **kw).eval()


def _official_from(model: SwinBackbone, buffers: bool = True) -> dict:
    """What microsoft/Swin-Transformer saves for these weights: ``{'model': sd}`` with the
    index / mask buffers, the final norm and the classification head, no output norms."""
    from vitdet_plugin.functional import relative_position_index, shifted_window_mask
    sd = {k: v.clone() for k, v in model.state_dict().items() if not re.match(r'norm\d', k)}
    for i, stage in enumerate(model.layers if buffers else []):
        for j, blk in enumerate(stage.blocks):
            sd[f'layers.{i}.blocks.{j}.attn.relative_position_index'] = \
                relative_position_index(blk.window_size)
            if any(blk.shift_size):
                sd[f'layers.{i}.blocks.{j}.attn_mask'] = shifted_window_mask(
                    (56 >> i, 56 >> i), blk.window_size, blk.shift_size)
    c = model.num_features[-1]
    sd.update({'norm.weight': torch.randn(c), 'norm.bias': torch.randn(c),
               'head.weight': torch.randn(1000, c), 'head.bias': torch.randn(1000)})
    return {'model': sd}


def _assert_same_weights(model, other, skip=r'^norm\d'):
    a, b = model.state_dict(), other.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        if not re.match(skip, k):
            assert torch.equal(a[k], b[k]), k


def test_official_checkpoint_loads_and_matches_mmdet_loading_the_same_file(tmp_path, caplog):
    src = randomize_(_ours())
    path = str(tmp_path / 'swin_official.pth')
    torch.save(_official_from(src), path)

    ours = _ours(init_cfg=dict(type='Pretrained', checkpoint=path))
    with caplog.at_level(logging.WARNING, logger='vitdet_plugin'):
        ours.init_weights()
    _assert_same_weights(ours, src)
    assert 'norm0.weight' in caplog.text  # output norms are reported as kept at init

    from mmdet.models.backbones import SwinTransformer
    ref = SwinTransformer(embed_dims=32, depths=(2, 2, 2, 2), num_heads=(2, 2, 4, 4),
                          drop_path_rate=0.0, convert_weights=True,
                          init_cfg=ConfigDict(type='Pretrained', checkpoint=path))
    ref.init_weights()
    ref.eval()
    x = torch.randn(1, 3, 160, 224)
    with torch.no_grad():
        assert_close_rel(ours.eval()(x), ref(x), tol=1e-5)


# Checkpoints built independently of our converters: from mmdet's own SwinTransformer weights,
# mapped by hand to the layouts the reference repositories document (REFERENCE.md), so a bug
# shared by a converter and its inverse cannot pass.
MM_ARCH = dict(embed_dims=32, depths=(2, 2, 2, 2), num_heads=(2, 2, 4, 4))
#: mmdet's Unfold-based PatchMerging orders the four merged pixels (0,0),(0,1),(1,0),(1,1)
#: where the official code concatenates (0,0),(1,0),(0,1),(1,1): pixel 1 and 2 swap, and
#: the unfolded channels are pixel-minor (c * 4 + pixel) instead of pixel-major
UNFOLD_TO_OFFICIAL_PIXELS = [0, 2, 1, 3]
#: mmdet -> official key pieces (microsoft/Swin-Transformer, models/swin_transformer.py)
MMDET_TO_OFFICIAL = (('patch_embed.projection.', 'patch_embed.proj.'), ('stages.', 'layers.'),
                     ('.attn.w_msa.', '.attn.'), ('.ffn.layers.0.0.', '.mlp.fc1.'),
                     ('.ffn.layers.1.', '.mlp.fc2.'))
#: the official shifted-window mask buffer is sized for the 224 pretraining input
OFFICIAL_TOKENS_224 = 56


def _mmdet_swin(**kw):
    from mmdet.models.backbones import SwinTransformer
    ref = randomize_(SwinTransformer(**MM_ARCH, drop_path_rate=0.0, **kw), seed=3)
    ref.eval()  # mmdet's SwinTransformer.train() returns None
    return ref


def _unfold_to_official(w: torch.Tensor) -> torch.Tensor:
    """A PatchMerging weight's last dim (4 * C), mmdet's unfold order -> official order."""
    lead, c4 = w.shape[:-1], w.shape[-1]
    w = w.reshape(*lead, c4 // 4, 4).transpose(-1, -2)       # pixel-major
    return w[..., UNFOLD_TO_OFFICIAL_PIXELS, :].reshape(*lead, c4)


def _official_from_mmdet(ref) -> dict:
    """microsoft/Swin-Transformer's ``{'model': sd}`` for the weights of mmdet's ``ref``: no
    output norms, a final norm and a classification head, ``attn_mask`` buffers."""
    sd = {}
    for k, v in ref.state_dict().items():
        if re.match(r'norm\d\.', k):
            continue  # mmdet's per-output norms do not exist in classification checkpoints
        for a, b in MMDET_TO_OFFICIAL:
            k = k.replace(a, b)
        if '.downsample.' in k:
            v = _unfold_to_official(v)
        sd[k] = v.clone()
    for i, depth in enumerate(MM_ARCH['depths']):
        windows = (OFFICIAL_TOKENS_224 >> i) // 7
        for j in range(1, depth, 2):  # shifted blocks keep their 224-input mask
            sd[f'layers.{i}.blocks.{j}.attn_mask'] = torch.zeros(windows ** 2, 49, 49)
    c = MM_ARCH['embed_dims'] * 8
    sd.update({'norm.weight': torch.randn(c), 'norm.bias': torch.randn(c),
               'head.weight': torch.randn(1000, c), 'head.bias': torch.randn(1000)})
    return {'model': sd}


def _identity_output_norms(ref) -> None:
    with torch.no_grad():
        for i in range(len(MM_ARCH['depths'])):
            getattr(ref, f'norm{i}').weight.fill_(1.0)
            getattr(ref, f'norm{i}').bias.zero_()


def test_official_layout_built_from_mmdet_weights_loads_and_matches_mmdet(tmp_path):
    ref = _mmdet_swin()
    _identity_output_norms(ref)  # not in the file: both models keep LayerNorm's init
    path = str(tmp_path / 'official.pth')
    torch.save(_official_from_mmdet(ref), path)
    x = torch.randn(1, 3, 96, 128)
    with torch.no_grad():
        expected = ref(x)
        # the hand-written layout is what mmdet's own converter reads
        from mmdet.models.backbones import SwinTransformer
        check = SwinTransformer(**MM_ARCH, drop_path_rate=0.0, convert_weights=True,
                                init_cfg=ConfigDict(type='Pretrained', checkpoint=path))
        check.init_weights()
        check.eval()
        assert_close_rel(check(x), expected, tol=1e-6)
        ours = _ours(init_cfg=dict(type='Pretrained', checkpoint=path))
        ours.init_weights()
        assert_close_rel(ours.eval()(x), expected, tol=1e-5)


def test_mmdet_checkpoint_of_mmdet_model_matches_mmdet():
    ref = _mmdet_swin()
    ours = _ours()
    load_pretrained(ours, {'state_dict': ref.state_dict()})
    x = torch.randn(1, 3, 96, 128)
    with torch.no_grad():
        assert_close_rel(ours(x), ref(x), tol=1e-5)


def test_detect_formats():
    src = randomize_(_ours())
    sd = src.state_dict()
    assert detect_layout(sd).name == 'ours'
    assert detect_layout(_official_from(src)['model']).name == 'official'
    assert detect_layout(swin_to_mmdet(sd)).name == 'mmdet'
    assert detect_layout({'backbone.' + k: v for k, v in sd.items()}).name == 'swin_od'
    from timm.models.swin_transformer import SwinTransformer
    timm_sd = SwinTransformer(embed_dim=32, depths=(2, 2, 2, 2), num_heads=(2, 2, 4, 4),
                              num_classes=5).state_dict()
    assert detect_layout(timm_sd).name == 'timm'


def test_swin_od_detection_checkpoint(tmp_path):
    src = randomize_(_ours(use_abs_pos_embed=True, pretrain_img_size=224))
    sd = {'backbone.' + k: v for k, v in src.state_dict().items()}
    sd.update({'neck.lateral_convs.0.conv.weight': torch.randn(8, 32, 1, 1),
               'bbox_head.cls.weight': torch.randn(3, 8)})
    ours = _ours(use_abs_pos_embed=True, pretrain_img_size=224)
    dropped = load_pretrained(ours, {'state_dict': sd, 'meta': {'epoch': 12}}).dropped
    _assert_same_weights(ours, src, skip='^$')
    assert set(dropped) == {'neck.lateral_convs.0.conv.weight', 'bbox_head.cls.weight'}


def test_mmdet_and_mmpretrain_checkpoints():
    src = randomize_(_ours())
    mm = swin_to_mmdet(src.state_dict())
    for wrapped in ({'state_dict': mm},                                       # mmdet backbone
                    {'state_dict': {**{'backbone.' + k: v for k, v in mm.items()},  # mmpretrain
                                    'head.fc.weight': torch.randn(10, 256)}}):
        ours = _ours()
        load_pretrained(ours, wrapped)
        _assert_same_weights(ours, src, skip='^$')


def test_timm_roundtrip_weights():
    from timm.models.swin_transformer import SwinTransformer
    ref = randomize_(SwinTransformer(embed_dim=32, depths=(2, 2, 2, 2), num_heads=(2, 2, 4, 4),
                                     num_classes=5))
    ours = _ours()
    load_pretrained(ours, ref.state_dict())
    rsd = ref.state_dict()
    osd = ours.state_dict()
    assert torch.equal(osd['layers.0.downsample.reduction.weight'],
                       rsd['layers.1.downsample.reduction.weight'])
    assert torch.equal(osd['layers.3.blocks.1.attn.relative_position_bias_table'],
                       rsd['layers.3.blocks.1.attn.relative_position_bias_table'])


def test_window_resize_matches_mmdet(tmp_path):
    src = randomize_(_ours())  # window 7
    path = str(tmp_path / 'w7.pth')
    # without the index buffers: mmdet itself cannot load those into another window size
    torch.save(_official_from(src, buffers=False), path)
    ours = _ours(window_size=12, init_cfg=dict(type='Pretrained', checkpoint=path))
    ours.init_weights()
    from mmdet.models.backbones import SwinTransformer
    ref = SwinTransformer(embed_dims=32, depths=(2, 2, 2, 2), num_heads=(2, 2, 4, 4),
                          window_size=12, convert_weights=True,
                          init_cfg=ConfigDict(type='Pretrained', checkpoint=path))
    ref.init_weights()
    table = ours.layers[2].blocks[1].attn.relative_position_bias_table
    assert tuple(table.shape) == (23 * 23, 4)
    assert torch.allclose(table, ref.stages[2].blocks[1].attn.w_msa.relative_position_bias_table,
                          atol=1e-6)


def test_abs_pos_embed_resized_from_token_layout():
    sd = swin_to_mmdet(randomize_(_ours(use_abs_pos_embed=True, pretrain_img_size=224))
                       .state_dict())
    assert sd['absolute_pos_embed'].shape == (1, 56 * 56, 32)
    converted, _ = convert_swin(sd, pos_grid=(96, 96))
    assert converted['absolute_pos_embed'].shape == (1, 32, 96, 96)


# --------------------------------------------------------------------------- errors
def test_missing_checkpoint_file():
    model = _ours(init_cfg=dict(type='Pretrained', checkpoint='/nonexistent/swin.pth'))
    with pytest.raises(FileNotFoundError, match=r"'/nonexistent/swin\.pth' does not exist"):
        model.init_weights()


def test_unrecognised_checkpoint_format():
    with pytest.raises(CheckpointError, match='unrecognised checkpoint format'):
        load_pretrained(_ours(), {'state_dict': {'conv1.weight': torch.zeros(3)}})


def test_checkpoint_for_a_different_arch_names_both():
    src = randomize_(SwinBackbone(arch='tiny'))
    with pytest.raises(CheckpointError) as err:
        load_pretrained(_ours(), src.state_dict())
    assert str(err.value) == (
        'the Swin checkpoint (ours layout) holds embed_dims=96, depths=(2, 2, 6, 2), '
        "num_heads=(3, 6, 12, 24) (arch='tiny'); SwinBackbone was built with embed_dims=32, "
        "depths=(2, 2, 2, 2), num_heads=(2, 2, 4, 4): build it with arch='tiny'")


def test_same_arch_other_mlp_width_lists_the_keys():
    """Where the read architecture agrees (embed dims, depths, heads), the strict check lists
    every key that differs (fc1 weight and bias, fc2 weight of 8 blocks)."""
    src = randomize_(SwinBackbone(arch=ARCH, mlp_ratio=2.0))
    with pytest.raises(CheckpointError) as err:
        load_pretrained(_ours(), src.state_dict())
    assert str(err.value).startswith(
        'the Swin checkpoint (ours layout) does not match SwinBackbone: shape mismatch for 24 '
        'keys: layers.0.blocks.0.mlp.fc1.weight: checkpoint (64, 32) vs model (128, 32), ')


def test_missing_backbone_keys_are_an_error():
    sd = randomize_(_ours()).state_dict()
    del sd['layers.1.blocks.0.mlp.fc1.weight']
    with pytest.raises(CheckpointError, match=r'missing from the Swin checkpoint \(ours layout\): '
                                              r'layers\.1\.blocks\.0\.mlp\.fc1\.weight'):
        load_pretrained(_ours(), sd)


class _Payload:
    def __reduce__(self):
        return (os.system, ('touch /tmp/vitdet_plugin_pwned',))


def test_malicious_checkpoint_is_refused_and_nothing_runs(tmp_path):
    marker = '/tmp/vitdet_plugin_pwned'
    if os.path.exists(marker):
        os.remove(marker)
    path = str(tmp_path / 'evil.pth')
    with open(path, 'wb') as f:
        pickle.dump({'state_dict': {'x': _Payload()}}, f)
    model = _ours(init_cfg=dict(type='Pretrained', checkpoint=path))
    # a raw pickle is no torch.save file; the weights-only reader stops before any object
    with pytest.raises(CheckpointError, match=r"cannot read .*evil\.pth' as a checkpoint .*"
                                              r'Nothing in it was executed'):
        model.init_weights()
    assert not os.path.exists(marker)
    torch.save({'state_dict': {'x': _Payload()}}, path)     # the objects inside a torch.save file
    with pytest.raises(CheckpointError, match=r'refused to load .*evil\.pth.*not on the '
                                              r'weights_only allow-list.*could run arbitrary'):
        model.init_weights()
    assert not os.path.exists(marker)


@pytest.mark.parametrize('content, match', [
    (b'', r'is empty'),
    (b'hello world\n' * 8, r"cannot read .* as a checkpoint \(KeyError"),
    (bytes(range(256)) * 4, r'cannot read .* as a checkpoint'),
])
def test_unreadable_checkpoint_files_are_named(tmp_path, content, match):
    path = tmp_path / 'bad.pth'
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=match):
        _ours(init_cfg=dict(type='Pretrained', checkpoint=path)).init_weights()


def test_checkpoint_path_forms(tmp_path, monkeypatch):
    """pathlib paths, ``~`` and .safetensors files load; an unreachable URL names the cache
    path where the file can be placed by hand (then it loads without a network)."""
    from safetensors.torch import save_file
    src = randomize_(_ours())
    sd = {k: v.contiguous() for k, v in src.state_dict().items()}
    torch.save(sd, tmp_path / 'a.pth')
    save_file(sd, str(tmp_path / 'a.safetensors'))
    monkeypatch.setenv('HOME', str(tmp_path))
    monkeypatch.setenv('TORCH_HOME', str(tmp_path / 'torch'))
    for ckpt in (tmp_path / 'a.pth', '~/a.pth', tmp_path / 'a.safetensors'):
        model = _ours(init_cfg=dict(type='Pretrained', checkpoint=ckpt))
        model.init_weights()
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                     src.state_dict().values())), ckpt
    url = 'http://127.0.0.1:9/swin_tiny.pth'
    cached = tmp_path / 'torch' / 'hub' / 'checkpoints' / 'swin_tiny.pth'
    with pytest.raises(CheckpointError, match=r'cannot download checkpoint .*place it at '
                                              + re.escape(repr(str(cached)))
                                              + '; or set init_cfg=None to start from random '
                                                'weights$'):
        _ours(init_cfg=dict(type='Pretrained', checkpoint=url)).init_weights()
    cached.write_bytes((tmp_path / 'a.pth').read_bytes())
    model = _ours(init_cfg=dict(type='Pretrained', checkpoint=url))
    model.init_weights()
    assert torch.equal(model.patch_embed.proj.weight, src.patch_embed.proj.weight)


def test_official_checkpoint_into_a_conv_stem_model_names_the_stem_keys():
    """A conv stem has no published weights: loading a standard checkpoint must say so."""
    sd = randomize_(_ours()).state_dict()
    with pytest.raises(CheckpointError) as err:
        load_pretrained(_ours(stem_channels=(8, )), sd)
    msg = str(err.value)
    assert 'missing from the Swin checkpoint (ours layout): ' in msg
    assert 'patch_embed.stem.0.conv.weight' in msg
    assert 'patch_embed.proj.weight: checkpoint (32, 3, 4, 4) vs model (32, 8, 2, 2)' in msg


def test_conv_stem_model_roundtrips_its_own_checkpoint_and_refuses_mmdet_export(tmp_path):
    src = randomize_(_ours(stem_channels=(8, )))
    path = tmp_path / 'stem.pth'
    torch.save({'state_dict': src.state_dict()}, path)
    dst = SwinBackbone(arch=ARCH, drop_path_rate=0.0, stem_channels=(8, ),
                       init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    dst.init_weights()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert_close_rel(dst.eval()(x), src(x), tol=0)
    with pytest.raises(ValueError, match=r'convolutional stem .*patch_embed\.stem\.0'):
        swin_to_mmdet(src.state_dict())


def test_mmdet_checkpoint_with_a_non_square_position_grid_loads():
    """mmdet stores the absolute position embedding as tokens; a non-square pretraining size
    must be read on the model's (known) grid, not refused or misread."""
    from mmdet.models.backbones import SwinTransformer
    arch = dict(embed_dims=32, depths=(2, 2), num_heads=(2, 4))
    ours = SwinBackbone(arch=arch, out_indices=(0, 1), use_abs_pos_embed=True,
                        pretrain_img_size=(128, 96), drop_path_rate=0.0)
    ref = SwinTransformer(embed_dims=32, depths=(2, 2), num_heads=(2, 4), out_indices=(0, 1),
                          strides=(4, 2), use_abs_pos_embed=True, pretrain_img_size=(128, 96),
                          drop_path_rate=0.0)
    randomize_(ref)
    load_pretrained(ours, {'state_dict': ref.state_dict()})
    ours.eval(), ref.eval()
    x = torch.randn(1, 3, 128, 96)
    with torch.no_grad():
        assert_close_rel(ours(x), ref(x), tol=1e-5)


def test_detection_checkpoint_with_more_output_norms_loads_into_fewer_outputs(caplog):
    """Trained with out_indices=(0, 1), loaded with (1, ): the spare norm0 is reported and
    not used (mmdet loads such checkpoints too); everything else is strict."""
    arch = dict(embed_dims=32, depths=(2, 2), num_heads=(2, 4))
    src = randomize_(SwinBackbone(arch=arch, out_indices=(0, 1), drop_path_rate=0.0))
    dst = SwinBackbone(arch=arch, out_indices=(1, ), drop_path_rate=0.0)
    with caplog.at_level(logging.INFO, logger='vitdet_plugin'):
        dropped = load_pretrained(dst, {'state_dict': src.state_dict()}).dropped
    assert sorted(dropped) == ['norm0.bias', 'norm0.weight']
    assert 'outside out_indices=(1,) not used: norm0.weight, norm0.bias' in caplog.text
    assert torch.equal(dst.norm1.weight, src.norm1.weight)


def test_rectangular_window_checkpoint_needs_and_uses_its_window(tmp_path):
    arch = dict(embed_dims=32, depths=(2, 2), num_heads=(2, 4))
    src = randomize_(SwinBackbone(arch=arch, window_size=(5, 7), out_indices=(0, 1)))
    torch.save(src.state_dict(), tmp_path / 'rect.pth')
    cfg = dict(type='Pretrained', checkpoint=str(tmp_path / 'rect.pth'))
    with pytest.raises(CheckpointError, match=r'117 rows \(not a square window\); give the '
                                              r'window .*src_window_size=\(h, w\)'):
        SwinBackbone(arch=arch, out_indices=(0, 1), init_cfg=cfg).init_weights()
    model = SwinBackbone(arch=arch, out_indices=(0, 1), init_cfg=dict(cfg, src_window_size=(5, 7)))
    model.init_weights()
    table = src.layers[0].blocks[0].attn.relative_position_bias_table
    expected = resize_rel_pos_bias_table(table.detach(), (7, 7), (5, 7))
    assert torch.equal(model.layers[0].blocks[0].attn.relative_position_bias_table, expected)


def test_official_rectangular_window_is_read_from_its_index_buffer(caplog):
    """Official / mmdet checkpoints keep ``relative_position_index``, which tells the window:
    a (5, 7) checkpoint loads into a (7, 5) model resized (not verbatim), no argument needed,
    and a contradicting src_window_size is refused."""
    arch = dict(embed_dims=32, depths=(2, 2), num_heads=(2, 4))
    from vitdet_plugin.functional import relative_position_index
    src = randomize_(SwinBackbone(arch=arch, window_size=(5, 7), out_indices=(0, 1)))
    ckpt = _official_from(src, buffers=False)
    for k in [k for k in ckpt['model'] if k.endswith('relative_position_bias_table')]:
        ckpt['model'][k.replace('_bias_table', '_index')] = relative_position_index((5, 7))
    dst = SwinBackbone(arch=arch, window_size=(7, 5), out_indices=(0, 1))
    with caplog.at_level(logging.WARNING, logger='vitdet_plugin'):
        load_pretrained(dst, ckpt)
    assert 'records no window' not in caplog.text
    table = src.layers[1].blocks[1].attn.relative_position_bias_table.detach()
    assert torch.equal(dst.layers[1].blocks[1].attn.relative_position_bias_table,
                       resize_rel_pos_bias_table(table, (7, 5), (5, 7)))
    with pytest.raises(CheckpointError, match=r'src_window_size=\(7, 5\) contradicts the '
                                              r'checkpoint, .* built for 5x7 windows'):
        load_pretrained(dst, ckpt, src_window_size=(7, 5))


def test_rectangular_window_without_a_recorded_window_is_loaded_with_a_warning(caplog):
    """Our own layout records no window, and a (5, 7) table has as many rows as a (7, 5) one:
    it loads as the model's window, and the warning names the way out."""
    arch = dict(embed_dims=32, depths=(2, 2), num_heads=(2, 4))
    src = randomize_(SwinBackbone(arch=arch, window_size=(7, 5), out_indices=(0, 1)))
    dst = SwinBackbone(arch=arch, window_size=(7, 5), out_indices=(0, 1))
    with caplog.at_level(logging.WARNING, logger='vitdet_plugin'):
        load_pretrained(dst, src.state_dict())
    assert 'loaded as 7x5. If it was trained with 5x7 windows, pass src_window_size=(5, 7)' \
        in caplog.text
    _assert_same_weights(dst, src)


def test_src_window_size_that_does_not_fit_the_table_is_named():
    sd = _official_from(randomize_(_ours()))
    with pytest.raises(CheckpointError, match=r'src_window_size=\(5, 7\) does not fit a bias '
                                              r'table of 169 rows .*e\.g\. 7 \(square\)'):
        convert_swin({k: v for k, v in sd['model'].items() if 'index' not in k},
                     window_size=(7, 7), src_window_size=(5, 7))


def test_official_position_tokens_are_read_as_a_square_grid():
    """The official code only has square grids: 16 tokens are 4x4, even for a model whose
    8x2 grid also has 16 cells (reading them as 8x2 would scramble them)."""
    tokens = torch.randn(1, 16, 32)
    sd = dict(_official_from(randomize_(_ours()))['model'], absolute_pos_embed=tokens)
    converted, _ = convert_swin(sd, pos_grid=(8, 2))
    grid = tokens.reshape(1, 4, 4, 32).permute(0, 3, 1, 2)
    expected = torch.nn.functional.interpolate(grid, size=(8, 2), mode='bicubic',
                                               align_corners=False)
    torch.testing.assert_close(converted['absolute_pos_embed'], expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('wrapper', ['model_ema', 'state_dict_ema', 'ema_state_dict'])
def test_checkpoint_holding_only_ema_weights_loads(wrapper):
    src = randomize_(_ours())
    dst = _ours()
    load_pretrained(dst, {wrapper: src.state_dict(), 'epoch': 3})
    _assert_same_weights(dst, src, skip=r'^$')


def test_checkpoint_without_tensors_lists_its_top_level_keys():
    with pytest.raises(CheckpointError, match=r"holds no tensors .*top-level keys are epoch, "
                                              r"optimizer"):
        load_pretrained(_ours(), {'epoch': 3, 'optimizer': {'lr': 0.1}})


def test_prefix_that_matches_no_key_is_an_error():
    sd = {'backbone.' + k: v for k, v in randomize_(_ours()).state_dict().items()}
    with pytest.raises(CheckpointError, match=r"no key of the checkpoint starts with "
                                              r"prefix='encoder\.'; .*backbone\."):
        load_pretrained(_ours(), sd, prefix='encoder')


def test_rectangular_window_state_dict_is_not_exported_to_mmdet():
    src = _ours(window_size=(5, 7))
    with pytest.raises(ValueError, match=r"117 rows, the table of a rectangular window; "
                                         r"mmdet's SwinTransformer only has square windows"):
        swin_to_mmdet(src.state_dict())
