"""The checkpoint contract: importing vitdet_plugin plugs the weights package's loader in, the
models reach it only through the contract, and without a loader the error names the fix."""
import pytest
import torch

import vitdet_plugin  # noqa: F401
from vitdet_plugin.functional import checkpoint_target
from vitdet_plugin.models.backbones import ViTBackbone
from vitdet_plugin.weights import load_checkpoint, load_init_checkpoint, read_part


def test_importing_the_package_plugs_the_layout_table_in():
    loader = checkpoint_target.checkpoint_loader()
    assert loader.convert is load_checkpoint
    assert loader.read_as_saved is read_part  # read_as_saved, RF-DETR files converted first
    assert loader.load_init is load_init_checkpoint


def test_without_a_plugged_loader_a_model_load_names_the_fix(monkeypatch):
    arch = dict(embed_dims=32, depth=1, num_heads=2)
    state = ViTBackbone(arch=arch, global_attn_indexes=(0,)).state_dict()
    model = ViTBackbone(arch=arch, global_attn_indexes=(0,), init_cfg=dict(
        type='Pretrained', checkpoint={k: torch.zeros(v.shape) for k, v in state.items()}))
    monkeypatch.setattr(checkpoint_target, '_plugged', {})
    with pytest.raises(RuntimeError, match='^no checkpoint loader is plugged in: import '
                       r'vitdet_plugin \(its weights package plugs the layout table in\) before '
                       'loading weights$'):
        model.init_weights()
