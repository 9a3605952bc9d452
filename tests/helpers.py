"""Small helpers shared by the test modules."""
import contextlib
import importlib.util
import io
import os
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, List, NamedTuple, Sequence

import torch
from torch import Tensor


def max_rel_err(a: Tensor, b: Tensor) -> float:
    """``max |a - b| / max |b|`` (a scale-free error that does not blow up near zeros)."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def assert_close_rel(outs: Sequence[Tensor], refs: Sequence[Tensor], tol: float = 1e-5) -> None:
    assert len(outs) == len(refs), (len(outs), len(refs))
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.shape == r.shape, f'output {i}: {tuple(o.shape)} vs {tuple(r.shape)}'
        err = max_rel_err(o, r)
        assert err <= tol, f'output {i}: relative error {err:.3g} > {tol:g}'


def randomize_(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every parameter (norms included) random values so parity tests see all weights."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1 and ('norm' in name or name.endswith('bias')):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if name.endswith(
                    'weight') else 0.0))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return module


def random_rfdetr(name: str, seed: int = 0) -> Any:
    """The ``rfdetr`` package's model ``name`` (e.g. ``'RFDETRNano'``) built without pretrained
    weights, every parameter of its ``LWDETR`` (``.model.model``) random (:func:`randomize_`),
    in eval mode: the source of RF-DETR checkpoints in rfdetr's own format for parity tests."""
    import rfdetr
    model = getattr(rfdetr, name)(pretrain_weights=None)
    randomize_(model.model.model, seed).eval()
    return model


def save_rfdetr_checkpoint(model: Any, path: str, **extra: Any) -> None:
    """``model``'s (:func:`random_rfdetr`) state dict as rfdetr's pre-Lightning training loop
    saves it: ``{'model': state_dict, 'args': argparse.Namespace, **extra}``."""
    import argparse
    torch.save({'model': model.model.model.state_dict(),
                'args': argparse.Namespace(**vars(model.model.args)), **extra}, path)


REPO_ROOT = Path(__file__).resolve().parent.parent

#: A tiny D-FINE detector as config text (``model = dict(...)``): a 4-stage HGNetV2 (strides 8 /
#: 16 / 32 out), a 32-wide hybrid encoder, a 2-layer decoder of 10 queries, 5 classes.
TINY_DFINE_MODEL = """
model = dict(
    type='SingleStageDetector',
    data_preprocessor=dict(type='DetDataPreprocessor', mean=[0.0, 0.0, 0.0],
                           std=[255.0, 255.0, 255.0], bgr_to_rgb=True, pad_size_divisor=32),
    backbone=dict(type='HGNetV2Backbone', out_indices=(1, 2, 3), use_lab=True,
                  arch=dict(stem_channels=(3, 8, 8), in_channels=(8, 16, 24, 32),
                            mid_channels=(8, 8, 8, 16), out_channels=(16, 24, 32, 48),
                            num_blocks=(1, 1, 1, 1), num_layers=(2, 2, 2, 2),
                            downsample=(False, True, True, True),
                            light_block=(False, False, True, True),
                            kernel_size=(3, 3, 5, 5))),
    neck=dict(type='HybridEncoder', in_channels=(24, 32, 48), in_strides=(8, 16, 32),
              hidden_dim=32, num_heads=4, ffn_dim=64, expansion=0.5, depth_mult=0.34),
    bbox_head=dict(type='DFineHead', num_classes=5, in_channels=(32, 32, 32), embed_dims=32,
                   num_queries=10, num_heads=4, ffn_dims=64, num_layers=2, num_points=(3, 2, 4),
                   num_denoising=8),
    test_cfg=dict(max_per_img=10))
"""


#: The folder of the ``sitecustomize`` every process the tests start runs (on PYTHONPATH:
#: tests/conftest.py, :func:`subprocess_env`): transformers reads as not installed there.
SUBPROCESS_SITE = str(REPO_ROOT / 'tests' / 'subprocess_site')


def subprocess_env(no_site: bool, **extra: str) -> Dict[str, str]:
    """The environment of a fresh interpreter of this venv: VITDET_MMCV_OPS unset, PYTHONPATH
    ``extra``'s (if given) then :data:`SUBPROCESS_SITE` only. ``no_site``: for ``python -S``,
    site-packages and the checkout on PYTHONPATH (unless ``extra`` names one), so no .pth file
    (the compile-free ops' hook) and no sitecustomize runs."""
    env = {k: v for k, v in os.environ.items() if k not in ('VITDET_MMCV_OPS', 'PYTHONPATH')}
    if no_site:
        env['PYTHONPATH'] = os.pathsep.join([sysconfig.get_paths()['purelib'], str(REPO_ROOT)])
    else:
        extra['PYTHONPATH'] = os.pathsep.join(
            str(p) for p in (extra.get('PYTHONPATH'), SUBPROCESS_SITE) if p)
    env.update(extra)
    return env


def load_tool(path: str) -> ModuleType:
    """The script ``tools/<path>`` (e.g. ``'convert_weights.py'``, ``'analysis/feature_shapes.py'``)
    imported as a module (``tools/`` is no package), to call its ``main(argv)`` in this process:
    a subprocess would pay the torch + mmdet import (~5 s on 2 cores) per call."""
    file = REPO_ROOT / 'tools' / path
    spec = importlib.util.spec_from_file_location(
        'vitdet_tool_' + path[:-len('.py')].replace('/', '_'), file)
    assert spec is not None and spec.loader is not None, file
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ToolRun(NamedTuple):
    """What :func:`run_tool` saw: the exit code and the text written to stdout / stderr."""
    returncode: int
    stdout: str
    stderr: str


def run_tool(path: str, args: List[str]) -> ToolRun:
    """``tools/<path>`` ``main(args)`` in this process, as its command line would run it: the
    exit code (``main``'s return value or argparse's ``SystemExit``) and its output."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = load_tool(path).main(args)
        except SystemExit as e:  # argparse errors (2), --help (0)
            code = e.code if isinstance(e.code, int) else 1
    return ToolRun(int(code or 0), out.getvalue(), err.getvalue())


def parse_cfg_options(line: str) -> dict:
    """A ``--cfg-options ...`` line (as a message prints it) read as a shell and mmengine's
    DictAction read it: what our tools and mmdet's tools/train.py merge into the config."""
    import argparse
    import shlex

    from mmengine.config import DictAction
    parser = argparse.ArgumentParser()
    parser.add_argument('--cfg-options', nargs='+', action=DictAction)
    return parser.parse_args(shlex.split(line)).cfg_options
