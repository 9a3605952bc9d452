"""Official D-FINE / DEIMv2 checkpoints -> our parts, on files in the official layout.

The official repositories cannot be fetched here: ``tests/fixtures/dfine_official_*.json`` hold
the ``state_dict()`` key names and shapes (and constant buffers) of the official models built by
the repositories' own code (provenance in each file: repository, commit, config). The tests
write seeded random tensors of those shapes in the official containers (``{'model': sd}``,
``{'ema': {'module': sd}}``), load them into our parts built at that size and check where each
tensor lands: key pairs read from the official model code (nn.MultiheadAttention's q / k / v
thirds of ``in_proj``, DEIMv2's SwiGLU ``w12`` gate / up halves, RepNCSPELAN's ``cv1``..``cv4``)
and the key correspondences of transformers' own conversion scripts
(``convert_deimv2_original_pytorch_checkpoint_to_hf.py``).
"""
import json
import os
from typing import Dict, Tuple

import pytest
import torch
from torch import Tensor, nn

from vitdet_plugin.models.backbones.dinov3_sta import DINOv3STABackbone
from vitdet_plugin.models.backbones.hgnetv2 import HGNetV2Backbone
from vitdet_plugin.models.heads.dfine_decoder import DFineDecoder, DFineQuerySelector
from vitdet_plugin.models.necks.hybrid_encoder import HybridEncoder
from vitdet_plugin.models.necks.lite_encoder import LiteEncoder
from vitdet_plugin.weights.checkpoint_io import CheckpointError
from vitdet_plugin.weights.deimv2 import encoder_part as transformers_encoder_part
from vitdet_plugin.weights.dfine_keys import check_bins, dfine_head_state_dict
from vitdet_plugin.weights.dfine_official import (encoder_part, head_part, official_parts,
                                                  official_size, read_official_checkpoint)
from vitdet_plugin.weights.layouts import find_layout, load_checkpoint

FIXTURES = os.path.join(os.path.dirname(__file__), os.pardir, 'fixtures')
#: COCO's classes (the official configs').
NUM_CLASSES = 80


def official(name: str, seed: int = 0) -> Tuple[Dict[str, Tensor], dict]:
    """Seeded random tensors in the official ``state_dict()`` layout of fixture ``name`` (its
    constant buffers at their recorded values), and the fixture's provenance."""
    with open(os.path.join(FIXTURES, f'dfine_official_{name}.json')) as f:
        doc = json.load(f)
    gen = torch.Generator().manual_seed(seed)
    sd: Dict[str, Tensor] = {}
    for key, shape in doc['state_dict'].items():
        if key in doc['buffers']:
            sd[key] = torch.tensor(doc['buffers'][key], dtype=torch.float32).reshape(shape)
        elif key.endswith('num_batches_tracked'):
            sd[key] = torch.randint(0, 1000, (), generator=gen)
        else:
            sd[key] = torch.randn(shape, generator=gen)
    return sd, doc['provenance']


def our_parts(name: str) -> Dict[str, nn.Module]:
    """Our parts at the size of fixture ``name``, with the official config's arguments."""
    if name == 'dfine_n':  # dfine_hgnetv2_n_coco.yml
        backbone: nn.Module = HGNetV2Backbone('B0', out_indices=(2, 3), use_lab=True)
        neck: nn.Module = HybridEncoder(
            in_channels=(512, 1024), in_strides=(16, 32), hidden_dim=128, ffn_dim=512,
            encoder_levels=(1,), expansion=0.34, depth_mult=0.5)
        decoder = DFineDecoder(NUM_CLASSES, 128, 8, 512, 3, (6, 6), style='dfine')
        width, queries = 128, 300
    elif name == 'deimv2_atto':  # deimv2_hgnetv2_atto_coco.yml
        backbone = HGNetV2Backbone('Atto', out_indices=(2,), use_lab=True)
        neck = LiteEncoder(in_channels=(256,), in_strides=(16,), hidden_dim=64, expansion=0.34,
                           depth_mult=0.5)
        decoder = DFineDecoder(NUM_CLASSES, 64, 8, 160, 3, (4, 2), style='deimv2',
                               use_gateway=False, share_reg_branch=True, query_pos_act='silu',
                               mlp_act='silu')
        width, queries = 64, 100
    else:  # deimv2_dinov3_s_coco.yml
        backbone = DINOv3STABackbone('S')
        neck = HybridEncoder(
            in_channels=(192,) * 3, hidden_dim=192, ffn_dim=512, expansion=0.34, depth_mult=0.67,
            fuse_op='sum', version='deim', csp_type='csp2', input_proj=False)
        decoder = DFineDecoder(NUM_CLASSES, 192, 8, 512, 4, (3, 6, 3), style='deimv2',
                               query_pos_act='silu', mlp_act='silu')
        width, queries = 192, 300
    return {'backbone': backbone, 'neck': neck, 'decoder': decoder,
            # official DEIMv2 scores the memory as it is: no enc_output
            'selector': DFineQuerySelector(NUM_CLASSES, queries, width,
                                           enc_output=name == 'dfine_n'),
            'dn_label_embed': nn.Embedding(NUM_CLASSES + 1, width, padding_idx=NUM_CLASSES)}


#: (fixture, official key, slice of it along dim 0 or None, our part, our key): read from the
#: official model code.
KNOWN_PAIRS = [
    ('dfine_n', 'backbone.stages.2.blocks.1.layers.0.conv1.conv.weight', None, 'backbone',
     'stages.2.blocks.1.layers.0.conv1.conv.weight'),
    ('dfine_n', 'encoder.input_proj.1.norm.running_var', None, 'neck',
     'input_proj.1.norm.running_var'),
    ('dfine_n', 'encoder.encoder.0.layers.0.self_attn.in_proj_weight', (128, 256), 'neck',
     'aifi.0.0.k_proj.weight'),
    ('dfine_n', 'encoder.encoder.0.layers.0.linear2.bias', None, 'neck', 'aifi.0.0.fc2.bias'),
    ('dfine_n', 'encoder.fpn_blocks.0.cv2.1.conv.weight', None, 'neck',
     'fpn_blocks.0.branches.0.conv.conv.weight'),
    ('dfine_n', 'encoder.pan_blocks.0.cv3.0.bottlenecks.0.conv2.norm.weight', None, 'neck',
     'pan_blocks.0.branches.1.csp.bottlenecks.0.conv2.norm.weight'),
    ('dfine_n', 'encoder.pan_blocks.0.cv4.norm.running_mean', None, 'neck',
     'pan_blocks.0.conv_out.norm.running_mean'),
    ('dfine_n', 'encoder.downsample_convs.0.0.cv2.conv.weight', None, 'neck',
     'downsample_convs.0.conv2.conv.weight'),
    ('dfine_n', 'decoder.decoder.layers.2.self_attn.in_proj_bias', (256, 384), 'head',
     'decoder.layers.2.self_attn.v_proj.bias'),
    ('dfine_n', 'decoder.decoder.layers.1.linear2.weight', None, 'head',
     'decoder.layers.1.ffn.fc2.weight'),
    ('dfine_n', 'decoder.decoder.layers.0.gateway.gate.weight', None, 'head',
     'decoder.layers.0.gateway.gate.weight'),
    ('dfine_n', 'decoder.decoder.lqe_layers.2.reg_conf.layers.1.bias', None, 'head',
     'decoder.lqe_layers.2.reg_conf.layers.1.bias'),
    ('dfine_n', 'decoder.dec_bbox_head.2.layers.1.weight', None, 'head',
     'decoder.reg_branches.2.layers.1.weight'),
    ('dfine_n', 'decoder.dec_score_head.0.bias', None, 'head', 'decoder.cls_branches.0.bias'),
    ('dfine_n', 'decoder.enc_output.norm.bias', None, 'head', 'selector.enc_output.1.bias'),
    ('dfine_n', 'decoder.enc_bbox_head.layers.2.weight', None, 'head',
     'selector.enc_bbox_head.layers.2.weight'),
    ('dfine_n', 'decoder.denoising_class_embed.weight', None, 'head', 'dn_label_embed.weight'),
    ('deimv2_atto', 'encoder.down_sample1.1.weight', None, 'neck', 'down1.conv.conv.weight'),
    ('deimv2_atto', 'encoder.down_sample2.2.running_var', None, 'neck',
     'down2.conv.norm.running_var'),
    ('deimv2_atto', 'encoder.bi_fusion.cv.norm.weight', None, 'neck', 'gap_fusion.norm.weight'),
    ('deimv2_atto', 'encoder.fpn_block.cv3.1.conv.weight', None, 'neck',
     'fpn_block.branches.1.conv.conv.weight'),
    ('deimv2_atto', 'decoder.decoder.layers.0.swish_ffn.w12.weight', (0, 80), 'head',
     'decoder.layers.0.ffn.fc1_g.weight'),
    ('deimv2_atto', 'decoder.decoder.layers.0.swish_ffn.w12.bias', (80, 160), 'head',
     'decoder.layers.0.ffn.fc1_x.bias'),
    ('deimv2_atto', 'decoder.decoder.layers.1.swish_ffn.w3.weight', None, 'head',
     'decoder.layers.1.ffn.fc2.weight'),
    ('deimv2_atto', 'decoder.decoder.layers.2.norm2.scale', None, 'head',
     'decoder.layers.2.norm2.weight'),
    ('deimv2_s', 'backbone.dinov3._model.blocks.11.attn.qkv.bias', None, 'backbone',
     'vit.blocks.11.attn.qkv.bias'),
    ('deimv2_s', 'backbone.dinov3._model.cls_token', None, 'backbone', 'vit.cls_token'),
    ('deimv2_s', 'backbone.sta.stem.1.running_mean', None, 'backbone',
     'sta.stem_conv.norm.running_mean'),
    ('deimv2_s', 'backbone.sta.conv3.1.weight', None, 'backbone', 'sta.conv3.conv.weight'),
    ('deimv2_s', 'backbone.convs.2.weight', None, 'backbone', 'fusion_proj.2.conv.weight'),
    ('deimv2_s', 'backbone.norms.0.bias', None, 'backbone', 'fusion_proj.0.norm.bias'),
    ('deimv2_s', 'encoder.fpn_blocks.1.cv2.0.conv1.conv.weight', None, 'neck',
     'fpn_blocks.1.branches.0.csp.conv1.conv.weight'),
    ('deimv2_s', 'decoder.decoder.layers.3.gateway.norm.scale', None, 'head',
     'decoder.layers.3.gateway.norm.weight'),
    ('deimv2_s', 'decoder.dec_bbox_head.2.layers.0.weight', None, 'head',
     'decoder.reg_branches.2.layers.0.weight'),
]
#: The published size of each fixture (the config our loader names).
CONFIGS = {'dfine_n': 'configs/dfine/dfine_n.py', 'deimv2_atto': 'configs/deimv2/deimv2_atto.py',
           'deimv2_s': 'configs/deimv2/deimv2_s.py'}
#: The layouts the table detects (family).
FAMILIES = {'dfine_n': 'D-FINE', 'deimv2_atto': 'DEIMv2', 'deimv2_s': 'DEIMv2 DINOv3'}


@pytest.mark.parametrize('name', sorted(CONFIGS))
def test_fixture_is_the_official_model(name):
    sd, provenance = official(name)
    assert provenance['commit'] and provenance['config'].endswith('_coco.yml')
    layout = find_layout(sd)
    assert (layout.family, layout.name) == (FAMILIES[name], 'official')
    assert official_size(sd)[1] == CONFIGS[name]


def _load_parts(name: str, checkpoint: object) -> Dict[str, Dict[str, Tensor]]:
    """Every part of ``checkpoint`` strictly loaded into ours: backbone and neck through the
    layout table, the head through :func:`official_parts`."""
    parts = our_parts(name)
    out = {}
    for part in ('backbone', 'neck'):
        converted, report = load_checkpoint(checkpoint, parts[part].checkpoint_target())
        parts[part].load_state_dict(converted)
        assert report.layout == f'{FAMILIES[name]} official'
        out[part] = converted
    sd = read_official_checkpoint(checkpoint)
    head = official_parts(sd)[0]['head']
    for prefix in ('decoder', 'selector', 'dn_label_embed'):
        state = {k[len(prefix) + 1:]: v for k, v in head.items() if k.startswith(prefix + '.')}
        parts[prefix].load_state_dict(state)
    out['head'] = head
    return out


@pytest.mark.parametrize('container', ['model', 'ema'])
@pytest.mark.parametrize('name', sorted(CONFIGS))
def test_every_official_tensor_lands_in_its_place(name, container, tmp_path):
    sd, _ = official(name)
    ckpt = {'model': sd} if container == 'model' else {'ema': {'module': sd, 'updates': 3}}
    path = str(tmp_path / 'best_stg2.pth')
    torch.save(ckpt, path)
    # the table reads either file itself (an EMA-only file's weights under 'ema' / 'module')
    parts = _load_parts(name, path)
    for fixture, key, rows, part, ours in KNOWN_PAIRS:
        if fixture == name:
            want = sd[key] if rows is None else sd[key][rows[0]:rows[1]]
            assert torch.equal(parts[part][ours], want), (key, ours)
    # every tensor accounted for: the parts' sizes add up to the checkpoint's minus the
    # buffers our modules rebuild, plus the chunks of the fused tensors
    _, dropped = official_parts(sd)
    fused = sum(k.endswith(('in_proj_weight', 'in_proj_bias')) for k in sd) * 2 + \
        sum('.swish_ffn.w12.' in k for k in sd)
    assert sum(map(len, parts.values())) == len(sd) - len(dropped) + fused
    assert all(k.endswith(('anchors', 'valid_mask', '.up', '.reg_scale', 'num_points_scale',
                           'rope_embed.periods')) for k in dropped)


def test_the_ema_weights_are_read_before_the_model_weights():
    sd, _ = official('deimv2_atto')
    ema = {k: v + 1 if v.is_floating_point() else v for k, v in sd.items()}
    read = read_official_checkpoint({'model': sd, 'ema': {'module': ema}, 'optimizer': {}})
    key = 'decoder.enc_score_head.bias'
    assert torch.equal(read[key], ema[key])


def test_the_official_bins_are_compared_with_the_decoder_arguments():
    sd, _ = official('dfine_n')
    check_bins(sd, up=0.5, reg_scale=4.0, prefix='decoder.decoder.')
    with pytest.raises(ValueError, match=r'the checkpoint has reg_scale=\[4\.0\] but the decoder '
                                         r'was built with reg_scale=8\.0; set reg_scale=4'):
        check_bins(sd, up=0.5, reg_scale=8.0, prefix='decoder.decoder.')


def test_a_part_of_another_size_is_refused_naming_the_config_of_the_checkpoint():
    sd, _ = official('deimv2_atto')
    femto = HGNetV2Backbone('Femto', out_indices=(2,), use_lab=True)
    with pytest.raises(CheckpointError, match=r'the official checkpoint is the DEIMv2 size of '
                                              r'configs/deimv2/deimv2_atto\.py, which '
                                              r'HGNetV2Backbone does not fit \(shape differs: '
                                              r".*build it with configs/deimv2/deimv2_atto\.py"):
        load_checkpoint(sd, femto.checkpoint_target())


def test_the_encoder_of_another_kind_is_refused():
    sd, _ = official('dfine_n')
    lite = LiteEncoder(in_channels=(1024,), in_strides=(32,), hidden_dim=128)
    with pytest.raises(CheckpointError, match=r"the checkpoint is a D-FINE checkpoint "
                                              r"\(official layout\); LiteEncoder loads "
                                              r"LiteEncoder checkpoints"):
        load_checkpoint(sd, lite.checkpoint_target())
    sd, _ = official('deimv2_atto')  # DEIMv2's layout loads both encoders: its keys decide
    hybrid = HybridEncoder(in_channels=(256,), in_strides=(16,), hidden_dim=64, encoder_levels=(0,))
    with pytest.raises(CheckpointError, match=r"a DEIMv2 checkpoint \(official layout\) holds "
                                              r"a LiteEncoder \(its encoder keys\), not a "
                                              r"HybridEncoder: build type='LiteEncoder'"):
        load_checkpoint(sd, hybrid.checkpoint_target())


def test_unknown_keys_are_refused_naming_them():
    sd, _ = official('deimv2_atto')
    sd['decoder.decoder.layers.0.cross_attn.value_proj.weight'] = torch.zeros(1)
    with pytest.raises(CheckpointError, match=r"official decoder: 1 keys no rule knows: "
                                              r"\['decoder\.decoder\.layers\.0\.cross_attn\."
                                              r"value_proj\.weight'\]"):
        head_part(sd)
    sd, _ = official('dfine_n')
    sd['encoder.fpn_blocks.0.cv5.conv.weight'] = torch.zeros(1)
    with pytest.raises(CheckpointError, match=r"official encoder: 1 keys no rule knows: "
                                              r"\['encoder\.fpn_blocks\.0\.cv5\.conv\.weight'\]"):
        encoder_part(sd)


#: (official key, transformers key) pairs of transformers' DEIMv2 conversion script
#: (``ORIGINAL_TO_CONVERTED_KEY_MAPPING``, ``split_swiglu_fused_weights``): both spellings
#: must reach the same part of ours.
TRANSFORMERS_HEAD_PAIRS = [
    ('decoder.decoder.layers.1.self_attn.out_proj.weight',
     'model.decoder.layers.1.self_attn.o_proj.weight'),
    ('decoder.decoder.layers.0.cross_attn.attention_weights.bias',
     'model.decoder.layers.0.encoder_attn.attention_weights.bias'),
    ('decoder.decoder.layers.2.norm1.scale', 'model.decoder.layers.2.self_attn_layer_norm.weight'),
    ('decoder.decoder.layers.0.norm2.scale',
     'model.decoder.layers.0.encoder_attn_layer_norm.weight'),
    ('decoder.decoder.layers.1.norm3.scale', 'model.decoder.layers.1.final_layer_norm.weight'),
    ('decoder.decoder.layers.2.swish_ffn.w3.bias', 'model.decoder.layers.2.mlp.down_proj.bias'),
    ('decoder.dec_score_head.2.weight', 'model.decoder.class_embed.2.weight'),
    ('decoder.dec_bbox_head.1.layers.0.bias', 'model.decoder.bbox_embed.1.layers.0.bias'),
    ('decoder.pre_bbox_head.layers.1.weight', 'model.decoder.pre_bbox_head.layers.1.weight'),
    ('decoder.query_pos_head.layers.0.bias', 'model.decoder.query_pos_head.layers.0.bias'),
    ('decoder.enc_score_head.weight', 'model.enc_score_head.weight'),
    ('decoder.enc_bbox_head.layers.1.bias', 'model.enc_bbox_head.layers.1.bias'),
    ('decoder.denoising_class_embed.weight', 'model.denoising_class_embed.weight'),
]
#: The same for the encoder (``model.`` dropped: the transformers converter's input).
TRANSFORMERS_ENCODER_PAIRS = [
    ('encoder.fpn_blocks.0.cv1.conv.weight', 'encoder.fpn_blocks.0.conv1.conv.weight'),
    ('encoder.fpn_blocks.0.cv4.norm.bias', 'encoder.fpn_blocks.0.conv2.norm.bias'),
    ('encoder.pan_blocks.1.cv2.0.bottlenecks.2.conv1.conv.weight',
     'encoder.pan_blocks.1.csp_rep1.bottlenecks.2.conv1.conv.weight'),
    ('encoder.pan_blocks.0.cv3.0.conv1.norm.weight',
     'encoder.pan_blocks.0.csp_rep2.conv1.norm.weight'),
    ('encoder.downsample_convs.1.0.cv2.conv.weight',
     'encoder.downsample_convs.1.conv2.conv.weight'),
    ('encoder.lateral_convs.0.norm.running_mean', 'encoder.lateral_convs.0.norm.running_mean'),
    ('encoder.encoder.0.layers.0.linear1.weight', 'encoder.aifi.0.layers.0.mlp.layers.0.weight'),
    ('encoder.encoder.0.layers.0.norm2.bias', 'encoder.aifi.0.layers.0.final_layer_norm.bias'),
]


@pytest.mark.parametrize('official_key, transformers_key', TRANSFORMERS_HEAD_PAIRS)
def test_official_and_transformers_head_keys_reach_the_same_place(official_key,
                                                                  transformers_key):
    value = torch.randn(3)
    ours, _ = head_part({official_key: value})
    assert ours.keys() == dfine_head_state_dict({transformers_key: value}).keys()


@pytest.mark.parametrize('official_key, transformers_key', TRANSFORMERS_ENCODER_PAIRS)
def test_official_and_transformers_encoder_keys_reach_the_same_place(official_key,
                                                                     transformers_key):
    value = torch.randn(3)
    ours = encoder_part({official_key: value})
    assert ours.keys() == transformers_encoder_part({transformers_key: value},
                                                    'transformers Deimv2').keys()
