"""A checkpoint of the right family but another size is refused naming both architectures and
the preset that builds the checkpoint's (before any per-key shape list)."""
import pytest
import timm
import torch
from mmdet.registry import MODELS

import vitdet_plugin  # noqa: F401
from vitdet_plugin.weights import CheckpointError


def _load(cfg: dict, sd: dict) -> None:
    MODELS.build(dict(cfg, init_cfg=dict(type='Pretrained', checkpoint=sd))).init_weights()


def test_timm_swin_tiny_given_to_swin_small_names_tiny():
    sd = timm.create_model('swin_tiny_patch4_window7_224', pretrained=False).state_dict()
    with pytest.raises(CheckpointError) as e:
        _load(dict(type='SwinBackbone', arch='small'), sd)
    assert str(e.value) == (
        'the Swin checkpoint (timm layout) holds embed_dims=96, depths=(2, 2, 6, 2), '
        "num_heads=(3, 6, 12, 24) (arch='tiny'); SwinBackbone was built with embed_dims=96, "
        "depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24) (arch='small'): build it with "
        "arch='tiny'")


def test_timm_dinov2_small_given_to_base_names_small():
    sd = timm.create_model('vit_small_patch14_dinov2', pretrained=False,
                           img_size=518).state_dict()
    with pytest.raises(CheckpointError) as e:
        _load(dict(type='DINOv2Backbone', arch='base'), sd)
    assert str(e.value) == (
        "the DINOv2 checkpoint (ours layout) holds embed_dims=384, depth=12 (arch='small'); "
        "DINOv2Backbone was built with embed_dims=768, depth=12 (arch='base'): build it with "
        "arch='small'")


def test_custom_swin_without_a_preset_names_the_arguments():
    arch = dict(embed_dims=16, depths=(1, 1), num_heads=(1, 2))
    src = MODELS.build(dict(type='SwinBackbone', arch=arch, out_indices=(0, 1)))
    with pytest.raises(CheckpointError) as e:
        _load(dict(type='SwinBackbone', arch=dict(arch, depths=(1, 2)), out_indices=(0, 1)),
              src.state_dict())
    assert str(e.value) == (
        'the Swin checkpoint (ours layout) holds embed_dims=16, depths=(1, 1), num_heads=(1, 2); '
        'SwinBackbone was built with embed_dims=16, depths=(1, 2), num_heads=(1, 2): set its '
        'architecture arguments to embed_dims=16, depths=(1, 1), num_heads=(1, 2)')


def test_same_architecture_loads():
    src = MODELS.build(dict(type='SwinBackbone', arch=dict(embed_dims=16, depths=(1, 1),
                                                          num_heads=(1, 2)), out_indices=(0, 1)))
    dst = MODELS.build(dict(type='SwinBackbone', arch=dict(embed_dims=16, depths=(1, 1),
                                                          num_heads=(1, 2)), out_indices=(0, 1),
                            init_cfg=dict(type='Pretrained', checkpoint=src.state_dict())))
    dst.init_weights()
    for k, v in src.state_dict().items():
        assert torch.equal(v, dst.state_dict()[k]), k
