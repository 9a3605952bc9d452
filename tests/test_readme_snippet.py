"""The README's config change under mmdet's own ``tools/train.py`` (issue 38).

The snippet of "Use a backbone in an mmdet config" is read from README.md itself, pointed at a
small shapes dataset and run by mmdet's script (installed with mmdet under ``.mim/tools``):
swapping Swin-T for Swin-B without the neck change stops with the pre-flight check's line, not
with the first forward's ``Given groups=1, weight of size [256, 192, 1, 1] ...``; and a
2-iteration run logs where each model part's weights came from.
"""
import os
import os.path as osp
import re
import subprocess
import sys
from typing import List

import mmdet
import pytest
import torch

import vitdet_plugin  # noqa: F401
from vitdet_plugin.datasets.shapes import CLASSES, generate_split

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
MMDET_TRAIN = osp.join(osp.dirname(mmdet.__file__), '.mim', 'tools', 'train.py')
SECTION = '## Use a backbone in an mmdet config'
#: small images and one epoch of two, so two iterations run on the CPU
IMAGE_SCALE = (96, 96)


def readme_snippet() -> str:
    """The first python block after the README's heading."""
    text = open(osp.join(ROOT, 'README.md')).read()
    rest = text[text.index(SECTION):]
    return re.search(r'```python\n(.*?)```', rest, re.S).group(1)


@pytest.fixture(scope='module')
def data_root(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp('shapes'))
    generate_split(root, 'train', 2, seed=0, progress=False)
    return root


def _config(tmp_path, data_root: str, extra: str = '') -> str:
    """The snippet + this test's data (two train images, no validation) as a config file."""
    data = f'''
train_dataloader = dict(
    batch_size=1, num_workers=0, persistent_workers=False,
    dataset=dict(data_root={data_root + '/'!r}, ann_file='annotations/instances_train.json',
                 data_prefix=dict(img='train/'), metainfo=dict(classes={CLASSES!r}),
                 pipeline=[dict(type='LoadImageFromFile'),
                           dict(type='LoadAnnotations', with_bbox=True),
                           dict(type='Resize', scale={IMAGE_SCALE!r}, keep_ratio=True),
                           dict(type='PackDetInputs')]))
model.update(bbox_head=dict(num_classes={len(CLASSES)}))
train_cfg = dict(max_epochs=1, val_interval=10)
val_dataloader = val_cfg = val_evaluator = test_dataloader = test_cfg = test_evaluator = None
default_hooks = dict(checkpoint=dict(interval=100), logger=dict(interval=1))
{extra}'''
    path = tmp_path / 'snippet.py'
    path.write_text(readme_snippet() + data)
    return str(path)


def _mmdet_train(config: str, work_dir: str, *options: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(  # this checkout's plugin
        [ROOT, os.environ.get('PYTHONPATH', '')]))
    return subprocess.run([sys.executable, MMDET_TRAIN, config, '--work-dir', work_dir,
                           *(['--cfg-options', *options] if options else [])],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_readme_snippet_has_the_hook_and_the_constructor():
    snippet = readme_snippet()
    assert "custom_hooks = [dict(type='PreflightCheckHook')]" in snippet
    assert "optim_wrapper = dict(constructor='NoDecayOptimWrapperConstructor')" in snippet
    assert "custom_imports = dict(imports=['vitdet_plugin']" in snippet


def test_swin_b_without_the_neck_change_under_mmdets_train(data_root, tmp_path):
    config = _config(tmp_path, data_root, "model['backbone']['init_cfg'] = None")
    # mmdet's Swin-B settings over the stock Swin-T config, the neck left as it was
    done = _mmdet_train(config, str(tmp_path / 'work'), 'model.backbone.embed_dims=128',
                        'model.backbone.depths=[2,2,18,2]', 'model.backbone.num_heads=[4,8,16,32]')
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert 'Given groups=1' not in out
    assert ('  model.neck.in_channels=[192, 384, 768] does not match the backbone (SwinBackbone: '
            'channels [256, 512, 1024] at strides [8, 16, 32]); set model.neck.in_channels='
            '[256, 512, 1024]\n') in out
    assert "  --cfg-options 'model.neck.in_channels=[256,512,1024]'\n" in out


def _init_lines(log: str) -> List[str]:
    return [ln.split(' - ', 1)[-1].split('INFO - ', 1)[-1] for ln in log.splitlines()
            if ' - init ' in ln or 'INFO - init ' in ln]


def test_two_iterations_log_where_each_part_came_from(data_root, tmp_path):
    from mmdet.registry import MODELS
    from mmengine.registry import init_default_scope
    init_default_scope('mmdet')
    swin_t = MODELS.build(dict(type='SwinBackbone', arch='tiny', out_indices=(1, 2, 3)))
    ckpt = str(tmp_path / 'swin_t.pth')
    torch.save({'state_dict': swin_t.state_dict()}, ckpt)  # our own layout
    init = f"dict(type='Pretrained', checkpoint={ckpt!r})"
    config = _config(tmp_path, data_root, f"model['backbone']['init_cfg'] = {init}")
    work = str(tmp_path / 'work')
    done = _mmdet_train(config, work)
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert re.search(r'Iter\(train\) \[2/2\]|Epoch\(train\)\s+\[1\]\[2/2\]', log), log[-3000:]
    lines = _init_lines(log)
    # the pre-flight summary (from the config), then the train log (after loading)
    assert lines == [
        f'init backbone (SwinBackbone): loads {ckpt} (init_cfg Pretrained)',
        'init neck (FPN): random init (no Pretrained init_cfg)',
        'init bbox_head (RetinaHead): random init (no Pretrained init_cfg)',
        f'init backbone (SwinBackbone): loaded from {ckpt}, '
        f'{len(swin_t.state_dict())} tensors, Swin ours layout',
        'init neck (FPN): randomly initialised (no Pretrained init_cfg, no load_from)',
        'init bbox_head (RetinaHead): randomly initialised (no Pretrained init_cfg, no '
        'load_from)'], log[-3000:]
