"""Every shipped config, shrunk, runs through mmengine's Runner as mmdet's tools/train.py runs
it: the config's train / val / test loops, hooks (the pre-flight check among them), optimizer
wrapper and parameter schedulers are built from the config, one training iteration runs and
one validation scores the shapes set (issue 47: three configs could not build their loop).

The data is the shapes set laid out under the names each config expects (COCO's
``instances_train2017.json`` / ``train2017/`` and the shapes names alike), so ``data_root``
alone points every config at it; the class lists and counts come from the pre-flight report's
own ``--cfg-options`` line, as a newcomer's second run would. Shrunk: the model
(tests/configs/test_configs.py's ``_shrink``), the pipelines' sizes (1 / :data:`SIZE_DIVISOR`),
the loop lengths (one iteration / epoch of two images) and the data loaders (no workers).
The FSDP configs run without their FSDP2Runner (tests/engine trains that one on 2 ranks).
"""
import os
import os.path as osp
from unittest import mock

import pytest
import torch

import vitdet_plugin  # noqa: F401
from vitdet_plugin.checks import preflight
from vitdet_plugin.config import apply_cfg_options, iter_datasets
from vitdet_plugin.datasets.shapes import ShapesSpec, generate_split
from helpers import REPO_ROOT, parse_cfg_options
from test_configs import CONFIG_IDS, CONFIGS, _config, _shrink

#: the pipelines' image sizes above SHRINK_ABOVE are divided by SIZE_DIVISOR (LSJ 1024 -> 256,
#: 1333 x 800 -> 333 x 200; the demo configs' 256 px stay)
SIZE_DIVISOR = 4
SHRINK_ABOVE = 512
#: detections per image kept at test time (DINO's 300 is more than 30 queries x 5 classes)
TINY_DETECTIONS = 10
SIZE_KEYS = ('scale', 'scales', 'crop_size', 'size')
#: images per split: one training batch, one validation batch
IMAGES = 2
SPEC = ShapesSpec(image_size=96, objects=(1, 2), object_size=(24, 48), lines=(0, 1))
#: the names COCO configs give each split's files (the shapes generator writes the plain ones)
COCO_SPLITS = {'train': 'train2017', 'val': 'val2017'}
FSDP_KEYS = ('runner_type', 'model_wrapper_cfg')
PANOPTIC_BASE = osp.join(str(REPO_ROOT), 'configs', '_base_', 'datasets', 'shapes_panoptic.py')


@pytest.fixture(scope='module')
def shapes_root(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp('shapes_all_names'))
    ann = osp.join(root, 'annotations')
    for split, coco in COCO_SPLITS.items():
        generate_split(root, split, IMAGES, seed=0, spec=SPEC, progress=False)
        os.symlink(split, osp.join(root, coco))
        for kind in ('instances', 'panoptic'):
            os.symlink(f'{kind}_{split}.json', osp.join(ann, f'{kind}_{coco}.json'))
        os.symlink(f'panoptic_{split}', osp.join(ann, f'panoptic_{coco}'))
    return root + '/'


def _shrink_sizes(node) -> None:
    """Every image size of a pipeline (nested transform lists too) divided by SIZE_DIVISOR."""
    if isinstance(node, list):
        for item in node:
            _shrink_sizes(item)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key in SIZE_KEYS and isinstance(value, (int, list, tuple)) \
                    and _largest(value) > SHRINK_ABOVE:
                node[key] = _divided(value)
                ratio = node.get('ratio_range')
                if ratio:  # LSJ's smallest draw stays the config's size (above the stride)
                    node['ratio_range'] = (min(ratio[0] * SIZE_DIVISOR, ratio[1]), ratio[1])
            else:
                _shrink_sizes(value)


def _largest(value) -> int:
    if isinstance(value, (list, tuple)):
        return max((_largest(v) for v in value), default=0)
    return value if isinstance(value, int) else 0


def _divided(value):
    if isinstance(value, int):
        return max(value // SIZE_DIVISOR, 1)
    return type(value)(_divided(v) for v in value)


def _loaders(cfg) -> None:
    for key in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        loader = cfg[key]
        loader.update(batch_size=IMAGES, num_workers=0, persistent_workers=False)
        _shrink_sizes(loader.dataset)
    loop = cfg.train_cfg
    loop.update(val_interval=1, **({'max_iters': 1} if 'max_iters' in loop else {'max_epochs': 1}))


def _keep_every_score(node) -> None:
    """Score thresholds to 0 (an untrained model's scores are below 0.05, and CocoMetric scores
    nothing, an empty dict, without a detection); at most TINY_DETECTIONS per image."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == 'score_thr':
                node[key] = 0.0
            elif key == 'max_per_img' and isinstance(value, int):
                node[key] = min(value, TINY_DETECTIONS)
            else:
                _keep_every_score(value)


def _panoptic_metainfo(cfg) -> None:
    """The shapes set's things and stuff for panoptic datasets (a config's own classes are
    set by the pre-flight report's options; things / stuff are the user's to give)."""
    from mmengine.config import Config
    meta = Config.fromfile(PANOPTIC_BASE).metainfo.to_dict()
    for key in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        for ds, _ in iter_datasets(cfg[key].dataset, key):
            if ds.get('type') == 'CocoPanopticDataset':
                ds.metainfo = dict(meta)


def _runnable(path: str, root: str, work_dir: str):
    """The shrunk config on the shapes set, with the fixes its pre-flight report gives."""
    cfg = _config(path)
    apply_cfg_options(cfg, {'data_root': root})
    for key in FSDP_KEYS:
        cfg.pop(key, None)
    _shrink(cfg.model)
    _keep_every_score(cfg.model.get('test_cfg'))
    _loaders(cfg)
    _panoptic_metainfo(cfg)
    cfg.work_dir = work_dir
    try:
        preflight(cfg, ('train', 'val'), weights=False, log=None)
    except ValueError as e:  # every report kind is a ValueError or a FileNotFoundError
        cfg.merge_from_dict(parse_cfg_options(str(e).splitlines()[-1]))
    except FileNotFoundError as e:
        raise AssertionError(f'{path}: the shapes layout misses a file\n{e}') from e
    return cfg


def _schedulers(cfg) -> list:
    found = cfg.get('param_scheduler') or []
    return [s['type'] for s in (found if isinstance(found, list) else [found])]


@pytest.mark.parametrize('path', CONFIGS, ids=CONFIG_IDS)
def test_config_runner_pieces_build(path, shapes_root, tmp_path):
    """The cheap guard (issue 47's leftover _delete_ reached IterBasedTrainLoop here): the
    runner of the shrunk config builds its loops (their data loaders and datasets, the
    evaluators), optimizer wrapper, schedulers and hooks, without running an iteration."""
    from mmengine.config import Config
    from mmengine.runner import Runner
    import mmengine.optim.optimizer.amp_optimizer_wrapper as amp_module

    cfg = _runnable(path, shapes_root, str(tmp_path / 'work'))
    # the config text the runner logs and dumps is formatted by yapf: half of this test's time
    # (the slow test below runs it as it is)
    with mock.patch.object(Config, 'pretty_text', property(lambda self: self.text)):
        runner = Runner.from_cfg(cfg)
    loops = [runner.build_train_loop(cfg.train_cfg), runner.build_val_loop(cfg.val_cfg),
             runner.build_test_loop(cfg.test_cfg)]
    assert [type(loop).__name__ for loop in loops] == [
        cfg.train_cfg.type, cfg.val_cfg.type, cfg.test_cfg.type]
    assert len(loops[0].dataloader.dataset) == IMAGES
    runner._train_loop = loops[0]  # epoch-based schedulers convert to iterations with it
    with mock.patch.object(amp_module, 'is_cuda_available', lambda: True):
        runner.optim_wrapper = runner.build_optim_wrapper(cfg.optim_wrapper)
    assert type(runner.optim_wrapper).__name__ == cfg.optim_wrapper.get('type', 'OptimWrapper')
    schedulers = runner.build_param_scheduler(cfg.get('param_scheduler'))
    assert [type(s).__name__ for s in schedulers] == _schedulers(cfg)
    hooks = {type(h).__name__ for h in runner.hooks}
    assert {h['type'] for h in cfg.default_hooks.values()} <= hooks
    assert {h['type'] for h in cfg.get('custom_hooks', [])} <= hooks


@pytest.mark.slow
@pytest.mark.parametrize('path', CONFIGS, ids=CONFIG_IDS)
def test_config_runs_one_iteration_and_validates(path, shapes_root, tmp_path):
    """The whole run (make test-all): one iteration and one scored validation."""
    from mmengine.hooks import Hook
    from mmengine.registry import HOOKS, LOOPS
    from mmengine.runner import Runner
    import mmengine.optim.optimizer.amp_optimizer_wrapper as amp_module

    cfg = _runnable(path, shapes_root, str(tmp_path / 'work'))
    amp = cfg.optim_wrapper.get('type') == 'AmpOptimWrapper' and not torch.cuda.is_available()
    if amp:  # mmengine's AMP wrapper builds only with CUDA; its autocast runs on CPU in bf16
        cfg.optim_wrapper.dtype = 'bfloat16'
    metrics = []

    @HOOKS.register_module(force=True)
    class KeepMetrics(Hook):
        def after_val_epoch(self, runner, metrics=None):
            keep.append(dict(metrics or {}))
    keep = metrics
    cfg.custom_hooks = list(cfg.get('custom_hooks') or []) + [dict(type='KeepMetrics')]
    torch.manual_seed(0)
    runner = Runner.from_cfg(cfg)
    with mock.patch.object(amp_module, 'is_cuda_available', lambda: True):
        runner.train()
    assert runner.iter == 1
    assert type(runner.train_loop).__name__ == cfg.train_cfg.type
    assert type(runner.val_loop).__name__ == cfg.val_cfg.type
    assert type(runner.build_test_loop(cfg.test_cfg)).__name__ == cfg.test_cfg.type
    assert type(runner.optim_wrapper).__name__ == cfg.optim_wrapper.get('type', 'OptimWrapper')
    assert [type(s).__name__ for s in runner.param_schedulers] == _schedulers(cfg)
    hooks = {type(h).__name__ for h in runner.hooks}
    assert {h['type'] for h in cfg.default_hooks.values()} <= hooks
    assert {'PreflightCheckHook', 'KeepMetrics'} <= hooks
    assert len(metrics) == 1 and metrics[0], metrics  # one validation, scored
    assert LOOPS.get(cfg.train_cfg.type) is not None
