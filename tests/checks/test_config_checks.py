"""Config checks before the first iteration (vitdet_plugin.checks): each mistake gets one line
naming the key and the value to set; every shipped config passes; the mistakes really do break
the model the check refuses (checked against mmdet's own modules); the checks run from our
tools/train.py before anything is built and from PreflightCheckHook in a plain mmengine Runner.
"""
import copy
import glob
import os.path as osp
import subprocess
import sys

import pytest
import torch
from dist_worker import make_data, tiny_cfg
from helpers import REPO_ROOT, subprocess_env
from mmengine.config import Config
from mmengine.runner import Runner

import vitdet_plugin  # noqa: F401
from vitdet_plugin.checks import ConfigCheckError, check_config, config_problems, preflight
from vitdet_plugin.checks.suggest import set_fixes
from vitdet_plugin.config import DatasetNotFoundError, load_config

ROOT = str(REPO_ROOT)
CONFIGS = sorted(glob.glob(osp.join(ROOT, 'configs', '*.py'))
                 + glob.glob(osp.join(ROOT, 'configs', 'demo', '*.py')))
RETINANET = osp.join(ROOT, 'configs', 'swin_retinanet.py')
SHAPES_RETINANET = osp.join(ROOT, 'configs', 'demo', 'swin_retinanet_shapes.py')
COCO_80 = ("['person', 'bicycle', 'car', 'motorcycle', 'airplane', 'bus', 'train', 'truck', "
           "'boat', 'traffic light', '...']")


def _problems(path: str, **options) -> list:
    return config_problems(load_config(path, options))


#: Shipped configs that load a checkpoint another command writes (make demo-detr: make demo's),
#: with the keys that name it.
NEEDS_CHECKPOINT = {
    'demo/swin_detr_pretrained_shapes.py': ('model.backbone.init_cfg.checkpoint',
                                            'model.neck.init_cfg.checkpoint'),
    # DINOv3's official file is handed out on request: the config names a local path
    'dinov3_dino.py': ('model.backbone.init_cfg.checkpoint',),
    'dinov3_7b_dino_fsdp.py': ('model.backbone.init_cfg.checkpoint',),
    'dinov3_l_cascade_mask_rcnn_fsdp.py': ('model.backbone.init_cfg.checkpoint',),
}


@pytest.mark.parametrize('path', CONFIGS, ids=lambda p: osp.relpath(p, ROOT))
def test_every_shipped_config_passes(path, tmp_path):
    keys = NEEDS_CHECKPOINT.get(osp.relpath(path, osp.join(ROOT, 'configs')), ())
    if not keys:
        assert _problems(path) == []
        return
    # before the command that writes it has run, the check names the missing file per key
    problems = _problems(path)
    assert [p.split('=')[0] for p in problems] == list(keys), problems
    assert all('does not exist' in p for p in problems), problems
    ckpt = tmp_path / 'iter_1.pth'
    torch.save({'state_dict': {}}, ckpt)
    assert _problems(path, **{k: str(ckpt) for k in keys}) == []


def test_bigger_swin_without_the_neck_change_names_key_and_channels():
    """The issue's case: arch tiny -> base, neck untouched."""
    assert _problems(RETINANET, **{'model.backbone.arch': 'base'}) == [
        'model.neck.in_channels=[192, 384, 768] does not match the backbone (SwinBackbone: '
        'channels [256, 512, 1024] at strides [8, 16, 32]); set model.neck.in_channels='
        '[256, 512, 1024]']


def test_the_refused_mismatch_is_the_one_that_breaks_the_forward():
    """Independent of the check: mmdet's FPN built as configured fails on the backbone's maps
    with the cryptic message, and accepts them with the value the check names."""
    from mmdet.registry import MODELS
    cfg = load_config(RETINANET, {'model.backbone.arch': 'base'})
    backbone = MODELS.build(dict(cfg.model.backbone, arch=dict(embed_dims=128, depths=(1,) * 4,
                                                               num_heads=(4, 8, 16, 32))))
    feats = backbone(torch.randn(1, 3, 64, 64))
    with pytest.raises(RuntimeError, match=r'expected input.* to have 192 channels'):
        MODELS.build(copy.deepcopy(cfg.model.neck))(feats)
    fixed = dict(copy.deepcopy(cfg.model.neck), in_channels=[256, 512, 1024])
    assert len(MODELS.build(fixed)(feats)) == 5


def test_out_indices_against_the_neck():
    assert _problems(RETINANET, **{'model.backbone.out_indices': (2, 3)}) == [
        'model.neck.in_channels=[192, 384, 768] does not match the backbone (SwinBackbone: '
        'channels [384, 768] at strides [16, 32]) (model.backbone.out_indices=(2, 3) selects 2 '
        'maps, the neck lists 3); set model.neck.in_channels=[384, 768]']


def test_head_channels_and_num_classes_against_neck_and_dataset():
    assert _problems(RETINANET, **{'model.neck.out_channels': 128,
                                   'model.bbox_head.num_classes': 5}) == [
        'model.bbox_head.in_channels=256 but the neck (FPN: channels [128, 128, 128, 128, 128] '
        'at strides [8, 16, 32, 64, 128]) outputs 128 channels; set '
        'model.bbox_head.in_channels=128',
        f'model.bbox_head.num_classes=5 but train_dataloader.dataset has 80 classes {COCO_80}; '
        'set model.bbox_head.num_classes=80']


def test_num_classes_read_from_the_config_metainfo():
    assert _problems(SHAPES_RETINANET, **{'model.bbox_head.num_classes': 80}) == [
        'model.bbox_head.num_classes=80 but train_dataloader.dataset has 5 classes '
        "['square', 'circle', 'triangle', 'star', 'cross']; set model.bbox_head.num_classes=5"]


def test_anchor_strides_and_levels_against_the_neck():
    assert _problems(SHAPES_RETINANET,
                     **{'model.bbox_head.anchor_generator.strides': [4, 8, 16]}) == [
        'model.bbox_head.anchor_generator.strides=[4, 8, 16] but the neck (FPN: channels '
        '[64, 64, 64] at strides [8, 16, 32]) outputs 3 levels at strides [8, 16, 32]; set '
        'model.bbox_head.anchor_generator.strides=[8, 16, 32]']


def test_two_stage_neck_levels_and_missing_weights(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cwd = str(tmp_path)
    assert _problems(osp.join(ROOT, 'configs', 'swin_mask_rcnn.py'), **{
        'model.neck.num_outs': 4, 'load_from': 'x.pth',
        'model.backbone.init_cfg': dict(type='Pretrained', checkpoint='swin_t.pth')}) == [
        'model.rpn_head.anchor_generator.strides=[4, 8, 16, 32, 64] but the neck (FPN: channels '
        '[256, 256, 256, 256] at strides [4, 8, 16, 32]) outputs 4 levels at strides '
        '[4, 8, 16, 32]; set model.rpn_head.anchor_generator.strides=[4, 8, 16, 32]',
        f"model.backbone.init_cfg.checkpoint='swin_t.pth' does not exist (relative paths are "
        f'read from {cwd}); download the weights there or point the key at your copy (random '
        'init instead: model.backbone.init_cfg=None)',
        f"load_from='x.pth' does not exist (relative paths are read from {cwd}); point it at "
        'your checkpoint or set load_from=None']
    (tmp_path / 'swin_t.pth').write_bytes(b'')
    (tmp_path / 'x.pth').write_bytes(b'')
    assert len(_problems(osp.join(ROOT, 'configs', 'swin_mask_rcnn.py'), **{
        'model.neck.num_outs': 4, 'load_from': 'x.pth',
        'model.backbone.init_cfg': dict(type='Pretrained', checkpoint='swin_t.pth')})) == 1


def test_deformable_levels_of_dino_against_the_neck():
    assert _problems(osp.join(ROOT, 'configs', 'swin_dino.py'),
                     **{'model.neck.num_outs': 3}) == [
        'model.encoder.layer_cfg.self_attn_cfg.num_levels=4 but the neck (ChannelMapper: '
        'channels [256, 256, 256] at strides [8, 16, 32]) outputs 3 levels; set '
        'model.encoder.layer_cfg.self_attn_cfg.num_levels=3',
        'model.decoder.layer_cfg.cross_attn_cfg.num_levels=4 but the neck (ChannelMapper: '
        'channels [256, 256, 256] at strides [8, 16, 32]) outputs 3 levels; set '
        'model.decoder.layer_cfg.cross_attn_cfg.num_levels=3']


def test_mask2former_class_counts_and_class_weight():
    """The class weights are checked against the counts the lines before them set (one run):
    a uniform list gets its value for the new count."""
    assert _problems(osp.join(ROOT, 'configs', 'swin_mask2former_panoptic.py'),
                     **{'model.panoptic_head.num_things_classes': 10}) == [
        'model.panoptic_head.num_things_classes=10 but train_dataloader.dataset has 80 '
        f'thing_classes {COCO_80}; set model.panoptic_head.num_things_classes=80']
    three = {'train_dataloader.dataset.metainfo': dict(classes=('a', 'b', 'c'))}
    problems = _problems(osp.join(ROOT, 'configs', 'swin_mask2former_instance.py'), **three)
    assert problems == [
        "model.panoptic_head.num_things_classes=80 but train_dataloader.dataset has 3 classes "
        "['a', 'b', 'c']; set model.panoptic_head.num_things_classes=3",
        'model.panoptic_head.loss_cls.class_weight has 81 entries for 3 classes; give 4 (3 '
        'classes + the no-object class); set model.panoptic_head.loss_cls.class_weight='
        '[1.0, 1.0, 1.0, 0.1]',
        "model.panoptic_fusion_head.num_things_classes=80 but train_dataloader.dataset has 3 "
        "classes ['a', 'b', 'c']; set model.panoptic_fusion_head.num_things_classes=3"]
    assert _problems(osp.join(ROOT, 'configs', 'swin_mask2former_instance.py'),
                     **three, **set_fixes(problems)) == []


def test_a_backbone_without_a_contract_is_probed_on_meta_tensors():
    """mmdet's ResNet declares no contract: channels and strides come from a meta forward."""
    cfg = load_config(RETINANET)
    cfg.model.backbone = dict(type='ResNet', depth=50, out_indices=(1, 2, 3), norm_eval=True,
                              norm_cfg=dict(type='BN', requires_grad=True), style='pytorch')
    assert config_problems(cfg) == [
        'model.neck.in_channels=[192, 384, 768] does not match the backbone (ResNet: channels '
        '[512, 1024, 2048] at strides [8, 16, 32]); set model.neck.in_channels=[512, 1024, 2048]']


def test_all_problems_in_one_error():
    cfg = load_config(SHAPES_RETINANET, {'model.bbox_head.num_classes': 80,
                                         'model.bbox_head.anchor_generator.strides': [4, 8, 16]})
    with pytest.raises(ConfigCheckError) as e:
        check_config(cfg, config_path='demo.py')
    lines = str(e.value).splitlines()
    assert lines[0] == 'demo.py: 2 problems found before training'
    assert [ln[:2] for ln in lines[1:]] == ['  ', '  ']


# ----------------------------------------------------------------------------- preflight
@pytest.fixture(scope='module')
def data_root(tmp_path_factory):
    return make_data(str(tmp_path_factory.mktemp('shapes')))


def test_batch_larger_than_the_dataset(data_root):
    cfg = Config(tiny_cfg(data_root, 'unused'))
    cfg.train_dataloader.batch_size = 16
    with pytest.raises(ConfigCheckError) as e:
        preflight(cfg, ('train',), config_path='tiny.py', log=None)
    ann = osp.join(data_root, 'annotations/instances_train.json')
    assert str(e.value) == (
        'tiny.py: 1 problem found before training\n'
        '  train_dataloader.batch_size=16 is larger than train_dataloader.dataset (4 images to '
        f'train on in {ann}); set train_dataloader.batch_size=4 or fewer, or give the dataset '
        'more images\n'
        "Every fix above as options (our tools/train.py and mmdet's tools/train.py alike):\n"
        '  --cfg-options train_dataloader.batch_size=4')


def test_data_root_without_annotations(tmp_path):
    cfg = Config(tiny_cfg(str(tmp_path / 'empty'), 'unused'))
    with pytest.raises(DatasetNotFoundError, match=r'missing train_dataloader\.dataset\.ann_file'):
        preflight(cfg, ('train',), log=None)


def test_preflight_prints_one_summary_line_per_dataset(data_root):
    lines = []
    summaries = preflight(Config(tiny_cfg(data_root, 'unused')), ('train',), log=lines.append)
    assert lines[:1] == [s.line() for s in summaries] and len(summaries) == 1
    assert lines[0].startswith('data train_dataloader.dataset (')
    # then where each model part's weights come from
    assert lines[1:] == ['init backbone (SwinBackbone): random init (no Pretrained init_cfg)',
                         'init neck (FPN): random init (no Pretrained init_cfg)',
                         'init bbox_head (RetinaHead): random init (no Pretrained init_cfg)']


def test_tools_train_stops_before_building_with_the_message(data_root, tmp_path):
    cfg = tiny_cfg(data_root, str(tmp_path / 'work'))
    cfg['model']['neck']['in_channels'] = [16, 16]
    path = str(tmp_path / 'bad.py')
    Config(cfg).dump(path)
    done = subprocess.run([sys.executable, osp.join(ROOT, 'tools', 'train.py'), path],
                          env=subprocess_env(False), capture_output=True, text=True,
                          timeout=240, cwd=ROOT)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-4:] == [
        f'error: {path}: 1 problem found before training',
        '  model.neck.in_channels=[16, 16] does not match the backbone (SwinBackbone: channels '
        '[16, 32] at strides [4, 8]); set model.neck.in_channels=[16, 32]',
        "Every fix above as options (our tools/train.py and mmdet's tools/train.py alike):",
        "  --cfg-options 'model.neck.in_channels=[16,32]'"]
    assert not osp.exists(str(tmp_path / 'work'))  # nothing was built or written


def test_preflight_hook_stops_a_plain_runner_before_the_first_iteration(data_root, tmp_path):
    """What mmdet's own tools/train.py does with a config that lists the hook."""
    from mmengine.hooks import Hook
    from mmengine.registry import HOOKS

    @HOOKS.register_module(force=True)
    class CountIters(Hook):
        iters = 0

        def before_train_iter(self, runner, batch_idx, data_batch=None):
            CountIters.iters += 1

    cfg = tiny_cfg(data_root, str(tmp_path / 'work'),
                   custom_hooks=[dict(type='PreflightCheckHook'), dict(type='CountIters')])
    cfg['model']['bbox_head']['num_classes'] = 3
    runner = Runner.from_cfg(Config(cfg))
    with pytest.raises(ConfigCheckError, match=r'model\.bbox_head\.num_classes=3 but '
                       r'train_dataloader\.dataset has 5 classes'):
        runner.train()
    assert CountIters.iters == 0
