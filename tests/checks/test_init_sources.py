"""Pretrained by default, and said (issue 38): every full config starts from its recipe's
published weights; offline, the pre-flight check names the URL, where a downloaded copy goes,
the --cfg-options for a local copy and init_cfg=None; the summary names each part's source."""
import glob
import os.path as osp

import pytest
from mmengine.config import Config

import vitdet_plugin  # noqa: F401
from vitdet_plugin.checks import ConfigCheckError
from vitdet_plugin.checks.init_sources import (
    loaded_init_lines,
    planned_init_lines,
    unreachable_weights,
)
from vitdet_plugin.checks.preflight import preflight
from helpers import REPO_ROOT

ROOT = str(REPO_ROOT)
FULL_CONFIGS = sorted(glob.glob(osp.join(ROOT, 'configs', '*.py')))
#: what each family's published recipe starts from (mmdet's stock configs / official releases)
PUBLISHED = {
    'swin': 'https://github.com/SwinTransformer/storage/releases/download/v1.0.0/'
            'swin_tiny_patch4_window7_224.pth',
    'swinv2': 'https://github.com/SwinTransformer/storage/releases/download/v2.0.0/'
              'swinv2_tiny_patch4_window8_256.pth',
    'vit': 'https://dl.fbaipublicfiles.com/mae/pretrain/mae_pretrain_vit_base.pth',
    'dinov2': 'https://dl.fbaipublicfiles.com/dinov2/dinov2_vitb14/'
              'dinov2_vitb14_reg4_pretrain.pth',
    'eva02': 'https://huggingface.co/Yuxin-CV/EVA-02/resolve/main/eva02/pt/'
             'eva02_B_pt_in21k_p14.pt',
    'dinov3': 'checkpoints/dinov3_vitb16_pretrain_lvd1689m.pth',  # given on request only
}
#: the large backbones' configs (docs/large_models.md) start from their own size's release
PUBLISHED_LARGE = {
    'dinov3_l_cascade_mask_rcnn_fsdp.py': 'checkpoints/dinov3_vitl16_pretrain_lvd1689m.pth',
    'eva02_l_cascade_mask_rcnn_fsdp.py': 'https://huggingface.co/Yuxin-CV/EVA-02/resolve/main/'
                                         'eva02/pt/eva02_L_pt_in21k_p14.pt',
    'dinov3_7b_dino_fsdp.py': 'checkpoints/dinov3_vit7b16_pretrain_lvd1689m.pth',
}
#: a URL nothing answers (a closed local port): the offline case, without a network
CLOSED = 'http://127.0.0.1:9/weights/swin_tiny_patch4_window7_224.pth'


def test_every_full_config_names_its_published_weights():
    assert len(FULL_CONFIGS) == 18
    for path in FULL_CONFIGS:
        name = osp.basename(path)
        want = PUBLISHED_LARGE.get(name) or PUBLISHED[name.split('_')[0]]
        init = Config.fromfile(path).model.backbone.init_cfg
        assert init == dict(type='Pretrained', checkpoint=want), path


def test_demo_configs_say_they_start_from_random_init():
    cfg = Config.fromfile(osp.join(ROOT, 'configs', 'demo', 'swin_retinanet_shapes.py'))
    assert planned_init_lines(cfg) == [
        'init backbone (SwinBackbone): random init (no Pretrained init_cfg)',
        'init neck (FPN): random init (no Pretrained init_cfg)',
        'init bbox_head (RetinaHead): random init (no Pretrained init_cfg)']


def test_offline_url_message(tmp_path, monkeypatch):
    monkeypatch.setenv('TORCH_HOME', str(tmp_path / 'torch'))
    cfg = Config(dict(model=dict(type='RetinaNet', backbone=dict(
        type='SwinBackbone', init_cfg=dict(type='Pretrained', checkpoint=CLOSED)))))
    cached = tmp_path / 'torch' / 'hub' / 'checkpoints' / 'swin_tiny_patch4_window7_224.pth'
    assert unreachable_weights(cfg) == [
        f"model.backbone.init_cfg.checkpoint='{CLOSED}' cannot be downloaded (URLError: "
        "[Errno 111] Connection refused) and is not in torch hub's cache "
        f'({cached}); download it where there is network and put it at that path, or give '
        'your copy with --cfg-options model.backbone.init_cfg.checkpoint=/path/to/'
        'swin_tiny_patch4_window7_224.pth, or train from random init with --cfg-options '
        'model.backbone.init_cfg=None']
    # a copy in the cache is what the loader reads: then nothing is asked of the network
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b'')
    assert unreachable_weights(cfg) == []


def test_offline_url_stops_the_preflight(tmp_path, monkeypatch):
    monkeypatch.setenv('TORCH_HOME', str(tmp_path / 'torch'))
    cfg = Config.fromfile(osp.join(ROOT, 'configs', 'demo', 'swin_retinanet_shapes.py'))
    cfg.model.backbone.init_cfg = dict(type='Pretrained', checkpoint=CLOSED)
    cfg.train_dataloader = cfg.val_dataloader = None  # the weights alone
    with pytest.raises(ConfigCheckError) as e:
        preflight(cfg, ('train',), config_path='demo.py', log=None)
    lines = str(e.value).splitlines()
    assert lines[0] == 'demo.py: 1 problem found before training'
    assert lines[1].startswith(f"  model.backbone.init_cfg.checkpoint='{CLOSED}' cannot be "
                               'downloaded (URLError: [Errno 111] Connection refused)')


def test_loaded_lines_name_the_report_when_a_module_keeps_one():
    """The interface for the loaders: a module's ``init_report`` (a LoadReport, optionally
    with a ``layout``) adds the tensor count and the layout to its line."""
    from types import SimpleNamespace

    import torch
    backbone = torch.nn.Linear(1, 1)
    backbone.init_report = SimpleNamespace(loaded=['a', 'b'], layout='official')
    model = SimpleNamespace(backbone=backbone, neck=torch.nn.Identity())
    cfg = Config(dict(model=dict(
        type='X', backbone=dict(type='B', init_cfg=dict(type='Pretrained', checkpoint='w.pth',
                                                        prefix='backbone.')),
        neck=dict(type='N'))))
    assert loaded_init_lines(model, cfg) == [
        "init backbone (Linear): loaded from w.pth (prefix 'backbone.'), 2 tensors, official "
        'layout',
        'init neck (Identity): randomly initialised (no Pretrained init_cfg, no load_from)']
    cfg.load_from = 'run/iter_8.pth'
    assert loaded_init_lines(model, cfg)[1] == \
        'init neck (Identity): loaded from load_from=run/iter_8.pth'


def test_loaded_line_of_a_real_backbone_says_layout_and_tensors(tmp_path):
    """A timm Swin file loaded by SwinBackbone's init_weights: the line counts the tensors the
    model received, names the layout the table detected and the checkpoint keys dropped (timm's
    final norm and classifier)."""
    from types import SimpleNamespace

    import timm
    import torch
    from mmdet.registry import MODELS
    path = tmp_path / 'swin_t_timm.pth'
    torch.save(timm.create_model('swin_tiny_patch4_window7_224', pretrained=False).state_dict(),
               path)
    part = dict(type='SwinBackbone', out_indices=(1, 2, 3),
                init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    backbone = MODELS.build(part)
    backbone.init_weights()
    model = SimpleNamespace(backbone=backbone)
    cfg = Config(dict(model=dict(type='X', backbone=part)))
    output_norms = 2 * 3  # norm1..norm3 weight + bias: detection-only, not in the checkpoint
    assert loaded_init_lines(model, cfg) == [
        f'init backbone (SwinBackbone): loaded from {path}, '
        f'{len(backbone.state_dict()) - output_norms} tensors, Swin timm layout; dropped 4 '
        'checkpoint keys: norm.weight, norm.bias, head.fc.weight, head.fc.bias']
