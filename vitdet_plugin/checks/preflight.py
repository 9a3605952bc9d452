"""Everything checked before a run builds its model: :func:`preflight` for our tools and
scripts, :class:`PreflightCheckHook` for any mmengine runner (mmdet's own ``tools/train.py``,
``mim train``).

The order is cheapest first, each step raising before the next: the dataset files exist
(:func:`vitdet_plugin.datasets.check_data`), the config's pieces fit together
(:func:`.config.check_config`), the annotations are usable (:func:`.data.check_annotations`,
which also gives the summary lines printed at start) and the batch fits the dataset.
"""
from typing import Any, Callable, List, Optional, Sequence

from mmengine.hooks import Hook
from mmengine.registry import HOOKS

from ..config import check_data
from .config import FeatureMaps, config_problems, probe_backbone, raise_problems
from .data import DataSummary, check_annotations

#: type name of the hook, as configs write it
HOOK_TYPE = 'PreflightCheckHook'



def batch_problems(cfg: Any, summaries: Sequence[DataSummary]) -> List[str]:
    """``train_dataloader.batch_size`` larger than the images training can draw from."""
    loader = cfg.get('train_dataloader') or {}
    batch = loader.get('batch_size')
    dataset = loader.get('dataset') or {}
    usable = [s for s in summaries if s.key.startswith('train_dataloader.')]
    # only a dataset used as it is: wrappers (repeat, concat, mosaic) change the count
    if not isinstance(batch, int) or len(usable) != 1 or 'ann_file' not in dataset:
        return []
    kept = usable[0].kept_images
    if batch <= kept:
        return []
    return [f'train_dataloader.batch_size={batch} is larger than {usable[0].key} ({kept} '
            f'images to train on in {usable[0].ann_file}); set train_dataloader.batch_size='
            f'{max(kept, 1)} or fewer, or give the dataset more images']


def preflight(cfg: Any, stages: Sequence[str] = ('train', 'val'),
              config_path: Optional[str] = None, tool: str = 'tools/train.py',
              weights: bool = True,
              log: Optional[Callable[[str], None]] = print) -> List[DataSummary]:
    """Check ``cfg`` for a run over ``stages`` before anything is built.

    Raises :class:`~vitdet_plugin.datasets.DatasetNotFoundError`,
    :class:`~.config.ConfigCheckError` or :class:`~.data.DataCheckError`; on success ``log``
    gets one summary line per dataset (images, boxes, dropped) and the summaries are returned.
    ``weights``: also check that the checkpoints training loads exist.
    """
    from mmengine.registry import init_default_scope
    init_default_scope(cfg.get('default_scope') or 'mmdet')
    check_data(cfg, stages, config_path=config_path, tool=tool)
    model = cfg.get('model')
    probed = probe_backbone(model) if isinstance(model, dict) else None  # built once, on meta
    raise_problems(config_problems(cfg, stages, weights, probed), cfg, config_path)
    largest = max(probed.strides) if isinstance(probed, FeatureMaps) else None
    summaries = check_annotations(cfg, stages, min_image_side=largest)
    if 'train' in stages:
        raise_problems(batch_problems(cfg, summaries), cfg, config_path)
    for s in summaries:
        if log is not None:
            log(s.line())
    return summaries


def drop_preflight_hook(cfg: Any) -> None:
    """Remove :class:`PreflightCheckHook` from ``cfg.custom_hooks`` (for tools that ran
    :func:`preflight` themselves, before the datasets were built)."""
    hooks = cfg.get('custom_hooks')
    if isinstance(hooks, list):
        cfg['custom_hooks'] = [h for h in hooks
                               if not (isinstance(h, dict) and h.get('type') == HOOK_TYPE)]


@HOOKS.register_module()
class PreflightCheckHook(Hook):
    """Run :func:`preflight` in ``before_run``: after mmengine has built the model and the
    train loop, before weights are loaded and before the first iteration.

    For runners that are not ours (mmdet's ``tools/train.py``, ``mim train``):
    ``custom_hooks = [dict(type='PreflightCheckHook')]``. The base runtime config includes it;
    our ``tools/train.py`` runs the same checks before building anything and drops the hook.
    """
    priority = 'VERY_HIGH'

    def __init__(self, weights: bool = True) -> None:
        self.weights = weights

    def before_run(self, runner) -> None:
        from mmengine.runner import BaseLoop
        cfg = runner.cfg
        # Runner.train() builds its loop before before_run; test() / val() leave it a dict
        training = isinstance(runner._train_loop, BaseLoop)
        wanted = ('train', 'val') if training else ('test',)
        stages = tuple(s for s in wanted if cfg.get(f'{s}_dataloader'))
        preflight(cfg, stages, weights=self.weights and training,
                  tool='tools/train.py' if training else 'tools/test.py',
                  log=runner.logger.info)
