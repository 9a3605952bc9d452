"""Hugging Face transformers checkpoints: a ``save_pretrained`` folder of each supported class
loads into our backbone (strict, reported) and our feature maps equal transformers' own.

The references are tiny randomly initialised transformers models with every parameter
perturbed (layer scales, biases, cls / register / mask tokens, position embeddings, norms), so
nothing is trivially zero or one. Where the two models' semantics differ, the comparison is
made where they agree and the difference is pinned (docs/checkpoints.md#transformers):

* ``Dinov2Model`` resizes its position grid with plain bicubic, ours (timm's DINOv2) and
  ``Dinov2WithRegistersModel`` antialiased: off the grid ``Dinov2Model`` is compared with our
  backbone switched to plain bicubic, and the default is shown to differ;
* ViTDet (``ViTBackbone``) drops the cls token: the reference is transformers' own embedding
  and blocks run on the patch tokens;
* Swin / Swin V2 shift every other block (mmdet); transformers stops shifting where a stage's
  map fits in one window: the sizes keep every stage larger than its window.
"""
import json
import logging
import os
import re
import tempfile
from typing import Callable, Dict, Tuple

import pytest
import torch
import transformers as hf
from helpers import load_tool
from safetensors.torch import load_file
from torch import nn

import vitdet_plugin  # noqa: F401
from vitdet_plugin.models.backbones import (DINOv2Backbone, DINOv3Backbone, SwinBackbone,
                                            SwinV2Backbone, ViTBackbone)
from vitdet_plugin.weights import load_pretrained
from vitdet_plugin.weights import CheckpointError
from vitdet_plugin.weights.transformers_layouts import config_mismatch

#: Relative L2 tolerance of a feature map (fp32; the same operations in another order).
RTOL = 1e-5
#: Perturbation of every transformers parameter (randomness that is not the init's).
NOISE = 0.1
WIDTH, HEADS, DEPTH = 32, 2, 2
DINO2 = dict(hidden_size=WIDTH, num_hidden_layers=DEPTH, num_attention_heads=HEADS,
             image_size=56, patch_size=14, layer_norm_eps=1e-6)
VIT = dict(hidden_size=WIDTH, num_hidden_layers=DEPTH, num_attention_heads=HEADS,
           intermediate_size=4 * WIDTH, image_size=64, patch_size=16, layer_norm_eps=1e-6)
SWIN = dict(embed_dim=16, depths=[2, 2], num_heads=[1, 2], window_size=4, image_size=64)
#: DINOv2's SwiGLU width for 32 channels: (int(32 * 4 * 2 / 3) + 7) // 8 * 8 = 88 (transformers
#: Dinov2SwiGLUFFN), i.e. our mlp_ratio 88 / 32.
DINO2_SWIGLU_RATIO = 88 / WIDTH
ALL_BLOCKS = tuple(range(DEPTH))


def perturbed(model: nn.Module) -> nn.Module:
    """``model`` in eval mode with every parameter moved off its init."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(NOISE * torch.randn(p.shape, generator=gen))
    return model.eval()


#: name -> (a transformers model as saved, the part of it that is the backbone).
HF_MODELS: Dict[str, Callable[[], nn.Module]] = {
    'Dinov2Model': lambda: hf.Dinov2ForImageClassification(hf.Dinov2Config(**DINO2)),
    'Dinov2WithRegistersModel': lambda: hf.Dinov2WithRegistersModel(
        hf.Dinov2WithRegistersConfig(**DINO2, num_register_tokens=4, use_swiglu_ffn=True)),
    'DINOv3ViTModel': lambda: hf.DINOv3ViTModel(hf.DINOv3ViTConfig(
        **{**VIT, 'intermediate_size': 2 * WIDTH, 'layer_norm_eps': 1e-5},
        num_register_tokens=4, use_gated_mlp=True, hidden_act='silu')),
    'SwinModel': lambda: hf.SwinBackbone(hf.SwinConfig(**SWIN, out_features=['stage1', 'stage2'])),
    'Swinv2Model': lambda: hf.Swinv2ForImageClassification(hf.Swinv2Config(**SWIN)),
    'ViTModel': lambda: hf.ViTForImageClassification(hf.ViTConfig(**VIT)),
    'ViTMAEModel': lambda: hf.ViTMAEForPreTraining(hf.ViTMAEConfig(**VIT, mask_ratio=0.0)),
}
#: name -> our backbone for it (all blocks global, the outputs of both blocks / stages).
OURS: Dict[str, Callable[[], nn.Module]] = {
    'Dinov2Model': lambda: DINOv2Backbone(
        arch=dict(embed_dims=WIDTH, depth=DEPTH, num_heads=HEADS), pretrain_img_size=56,
        global_attn_indexes=ALL_BLOCKS, out_indices=ALL_BLOCKS),
    'Dinov2WithRegistersModel': lambda: DINOv2Backbone(
        arch=dict(embed_dims=WIDTH, depth=DEPTH, num_heads=HEADS, mlp='swiglu_packed',
                  mlp_ratio=DINO2_SWIGLU_RATIO), num_reg_tokens=4, pretrain_img_size=56,
        global_attn_indexes=ALL_BLOCKS, out_indices=ALL_BLOCKS),
    'DINOv3ViTModel': lambda: DINOv3Backbone(
        arch=dict(embed_dims=WIDTH, depth=DEPTH, num_heads=HEADS, mlp='swiglu', mlp_ratio=2),
        qkv_bias='qv', global_attn_indexes=ALL_BLOCKS, out_indices=ALL_BLOCKS),
    'SwinModel': lambda: SwinBackbone(arch=dict(embed_dims=16, depths=(2, 2), num_heads=(1, 2)),
                                      window_size=4, out_indices=(0, 1)),
    'Swinv2Model': lambda: SwinV2Backbone(
        arch=dict(embed_dims=16, depths=(2, 2), num_heads=(1, 2)), window_size=4,
        out_indices=(0, 1)),
    'ViTModel': lambda: ViTBackbone(
        arch=dict(embed_dims=WIDTH, depth=DEPTH, num_heads=HEADS), global_attn_indexes=ALL_BLOCKS,
        use_rel_pos=False, pretrain_img_size=64, out_indices=ALL_BLOCKS),
    'ViTMAEModel': lambda: ViTBackbone(
        arch=dict(embed_dims=WIDTH, depth=DEPTH, num_heads=HEADS), global_attn_indexes=ALL_BLOCKS,
        use_rel_pos=False, pretrain_img_size=64, out_indices=ALL_BLOCKS),
}
#: name -> the keys the load reports as dropped (the task wrapper's and pretraining parts).
DROPPED = {
    'Dinov2Model': ['classifier.weight', 'classifier.bias', 'dinov2.embeddings.mask_token'],
    'Dinov2WithRegistersModel': ['embeddings.mask_token'],
    'DINOv3ViTModel': ['embeddings.mask_token'],
    'SwinModel': ['swin.layernorm.weight', 'swin.layernorm.bias'],
    'Swinv2Model': ['classifier.weight', 'classifier.bias', 'norm.weight', 'norm.bias'],
    'ViTModel': ['classifier.weight', 'classifier.bias', 'cls_token', 'norm.weight', 'norm.bias'],
}
#: Input sizes (h, w): the pretraining grid and one off it (non-square, not a window multiple).
SIZES = {'Dinov2Model': ((56, 56), (70, 42)), 'Dinov2WithRegistersModel': ((56, 56), (70, 42)),
         'DINOv3ViTModel': ((64, 64), (80, 48)), 'SwinModel': ((64, 64), (72, 56)),
         'Swinv2Model': ((64, 64), (72, 56)), 'ViTModel': ((64, 64), (80, 48)),
         'ViTMAEModel': ((64, 64), (80, 48))}


def save(model: nn.Module, folder: str, **kw) -> str:
    model.save_pretrained(folder, **kw)
    return folder


def saved_state_dict(name: str) -> Dict[str, torch.Tensor]:
    """The tensors ``save_pretrained`` writes for the :data:`HF_MODELS` model ``name`` (the
    hub's names), for tests that need the state dict rather than the folder."""
    with tempfile.TemporaryDirectory() as folder:
        save(perturbed(HF_MODELS[name]()), folder)
        return load_file(os.path.join(folder, 'model.safetensors'))


@pytest.fixture(scope='module')
def folders(tmp_path_factory) -> Dict[str, Tuple[nn.Module, str]]:
    """name -> (the perturbed transformers model, its save_pretrained folder)."""
    root = tmp_path_factory.mktemp('hf')
    built = {}
    for name, make in HF_MODELS.items():
        model = perturbed(make())
        built[name] = (model, save(model, str(root / name)))
    return built


def _tokens_to_maps(tokens: torch.Tensor, hw: Tuple[int, int]) -> torch.Tensor:
    b, _, c = tokens.shape
    return tokens.transpose(1, 2).reshape(b, c, *hw)                # (B, C, h, w)


def reference_maps(name: str, model: nn.Module, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """transformers' own feature maps of ``x`` for the outputs our backbone returns."""
    hw = (x.shape[2] // model.config.patch_size, x.shape[3] // model.config.patch_size)
    with torch.no_grad():
        if name == 'SwinModel':  # SwinBackbone: stage outputs through its output norms
            return tuple(model(x).feature_maps)
        if name == 'Swinv2Model':  # stage outputs before the merge (our output norms: init)
            inner = model.swinv2
            out = inner.encoder(*inner.embeddings(x), output_hidden_states=True,
                                output_hidden_states_before_downsampling=True)
            return tuple(out.reshaped_hidden_states[1:3])
        if name.startswith('Dinov2'):
            inner = getattr(model, 'dinov2', model)
            out = inner(x, output_hidden_states=True)
            skip = 1 + model.config.num_register_tokens if 'Registers' in name else 1
            return tuple(_tokens_to_maps(inner.layernorm(h)[:, skip:], hw)
                         for h in out.hidden_states[1:])
        if name == 'DINOv3ViTModel':
            out = model(x, output_hidden_states=True)
            return tuple(_tokens_to_maps(model.norm(h)[:, 5:], hw) for h in out.hidden_states[1:])
        # ViTDet drops the cls token: transformers' embedding, then its blocks on the patches
        emb = model.vit.embeddings
        if name == 'ViTMAEModel':  # unshuffled (noise in order), nothing masked
            noise = torch.arange(hw[0] * hw[1], dtype=torch.float32).expand(x.shape[0], -1)
            tokens = emb(x, noise=noise, interpolate_pos_encoding=True)[0][:, 1:]
        else:
            tokens = emb(x, interpolate_pos_encoding=True)[:, 1:]
        maps = []
        for layer in model.vit.layers:
            tokens = layer(tokens)
            tokens = tokens[0] if isinstance(tokens, tuple) else tokens
            maps.append(_tokens_to_maps(tokens, hw))
        return tuple(maps)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def loaded(name: str, checkpoint) -> Tuple[nn.Module, object]:
    ours = OURS[name]()
    report = load_pretrained(ours, checkpoint)
    return ours.eval(), report


@pytest.mark.parametrize('name', list(HF_MODELS))
def test_a_save_pretrained_folder_matches_transformers(folders, name):
    model, folder = folders[name]
    ours, report = loaded(name, folder)
    assert report.layout.endswith(f'transformers {name}')
    if name in DROPPED:
        assert sorted(report.dropped) == sorted(DROPPED[name])
    if name == 'Dinov2Model':  # transformers resizes its grid without antialiasing
        ours.POS_ANTIALIAS = False
    gen = torch.Generator().manual_seed(1)
    for size in SIZES[name]:
        x = torch.randn(2, 3, *size, generator=gen)
        with torch.no_grad():
            maps = ours(x)
        refs = reference_maps(name, model, x)
        if name == 'Swinv2Model':  # our output norms keep their init: apply them to its maps
            refs = tuple(getattr(ours, f'norm{i}')(r.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
                         for i, r in enumerate(refs))
        assert [m.shape for m in maps] == [r.shape for r in refs]
        for m, r in zip(maps, refs):
            assert rel_err(m, r) <= RTOL, (size, rel_err(m, r))


def test_dinov2_position_resize_is_the_one_difference(folders):
    """Off the grid our default (antialiased, as timm and Dinov2WithRegistersModel) differs
    from Dinov2Model's plain bicubic; on the grid nothing is resized and both agree."""
    model, folder = folders['Dinov2Model']
    ours, _ = loaded('Dinov2Model', folder)
    x = torch.randn(1, 3, 70, 42, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        err = rel_err(ours(x)[-1], reference_maps('Dinov2Model', model, x)[-1])
    assert err > 100 * RTOL


@pytest.mark.parametrize('name', ['Dinov2Model', 'SwinModel', 'ViTModel', 'DINOv3ViTModel'])
def test_the_in_memory_state_dict_loads_the_same(folders, name):
    """transformers 5's in-memory names (``attention.q_proj``, ``model.layer``, ...) load as
    the saved ones do."""
    model, folder = folders[name]
    from_folder, _ = loaded(name, folder)
    from_memory, report = loaded(name, model.state_dict())
    assert report.layout.endswith(f'transformers {name}')
    for k, v in from_folder.state_dict().items():
        assert torch.equal(v, from_memory.state_dict()[k]), k


def test_a_sharded_folder_loads_and_a_missing_shard_is_named(folders, tmp_path):
    model, folder = folders['Dinov2Model']
    sharded = save(model, str(tmp_path / 'sharded'), max_shard_size='40KB')
    with open(os.path.join(sharded, 'model.safetensors.index.json')) as f:
        shards = sorted(set(json.load(f)['weight_map'].values()))
    assert len(shards) > 1
    whole, _ = loaded('Dinov2Model', folder)
    parts, _ = loaded('Dinov2Model', sharded)
    assert all(torch.equal(v, parts.state_dict()[k]) for k, v in whole.state_dict().items())
    os.remove(os.path.join(sharded, shards[1]))
    want = (f'the sharded checkpoint {sharded!r} lacks {shards[1]} (of the {len(shards)} shards '
            'its model.safetensors.index.json lists): download or copy the missing shard into '
            'the folder')
    with pytest.raises(CheckpointError, match='^' + re.escape(want) + '$'):
        loaded('Dinov2Model', sharded)


def test_a_pytorch_model_bin_folder_is_read_weights_only(folders, tmp_path):
    """Older hub folders hold ``pytorch_model.bin`` (torch.save of the saved names)."""
    model, folder = folders['ViTModel']
    old = tmp_path / 'bin'
    old.mkdir()
    (old / 'config.json').write_text(open(os.path.join(folder, 'config.json')).read())
    torch.save(load_file(os.path.join(folder, 'model.safetensors')), old / 'pytorch_model.bin')
    a, _ = loaded('ViTModel', folder)
    b, report = loaded('ViTModel', str(old))
    assert report.layout == 'ViT transformers ViTModel'
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())


def _folder_with(tmp_path, model: nn.Module, name: str) -> str:
    return save(perturbed(model), str(tmp_path / name))


def test_a_config_of_other_heads_is_refused_naming_both(tmp_path):
    """4 heads instead of 2: the shapes agree, only config.json tells."""
    folder = _folder_with(tmp_path, hf.Dinov2Model(hf.Dinov2Config(
        **{**DINO2, 'num_attention_heads': 4})), 'heads')
    want = (f"the transformers folder {folder!r} (config.json: Dinov2Model) has num_heads=4; "
            'DINOv2Backbone was built with num_heads=2: build it with num_heads=4')
    with pytest.raises(CheckpointError, match='^' + re.escape(want) + '$'):
        loaded('Dinov2Model', folder)


def test_a_config_of_another_width_names_the_arguments(tmp_path):
    cfg = hf.Dinov2Config(hidden_size=384, num_hidden_layers=1, num_attention_heads=6,
                          image_size=28, patch_size=14)
    folder = save(hf.Dinov2Model(cfg), str(tmp_path / 'small'))
    model = DINOv2Backbone(arch='base', depth=1, pretrain_img_size=28)
    want = (f"the transformers folder {folder!r} (config.json: Dinov2Model) has "
            "embed_dims=384, num_heads=6; DINOv2Backbone was built with embed_dims=768, "
            "num_heads=12: build it with embed_dims=384, num_heads=6")
    with pytest.raises(CheckpointError, match='^' + re.escape(want) + '$'):
        load_pretrained(model, folder)


def test_the_preset_that_builds_a_config_is_named():
    """DINOv2-S's config.json (transformers' own, no weights needed) given to a small custom
    model: the fix is the preset."""
    config = hf.Dinov2Config(hidden_size=384, num_hidden_layers=12,
                             num_attention_heads=6).to_dict()
    target = OURS['Dinov2Model']().checkpoint_target()
    assert config_mismatch(config, 'DINOv2', target, 'folder') == (
        'the folder (config.json: Dinov2Model) has embed_dims=384, depth=12, num_heads=6; '
        'DINOv2Backbone was built with embed_dims=32, depth=2, num_heads=2: build it with '
        "arch='small'")


def test_registers_rope_activation_and_pretrained_windows_are_checked(folders, tmp_path):
    _, regs = folders['Dinov2WithRegistersModel']
    model = DINOv2Backbone(arch=dict(embed_dims=WIDTH, depth=DEPTH, num_heads=HEADS,
                                     mlp='swiglu_packed', mlp_ratio=DINO2_SWIGLU_RATIO),
                           pretrain_img_size=56)
    want = (f"the transformers folder {regs!r} (config.json: Dinov2WithRegistersModel) has "
            'num_reg_tokens=4; DINOv2Backbone was built with num_reg_tokens=0: build it with '
            'num_reg_tokens=4')
    with pytest.raises(CheckpointError, match='^' + re.escape(want) + '$'):
        load_pretrained(model, regs)
    _, dinov3 = folders['DINOv3ViTModel']
    model = DINOv3Backbone(arch=dict(embed_dims=WIDTH, depth=DEPTH, num_heads=HEADS,
                                     mlp='swiglu', mlp_ratio=2), qkv_bias='qv',
                           rope=dict(temperature=10000.0))
    want = (f"the transformers folder {dinov3!r} (config.json: DINOv3ViTModel) has "
            'rope=dict(temperature=100); DINOv3Backbone was built with '
            'rope=dict(temperature=10000): build it with rope=dict(temperature=100)')
    with pytest.raises(CheckpointError, match='^' + re.escape(want) + '$'):
        load_pretrained(model, dinov3)
    gelu_gated = _folder_with(tmp_path, hf.DINOv3ViTModel(hf.DINOv3ViTConfig(
        **{**VIT, 'intermediate_size': 2 * WIDTH}, use_gated_mlp=True, hidden_act='gelu')), 'act')
    want = (f"the transformers folder {gelu_gated!r} (config.json: DINOv3ViTModel) has "
            "hidden_act='gelu'; our gated MLP (SwiGLU) computes 'silu', no argument changes "
            "that: a model with hidden_act='gelu' cannot be loaded")
    with pytest.raises(CheckpointError, match='^' + re.escape(want) + '$'):
        load_pretrained(model, gelu_gated)
    v2 = _folder_with(tmp_path, hf.Swinv2Model(hf.Swinv2Config(
        **SWIN, pretrained_window_sizes=[8, 8])), 'v2')
    want = (f"the transformers folder {v2!r} (config.json: Swinv2Model) has "
            'pretrained_window_sizes=[8, 8]; SwinV2Backbone was built with '
            'pretrained_window_sizes=[4, 4]: build it with pretrained_window_sizes=[8, 8]')
    with pytest.raises(CheckpointError, match='^' + re.escape(want) + '$'):
        loaded('Swinv2Model', v2)


def test_a_folder_of_another_family_is_refused_naming_the_backbone(folders):
    _, swin = folders['SwinModel']
    want = ('the checkpoint is a Swin checkpoint (transformers SwinModel layout); '
            "DINOv2Backbone loads DINOv2 checkpoints: build type='SwinBackbone'")
    with pytest.raises(CheckpointError, match='^' + re.escape(want) + '$'):
        loaded('Dinov2Model', swin)


def test_a_directory_without_config_is_refused(tmp_path):
    want = (f'{str(tmp_path)!r} is a directory without config.json: a checkpoint directory '
            'must be a Hugging Face transformers model folder (save_pretrained writes '
            'config.json and model.safetensors); give that folder or a checkpoint file')
    with pytest.raises(CheckpointError, match='^' + re.escape(want) + '$'):
        loaded('ViTModel', str(tmp_path))


def test_convert_weights_reads_a_folder(folders, tmp_path, caplog):
    _, folder = folders['SwinModel']
    out = str(tmp_path / 'swin_ours.pth')
    assert load_tool('convert_weights.py').main([folder, out]) == 0
    with caplog.at_level(logging.INFO, 'vitdet_plugin'):
        a, _ = loaded('SwinModel', folder)
        b, report = loaded('SwinModel', out)
    assert report.layout == 'Swin ours'
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())


#: ``config.json`` values of published hub models (facebook/dinov2-{base,giant},
#: facebook/dinov2-with-registers-small, facebook/dinov3-vit{b,l}16-pretrain-lvd1689m,
#: microsoft/swin-{tiny-patch4-window7-224,base-patch4-window12-384},
#: microsoft/swinv2-tiny-patch4-window8-256, google/vit-base-patch16-224,
#: facebook/vit-mae-large; transformers' defaults for the rest) and the backbone that loads each.
HUB_CONFIGS = {
    'dinov2-base': ('DINOv2', lambda: hf.Dinov2Config(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, image_size=518),
        lambda: DINOv2Backbone(arch='base')),
    'dinov2-giant': ('DINOv2', lambda: hf.Dinov2Config(
        hidden_size=1536, num_hidden_layers=40, num_attention_heads=24, image_size=518,
        use_swiglu_ffn=True), lambda: DINOv2Backbone(arch='giant')),
    'dinov2-with-registers-small': ('DINOv2', lambda: hf.Dinov2WithRegistersConfig(
        hidden_size=384, num_hidden_layers=12, num_attention_heads=6, image_size=518,
        num_register_tokens=4), lambda: DINOv2Backbone(arch='small', num_reg_tokens=4)),
    'dinov3-vitb16': ('DINOv3', lambda: hf.DINOv3ViTConfig(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
        rope_theta=100.0, num_register_tokens=4, layer_norm_eps=1e-5),
        lambda: DINOv3Backbone(arch='base')),
    'dinov3-vitl16': ('DINOv3', lambda: hf.DINOv3ViTConfig(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
        rope_theta=100.0, num_register_tokens=4, layer_norm_eps=1e-5),
        lambda: DINOv3Backbone(arch='large')),
    'swin-tiny': ('Swin', hf.SwinConfig, lambda: SwinBackbone(arch='tiny')),
    'swin-base-384': ('Swin', lambda: hf.SwinConfig(
        embed_dim=128, depths=[2, 2, 18, 2], num_heads=[4, 8, 16, 32], window_size=12,
        image_size=384), lambda: SwinBackbone(arch='base', window_size=12)),
    'swinv2-tiny-256': ('Swin V2', lambda: hf.Swinv2Config(window_size=8, image_size=256),
                        lambda: SwinV2Backbone(arch='tiny', window_size=8)),
    'vit-base': ('ViT', hf.ViTConfig, lambda: ViTBackbone(arch='base')),
    'vit-mae-large': ('ViT', lambda: hf.ViTMAEConfig(
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
        lambda: ViTBackbone(arch='large')),
}


@pytest.mark.parametrize('name', list(HUB_CONFIGS))
def test_published_configs_agree_with_the_presets(name):
    """The config.json of each published model passes the check against the preset that
    builds it (the backbone built on the meta device: full size, no memory), and the same
    config against another size is refused naming the preset."""
    family, config, build = HUB_CONFIGS[name]
    with torch.device('meta'):
        target = build().checkpoint_target()
    assert config_mismatch(config().to_dict(), family, target, 'folder') == ''
    smaller = dict(config().to_dict(), num_hidden_layers=2, depths=[1, 1, 1, 1])
    message = config_mismatch(smaller, family, target, 'folder')
    assert message.startswith('the folder (config.json: ') and ': build it with depth' in message
