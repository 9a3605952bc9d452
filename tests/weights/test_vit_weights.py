"""ViT checkpoint conversion: format detection, round trips, resizing, strict loading and
``init_cfg=dict(type='Pretrained')`` for every supported layout."""
import re
from functools import partial
from typing import Optional

import pytest
import timm.models.vision_transformer as timm_vit  # a test dependency: never skipped
import timm.models.vision_transformer_sam as timm_sam
import torch
import torch.nn.functional as F
from helpers import assert_close_rel, randomize_
from torch import nn

import vitdet_plugin  # noqa: F401
from vitdet_plugin.models.backbones import ViTBackbone
from vitdet_plugin.weights import load_pretrained
from vitdet_plugin.functional import resize_rel_pos
from vitdet_plugin.models.necks import ViTSimpleFPN
from vitdet_plugin.weights import detect_layout
from vitdet_plugin.weights.checkpoint_io import CheckpointError
from vitdet_plugin.weights.vit import convert_vit, simple_fpn_to_detectron2

LN6 = partial(nn.LayerNorm, eps=1e-6)
ARCH = dict(arch=dict(embed_dims=64, depth=4, num_heads=4), global_attn_indexes=(1, 3),
            window_size=3)


def ours(**kwargs) -> ViTBackbone:
    cfg = dict(ARCH, img_size=128, pretrain_img_size=128)
    cfg.update(kwargs)
    return randomize_(ViTBackbone(**cfg)).eval()


def samvit(img_size=128):
    return randomize_(timm_sam.VisionTransformerSAM(
        img_size=img_size, embed_dim=64, depth=4, num_heads=4, window_size=3,
        global_attn_indexes=(1, 3), use_rel_pos=True, norm_layer=LN6, num_classes=0))


def sam_checkpoint(ref_sd):
    """The Segment Anything file layout: image_encoder. prefix, mlp.lin1/lin2, other parts."""
    sd = {'image_encoder.' + re.sub(r'\.mlp\.fc([12])\.', r'.mlp.lin\1.', k): v
          for k, v in ref_sd.items()}
    sd['prompt_encoder.pe_layer.positional_encoding_gaussian_matrix'] = torch.randn(2, 8)
    sd['mask_decoder.iou_token.weight'] = torch.randn(1, 8)
    return sd


def d2_checkpoint(model: ViTBackbone, neck: Optional[ViTSimpleFPN] = None) -> dict:
    """The detectron2 ViTDet layout: backbone.net.* (the ViT), backbone.simfp_* (the pyramid,
    from ``neck``), heads."""
    out = {'backbone.net.' + k: v for k, v in model.state_dict().items()}
    if neck is not None:
        out.update({'backbone.' + k: v for k, v in simple_fpn_to_detectron2(
            neck.state_dict(), neck.scale_factors).items()})
    out['roi_heads.box_predictor.cls_score.weight'] = torch.randn(81, 8)
    out['proposal_generator.rpn_head.conv.weight'] = torch.randn(8, 8, 3, 3)
    return {'model': out, '__author__': 'detectron2'}


def run(model, size=(128, 128)):
    with torch.no_grad():
        return model(torch.randn(1, 3, *size, generator=torch.Generator().manual_seed(1)))


# ---------------------------------------------------------------------------- detection
def test_detect_formats():
    sam_sd = samvit().state_dict()
    vit = timm_vit.VisionTransformer(img_size=64, embed_dim=32, depth=1, num_heads=2)
    assert detect_layout(sam_sd).name == 'timm_samvit'
    assert detect_layout(sam_checkpoint(sam_sd)).name == 'sam'
    assert detect_layout(vit.state_dict()).name == 'timm_vit'
    mae = dict(vit.state_dict(), mask_token=torch.zeros(1, 1, 32),
               **{'decoder_embed.weight': torch.zeros(16, 32)})
    assert detect_layout(mae).name == 'mae'
    assert detect_layout(d2_checkpoint(ours())['model']).name == 'detectron2'
    assert detect_layout(ours().state_dict()).name == 'ours'
    det = {'backbone.' + k: v for k, v in ours().state_dict().items()}
    det['neck.lateral_convs.0.conv.weight'] = torch.zeros(1)
    assert detect_layout(det).name == 'ours'
    with pytest.raises(CheckpointError, match='unrecognised checkpoint format: no ViT '
                                              'attention weights found'):
        detect_layout({'conv1.weight': torch.zeros(1)}, 'ViT')
    with pytest.raises(CheckpointError, match=r"^the checkpoint is a Swin checkpoint \(official "
                                              r"layout\); ViTBackbone loads ViT checkpoints: "
                                              r"build type='SwinBackbone'$"):
        detect_layout({'layers.0.blocks.0.attn.qkv.weight': torch.zeros(1)}, 'ViT')


# ---------------------------------------------------------------------------- round trips
@pytest.mark.parametrize('fmt', ['timm_samvit', 'sam', 'sam_encoder_only'])
def test_sam_formats_round_trip(fmt):
    ref = samvit()
    sd = ref.state_dict() if fmt == 'timm_samvit' else sam_checkpoint(ref.state_dict())
    if fmt == 'sam_encoder_only':  # the image encoder saved alone: no prefix, SAM's names
        sd = {k[len('image_encoder.'):]: v for k, v in sd.items()
              if k.startswith('image_encoder.')}
        fmt = 'sam'
    model = ours(pretrain_use_cls_token=False)
    conv, dropped = convert_vit(sd, model.checkpoint_target().expected,
                                pos_grid=model.pretrain_grid)
    assert detect_layout(sd).name == fmt
    assert all(k.startswith(('neck.', 'prompt_encoder.', 'mask_decoder.')) for k in dropped)
    assert torch.equal(conv['pos_embed'], ref.pos_embed.flatten(1, 2))
    assert torch.equal(conv['blocks.2.mlp.fc1.weight'], ref.blocks[2].mlp.fc1.weight)
    assert torch.equal(conv['blocks.1.attn.rel_pos_h'], ref.blocks[1].attn.rel_pos_h)
    model.load_state_dict(conv)  # complete: every key present, no leftovers


# ---------------------------------------------------------------------------- timm ViT / MAE / DeiT
def _timm_vit(**kwargs):
    cfg = dict(img_size=224, patch_size=16, embed_dim=64, depth=4, num_heads=4, num_classes=10)
    cfg.update(kwargs)
    return randomize_(timm_vit.VisionTransformer(**cfg))


@pytest.mark.parametrize('kind', ['timm_vit', 'mae', 'deit_distilled'])
def test_timm_vit_family_loads_through_init_cfg(tmp_path, kind):
    if kind == 'deit_distilled':
        from timm.models.deit import VisionTransformerDistilled
        ref = randomize_(VisionTransformerDistilled(img_size=224, patch_size=16, embed_dim=64,
                                                    depth=4, num_heads=4, num_classes=10))
        sd = ref.state_dict()
        assert sd['pos_embed'].shape[1] == 2 + 14 * 14
    else:
        ref = _timm_vit()
        sd = ref.state_dict()
    if kind == 'mae':
        sd = {k: v for k, v in sd.items() if not k.startswith('head.')}
        sd['mask_token'] = torch.zeros(1, 1, 32)
        sd['decoder_embed.weight'] = torch.zeros(32, 64)
        sd = {'model': sd}
    path = tmp_path / f'{kind}.pth'
    torch.save(sd, path)
    model = ViTBackbone(**ARCH, init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    before_rel = model.blocks[0].attn.rel_pos_h.clone()
    model.init_weights()
    # ViTDet pretrain layout: cls slot + 14x14 grid, taken over unchanged (the grid starts
    # after the cls and, for distilled DeiT, the distillation token)
    num_prefix = ref.pos_embed.shape[1] - 196
    assert torch.equal(model.pos_embed[:, :1], ref.pos_embed[:, :1])
    assert torch.equal(model.pos_embed[:, 1:], ref.pos_embed[:, num_prefix:])
    assert torch.equal(model.blocks[3].attn.qkv.weight, ref.blocks[3].attn.qkv.weight)
    assert torch.equal(model.patch_embed.proj.weight, ref.patch_embed.proj.weight)
    # relative positions are new (zero init, as ViTDet from MAE)
    assert torch.equal(model.blocks[0].attn.rel_pos_h, before_rel)


def test_pos_embed_is_resized_bicubically_and_cls_slot_kept():
    ref = _timm_vit(img_size=224)
    model = ViTBackbone(**ARCH, pretrain_img_size=256)  # 16x16 grid
    conv, _ = convert_vit(ref.state_dict(), model.checkpoint_target().expected,
                          pos_grid=model.pretrain_grid)
    grid = ref.pos_embed[:, 1:].reshape(1, 14, 14, 64).permute(0, 3, 1, 2)
    expected = F.interpolate(grid, size=(16, 16), mode='bicubic', align_corners=False)
    expected = expected.permute(0, 2, 3, 1).reshape(1, 256, 64)
    assert conv['pos_embed'].shape == (1, 257, 64)
    assert torch.equal(conv['pos_embed'][:, :1], ref.pos_embed[:, :1])
    assert_close_rel([conv['pos_embed'][:, 1:]], [expected], tol=1e-6)


def test_sam_pos_embed_and_rel_pos_resized_to_target():
    ref = samvit(img_size=128)  # pos 8x8, global tables 15 rows, window tables 5 rows
    model = ViTBackbone(**dict(ARCH, window_size=5), img_size=192, pretrain_img_size=224)
    conv, _ = convert_vit(ref.state_dict(), model.checkpoint_target().expected,
                          pos_grid=model.pretrain_grid)
    assert conv['pos_embed'].shape == (1, 1 + 14 * 14, 64)
    assert torch.equal(conv['pos_embed'][:, 0], torch.zeros(1, 64))  # no cls in SAM
    assert conv['blocks.1.attn.rel_pos_h'].shape == (23, 16)  # 2 * 192/16 - 1
    assert conv['blocks.0.attn.rel_pos_w'].shape == (9, 16)   # 2 * 5 - 1
    assert torch.equal(conv['blocks.0.attn.rel_pos_w'],
                       resize_rel_pos(ref.blocks[0].attn.rel_pos_w, 9))
    model.load_state_dict(conv)


def test_sam_weights_into_matching_model_equal_timm_features(tmp_path):
    ref = samvit(img_size=128).eval()
    path = tmp_path / 'sam.pth'
    torch.save(sam_checkpoint(ref.state_dict()), path)
    model = ViTBackbone(**ARCH, img_size=128, pretrain_img_size=128,
                        pretrain_use_cls_token=False,
                        init_cfg=dict(type='Pretrained', checkpoint=str(path))).eval()
    model.init_weights()
    x = torch.randn(1, 3, 128, 128)
    with torch.no_grad():
        assert_close_rel(model(x), ref.forward_intermediates(x, indices=[3],
                                                             intermediates_only=True), 1e-5)


# ---------------------------------------------------------------------------- strictness / safety
def test_mismatched_architecture_is_reported():
    ref = _timm_vit(embed_dim=96, num_heads=4)
    model = ViTBackbone(**ARCH)
    with pytest.raises(CheckpointError) as err:
        load_pretrained(model, ref.state_dict())
    assert str(err.value) == (
        'the ViT checkpoint (timm_vit layout) holds embed_dims=96, depth=4; ViTBackbone was '
        'built with embed_dims=64, depth=4: set its architecture arguments to embed_dims=96, '
        'depth=4')


def test_unknown_keys_and_missing_blocks_are_reported():
    model = ViTBackbone(**ARCH)
    sd = ours().state_dict()
    sd['blocks.0.ls1.gamma'] = torch.ones(64)
    with pytest.raises(CheckpointError, match=r'unexpected in the ViT checkpoint \(ours layout\): '
                                              r'blocks.0.ls1.gamma'):
        load_pretrained(model, sd)
    sd = {k: v for k, v in ours().state_dict().items() if not k.startswith('blocks.3.mlp')}
    with pytest.raises(CheckpointError, match=r'missing from the ViT checkpoint \(ours layout\): '
                                              r'blocks.3.mlp.fc1.weight'):
        load_pretrained(model, sd)
    # partial rel-pos tables are not silently allowed either
    sd = {k: v for k, v in ours().state_dict().items() if k != 'blocks.2.attn.rel_pos_h'}
    with pytest.raises(CheckpointError, match=r'missing from the ViT checkpoint \(ours layout\): '
                                              r'blocks.2.attn.rel_pos_h'):
        load_pretrained(model, sd)


def test_checkpoint_with_code_is_refused(tmp_path):
    path = tmp_path / 'evil.pth'
    torch.save({'model': ours().state_dict(), 'cfg': partial(print)}, path)
    model = ViTBackbone(**ARCH, init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    with pytest.raises(CheckpointError, match='weights_only'):
        model.init_weights()


def test_unknown_format_name():
    with pytest.raises(ValueError, match=r"src_format='beit' is not a ViT format"):
        convert_vit(ours().state_dict(), src_format='beit')


def _mmpretrain_layout(ref) -> dict:
    """A timm ViT's weights as mmpretrain saves them (backbone.-prefixed, ln1/ln2/ffn names)."""
    renames = ((r'^patch_embed\.proj\.', 'patch_embed.projection.'),
               (r'^blocks\.(\d+)\.norm1\.', r'layers.\1.ln1.'),
               (r'^blocks\.(\d+)\.norm2\.', r'layers.\1.ln2.'),
               (r'^blocks\.(\d+)\.mlp\.fc1\.', r'layers.\1.ffn.layers.0.0.'),
               (r'^blocks\.(\d+)\.mlp\.fc2\.', r'layers.\1.ffn.layers.1.'),
               (r'^blocks\.', 'layers.'), (r'^norm\.', 'ln1.'))
    sd = {}
    for k, v in ref.state_dict().items():
        if k.startswith('head.'):
            continue
        for pattern, repl in renames:
            k, n = re.subn(pattern, repl, k)
            if n:
                break
        sd['backbone.' + k] = v
    return sd


def test_mmpretrain_mae_layout(tmp_path):
    """mmpretrain ViT / MAE: backbone.-prefixed, ln1/ln2/ffn.layers names, neck dropped."""
    ref = _timm_vit()
    sd = _mmpretrain_layout(ref)
    sd['neck.mask_token'] = torch.zeros(1, 1, 8)
    sd['neck.decoder_blocks.0.ln1.weight'] = torch.zeros(8)
    assert detect_layout(sd).name == 'mmpretrain'
    path = tmp_path / 'mmpretrain_mae.pth'
    torch.save({'state_dict': sd, 'meta': {}}, path)
    model = ViTBackbone(**ARCH, init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    model.init_weights()
    assert torch.equal(model.blocks[2].mlp.fc1.weight, ref.blocks[2].mlp.fc1.weight)
    assert torch.equal(model.blocks[1].norm2.bias, ref.blocks[1].norm2.bias)
    assert torch.equal(model.patch_embed.proj.weight, ref.patch_embed.proj.weight)
    assert torch.equal(model.pos_embed, ref.pos_embed)


@pytest.mark.parametrize('pretrain, use_cls', [((96, 128), True), ((96, 160), False),
                                               ((96, 160), True)])
def test_own_checkpoint_with_a_non_square_position_grid_round_trips(pretrain, use_cls):
    """A non-square grid (plus a cls slot, without a cls_token key) must be read on the model's
    grid: 6x8 + 1 = 49 positions would otherwise pass for a square 7x7 grid."""
    kw = dict(arch=dict(embed_dims=32, depth=2, num_heads=2), patch_size=16, img_size=pretrain,
              pretrain_img_size=pretrain, pretrain_use_cls_token=use_cls, window_size=2,
              global_attn_indexes=(1, ), drop_path_rate=0.0)
    src = randomize_(ViTBackbone(**kw)).eval()
    dst = ViTBackbone(**kw).eval()
    load_pretrained(dst, {'state_dict': src.state_dict()})
    assert torch.equal(dst.pos_embed, src.pos_embed)


def test_position_resizing_keeps_float64_precision():
    from vitdet_plugin.functional import resize_pos_grid
    g = torch.Generator().manual_seed(0)
    table = torch.randn(13, 8, generator=g, dtype=torch.float64)
    grid = torch.randn(1, 8, 5, 7, generator=g, dtype=torch.float64)
    ref_table = torch.nn.functional.interpolate(table.t()[None], size=21, mode='linear')[0].t()
    ref_grid = torch.nn.functional.interpolate(grid, size=(9, 11), mode='bicubic',
                                               align_corners=False)
    assert resize_rel_pos(table, 21).dtype == torch.float64
    assert (resize_rel_pos(table, 21) - ref_table).abs().max() < 1e-12
    assert (resize_pos_grid(grid, (9, 11)) - ref_grid).abs().max() < 1e-12


@pytest.mark.parametrize('as_list', [False, True], ids=['dict', 'list'])
def test_init_cfg_pretrained_as_dict_or_list(tmp_path, as_list):
    """mmengine accepts init_cfg as a dict or a list of dicts."""
    src = randomize_(ours())
    torch.save(src.state_dict(), tmp_path / 'w.pth')
    cfg = dict(type='Pretrained', checkpoint=str(tmp_path / 'w.pth'))
    kw = dict(ARCH)
    model = ViTBackbone(**kw, img_size=128, pretrain_img_size=128,
                        init_cfg=[dict(type='TruncNormal', layer='Linear', std=0.02), cfg]
                        if as_list else cfg)
    model.init_weights()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 src.state_dict().values()))


def test_checkpoint_for_other_global_blocks_is_refused():
    """Window tables stretched into global blocks (and global ones squeezed into windows)
    would load silently as a 'resize'; it is a checkpoint for other global_attn_indexes."""
    sd = ours(global_attn_indexes=(1, 3)).state_dict()
    with pytest.raises(CheckpointError, match=r'global attention in blocks \[1, 3\] .* the model '
                                              r'in blocks \[0, 2\]; build the model with '
                                              r'global_attn_indexes=\(1, 3\)'):
        load_pretrained(ours(global_attn_indexes=(0, 2)), sd)
    # the same roles at another size are resized as before
    load_pretrained(ours(img_size=160, pretrain_img_size=160), sd)


def test_pos_embed_unused_by_a_model_without_abs_pos_is_a_warning(caplog):
    import logging
    sd = ours().state_dict()
    with caplog.at_level(logging.WARNING, logger='vitdet_plugin'):
        dropped = load_pretrained(ours(use_abs_pos=False), sd).dropped
    assert 'pos_embed' in dropped
    assert 'its trained pos_embed (1, 65, 64) is not used' in caplog.text
    assert 'use_abs_pos=True' in caplog.text


def test_mmpretrain_pre_norm_is_not_dropped():
    """A CLIP-style pre-norm is part of the features: a model without one refuses it."""
    sd = _mmpretrain_layout(_timm_vit())
    sd['backbone.pre_norm.weight'] = torch.ones(64)
    sd['backbone.pre_norm.bias'] = torch.zeros(64)
    assert detect_layout(sd).name == 'mmpretrain'
    with pytest.raises(CheckpointError, match=r'unexpected in the ViT checkpoint \(mmpretrain '
                                              r'layout\): pre_norm\.weight, pre_norm\.bias'):
        load_pretrained(ViTBackbone(**ARCH), sd)


def test_square_timm_grid_into_a_non_square_grid_of_as_many_cells_is_resized():
    """timm trains on square images: 1 + 16x16 positions are a 16x16 grid even for a model
    whose 8x32 grid has as many cells (reading them as 8x32 would scramble them)."""
    ref = _timm_vit(img_size=256)
    model = ViTBackbone(**ARCH, pretrain_img_size=(128, 512))
    conv, _ = convert_vit(ref.state_dict(), model.checkpoint_target().expected,
                          pos_grid=model.pretrain_grid)
    grid = ref.pos_embed[:, 1:].reshape(1, 16, 16, 64).permute(0, 3, 1, 2)
    expected = F.interpolate(grid, size=(8, 32), mode='bicubic', align_corners=False)
    assert_close_rel([conv['pos_embed'][:, 1:]], [expected.permute(0, 2, 3, 1).reshape(1, 256, 64)],
                     tol=1e-6)


@pytest.mark.parametrize('kw', [dict(arch=dict(embed_dims=64.5, depth=4, num_heads=4)),
                                dict(arch=dict(embed_dims=64, depth='4', num_heads=4)),
                                dict(arch=dict(embed_dims=64, depth=4, num_heads=True)),
                                dict(frozen_stages=2.0), dict(in_channels=True),
                                dict(drop_path_rate='0.1')],
                         ids=['embed-float', 'depth-str', 'heads-bool', 'frozen-float',
                              'in-channels-bool', 'drop-path-str'])
def test_architecture_numbers_are_not_coerced(kw):
    cfg = dict(ARCH, img_size=128, pretrain_img_size=128)
    cfg.update(kw)
    with pytest.raises(ValueError, match=r'must be (an int|a number|a positive int)'):
        ViTBackbone(**cfg)
