"""Bad inputs get clear errors: the argument, the value and what is accepted.

Checkpoint errors (missing file, unrecognised format, different arch listed by key, malicious
pickle) are covered in tests/weights/test_swin_weights.py and
tests/weights/test_vit_weights.py; the resume path's malicious-pickle refusal in
tests/engine/test_resume.py; config data_root checks in tests/configs/test_configs.py.
"""
import glob
import os.path as osp

import pytest
import torch
from dist_worker import make_data, tiny_cfg
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.runner import Runner

import vitdet_plugin  # noqa: F401
from vitdet_plugin.config import DatasetNotFoundError, check_data
from vitdet_plugin.engine.hooks import NonFiniteCheckHook, NonFiniteError
from vitdet_plugin.models.backbones.swin import SwinBackbone
from vitdet_plugin.models.backbones.vit import ViTBackbone

TINY = dict(arch=dict(embed_dims=16, depths=(1, 1), num_heads=(1, 2)), window_size=4,
            out_indices=(0, 1))


def _swin(**kw) -> SwinBackbone:
    return SwinBackbone(**{**TINY, **kw})


# ----------------------------------------------------------------------------- Swin inputs
@pytest.mark.parametrize('shape, match', [
    ((1, 1, 32, 32), r'input has 1 channels but the model was built with in_channels=3; '
                     r'convert the input or set in_channels=1'),
    ((3, 32, 32), r'expected an image batch of shape \(B, C, H, W\), got a 3-D tensor of '
                  r'shape \(3, 32, 32\)'),
    ((2, 1, 3, 32, 32), r'got a 5-D tensor of shape \(2, 1, 3, 32, 32\)'),
    ((1, 3, 0, 32), r'input has an empty dimension: shape \(1, 3, 0, 32\); B, H and W must '
                    r'be at least 1'),
    ((0, 3, 32, 32), r'input has an empty dimension: shape \(0, 3, 32, 32\)'),
])
def test_swin_bad_input_tensor(shape, match):
    with pytest.raises(ValueError, match=match):
        _swin()(torch.zeros(shape))


@pytest.mark.parametrize('kw, exc, match', [
    (dict(out_indices=(0, 2)), ValueError,
     r'out_indices=\(0, 2\) must be a non-empty subset of stage indices 0\.\.1'),
    (dict(out_indices=()), ValueError, r'out_indices=\(\) must be a non-empty subset'),
    (dict(out_indices=(-1,)), ValueError, r'out_indices=\(-1,\) must be a non-empty subset'),
    (dict(out_indices=(1, 1)), ValueError, r'out_indices=\(1, 1\) has duplicates'),
    (dict(arch='huge'), ValueError,
     r"unknown Swin arch 'huge'; choose one of \['base', 'large', 'small', 'tiny'\]"),
    (dict(arch=3), TypeError, r'arch must be a preset name, a dict or None, got int'),
    (dict(arch=dict(embed_dims=16, depths=(1,))), ValueError,
     r"Swin arch is missing \['num_heads'\]"),
    (dict(arch=dict(embed_dims=16, depths=(1, 1), num_heads=(3, 3)), out_indices=(0,)),
     ValueError, r'stage 0: embed dims 16 are not divisible by num_heads=3; choose heads '
                 r'that divide embed_dims \* 2\*\*stage'),
    (dict(arch=dict(embed_dims=16, depths=(1, 2), num_heads=(1,)), out_indices=(0,)),
     ValueError, r'depths \(1, 2\) and num_heads \(1,\) must be non-empty and of equal length'),
    (dict(depths=(1, 0)), ValueError, r'every stage needs at least one block, got '
                                      r'depths=\(1, 0\)'),
    (dict(window_size=0), ValueError, r'window_size must be positive, got 0'),
    (dict(window_size=(4, -1)), ValueError, r'window_size must be positive, got \(4, -1\)'),
    (dict(frozen_stages=3), ValueError, r'frozen_stages=3 must be in -1\.\.2'),
    (dict(frozen_stages=-2), ValueError, r'frozen_stages=-2 must be in -1\.\.2'),
    (dict(in_channels=0), ValueError, r'in_channels must be a positive int, got 0'),
    (dict(patch_size=0), ValueError, r'patch_size must be a positive int'),
    (dict(patch_size=(4, 4)), ValueError, r'patch_size must be a positive int .*got \(4, 4\)'),
    (dict(window_size=7.0), ValueError, r'window_size must be an int or a pair .*got 7\.0'),
    (dict(window_size='7'), ValueError, r"window_size must be an int or a pair .*got '7'"),
    (dict(frozen_stages=None), TypeError, r'frozen_stages must be an int in -1\.\.2, got None'),
    (dict(mlp_ratio=0), ValueError, r'mlp_ratio must be positive, got 0'),
    (dict(attn_drop_rate=-0.1), ValueError,
     r'attn_drop_rate must be a number in \[0, 1\), got -0\.1'),
    (dict(drop_path_rate=1.0), ValueError, r'drop_path_rate must be a number in \[0, 1\), got '
                                            r'1\.0'),
    (dict(strides=(4, 4)), ValueError, r'strides=\(4, 4\) is not supported: Swin uses the '
                                       r'patch size then 2x patch merging, i\.e\. \(4, 2\)'),
    (dict(pretrained='a.pth', init_cfg=dict(type='Pretrained', checkpoint='b.pth')),
     ValueError, r'give either pretrained or init_cfg, not both'),
])
def test_swin_bad_arguments(kw, exc, match):
    with pytest.raises(exc, match=match):
        _swin(**kw)


# mmdet's own tests/test_models/test_backbones/test_swin.py expects these exception types of
# its SwinTransformer (TypeError, and AssertionError from its asserts); ours raise the same types
# with messages that name the argument and the fix
@pytest.mark.parametrize('kw, exc, message', [
    (dict(pretrained=123), TypeError,
     "pretrained must be a checkpoint path or URL (str) or None, got 123 (int); or give "
     "init_cfg=dict(type='Pretrained', checkpoint=PATH)"),
    (dict(pretrain_img_size=(224, 224, 224)), AssertionError,
     'pretrain_img_size must be an int or a pair of ints (h, w), got (224, 224, 224) (tuple)'),
    (dict(strides=(2, 2, 2, 2), patch_size=4), AssertionError,
     'strides=(2, 2, 2, 2) is not supported: Swin uses the patch size then 2x patch merging, '
     'i.e. (4, 2, 2, 2)'),
])
def test_mmdet_peer_cases_raise_mmdet_exception_types(kw, exc, message):
    with pytest.raises(exc) as e:
        SwinBackbone(**kw)  # the default (tiny) arch, as mmdet's test builds it
    assert str(e.value) == message
    assert isinstance(e.value, (TypeError, ValueError))  # and the Python-idiomatic type


# ----------------------------------------------------------------------------- ViT arguments
VIT = dict(arch=dict(embed_dims=32, depth=2, num_heads=2), img_size=32, patch_size=8,
           window_size=2, pretrain_img_size=32)


@pytest.mark.parametrize('kw, match', [
    (dict(global_attn_indexes=(1, 5)), r'global_attn_indexes=\(1, 5\) contains \[5\], out of '
                                       r'range for depth=2: block indices must be in 0\.\.1'),
    (dict(arch='gigantic'), r"unknown ViT arch 'gigantic'; choose one of"),
    (dict(arch=dict(embed_dims=30, depth=2, num_heads=4)),
     r'embed_dims=30 is not divisible by num_heads=4'),
    (dict(window_size=0), r'window_size must be positive, got 0'),
    (dict(frozen_stages=3), r'frozen_stages=3 must be in -1\.\.2'),
    (dict(window_size=3.5), r'window_size must be an int or a pair of ints \(h, w\), got 3\.5'),
    (dict(out_indices=(-5, )), r'out_indices=\(-5,\) contains \[-5\], out of range for '
                               r'depth=2: block indices must be in -2\.\.1'),
    (dict(out_indices=()), r'out_indices is empty'),
    (dict(img_size=4), r'img_size=4 is smaller than the patch \(8 pixels\)'),
    (dict(pretrain_img_size=(32, 4)), r'pretrain_img_size=\(32, 4\) is smaller than the '
                                      r'patch \(8 pixels\)'),
])
def test_vit_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        ViTBackbone(**{**VIT, **kw})


@pytest.mark.parametrize('dtype, match', [
    (torch.uint8, r'input has dtype torch\.uint8; the model takes normalised floating point '
                  r'images: convert with x\.float\(\)'),
    (torch.float64, r'input dtype torch\.float64 differs from the model dtype torch\.float32; '
                    r'convert one of them'),
])
@pytest.mark.parametrize('backbone', ['swin', 'vit'])
def test_bad_input_dtype(backbone, dtype, match):
    model = _swin() if backbone == 'swin' else ViTBackbone(**VIT)
    x = (torch.rand(1, 3, 32, 32) * 255).to(dtype)
    with pytest.raises(TypeError, match=match):
        model(x)


def test_out_indices_in_any_order_follow_the_declared_contract():
    model = _swin(out_indices=(1, 0)).eval()
    with torch.no_grad():
        outs = model(torch.randn(1, 3, 64, 64))
    assert model.out_indices == (0, 1)
    assert [o.shape[1] for o in outs] == list(model.out_channels)
    assert [64 // o.shape[-1] for o in outs] == list(model.out_strides)


def test_vit_bad_input_channels():
    with pytest.raises(ValueError, match=r'input has 1 channels but the model was built with '
                                         r'in_channels=3'):
        ViTBackbone(**VIT)(torch.zeros(1, 1, 32, 32))


# ----------------------------------------------------------------------------- registry
def test_config_without_plugin_import_names_the_type():
    """A config using our type without ``custom_imports`` fails in mmdet's registry with a
    KeyError that names the type (simulated by hiding our registration)."""
    from mmdet.registry import MODELS
    from mmengine.registry import DefaultScope, init_default_scope
    init_default_scope('mmdet')
    assert DefaultScope.get_current_instance().scope_name == 'mmdet'
    saved = MODELS._module_dict.pop('SwinBackbone')
    try:
        with pytest.raises(KeyError, match=r'SwinBackbone is not in the mmdet::model registry'):
            MODELS.build(dict(type='SwinBackbone'))
    finally:
        MODELS._module_dict['SwinBackbone'] = saved
    assert isinstance(MODELS.build(dict(type='SwinBackbone', **TINY)), SwinBackbone)


# ----------------------------------------------------------------------------- data
def test_missing_dataset_directory_is_reported_before_building(tmp_path):
    cfg = Config(tiny_cfg(str(tmp_path / 'no_such_dir'), str(tmp_path / 'work')))
    with pytest.raises(DatasetNotFoundError) as info:
        check_data(cfg, ('train',), config_path='tiny.py')
    msg = str(info.value)
    assert msg.startswith('Dataset not found for tiny.py:')
    assert ('missing train_dataloader.dataset.ann_file: '
            f"{tmp_path / 'no_such_dir' / 'annotations/instances_train.json'}") in msg
    assert 'missing train_dataloader.dataset.data_prefix.img: ' in msg


# ----------------------------------------------------------------------------- NaN / Inf
class _Poison(Hook):
    """Puts a non-finite value into a parameter before iteration ``at`` (1-based)."""
    priority = 'VERY_HIGH'

    def __init__(self, param: str, value: float, at: int = 2) -> None:
        self.param, self.value, self.at = param, value, at

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        if runner.iter + 1 == self.at:
            with torch.no_grad():
                runner.model.get_parameter(self.param).fill_(self.value)


@pytest.fixture(scope='module')
def data_root(tmp_path_factory):
    return make_data(str(tmp_path_factory.mktemp('shapes')))


def _runner(data_root, work_dir, poison, name, action='raise'):
    torch.set_num_threads(1)
    cfg = tiny_cfg(data_root, work_dir, max_iters=3, ckpt_interval=100, name=name,
                   custom_hooks=[poison])
    cfg['custom_hooks'] = [h for h in cfg['custom_hooks']
                           if not (isinstance(h, dict) and h['type'] == 'NonFiniteCheckHook')]
    cfg['custom_hooks'].append(dict(type='NonFiniteCheckHook', action=action))
    return Runner(**cfg)


def test_nan_in_backbone_output_stops_training_naming_module_and_iteration(data_root,
                                                                            tmp_path):
    runner = _runner(data_root, str(tmp_path), _Poison('backbone.patch_embed.proj.bias',
                                                       float('nan')), 'nan-backbone')
    with pytest.raises(NonFiniteError, match=r'non-finite values during training at iteration '
                       r'2: model\.backbone \(SwinBackbone\) output \[0\] has 8192 NaN and 0 '
                       r'Inf of 8192 values, shape \(2, 16, 16, 16\)'):
        runner.train()
    assert runner.iter == 1  # the step with the NaN never completed


def test_inf_in_loss_is_reported(data_root, tmp_path):
    runner = _runner(data_root, str(tmp_path), _Poison('bbox_head.retina_cls.bias',
                                                       float('inf')), 'inf-loss')
    with pytest.raises(NonFiniteError, match=r'at iteration 2: non-finite losses '
                       r'loss_cls=(nan|inf), loss=(nan|inf)\. Common causes'
):
        runner.train()


def test_nonfinite_log_action_logs_and_continues(data_root, tmp_path):
    runner = _runner(data_root, str(tmp_path), _Poison('backbone.patch_embed.proj.bias',
                                                       float('inf')), 'nan-log', action='log')
    runner.train()
    assert runner.iter == 3
    logs = glob.glob(osp.join(str(tmp_path), '*', '*.log'))
    text = ''.join(open(p).read() for p in logs)
    assert 'non-finite values during training at iteration 2: model.backbone (SwinBackbone)' \
        in text


@pytest.mark.parametrize('kw, match', [
    (dict(action='skip'), r"action='skip' is not supported; choose one of \('raise', 'log'\)"),
    (dict(interval=0), r'interval=0 must be an int >= 1'),
])
def test_nonfinite_hook_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        NonFiniteCheckHook(**kw)
