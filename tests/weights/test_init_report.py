"""The train log's init line of a backbone names what its load dropped and resampled: real
checkpoints written by transformers and timm (randomly initialised, shrunk), loaded through
``init_cfg=dict(type='Pretrained', ...)`` as a config does."""
from types import SimpleNamespace

import timm
import torch
import transformers as hf
from mmdet.registry import MODELS
from mmengine.config import Config

import vitdet_plugin  # noqa: F401
from vitdet_plugin.checks.init_sources import loaded_init_lines

WIDTH, HEADS, DEPTH = 32, 2, 2


def _init_line(part: dict) -> str:
    backbone = MODELS.build(part)
    backbone.init_weights()
    (line,) = loaded_init_lines(SimpleNamespace(backbone=backbone),
                                Config(dict(model=dict(type='X', backbone=part))))
    return line


def test_a_patch14_transformers_dinov2_names_the_dropped_keys_and_the_resampled_kernel(tmp_path):
    """Dinov2ForImageClassification (patch 14) into a patch-16 DINOv2Backbone: the classifier
    and the mask token are dropped, the patch kernel is resampled 14 -> 16."""
    folder = str(tmp_path / 'dinov2')
    hf.Dinov2ForImageClassification(hf.Dinov2Config(
        hidden_size=WIDTH, num_hidden_layers=DEPTH, num_attention_heads=HEADS, image_size=56,
        patch_size=14, layer_norm_eps=1e-6)).save_pretrained(folder)
    part = dict(type='DINOv2Backbone', arch=dict(embed_dims=WIDTH, depth=DEPTH, num_heads=HEADS),
                patch_size=16, pretrain_img_size=56, global_attn_indexes=(0, 1),
                init_cfg=dict(type='Pretrained', checkpoint=folder))
    assert _init_line(part) == (
        f'init backbone (DINOv2Backbone): loaded from {folder}, 34 tensors, DINOv2 '
        'transformers Dinov2Model layout; dropped 3 checkpoint keys: classifier.bias, '
        'classifier.weight, dinov2.embeddings.mask_token; resampled 1: patch_embed.proj.weight '
        '32x3x14x14 -> 32x3x16x16')


def test_a_timm_vit_of_another_grid_names_the_resampled_position_table(tmp_path):
    """A timm ViT pretrained on 32 px (a 2 x 2 grid) into a ViTBackbone of a 4 x 4 grid: its
    classification head, cls token and final norm are dropped, the position table resampled."""
    path = str(tmp_path / 'vit.pth')
    torch.save(timm.create_model('vit_tiny_patch16_224', pretrained=False, img_size=32,
                                 embed_dim=WIDTH, depth=DEPTH, num_heads=HEADS,
                                 num_classes=3).state_dict(), path)
    part = dict(type='ViTBackbone', arch=dict(embed_dims=WIDTH, depth=DEPTH, num_heads=HEADS),
                global_attn_indexes=(0, 1), use_rel_pos=False, pretrain_img_size=64,
                init_cfg=dict(type='Pretrained', checkpoint=path))
    assert _init_line(part) == (
        f'init backbone (ViTBackbone): loaded from {path}, 27 tensors, ViT timm_vit layout; '
        'dropped 5 checkpoint keys: cls_token, norm.weight, norm.bias, head.weight, head.bias; '
        'resampled 1: pos_embed 1x5x32 -> 1x17x32')
