"""tools/convert_weights.py: converts Swin and ViT checkpoints into loadable files.

The first test runs the script as a command (a subprocess: the entry point, its imports and
exit code); the others call its ``main`` in this process (:func:`helpers.run_tool`), which
sees the same arguments, output and exit codes without paying the imports again."""
import subprocess
import sys

import torch
from helpers import REPO_ROOT, randomize_, run_tool

import vitdet_plugin  # noqa: F401
from vitdet_plugin.models.backbones.swin import SwinBackbone
from vitdet_plugin.weights.swin import swin_to_mmdet

ROOT = REPO_ROOT
ARCH = dict(embed_dims=32, depths=(2, 2), num_heads=(2, 4))


def _cli(*args):
    return run_tool('convert_weights.py', list(args))


def test_convert_mmdet_swin_checkpoint_with_window_resize(tmp_path):
    src = randomize_(SwinBackbone(arch=ARCH, out_indices=(0, 1)))
    torch.save({'state_dict': swin_to_mmdet(src.state_dict())}, tmp_path / 'mm.pth')
    res = subprocess.run([sys.executable, str(ROOT / 'tools' / 'convert_weights.py'),
                          str(tmp_path / 'mm.pth'), str(tmp_path / 'ours.pth'),
                          '--window-size', '12'], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "a Swin checkpoint (mmdet layout) -> " in res.stdout
    assert res.stdout.strip().endswith("load it with type='SwinBackbone'")
    model = SwinBackbone(arch=ARCH, out_indices=(0, 1), window_size=12,
                         init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'ours.pth')))
    model.init_weights()
    assert torch.equal(model.layers[1].blocks[0].attn.qkv.weight,
                       src.layers[1].blocks[0].attn.qkv.weight)
    assert model.layers[0].blocks[0].attn.relative_position_bias_table.shape == (23 * 23, 2)


def test_convert_timm_vit_checkpoint(tmp_path):
    from timm.models.vision_transformer import VisionTransformer
    ref = VisionTransformer(img_size=64, patch_size=16, embed_dim=32, depth=2, num_heads=2,
                            num_classes=5)
    torch.save({'model': ref.state_dict()}, tmp_path / 'mae.pth')
    res = _cli(str(tmp_path / 'mae.pth'), str(tmp_path / 'vit.pth'))
    assert res.returncode == 0, res.stderr
    assert 'a ViT checkpoint (timm_vit layout) -> ' in res.stdout
    sd = torch.load(tmp_path / 'vit.pth', weights_only=True)['state_dict']
    assert torch.equal(sd['blocks.1.attn.qkv.weight'], ref.state_dict()['blocks.1.attn.qkv.weight'])
    res = _cli(str(tmp_path / 'mae.pth'), str(tmp_path / 'swin.pth'), '--model', 'swin')
    assert res.returncode == 1
    assert res.stderr.strip() == ("error: the checkpoint is a ViT checkpoint (timm_vit layout), "
                                  "not --model swin: give --model vit (it loads into "
                                  "type='ViTBackbone')")


def test_convert_reports_bad_input(tmp_path):
    res = _cli(str(tmp_path / 'missing.pth'), str(tmp_path / 'out.pth'))
    assert res.returncode == 1
    assert 'does not exist' in res.stderr


def test_convert_with_a_prefix(tmp_path):
    """SimMIM-style checkpoints keep the backbone under 'encoder.'; --prefix selects it."""
    src = randomize_(SwinBackbone(arch=ARCH, out_indices=(0, 1)))
    torch.save({'model': {'encoder.' + k: v for k, v in src.state_dict().items()}},
               tmp_path / 'simmim.pth')
    res = _cli(str(tmp_path / 'simmim.pth'), str(tmp_path / 'out.pth'))
    assert res.returncode == 1
    assert 'error: unrecognised checkpoint format: no Swin attention weights found' in res.stderr
    for family in ('; no Swin V2 attention weights found', '; no ViT attention weights found',
                   '; not a DINOv2 / DINOv3 / EVA-02 checkpoint', '--prefix'):
        assert family in res.stderr
    res = _cli(str(tmp_path / 'simmim.pth'), str(tmp_path / 'out.pth'), '--prefix', 'encoder.')
    assert res.returncode == 0, res.stderr
    sd = torch.load(tmp_path / 'out.pth', weights_only=True)['state_dict']
    assert torch.equal(sd['layers.1.blocks.0.mlp.fc2.weight'],
                       src.state_dict()['layers.1.blocks.0.mlp.fc2.weight'])


def test_convert_refuses_bad_window_arguments(tmp_path):
    src = randomize_(SwinBackbone(arch=ARCH, out_indices=(0, 1)))
    torch.save(src.state_dict(), tmp_path / 'ours.pth')
    res = _cli(str(tmp_path / 'ours.pth'), str(tmp_path / 'out.pth'), '--window-size', '7', '7',
               '7')
    assert res.returncode == 2 and '--window-size takes 1 or 2 values' in res.stderr


def test_convert_official_eva02_checkpoint_to_patch16(tmp_path):
    """An official EVA-02 MIM file (built from a random timm model by the inverse map of
    tests/weights/test_official_vit_layouts.py) -> ours at patch 16: the file loads strictly into a
    patch-16 EVA02Backbone and holds timm's FlexiViT-resampled kernel."""
    from test_official_vit_layouts import eva02_official, tiny
    from timm.layers.patch_embed import resample_patch_embed

    from vitdet_plugin.models.backbones import EVA02Backbone
    ref = tiny('eva02_tiny_patch14_224', 56)
    torch.save({'module': eva02_official(ref.state_dict(), grid=4, ref_grid=16)},
               tmp_path / 'eva02_Ti_pt.pt')
    res = _cli(str(tmp_path / 'eva02_Ti_pt.pt'), str(tmp_path / 'ours.pth'), '--patch-size', '16')
    assert res.returncode == 0, res.stderr
    assert 'an EVA-02 checkpoint (eva02 official layout) -> ' in res.stdout
    assert res.stdout.strip().endswith("load it with type='EVA02Backbone'")
    model = EVA02Backbone(arch='tiny', embed_dims=64, depth=2, num_heads=4,
                          global_attn_indexes=(1,), patch_size=16, pretrain_img_size=56,
                          init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'ours.pth')))
    model.init_weights()
    want = resample_patch_embed(ref.patch_embed.proj.weight.detach(), [16, 16])
    assert torch.allclose(model.patch_embed.proj.weight, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(model.blocks[1].attn.v_bias, ref.state_dict()['blocks.1.attn.v_bias'])
    res = _cli(str(tmp_path / 'eva02_Ti_pt.pt'), str(tmp_path / 'x.pth'), '--model', 'swin',
               '--patch-size', '16')
    assert res.returncode == 2
    assert res.stderr.strip().endswith('--patch-size applies to DINOv2 / DINOv3 / EVA-02 '
                                       'checkpoints only')
