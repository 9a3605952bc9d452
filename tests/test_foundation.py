"""Package, registration, the mmcv ops backend and the torch>=2.6 checkpoint fix."""
import importlib.metadata
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import vitdet_plugin
from vitdet_plugin import compat

#: How each stack's refusals end: the command that installs it (README "Stacks").
FIXES = {
    'openmmlab': ("run `make env` in the vitdet_plugin checkout (mmcv-lite 2.1.0 with the "
                  "plugin's compile-free ops; `make env MMCV=compiled` builds mmcv 2.1.0 with its "
                  "own ops)"),
    'onedl': ("run `make env STACK=onedl` in the vitdet_plugin checkout (onedl-mmengine, "
              "onedl-mmcv without its extension and the plugin's compile-free ops, "
              "onedl-mmdetection)"),
}


def test_custom_imports_registers_our_names_and_leaves_mmdet_alone():
    code = textwrap.dedent("""
        from mmengine.config import Config
        from mmengine.registry import init_default_scope
        from mmdet.registry import MODELS
        from mmdet.models.backbones import SwinTransformer
        cfg = Config(dict(custom_imports=dict(imports=['vitdet_plugin'],
                                              allow_failed_imports=False)))
        from mmengine.utils import import_modules_from_strings
        import_modules_from_strings(**cfg.custom_imports)
        init_default_scope('mmdet')
        assert MODELS.get('SwinBackbone').__module__ == 'vitdet_plugin.models.backbones.swin'
        assert MODELS.get('SwinTransformer') is SwinTransformer
        m = MODELS.build(dict(type='SwinBackbone', arch='tiny'))
        print(type(m).__name__, m.out_channels, m.out_strides)
    """)
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    # the last line: the fork's mmdet 3.5 prints 'Could not import OneDL. Skipping OneDL
    # datasets.' on import (twice) where its optional `onedl` package is absent
    assert out.stdout.splitlines()[-1] == 'SwinBackbone (96, 192, 384, 768) (4, 8, 16, 32)'


def test_config_without_the_import_gives_a_clear_error():
    from mmdet.registry import MODELS
    from mmengine.registry import init_default_scope
    init_default_scope('mmdet')
    with pytest.raises(KeyError, match='not in the mmdet::model registry'):
        MODELS.build(dict(type='NotARegisteredBackbone'))


def test_our_names_do_not_shadow_mmdet():
    import mmdet.models  # noqa: F401
    from mmdet.registry import MODELS
    ours = {name for name, cls in MODELS.module_dict.items()
            if cls.__module__.startswith('vitdet_plugin')}
    assert 'SwinBackbone' in ours
    assert not ours & {'SwinTransformer', 'VisionTransformer', 'DETR', 'FPN'}


def test_mmcv_ops_are_usable():
    """mmcv.ops loads on this stack (mmcv-lite: the compile-free ops) and nms keeps the right
    boxes through mmcv's own wrapper."""
    from mmcv.ops import nms
    boxes = torch.tensor([[0, 0, 10, 10], [1, 1, 10, 10], [20, 20, 30, 30]], dtype=torch.float)
    scores = torch.tensor([0.9, 0.8, 0.7])
    dets, keep = nms(boxes, scores, iou_threshold=0.5)
    assert keep.tolist() == [0, 2]
    assert dets.shape == (2, 5)


@pytest.mark.parametrize('stack, mmcv_range', [('openmmlab', '2.0.0rc4 <= mmcv < 2.2.0'),
                                               ('onedl', '2.3.0 <= mmcv < 2.4.0')])
def test_version_gate_names_the_fix(monkeypatch, stack, mmcv_range):
    """The fork is told apart by its mmdet distribution (onedl-mmdetection), and each stack is
    held to its own versions: mmcv 2.2.0 is in neither range."""
    import mmcv
    real_version = importlib.metadata.version

    def version(name: str) -> str:
        if name == 'onedl-mmdetection':
            if stack == 'onedl':
                return '3.5.1'
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(importlib.metadata, 'version', version)
    monkeypatch.setattr(mmcv, '__version__', '2.2.0')
    with pytest.raises(ImportError, match=re.escape(
            f'mmcv 2.2.0 is not supported: vitdet_plugin needs {mmcv_range}; {FIXES[stack]}')):
        compat.check_stack()


def test_missing_ops_names_the_fix(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == 'mmcv.ops':
            raise ModuleNotFoundError("No module named 'mmcv._ext'")
        return real_import(name, *args, **kwargs)

    import mmcv
    monkeypatch.setattr(builtins, '__import__', fake_import)
    monkeypatch.delenv('VITDET_MMCV_OPS', raising=False)
    with pytest.raises(ImportError, match=re.escape(
            f"mmcv {mmcv.__version__} cannot load mmcv.ops (no compiled extension, and the "
            "compile-free ops are off or not installed: VITDET_MMCV_OPS=auto): No module named "
            f"'mmcv._ext'; {FIXES[compat.installed_stack().name]}")):
        compat.check_stack()


def test_mmengine_checkpoint_with_message_hub_loads_with_weights_only(tmp_path):
    from mmengine.logging import MessageHub
    from mmengine.runner.checkpoint import load_checkpoint, save_checkpoint
    hub = MessageHub.get_instance('vitdet_plugin_test_hub')
    for i in range(5):
        hub.update_scalar('train/loss', 1.0 / (i + 1))
        hub.update_scalar('train/lr', np.float64(1e-3))
    hub.update_info('iter', 5)
    model = torch.nn.Linear(3, 2)
    path = str(tmp_path / 'ckpt.pth')
    save_checkpoint({'state_dict': model.state_dict(), 'message_hub': hub.state_dict(),
                     'meta': {'epoch': 1, 'iter': 5, 'seed': np.int64(3)}}, path)
    # the plain torch default (weights_only=True) now accepts it ...
    ckpt = torch.load(path, weights_only=True)
    restored = MessageHub.get_instance('vitdet_plugin_test_hub_2')
    restored.load_state_dict(ckpt['message_hub'])
    assert restored.get_scalar('train/loss').current() == pytest.approx(0.2)
    assert restored.get_info('iter') == 5
    # ... and so does mmengine's own loader used by Runner.resume
    target = torch.nn.Linear(3, 2)
    load_checkpoint(target, path)
    assert torch.equal(target.weight, model.weight)


def test_weights_only_still_refuses_other_objects(tmp_path):
    path = str(tmp_path / 'other.pth')
    torch.save({'obj': compat.UnsupportedEnvironmentError('x')}, path)
    import pickle
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)


def test_version_attribute():
    assert vitdet_plugin.__version__.count('.') == 2
